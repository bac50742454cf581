"""hf_specdec.schedule.tree_size: `tree_total_tokens="auto"`, the tree's size from measured verify costs."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.schedule import tree_size as size
from hf_specdec.schedule.tree_size import auto_tree_size, ladder, measure_verify_costs, tree_size_for_costs
from tests.conftest import make_draft, make_model


def test_flat_costs_keep_every_node_and_steep_ones_keep_the_chain():
    assert tree_size_for_costs({6: 1.0, 8: 1.0, 16: 1.0, 65: 1.0}, depth=5, max_nodes=64) == 64
    assert tree_size_for_costs({6: 1.0, 8: 1.0, 16: 1.0, 65: 1.0}, depth=5, max_nodes=20) == 20
    assert tree_size_for_costs({6: 1.0, 8: 1.5}, depth=5, max_nodes=64) == 5


def test_the_budget_is_read_off_the_line_between_measured_widths():
    # chain 6 tokens at 1.0; 8 tokens 1.05 (within 10%); 11 tokens 1.15: the line crosses 1.1 at 9.5 tokens
    assert tree_size_for_costs({6: 1.0, 8: 1.05, 11: 1.15}, depth=5, max_nodes=64) == 8
    # a narrower tolerance stops before 8 tokens: 1.0 + 0.02 is crossed at 6.8 tokens
    assert tree_size_for_costs({6: 1.0, 8: 1.05, 11: 1.15}, depth=5, max_nodes=64, tolerance=0.02) == 5
    # past the widest width measured, nothing is assumed
    assert tree_size_for_costs({6: 1.0, 8: 1.0}, depth=5, max_nodes=64) == 7


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="the chain's width 6 was not measured"):
        tree_size_for_costs({8: 1.0}, depth=5, max_nodes=10)
    with pytest.raises(ValueError, match="expected 1 <= depth <= max_nodes"):
        tree_size_for_costs({6: 1.0}, depth=5, max_nodes=4)


def test_the_ladder_starts_at_the_chain_and_reaches_the_largest_tree():
    assert ladder(5, 64) == [6, 8, 11, 15, 20, 27, 36, 48, 64, 65]
    assert ladder(2, 6) == [3, 4, 5, 7]
    assert ladder(3, 3) == [4]


def test_costs_are_measured_once_per_model_dtype_device_and_batch_size():
    model = make_model("llama")
    calls = []

    def measure(model, batch_size, widths, stop_above):
        calls.append((batch_size, tuple(widths)))
        return {w: 1.0 + 0.01 * (w - widths[0]) for w in widths}  # 1% per token: 10 more tokens within 10%

    assert auto_tree_size(model, 1, 5, 68, measure=measure) == 15
    assert auto_tree_size(model, 1, 5, 68, measure=measure) == 15
    assert calls == [(1, tuple(ladder(5, 64)))]
    assert auto_tree_size(model, 2, 5, 68, measure=measure) == 15 and len(calls) == 2
    assert auto_tree_size(model, 1, 5, 12, measure=measure) == 12  # capped by the tree's candidates
    assert auto_tree_size(model, 1, 3, 3, measure=measure) == 3 and len(calls) == 2  # nothing to choose


def _reads(seconds: list[float]) -> list[float]:
    """Clock reads (start, end) for forwards taking these seconds."""
    return [read for elapsed in seconds for read in (0.0, elapsed)]


def test_measured_costs_stop_after_the_first_width_over_the_limit():
    model = make_model("llama")
    # a warm-up forward of the chain's width, then pairs (the chain's, the wider one's), each taking its width in
    # seconds: 8 costs 8/6 of 6, over 1.1, so width 11 is not measured
    reads = _reads([6.0] + [6.0, 8.0] * size.ROUNDS)
    costs = measure_verify_costs(model, 2, [6, 8, 11], stop_above=1.1, clock=iter(reads).__next__)
    assert costs == {6: 6.0, 8: 8.0}


def test_a_slow_stretch_between_widths_does_not_move_the_ratios():
    """Each width is timed beside the chain's: when the machine runs twice as slow while width 11 is timed, its cost
    still reads 1.1 of the chain's (timed alone it would read 2.2); one outlier pair is outvoted by the median."""
    model = make_model("llama")
    eight = [6.0, 6.3] * (size.ROUNDS - 1) + [6.0, 9.0]
    eleven = [12.0, 13.2] * size.ROUNDS
    reads = _reads([6.0] + eight + eleven)
    costs = measure_verify_costs(model, 2, [6, 8, 11], stop_above=1.2, clock=iter(reads).__next__)
    assert costs[6] == pytest.approx(9.0)  # the median of the chain's timings
    assert costs[8] / costs[6] == pytest.approx(1.05) and costs[11] / costs[6] == pytest.approx(1.1)


def test_real_measurements_on_a_small_model():
    model = make_model("llama")
    costs = measure_verify_costs(model, 2, [3, 4, 7])
    assert list(costs) == [3, 4, 7] and all(seconds > 0 for seconds in costs.values())


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_auto_trees_are_exact_and_report_their_size(method):
    target = make_model("llama")
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    drafter = dict(draft_model=make_draft()) if method == "draft" else dict(heads=_eagle_head(target))
    config = SpeculativeConfig(method=method, num_speculative_tokens=3, tree_width=2, tree_total_tokens="auto",
                               **drafter)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    assert 3 <= out.spec_stats.tree_total_tokens <= config.max_tree_nodes
    assert out.spec_stats.num_draft_tokens > 0
    plain = hf_specdec.generate(target, ids, return_dict_in_generate=True, **kwargs, speculative=SpeculativeConfig(
        method=method, num_speculative_tokens=3, **drafter))
    assert plain.spec_stats.tree_total_tokens is None  # a chain


def test_token_recyclings_tree_takes_the_measured_size(monkeypatch):
    """method='recycling' with tree_total_tokens='auto': the tree keeps as many nodes as the costs measured for the
    model afford (flat up to 21 tokens here, then twice as dear: 20 draft nodes at k = 3, where the budget crosses
    the line between 21 and 28 tokens), drafts from them, and is exact."""
    from hf_specdec.proposers.recycling import RecyclingProposer

    nodes = []
    build = RecyclingProposer.__init__
    monkeypatch.setattr(RecyclingProposer, "__init__", lambda self, config, target: (
        build(self, config, target), nodes.append(self.template.num_nodes - 1))[0])
    target = make_model("llama")
    # the costs as if measured for this model at batch 2 and k = 3, up to the largest automatic tree
    widths = ladder(3, size.MAX_AUTO_TREE_NODES)
    size._MEASURED[target] = {(target.dtype, str(target.device), 2, 3): {w: 1.0 if w <= 21 else 2.0 for w in widths}}
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    config = SpeculativeConfig(method="recycling", num_speculative_tokens=3, tree_total_tokens="auto")
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    assert out.spec_stats.tree_total_tokens == 20 and nodes == [20]
    assert out.spec_stats.num_draft_tokens > 0


def _eagle_head(target):
    from hf_specdec.heads import EagleConfig, EagleHead

    torch.manual_seed(2)
    return EagleHead(EagleConfig.for_target(target, "eagle")).eval()
