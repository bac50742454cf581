"""LOSSY typical acceptance: its rule on literal cases, its measured bias, and that it is opt-in only."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.tree import TokenTree, TreeTemplate
from hf_specdec.verify.chain import PLACEHOLDER_TOKEN_ID as P
from hf_specdec.verify.typical import typical_chain_verify_lossy, typical_thresholds, typical_tree_verify_lossy
from tests.conftest import make_model, padded_batch

PEAKED = torch.tensor([0.02, 0.02, 0.9, 0.06])  # low entropy: threshold = min(0.09, 0.3 exp(-H)) = 0.09
FLAT = torch.full((4,), 0.25)  # high entropy: threshold = 0.3 exp(-H) ~ 0.075


def test_thresholds_follow_the_rule():
    h = -(PEAKED * torch.log(PEAKED + 1e-5)).sum()
    assert typical_thresholds(PEAKED, 0.09, 0.3) == pytest.approx(min(0.09, 0.3 * float(torch.exp(-h))))
    assert typical_thresholds(FLAT, 0.09, 0.3) < 0.09


def test_chain_accepts_plausible_tokens_the_target_might_not_have_sampled():
    probs = torch.stack([FLAT, PEAKED, PEAKED])[None]  # [1, 3, 4]
    # token 1 at a flat position (p 0.25 > 0.075): accepted; token 3 at a peaked one (0.06 < 0.09): rejected
    result = typical_chain_verify_lossy(torch.tensor([[1, 3]]), torch.tensor([2]), probs, 0.09, 0.3,
                                        torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [1]
    assert result.output_token_ids[0, 0] == 1 and result.output_token_ids[0, 2] == P


def test_tree_takes_the_first_acceptable_child():
    template = TreeTemplate.from_paths([(0,), (1,), (1, 0)])
    tree = TokenTree.from_template(template, torch.tensor([[0, 3, 2, 2]]))  # children of root: 3 (0.06), 2 (0.9)
    probs = torch.stack([PEAKED, FLAT, PEAKED, PEAKED])[None]
    result = typical_tree_verify_lossy(tree, probs, 0.09, 0.3, torch.Generator().manual_seed(0))
    assert result.num_accepted.tolist() == [2]  # root -> node 2 (token 2), then node 3 (token 2 at PEAKED: 0.9)
    assert result.output_token_ids[0, :2].tolist() == [2, 2]


def test_it_is_lossy_and_the_bias_is_measured():
    """Always offering the second-likeliest token: typical acceptance emits it far more often than the target."""
    n = 20_000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])[None, None].expand(n, 2, -1)
    result = typical_chain_verify_lossy(torch.ones(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long), probs,
                                        0.09, 0.3, torch.Generator().manual_seed(1))
    counts = torch.bincount(result.output_token_ids[:, 0], minlength=4).double()
    expected = probs[0, 0].double() / probs[0, 0].double().sum() * n
    assert stats.chisquare(counts.numpy(), expected.numpy()).pvalue < 1e-10
    assert counts[1] / n > 0.9  # the target would give 0.3


def test_engine_uses_it_only_when_asked_and_only_when_sampling(forward_counter):
    target = make_model("llama")
    ids, mask = padded_batch([8, 5], seed=1, repeat_period=3)
    lossy = SpeculativeConfig(method="ngram", num_speculative_tokens=3, lossy_typical_acceptance=True, seed=0)
    out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=lossy, max_new_tokens=12,
                              do_sample=True, eos_token_id=None)
    assert out.shape == (2, ids.shape[1] + 12) and (out < 128).all()
    assert SpeculativeConfig(method="ngram").lossy_typical_acceptance is False
    count = forward_counter(target)
    with pytest.raises(ValueError, match="lossy_typical_acceptance: only applies when sampling"):
        hf_specdec.generate(target, ids, attention_mask=mask, speculative=lossy, max_new_tokens=4, do_sample=False)
    assert count() == 0
    with pytest.raises(ValueError, match=r"posterior_threshold: expected a number in \(0, 1\]"):
        SpeculativeConfig(method="ngram", posterior_threshold=0)
