"""Timing on a busy machine: interleaved repeats and paired ratios.

A loaded machine drifts: a run that happens to land on a slow stretch looks slow. So every run is repeated in
rounds, and each round calls every run once, in the same order (`time_interleaved`): a slow stretch hits the
baseline and the candidate of a round alike. A speedup is then the median over rounds of the ratio baseline /
candidate within each round (`paired_speedup`), which a slow stretch or a single outlier round barely moves.

`noise_note` says when the numbers cannot be trusted: when the baseline's own repeats spread by more than
NOISY_SPREAD of their median, or when a speedup exceeds what the run's target forwards allow (the baseline's time
over the time spent inside them) by more than that spread, which no round of a consistent machine can do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The baseline's repeats may spread this much (max - min over the median) before the machine is called too noisy.
NOISY_SPREAD = 0.20
# A speedup may pass the forwards saved by at least this much (or the baseline's spread, if larger): the jitter of a
# median of a few repeats on a quiet machine.
MIN_NOISE = 0.05


@dataclass(frozen=True)
class Repeats:
    """Every repeat of one run: its wall seconds and what it returned, round by round."""

    seconds: list[float]
    values: list[Any]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class CallTotals:
    """What one case's generate calls add up to over a run: wall seconds and new tokens, target forwards (a plain
    call's are its new tokens), and for speculative calls (`add` given their `spec_stats`) accepted tokens, drafting
    steps and draft tokens."""

    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    accepted: int = 0
    drafting_steps: int = 0
    draft_tokens: int = 0
    speculative: bool = False

    def add(self, seconds: float, new_tokens: int, stats: Any = None) -> None:
        """One call of `new_tokens` new tokens (one row) in `seconds`; `stats`: its `SpecStats`, None for plain."""
        self.seconds += seconds
        self.tokens += new_tokens
        if stats is None:
            self.forwards += new_tokens
            return
        self.speculative = True
        self.forwards += int(stats.target_forward_passes)
        self.accepted += int(stats.num_accepted_tokens)
        self.drafting_steps += int(stats.num_drafts)
        self.draft_tokens += int(stats.num_draft_tokens)

    @property
    def rate(self) -> float:
        """New tokens per second."""
        return self.tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.forwards, 1)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length, 1 + accepted tokens per drafting step (None for plain calls)."""
        return 1 + self.accepted / max(self.drafting_steps, 1) if self.speculative else None


def time_interleaved(
    runs: Mapping[str, Callable[[], Any]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Repeats]:
    """Call every run `repeats` times: round r calls each run once, in the mapping's order, timed by `clock`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results = {name: Repeats(seconds=[], values=[]) for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = clock()
            value = run()
            results[name].seconds.append(clock() - start)
            results[name].values.append(value)
    return results


def paired_speedup(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """Median over rounds of baseline[r] / candidate[r]: how many times faster the candidate ran."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(f"paired timings need the same number (>= 1) of repeats, got {len(baseline)} baseline and "
                         f"{len(candidate)} candidate")
    return statistics.median(b / c for b, c in zip(baseline, candidate))


def relative_spread(seconds: Sequence[float]) -> float:
    """(max - min) / median of the repeats: 0.0 for a quiet machine (or a single repeat)."""
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def noise_note(baseline: Sequence[float], speedups: Mapping[str, tuple[float, float]]) -> str | None:
    """One line when the timings are too noisy to judge, else None.

    `speedups` maps each run's name to (its paired speedup, the most its target forwards allow: the baseline's time
    over the time the run spent inside them, a run taking at least as long as its forwards), so a speedup past that
    bound by more than the noise means the rounds disagree. (A run's step can cost less than a plain step: on a CPU
    the engine's attention is faster than transformers', so the forwards saved alone do not bound it.)
    """
    spread = relative_spread(baseline)
    if spread > NOISY_SPREAD:
        return (f"note: the machine is too noisy to judge speed: plain generate's {len(baseline)} repeats spread by "
                f"{spread:.0%} (> {NOISY_SPREAD:.0%}); rerun on a quieter machine or with more --repeats")
    impossible = [f"{name} {speedup:.2f}x > {saved:.2f}x" for name, (speedup, saved) in speedups.items()
                  if speedup > saved * (1 + max(spread, MIN_NOISE))]
    if impossible:
        return (f"note: the machine is too noisy to judge speed: speedups above what their target forwards allow "
                f"({', '.join(impossible)}) beyond the {spread:.0%} spread of plain's repeats; rerun on a quieter "
                "machine or with more --repeats")
    return None
