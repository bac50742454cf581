"""benchmarks/auto_rows_ab.py: its `~step` cases are the auto cases with one candidate per step, and
benchmarks/head_feeds.py counts the EAGLE head's feeds in the steps it skips. What the scripts report, never how fast
anything was."""

from __future__ import annotations

import numpy as np

import hf_specdec.cli.bench as bench
from hf_specdec.schedule import controller
from hf_specdec.schedule.controller import Schedule
from hf_specdec.schedule.estimates import CostTable
from tests.conftest import make_model, padded_batch
from tests.proposers.test_auto import candidates_in_turn  # noqa: F401 (a fixture)
from tests.proposers.test_eagle import trained_head
from tests.schedule.test_lossless import cycled_widths  # noqa: F401 (a fixture)


def test_step_cases_switch_off_the_riders_of_their_own_schedules(benchmark_script, monkeypatch):
    for name in ("CASES", "SCHEDULED_CASES", "_speculative_config"):
        monkeypatch.setattr(bench, name, getattr(bench, name))
    for name in ("AUTO_CASES", "DRAFTER_OF"):
        monkeypatch.setattr(bench, name, dict(getattr(bench, name)))
    for name in ("__init__", "riders"):
        monkeypatch.setattr(controller.Schedule, name, getattr(controller.Schedule, name))
    script = benchmark_script("auto_rows_ab")
    script.register_cases()
    assert {"auto~step", "auto+eagle3~step"} <= set(bench.CASES)
    assert bench.DRAFTER_OF["auto+eagle3~step"] == "eagle3"
    riders = {}
    for case in ("auto", "auto~step"):
        config = bench._speculative_config(case, None, 3, 1, None)
        assert config.method == "auto"
        schedule = Schedule(config, 3, {"ngram": CostTable(), "suffix": CostTable()}, static_shapes=False)
        schedule.classes = {m: np.zeros(2, dtype=int) for m in ("ngram", "suffix")}  # a step's lookups' classes
        riders[case] = schedule.riders("ngram", ("ngram", "suffix"))
    assert riders == {"auto": ["suffix"], "auto~step": []}


def test_head_feeds_counts_no_head_forward_in_a_skipped_step(benchmark_script, candidates_in_turn,  # noqa: F811
                                                              cycled_widths):  # noqa: F811
    """With the candidates drafting in turn (rows commit different numbers of tokens in the lookups' steps), the head
    skips steps and runs only in the steps it drafts."""
    script = benchmark_script("head_feeds")
    target = make_model("llama")
    ids, mask = padded_batch([12, 7, 10, 9], seed=3, repeat_period=5)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    head = trained_head(target, "eagle", expected)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    counts = script.count_feeds(target, head, prompts, 0, batch_size=4, max_new_tokens=24, k=3)
    assert counts["skipped_steps"] > 0 and counts["feeds"] > 0, counts
    assert counts["feeds_in_skipped_steps"] == 0, counts
