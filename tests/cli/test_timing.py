"""Interleaved repeats and the paired speedup, on a fake clock: a machine that drifts, and one noisy round."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from hf_specdec.cli.timing import CallTotals, noise_note, paired_speedup, relative_spread, time_interleaved


class DriftingMachine:
    """A fake clock, and runs whose durations are their work times the machine's slowdown at the moment they
    start; `slowdown(call index)` scripts the machine."""

    def __init__(self, slowdown) -> None:
        self.now, self.calls, self.order = 0.0, 0, []
        self.slowdown = slowdown

    def clock(self) -> float:
        return self.now

    def run(self, name: str, work: float):
        def call() -> str:
            self.now += work * self.slowdown(self.calls)
            self.calls += 1
            self.order.append(name)
            return name

        return call


def test_rounds_call_every_run_once_in_order_and_record_what_they_return():
    machine = DriftingMachine(lambda call: 1.0)
    timed = time_interleaved({"plain": machine.run("plain", 2.0), "ngram": machine.run("ngram", 1.0)}, repeats=3,
                             clock=machine.clock)
    assert machine.order == ["plain", "ngram"] * 3
    assert timed["plain"].seconds == [2.0] * 3 and timed["ngram"].seconds == [1.0] * 3
    assert timed["ngram"].values == ["ngram"] * 3


def test_paired_speedup_is_exact_on_a_machine_that_slows_down():
    # The machine gets twice as slow every round: each run's times grow 1, 2, 4, 8, 16, ...
    def slowdown(call: int) -> float:
        return 2.0 ** (call // 2)

    machine = DriftingMachine(slowdown)
    timed = time_interleaved({"plain": machine.run("plain", 3.0), "medusa": machine.run("medusa", 2.0)}, repeats=5,
                             clock=machine.clock)
    assert paired_speedup(timed["plain"].seconds, timed["medusa"].seconds) == pytest.approx(1.5)
    # The same drift, timed one case after the other (plain's 5 repeats, then medusa's): medians 6 vs 128.
    sequential = DriftingMachine(slowdown)
    plain = time_interleaved({"plain": sequential.run("plain", 3.0)}, repeats=5, clock=sequential.clock)["plain"]
    sequential.calls = 10  # medusa's repeats come after plain's five, on the slower machine
    medusa = time_interleaved({"medusa": sequential.run("medusa", 2.0)}, repeats=5, clock=sequential.clock)["medusa"]
    assert statistics.median(plain.seconds) / statistics.median(medusa.seconds) < 0.5


def test_paired_speedup_ignores_one_noisy_round_on_a_drifting_machine():
    noisy_call = 1  # the ngram run of the first round lands on a busy moment

    def slowdown(call: int) -> float:
        return (10.0 if call == noisy_call else 1.0) * 2.0 ** (call // 2)

    machine = DriftingMachine(slowdown)
    timed = time_interleaved({"plain": machine.run("plain", 2.0), "ngram": machine.run("ngram", 1.0)}, repeats=3,
                             clock=machine.clock)
    assert timed["plain"].seconds == [2.0, 4.0, 8.0] and timed["ngram"].seconds == [10.0, 2.0, 4.0]
    assert paired_speedup(timed["plain"].seconds, timed["ngram"].seconds) == pytest.approx(2.0)
    # Unpaired statistics are thrown off by the spike and the drift together.
    assert timed["plain"].median_seconds / timed["ngram"].median_seconds == pytest.approx(1.0)
    assert statistics.mean(timed["plain"].seconds) / statistics.mean(timed["ngram"].seconds) == pytest.approx(14 / 16)


def test_paired_speedup_and_repeats_reject_bad_input():
    with pytest.raises(ValueError, match="same number"):
        paired_speedup([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        time_interleaved({"plain": lambda: None}, repeats=0)


def test_noise_note():
    quiet = [1.0, 1.05, 0.98]
    assert relative_spread(quiet) == pytest.approx(0.07)
    assert noise_note(quiet, {"ngram": (1.5, 1.9), "draft": (0.8, 2.0)}) is None
    noisy = [1.0, 1.4, 0.9]
    note = noise_note(noisy, {"ngram": (1.5, 1.9)})
    assert note is not None and "spread by 50%" in note
    # Faster than its target forwards alone allow, beyond the noise: the rounds disagree.
    note = noise_note(quiet, {"ngram": (2.5, 1.9), "draft": (0.8, 2.0)})
    assert note is not None and "ngram 2.50x > 1.90x" in note and "draft" not in note
    assert noise_note(quiet, {"ngram": (1.95, 1.9)}) is None  # within the 7% spread


def test_call_totals_add_plain_and_speculative_calls():
    plain, speculative = CallTotals(), CallTotals()
    plain.add(2.0, 10)
    plain.add(3.0, 15)
    assert (plain.rate, plain.tokens_per_forward, plain.tau) == (5.0, 1.0, None)
    stats = SimpleNamespace(target_forward_passes=5, num_accepted_tokens=6, num_drafts=4, num_draft_tokens=12)
    speculative.add(1.0, 10, stats)
    speculative.add(1.0, 10, stats)
    assert speculative.rate == 10.0 and speculative.tokens_per_forward == 2.0
    assert speculative.tau == 1 + 12 / 8 and speculative.draft_tokens == 24


def test_report_results_prints_each_and_writes_settings_results_environment(tmp_path, capsys):
    import argparse
    import json

    from hf_specdec.cli.environment import add_run_arguments, report_results

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    out = tmp_path / "sub" / "r.json"
    args = parser.parse_args(["--categories", "qa", "--json", str(out)])
    report_results(args, [{"case": "b", "x": 1}, {"case": "a"}], torch.device("cpu"), torch.bfloat16, extra=[1])
    assert capsys.readouterr().out.splitlines() == ['{"case": "b", "x": 1}', '{"case": "a"}']
    report = json.loads(out.read_text())
    assert report["settings"]["categories"] == ["qa"] and report["settings"]["json"] == str(out)
    assert report["results"][0] == {"case": "b", "x": 1} and report["extra"] == [1]
    assert report["environment"]["dtype"] == "bfloat16" and report["environment"]["device"] == "cpu"
    args.json = None
    report_results(args, [], torch.device("cpu"), torch.float32)  # nothing to write
