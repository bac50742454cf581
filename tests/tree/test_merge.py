"""`merge_trees`: each row's tree taken from one of several proposals' trees, node order kept."""

from __future__ import annotations

import torch

from hf_specdec.tree.merge import merge_trees
from hf_specdec.tree.template import TreeTemplate
from hf_specdec.tree.tree import TokenTree


def _chain(tokens: list[list[int]], valid: list[list[bool]] | None = None, probs: torch.Tensor | None = None):
    ids = torch.tensor(tokens)
    mask = None if valid is None else torch.tensor(valid)
    return TokenTree.from_template(TreeTemplate.chain(ids.shape[1] - 1), ids, mask, probs, dense=valid is None)


def test_chains_of_different_widths_give_a_chain_padded_with_invalid_nodes():
    short = _chain([[1, 2], [1, 3], [1, 4]])
    long = _chain([[5, 6, 7, 8], [5, 9, 9, 9], [5, 1, 1, 1]], valid=[[True] * 4, [True, True, False, False],
                                                                         [True] * 4])
    merged = merge_trees((short, long), torch.tensor([0, 1, 0]))
    assert merged.is_chain and merged.num_nodes == 4 and not merged.dense
    assert merged.token_ids.tolist() == [[1, 2, 0, 0], [5, 9, 9, 9], [1, 4, 0, 0]]
    assert merged.valid.tolist() == [[True, True, False, False], [True, True, False, False],
                                     [True, True, False, False]]
    assert merged.draft_probs is None
    # the same width everywhere and every node real: still dense
    dense = merge_trees((long, _chain([[7, 7, 7, 7]] * 3)), torch.tensor([1, 1, 1]))
    assert not dense.dense  # `long` is not dense, though no row takes it
    assert merge_trees((short, short), torch.tensor([1, 0, 1])).dense


def test_a_tree_among_chains_keeps_each_rows_parents_and_the_bounds():
    chain = _chain([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    # a root with two children, the first with one child, and a padding node
    tree = TokenTree(token_ids=torch.tensor([[4, 5, 6, 7, 0]] * 3), parents=torch.tensor([[-1, 0, 0, 1, 0]] * 3),
                     valid=torch.tensor([[True, True, True, True, False]] * 3), max_depth=2, max_children=2)
    third = _chain([[9, 8], [9, 8], [9, 8]])
    merged = merge_trees((chain, tree, third), torch.tensor([1, 0, 2]))
    assert not merged.is_chain and merged.num_nodes == 5
    assert merged.token_ids.tolist() == [[4, 5, 6, 7, 0], [1, 2, 3, 0, 0], [9, 8, 0, 0, 0]]
    assert merged.parents.tolist() == [[-1, 0, 0, 1, 0], [-1, 0, 1, 0, 0], [-1, 0, 0, 0, 0]]
    assert merged.valid.tolist() == [[True, True, True, True, False], [True, True, True, False, False],
                                     [True, True, False, False, False]]
    assert merged.max_depth == 2 and merged.max_children == 2


def test_draft_distributions_for_the_rows_that_carry_them_and_point_masses_elsewhere():
    vocab = 6
    probs = torch.softmax(torch.randn(3, 2, vocab, generator=torch.Generator().manual_seed(0)), dim=-1)
    sampled = _chain([[1, 2, 3]] * 3, probs=probs)
    lookup = _chain([[1, 4, 5, 5], [1, 0, 0, 0], [1, 5, 4, 3]])
    merged = merge_trees((sampled, lookup), torch.tensor([0, 1, 1]))
    assert merged.draft_probs.shape == (3, 3, vocab)
    torch.testing.assert_close(merged.draft_probs[0, :2], probs[0])
    assert merged.draft_probs[0, 2].tolist() == torch.nn.functional.one_hot(torch.tensor(0), vocab).tolist()
    for row in (1, 2):
        expected = torch.nn.functional.one_hot(merged.token_ids[row, 1:], vocab).float()
        assert torch.equal(merged.draft_probs[row], expected)
