"""Chain verification as pure functions: exact greedy cases, seeding, and the law of the emitted tokens."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from hf_specdec.verify.chain import PLACEHOLDER_TOKEN_ID as P
from hf_specdec.verify.chain import greedy_verify, rejection_sample


def _t(rows):
    return torch.tensor(rows, dtype=torch.long)


def test_greedy_perfect_match_appends_bonus():
    result = greedy_verify(_t([[5, 6, 7]]), _t([3]), _t([[5, 6, 7, 8]]))
    assert result.output_token_ids.tolist() == [[5, 6, 7, 8]]
    assert result.num_accepted.tolist() == [3]


def test_greedy_early_mismatch_emits_target_token_then_placeholders():
    result = greedy_verify(_t([[5, 9, 7]]), _t([3]), _t([[5, 6, 7, 8]]))
    assert result.output_token_ids.tolist() == [[5, 6, P, P]]
    assert result.num_accepted.tolist() == [1]


def test_greedy_ragged_rows_and_empty_drafts():
    drafts = _t([[1, 2, 3], [4, 4, 0], [0, 0, 0]])
    target = _t([[1, 2, 3, 9], [4, 4, 4, 4], [7, 7, 7, 7]])
    result = greedy_verify(drafts, _t([3, 2, 0]), target)
    # row 1: its third "draft" is padding, so it never counts even though the target argmax differs
    assert result.output_token_ids.tolist() == [[1, 2, 3, 9], [4, 4, 4, P], [7, P, P, P]]
    assert result.num_accepted.tolist() == [3, 2, 0]


def test_greedy_padding_never_accepted_even_if_it_matches():
    result = greedy_verify(_t([[3, 3]]), _t([1]), _t([[3, 3, 3]]))
    assert result.num_accepted.tolist() == [1]
    assert result.output_token_ids.tolist() == [[3, 3, P]]


def _random_probs(shape, generator, sparsity=0.0):
    logits = torch.randn(shape, generator=generator) * 2
    if sparsity:
        logits[torch.rand(shape, generator=generator) < sparsity] = float("-inf")
        logits[..., 0] = 0.0  # keep one token possible everywhere
    return torch.softmax(logits, dim=-1)


def test_rejection_sampling_is_deterministic_when_seeded():
    g = torch.Generator().manual_seed(0)
    target = _random_probs((4, 4, 11), g)
    draft = _random_probs((4, 3, 11), g)
    drafts = torch.multinomial(draft.reshape(-1, 11), 1, generator=g).reshape(4, 3)
    runs = [
        rejection_sample(drafts, _t([3, 2, 1, 0]), draft, target, torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].output_token_ids, runs[1].output_token_ids)


N = 60_000
VOCAB = 6


def _assert_law(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit; samples outside the support fail outright."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    result = stats.chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (result, counts, expected)


@pytest.mark.parametrize("draft_kind", ["sampled", "point_mass"])
@pytest.mark.parametrize("sparsity", [0.0, 0.4])
def test_rejection_sampling_emits_the_target_law(draft_kind, sparsity):
    """First emitted token ~ target_probs[0]; given the first draft was accepted, the second ~ target_probs[1]."""
    g = torch.Generator().manual_seed(1)
    target = _random_probs((3, VOCAB), g, sparsity)
    draft = 0.5 * target[:2] + 0.5 * _random_probs((2, VOCAB), g, sparsity)  # overlaps the target: real acceptance
    if draft_kind == "sampled":
        drafts = torch.multinomial(draft, N, replacement=True, generator=g).T  # [N, 2]
        draft_probs = draft[None].expand(N, -1, -1)
    else:
        drafts = target[:2].argmax(dim=-1)[None].expand(N, -1)  # a lookup guess that is often right
        draft_probs = None
    result = rejection_sample(
        drafts, torch.full((N,), 2), draft_probs, target[None].expand(N, -1, -1), torch.Generator().manual_seed(2)
    )
    out = result.output_token_ids
    _assert_law(out[:, 0], target[0])
    accepted_first = result.num_accepted >= 1
    assert 1_000 < int(accepted_first.sum()) < N
    _assert_law(out[accepted_first, 1], target[1])


def test_target_probability_zero_is_never_accepted():
    target = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]]).expand(5_000, -1, -1)
    draft = torch.tensor([[[1.0, 0.0]]]).expand(5_000, -1, -1)
    result = rejection_sample(torch.zeros(5_000, 1, dtype=torch.long), torch.ones(5_000, dtype=torch.long),
                              draft, target, torch.Generator().manual_seed(0))
    assert result.num_accepted.sum() == 0
    assert (result.output_token_ids[:, 0] == 1).all()


def test_identical_draft_and_target_always_accepted_without_nan():
    g = torch.Generator().manual_seed(3)
    probs = _random_probs((1, 3, VOCAB), g).expand(200, -1, -1)
    drafts = torch.multinomial(probs[0, :2], 200, replacement=True, generator=g).T
    result = rejection_sample(drafts, torch.full((200,), 2), probs[:, :2], probs, torch.Generator().manual_seed(4))
    assert (result.num_accepted == 2).all()
    assert (result.output_token_ids >= 0).all()


def test_greedy_without_drafts_emits_the_argmax():
    """A plain step (k = 0): every row emits the target's argmax, nothing accepted."""
    result = greedy_verify(_t([[], []]).reshape(2, 0), _t([0, 0]), _t([[4], [9]]))
    assert result.output_token_ids.tolist() == [[4], [9]] and result.num_accepted.tolist() == [0, 0]
    assert result.path_nodes.tolist() == [[0], [0]] and result.num_nodes == 1
