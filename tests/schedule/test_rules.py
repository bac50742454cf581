"""Batch-size rules and the schedule's configuration errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_specdec import SpeculativeConfig
from hf_specdec.schedule.rules import batch_size_cap, check_batch_size_schedule


def test_batch_size_cap():
    rules = check_batch_size_schedule([[1, 4, 5], [5, 16, 2], [17, 64, 0]], 5)
    assert [batch_size_cap(b, 5, None, rules) for b in (1, 4, 5, 16, 17, 64, 65)] == [5, 5, 2, 2, 0, 0, 5]
    assert [batch_size_cap(b, 5, 8, None) for b in (1, 7, 8, 9)] == [5, 5, 0, 0]
    assert batch_size_cap(3, 5, 3, rules) == 0


@pytest.mark.parametrize("value, message", [
    ([[1, 4, 5], [4, 8, 2]], r"\[1\]: range \[4, 8, 2\] overlaps"),
    ([[5, 8, 2], [1, 4, 5]], r"\[1\]: range \[1, 4, 5\] overlaps or comes before"),
    ([[1, 4, -1]], r"\[0\]: k = -1 must be in \[0, num_speculative_tokens = 5\]"),
    ([[1, 4, 6]], r"k = 6 must be in"),
    ([[0, 4, 2]], r"1 <= start <= end, got \[0, 4, 2\]"),
    ([[4, 2, 2]], r"1 <= start <= end"),
    ([[1, 4]], r"expected \[start, end, k\] \(three ints\), got \[1, 4\]"),
    ([[1, 4, 2.5]], r"three ints"),
    ([], r"non-empty list"),
    ("1-4:5", r"non-empty list"),
])
def test_malformed_batch_size_schedules_are_refused(value, message):
    with pytest.raises(ValueError, match=r"SpeculativeConfig\.num_speculative_tokens_per_batch_size"):
        SpeculativeConfig(method="ngram", num_speculative_tokens_per_batch_size=value)
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="ngram", num_speculative_tokens_per_batch_size=value)


def test_schedule_and_disable_errors_name_the_field():
    with pytest.raises(ValueError, match=r"SpeculativeConfig\.schedule: unknown schedule 'greedy'"):
        SpeculativeConfig(method="ngram", schedule="greedy")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"SpeculativeConfig\.disable_by_batch_size"):
            SpeculativeConfig(method="ngram", disable_by_batch_size=bad)


def test_defaults_and_valid_rules():
    config = SpeculativeConfig(method="ngram", disable_by_batch_size=8,
                               num_speculative_tokens_per_batch_size=[[1, 2, 5], [3, 7, 3]])
    assert config.schedule == "adaptive"
    assert config.num_speculative_tokens_per_batch_size == ((1, 2, 5), (3, 7, 3))


def test_the_draft_models_dynamic_tree_runs_on_the_schedule():
    """A dynamic tree is scheduled like every other shape, batch-size rules included."""
    from hf_specdec.schedule.controller import build_schedule
    from hf_specdec.testbed import load_testbed

    _, target, draft = load_testbed()
    proposer = SimpleNamespace(cost_key=lambda config, static_shapes: "draft", looks_ahead=False,
                               draft_classes=None, num_draft_classes=0, knows_draft_depths=False)
    tree = SpeculativeConfig(method="draft", draft_model=draft, top_k=2, depth=3, total_tokens=4)
    assert tree.schedule == "adaptive" and build_schedule(tree, target, proposer, 3, False) is not None
    ruled = SpeculativeConfig(method="draft", draft_model=draft, top_k=2, depth=3, total_tokens=4,
                              disable_by_batch_size=4, schedule="fixed")
    assert build_schedule(ruled, target, proposer, 3, False) is not None
