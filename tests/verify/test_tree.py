"""Tree verification: literal greedy walks, and the exact target law under sampling (width >= 2, depth >= 2)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from hf_specdec.tree import TokenTree, TreeTemplate
from hf_specdec.verify.chain import PLACEHOLDER_TOKEN_ID as P
from hf_specdec.verify.tree import greedy_tree_verify, tree_rejection_sample

TEMPLATE = TreeTemplate.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])  # 9 nodes


def _tree(tokens, valid=None):
    ids = torch.tensor(tokens)
    return TokenTree.from_template(TEMPLATE, ids, None if valid is None else torch.tensor(valid))


def test_greedy_follows_the_matching_branch():
    #            root  a  b  c  aa ab ba bb ca
    tree = _tree([[9, 1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 4, 5, 6, 7, 8], [9, 1, 2, 3, 4, 5, 6, 7, 8]])
    target = torch.tensor([
        [2, 0, 7, 0, 0, 0, 0, 5, 0],  # root -> b (2); at b -> bb (7); at bb: bonus 5
        [8, 0, 0, 0, 0, 0, 0, 0, 0],  # no child is 8: recovered 8
        [3, 0, 0, 4, 0, 0, 0, 0, 6],  # root -> c (3); c has no child 4... c's child is ca (8): target at c=4: stop
    ])
    result = greedy_tree_verify(tree, target)
    assert result.output_token_ids.tolist() == [[2, 7, 5], [8, P, P], [3, 4, P]]
    assert result.num_accepted.tolist() == [2, 0, 1]
    assert result.kept_nodes.int().tolist() == [
        [1, 0, 1, 0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 0, 0, 0]]


def test_greedy_never_enters_padding_nodes():
    tree = _tree([[9, 1, 2, 3, 4, 5, 6, 7, 8]], valid=[[True, True, False, True, True, True, True, True, True]])
    target = torch.tensor([[2, 0, 0, 0, 0, 0, 0, 0, 0]])  # node "b" (2) matches but is padding
    assert greedy_tree_verify(tree, target).output_token_ids.tolist() == [[2, P, P]]


VOCAB = 5
N = 50_000


def _law(generator):
    """p_root [V] and, for every first token x, p_second[x] [V]: a consistent two-token target law."""
    root = torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, dim=-1)
    second = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 1.5, dim=-1)
    return root, second


def _target_probs(tree: TokenTree, root, second):
    """[B, N, V]: the target at every node, a function of the node's context (depth-2 nodes: anything)."""
    depths = tree.depths
    probs = torch.full((*tree.token_ids.shape, VOCAB), 1.0 / VOCAB)
    probs[:, 0] = root
    depth_one = depths == 1
    probs[depth_one] = second[tree.token_ids[depth_one]]
    return probs


def _sampled_tree(generator, root, second, width=3, depth=2):
    """Children drawn i.i.d. from a draft q (overlapping the target), `width` per node."""
    template = TreeTemplate.full(width=width, depth=depth)
    q_root = 0.5 * root + 0.5 * torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1)
    q_second = 0.5 * second + 0.5 * torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)
    tokens = torch.zeros(N, template.num_nodes, dtype=torch.long)
    draft_probs = torch.zeros(N, template.num_nodes, VOCAB)
    for node in range(1, template.num_nodes):
        parent = template.parents[node]
        q = q_root.expand(N, -1) if parent == 0 else q_second[tokens[:, parent]]
        tokens[:, node] = torch.multinomial(q, 1, generator=generator).squeeze(1)
        draft_probs[:, node] = q
    return TokenTree.from_template(template, tokens, draft_probs=draft_probs[:, 1:])  # node 0 (the root) has none


def _topk_tree(root, second, width=2):
    """Deterministic children: the target's own top candidates perturbed (distinct tokens per parent)."""
    template = TreeTemplate.full(width=width, depth=2)
    tokens = torch.zeros(N, template.num_nodes, dtype=torch.long)
    order_root = torch.tensor([3, 0, 1, 4, 2])  # a fixed, not-best-first candidate order
    for node in range(1, template.num_nodes):
        parent, rank = template.parents[node], template.ranks[node]
        tokens[:, node] = order_root[rank] if parent == 0 else (tokens[:, parent] + rank + 1) % VOCAB
    return TokenTree.from_template(template, tokens)


def _pvalues(result, root, second):
    """Chi-square p-values: first emitted token vs p_root; second given the first was accepted vs p_second."""
    out = result.output_token_ids
    first = torch.bincount(out[:, 0], minlength=VOCAB).double()
    p_first = stats.chisquare(first.numpy(), (root.double() / root.double().sum() * N).numpy()).pvalue
    accepted = result.num_accepted >= 1
    pairs = out[accepted, 0] * VOCAB + out[accepted, 1]
    joint = torch.bincount(pairs, minlength=VOCAB * VOCAB).double().reshape(VOCAB, VOCAB)
    expected = joint.sum(dim=1, keepdim=True) * second.double()
    keep = expected > 0
    statistic = float(((joint - expected)[keep] ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - int((joint.sum(dim=1) > 0).sum())
    return p_first, float(stats.chi2.sf(statistic, dof)), int(accepted.sum())


@pytest.mark.parametrize("kind", ["sampled", "topk"])
def test_tree_sampling_emits_the_target_law(kind):
    generator = torch.Generator().manual_seed(0)
    root, second = _law(generator)
    tree = _sampled_tree(generator, root, second) if kind == "sampled" else _topk_tree(root, second)
    result = tree_rejection_sample(tree, _target_probs(tree, root, second), torch.Generator().manual_seed(1))
    p_first, p_second, accepted = _pvalues(result, root, second)
    assert accepted > N // 4
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)
    assert (result.num_accepted == 2).any(), "some rows should accept a whole root-to-leaf path"


def test_power_misreported_draft_probabilities_are_caught():
    """A proposer that misreports the distribution its children were drawn from (uniform instead of q) biases
    the law; the test above must notice. (Point-mass treatment of sampled children, by contrast, stays lossless:
    the one-hot rule is exact for any candidates chosen independently of the target's coins, only less accepting.)"""
    generator = torch.Generator().manual_seed(0)
    root, second = _law(generator)
    tree = _sampled_tree(generator, root, second)
    uniform = torch.full_like(tree.draft_probs, 1.0 / VOCAB)
    wrong = TokenTree(token_ids=tree.token_ids, parents=tree.parents, valid=tree.valid, draft_probs=uniform)
    result = tree_rejection_sample(wrong, _target_probs(tree, root, second), torch.Generator().manual_seed(1))
    p_first, p_second, _ = _pvalues(result, root, second)
    assert min(p_first, p_second) < 1e-3
