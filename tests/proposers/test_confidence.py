"""`SpeculativeConfig(draft_confidence=c)`: a row's chain stops where the drafter's running confidence falls below c.
The rule on its own, then through `generate`: greedy output identical to plain `generate` with rows cut at every
depth, the schedule's bookkeeping, and the errors. (Sampling: tests/decoding/test_sampling_lossless.py.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers import confidence
from hf_specdec.proposers.confidence import ConfidenceCut, peak_probability
from tests.conftest import InjectedCosts, make_draft, make_model, padded_batch
from tests.proposers.test_eagle import eagle_head

K = 4


def test_peak_probability_of_scores_and_of_distributions():
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, float("-inf"), 0.0]])
    assert torch.allclose(peak_probability(scores, False), torch.softmax(scores, -1).amax(-1))
    probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]])
    assert torch.equal(peak_probability(probs, True), torch.tensor([0.7, 0.5]))


def test_cut_keeps_each_row_until_its_running_confidence_falls_below_the_floor():
    cut = ConfidenceCut(0.3, [4, 4, 1, 0])
    assert cut.may_draft(0)
    cut.observe(0, [0.9, 0.2, 0.9, 0.9])  # row 1 stops at once; row 3 is allowed nothing
    assert cut.kept == [1, 0, 1, 0]
    assert cut.may_draft(1)
    cut.observe(1, [0.5, 1.0, 1.0, 1.0])  # 0.45 >= 0.3; row 2 is at its limit; row 1 stays stopped
    assert cut.kept == [2, 0, 1, 0]
    cut.observe(2, [0.6, 1.0, 1.0, 1.0])  # 0.27 < 0.3
    assert cut.kept == [2, 0, 1, 0] and cut.depth == 2
    assert np.isclose(cut.reach[0], 0.27)
    assert not cut.may_draft(3)  # no row still going


def test_cut_skips_a_position_no_row_can_reach():
    cut = ConfidenceCut(0.5, [3, 3])
    cut.observe(0, [0.6, 0.55])
    assert cut.kept == [1, 1]
    assert not cut.may_draft(1) or max(cut.reach) >= 0.5
    cut.observe(1, [0.8, 0.9])  # 0.48 and 0.495: both stop
    assert cut.kept == [1, 1]
    assert not cut.may_draft(2)  # their confidence cannot rise again: the drafter need not run


def _configs(target: torch.nn.Module, floor: float, schedule: str) -> dict[str, SpeculativeConfig]:
    common = dict(num_speculative_tokens=K, draft_confidence=floor, schedule=schedule)
    configs = {
        "random_draft": SpeculativeConfig(method="draft", draft_model=make_draft(), **common),
        "same_draft": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), **common),
        "early_exit": SpeculativeConfig(method="early_exit", early_exit_layer=1, **common),
    }
    if hasattr(target.config, "intermediate_size"):  # EAGLE heads are Llama decoder layers
        configs.update({
            "eagle": SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle"), **common),
            "eagle3": SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle3"), **common),
            "auto_eagle": SpeculativeConfig(method="auto", heads=eagle_head(target, "eagle"), **common),
        })
    return configs


@pytest.fixture
def cuts(monkeypatch):
    """Every position a `ConfidenceCut` observes: (its limits, what each row kept so far, the position, the running
    confidences of the rows still going)."""
    seen = []
    observe = ConfidenceCut.observe

    def spy(self, position, peaks):
        going = [self.reach[row] * float(p) for row, p in enumerate(peaks) if self.kept[row] == position
                 and position < self.limits[row]]
        observe(self, position, peaks)
        seen.append((list(self.limits), list(self.kept), position, going))

    monkeypatch.setattr(confidence.ConfidenceCut, "observe", spy)
    return seen


# right padding on the sliding-window architecture (where a short row's window holds fewer of its own keys)
@pytest.mark.parametrize("arch, side", [("llama", "left"), ("gpt2", "left"), ("mistral", "left"), ("mistral", "right")])
def test_greedy_output_is_plain_generate_with_rows_cut_at_every_depth(arch, side, cuts):
    """Floors from each case's own running confidences (measured with a floor that cuts nothing): the median first
    position's and the median last position's, so that rows stop at every depth: none, part, all k."""
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5, side=side)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    for name in _configs(target, 0.5, "fixed"):
        cuts.clear()
        hf_specdec.generate(target, ids, speculative=_configs(target, 1e-12, "fixed")[name], **kwargs)
        first = [value for _, _, position, going in cuts if position == 0 for value in going]
        last = [value for _, _, position, going in cuts if position == K - 1 for value in going]
        kept = []
        for floor in (float(np.median(first)), float(np.median(last))):
            for schedule in ("fixed", "adaptive"):
                cuts.clear()
                out = hf_specdec.generate(target, ids, speculative=_configs(target, floor, schedule)[name],
                                          return_dict_in_generate=True, **kwargs)
                assert torch.equal(out.sequences, expected), f"{arch}/{name}/{schedule}/{floor}"
                final = {}  # each (call step, row)'s kept positions after its last observed position
                steps = 0
                for limits, kept_rows, position, _ in cuts:
                    steps += position == 0
                    final.update({(steps, row): (limit, k) for row, (limit, k) in enumerate(zip(limits, kept_rows))
                                  if limit})
                kept += final.values()
        assert any(k == 0 for _, k in kept), name  # every depth: nothing, part of the chain, all of it
        assert any(0 < k < limit for limit, k in kept), name
        assert any(k == limit for limit, k in kept), name


def test_a_floor_no_draft_reaches_decodes_plainly_and_exactly(cuts):
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=2, repeat_period=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), num_speculative_tokens=K,
                               draft_confidence=0.999, schedule="fixed")
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    assert out.spec_stats.num_draft_tokens == 0
    assert cuts and all(kept == [0, 0] for _, kept, _, _ in cuts)


def test_the_schedule_times_a_cut_step_at_the_positions_drafted(monkeypatch):
    """A step the cut stopped at depth d computed d + 1 positions: the schedule's table gets its time under that
    width, not under the depth it verified."""
    from hf_specdec.schedule.controller import Schedule

    pairs = []  # per timed step: (width timed, positions computed, deepest row verified)
    timed = []
    observe_table, observe_step = InjectedCosts.observe, Schedule.observe  # the tests' step-time tables

    def table_spy(self, rows, width, seconds):
        timed.append(width)
        return observe_table(self, rows, width, seconds)

    def step_spy(self, state, proposal):
        timed.clear()
        result = observe_step(self, state, proposal)
        if timed and proposal.drafted_positions is not None:
            pairs.append((timed[0], proposal.drafted_positions, max(proposal.host_depths)))
        return result

    monkeypatch.setattr(InjectedCosts, "observe", table_spy)
    monkeypatch.setattr(Schedule, "observe", step_spy)
    target = make_model("llama")
    with torch.no_grad():  # sharper distributions: running confidences of 0.03 to 0.7 over four positions
        target.get_output_embeddings().weight.mul_(40)
    ids, mask = padded_batch([10], seed=5, repeat_period=3)
    config = SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=K,
                               draft_confidence=0.1)
    hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=30, do_sample=False,
                        eos_token_id=None)
    assert pairs and all(width == computed for width, computed, _ in pairs)
    assert any(computed > verified for _, computed, verified in pairs)  # cut steps, timed past what they verified


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(draft_confidence=0.0), "expected a number in (0, 1)"),
        (dict(draft_confidence=1.0), "expected a number in (0, 1)"),
        (dict(draft_confidence=True), "expected a number in (0, 1)"),
        (dict(draft_confidence="auto"), "expected a number in (0, 1)"),
        (dict(method="ngram", draft_model=None, draft_confidence=0.1), "method='ngram' drafts all its positions"),
        (dict(tree_width=2, draft_confidence=0.1), "a token tree (tree_width, tree_total_tokens)"),
        (dict(tree_total_tokens=3, draft_confidence=0.1), "a token tree (tree_width, tree_total_tokens)"),
    ],
)
def test_bad_draft_confidence_is_refused_naming_it(overrides, message):
    values = {"method": "draft", "draft_model": make_draft(), **overrides}
    with pytest.raises(ValueError, match="draft_confidence") as error:
        SpeculativeConfig(**values)
    assert message in str(error.value)


def test_auto_without_a_model_drafter_refuses_a_confidence():
    with pytest.raises(ValueError, match="method='auto' has no draft model or EAGLE head"):
        SpeculativeConfig(method="auto", draft_confidence=0.1)


def test_static_shapes_refuse_a_confidence_before_any_work():
    from transformers import StaticCache

    target = make_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    config = SpeculativeConfig(method="draft", draft_model=make_draft(), draft_confidence=0.1)
    cache = StaticCache(config=target.config, max_cache_len=64)
    with pytest.raises(ValueError, match="draft_confidence=0.1: stops each row's chain"):
        hf_specdec.generate(target, ids, speculative=config, past_key_values=cache, max_new_tokens=4,
                            do_sample=False)
