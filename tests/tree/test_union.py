"""Two proposers' chains as one tree (`hf_specdec.tree.union`): shared prefixes verified once, greedy verification
follows whichever branch the target does, sampling keeps the exact target law."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.step.proposal import chain_template
from hf_specdec.tree import TokenTree
from hf_specdec.tree.union import unite_chains
from hf_specdec.verify.chain import PLACEHOLDER_TOKEN_ID as P
from hf_specdec.verify.tree import greedy_tree_verify, tree_rejection_sample
from tests.verify.test_tree import VOCAB, _law, _pvalues


def _chain(tokens, lengths=None, draft_probs=None):
    """Rows [root, d1, ..., dk] as a chain proposal's tree, each row's drafts past its length padding."""
    ids = torch.tensor(tokens)
    k = ids.shape[1] - 1
    lengths = torch.tensor(lengths if lengths is not None else [k] * ids.shape[0])
    valid = torch.arange(k + 1)[None, :] <= lengths[:, None]
    return TokenTree.from_template(chain_template(k), ids, valid, draft_probs)


def test_the_second_chain_branches_off_where_the_two_differ():
    model = _chain([[9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 3]])
    lookup = _chain([[9, 1, 2, 5], [9, 4, 5, 6], [9, 1, 2, 3], [9, 1, 7, 0]], lengths=[3, 3, 3, 2])
    tree = unite_chains(model, lookup)
    assert tree.num_nodes == 7 and tree.max_depth == 3 and tree.max_children == 2
    # row 0 shares two tokens: its third hangs under the model's second node; row 1 shares none: a second branch
    # from the root; row 2 is the same chain: nothing added; row 3 shares one, then one more token of its own
    assert tree.valid[:, 4:].tolist() == [[False, False, True], [True, True, True], [False, False, False],
                                          [False, True, False]]
    assert tree.parents[0, 6].item() == 2 and tree.parents[1, 4:].tolist() == [0, 4, 5]
    assert tree.parents[3, 5].item() == 1
    assert (tree.parents[~tree.valid] == 0).all()  # padding hangs off the root
    assert tree.depths[1, 4:].tolist() == [1, 2, 3] and tree.depths[0, 6].item() == 3
    with pytest.raises(ValueError, match="deterministic"):
        unite_chains(model, _chain([[9, 1]], draft_probs=torch.ones(1, 1, 10)))


def test_greedy_follows_whichever_branch_the_target_follows():
    model = _chain([[9, 1, 2, 3], [9, 1, 2, 3]])
    lookup = _chain([[9, 1, 5, 6], [9, 4, 5, 6]])
    tree = unite_chains(model, lookup)
    # the target's argmax at each node (nodes: root, 1, 2, 3, [4: dropped], 5, 6 under node 1 / row 1: 4, 5, 6)
    target = torch.tensor([
        [1, 5, 0, 0, 0, 6, 8],  # root -> 1 (shared), then 5 (the lookup's branch), then 6, bonus 8
        [1, 2, 3, 7, 0, 0, 0],  # root -> 1 (the model's), 2, 3, bonus 7: the lookup's branch (4 ...) is left
    ])
    result = greedy_tree_verify(tree, target)
    assert result.output_token_ids.tolist() == [[1, 5, 6, 8], [1, 2, 3, 7]]
    assert result.num_accepted.tolist() == [3, 3]
    assert result.path_nodes[0].tolist() == [0, 1, 5, 6]


N = 50_000


def _united_law_pvalues(corrupt=None):
    """The model's two-token chain drawn from a draft law q, the lookup's fixed two-token chain beside it (often
    sharing its first token with the sample), verified by sampling: (p-value of the first emitted token, of the
    second, rows that accepted a token, rows that went down the lookup's own branch). `corrupt(tree)` stands for
    a broken union."""
    generator = torch.Generator().manual_seed(0)
    root, second = _law(generator)
    q_root = 0.5 * root + 0.5 * torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1)
    q_second = 0.5 * second + 0.5 * torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)
    first = torch.multinomial(q_root.expand(N, -1), 1, generator=generator).squeeze(1)
    after = torch.multinomial(q_second[first], 1, generator=generator).squeeze(1)
    probs = torch.stack([q_root.expand(N, -1), q_second[first]], dim=1)
    lookup_first = int(root.argmax())  # the lookup guesses the likeliest first token, then a fixed second
    model = _chain(torch.stack([torch.zeros(N, dtype=torch.long), first, after], dim=1).tolist(), draft_probs=probs)
    lookup = _chain([[0, lookup_first, (lookup_first + 1) % VOCAB]] * N)
    tree = unite_chains(model, lookup)
    assert 0.2 < (first == lookup_first).double().mean() < 0.8  # shared first tokens and separate branches both
    if corrupt is not None:
        tree = corrupt(tree)
    depths = tree.depths
    target = torch.full((N, tree.num_nodes, VOCAB), 1.0 / VOCAB)
    target[:, 0] = root
    target[depths == 1] = second[tree.token_ids[depths == 1]]
    result = tree_rejection_sample(tree, target, torch.Generator().manual_seed(1))
    assert (result.output_token_ids[:, 0] != P).all()
    on_lookup = (result.path_nodes[:, 1] > 2) & (result.num_accepted >= 1)
    return (*_pvalues(result, root, second), int(on_lookup.sum()))


def test_a_sampled_chain_with_a_lookup_branch_keeps_the_target_law():
    p_first, p_second, accepted, on_lookup = _united_law_pvalues()
    assert accepted > N // 4 and p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    assert on_lookup > N // 20  # rows that went down the lookup's own branch


def test_power_a_lookup_token_verified_with_another_law_is_caught():
    """Were the lookup's tokens verified with a law they were not drawn from (uniform, say) instead of as the point
    masses they are, the emitted law would be off; the test above must notice."""

    def uniform_lookup_laws(tree):
        laws = tree.draft_probs.clone()
        laws[:, 2:] = 1.0 / VOCAB  # nodes 3 and 4: the lookup's
        return TokenTree(token_ids=tree.token_ids, parents=tree.parents, valid=tree.valid, draft_probs=laws,
                         max_depth=tree.max_depth, max_children=tree.max_children)

    p_first, p_second, _, _ = _united_law_pvalues(uniform_lookup_laws)
    assert min(p_first, p_second) < 1e-3, (p_first, p_second)
