"""Online estimates the adaptive schedule decides from: per-row acceptance by draft position, and the wall time of
a step by batch size and width, measured during the run.

Step times are kept per target model and proposer for the life of the process (`cost_table`), so a later call on
the same model starts from what earlier calls measured. Acceptance is estimated per row; a new call's rows start
from the average its earlier calls' rows ended with (a drafter that is rarely right is not trusted afresh on every
call), or from an optimistic prior on the first call.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Sequence

import numpy as np

# weight of a new observation in the acceptance moving average: about the last ten observations of a position
# count. A faster average (0.3 before) turned a row off after a few rejections in a row where its drafts paid on
# the whole: replaying the schedule on recorded acceptance (`benchmarks/schedule_replay.py`; SmolLM2 with its EAGLE-3
# head, batch 1, coding requests, k <= 5) it reached 0.96 of the best fixed k's speed at 0.3 and 0.98 at 0.1
ACCEPTANCE_RATE = 0.1
# the acceptance by draft class (`Proposer.draft_classes`), pooled over all rows: a new observation's weight, at
# least (a class's first observations average as a running mean does after CLASS_PRIOR_COUNT prior ones)
CLASS_ACCEPTANCE_RATE = 0.05
CLASS_PRIOR_COUNT = 2
# a row's estimates for a candidate that looks ahead (observed every step, drafting or not): its first observations
# average as a running mean does after this many prior ones (a call's prior, what earlier calls ended with, gives
# way within a few steps instead of about ten)
LOOKAHEAD_PRIOR_COUNT = 2
# weight of a new step in the moving average of whether a row drafts when allowed (a lookup finds a match or not)
DRAFT_RATE_WEIGHT = 0.3
# acceptance assumed before a row's first observation at a position (optimistic: a new row drafts, and measures)
ACCEPTANCE_PRIOR = 0.7
# weight of a call's rows' ending acceptance in the prior of later calls (`CostTable.record_acceptance`). Replayed
# on recorded acceptance (`benchmarks/schedule_replay.py --call-weights`; SmolLM2 with its EAGLE-3 head, batch 1,
# k <= 5): with 0.1, Spec-Bench's categories in turn read 1.000 of the best fixed k against 0.988 and its slowest call
# (a translation) 0.951x plain against 0.932x, but random-token prompts' slowest call 0.856x against 0.905x and
# their whole 1.014 against 1.018 of the best fixed k; a running mean over calls did no better. Within the replay's
# resolution, so the weight stays
CALL_PRIOR_WEIGHT = 0.5
# a width's step time at a batch size is the lower quartile (TIME_QUANTILE) of its last TIME_WINDOW measurements.
# The noise of a step's time is one-sided (a stall, two to three times a step's usual length, only adds), and on a
# busy machine stalls come in runs of several steps, which land on whatever width the schedule chose then: the
# decision then leaves a width whose estimate a run raised and does not measure it again. A moving average rose with
# every stall (in one traced run on a CPU at batch 1, the setting of `benchmarks/schedule_trace.py`, the EAGLE-3
# head's width-1 steps took 1.08 plain steps in median, and the average read 1.19 at the steps the schedule left
# plain); the median of the window with a run of five (in a later trace width 2 read 1.5 plain steps after five
# stalls in a row, 1.23 measured in median over the run). The lower quartile moves only once 7 of the 9 are slow: a
# lasting change (a longer context) moves it, a run of stalls does not
TIME_WINDOW = 9
TIME_QUANTILE = 0.25
# a drafting width measured fewer than SETTLED_SAMPLES times at a batch size (once or twice: in the process's first
# call, whose shapes are new to the machine, or in a stall) reads at most the line through the settled widths there.
# Read high, the decision would leave it and never measure it again (in one traced run on a CPU widths 3 to 5 kept
# the 1.8 to 1.9 plain steps of their first steps, against 1.3 to 1.45 measured in a run before); read on the line
# it is chosen where it pays, and measured until it settles on its own measurements
SETTLED_SAMPLES = 3
# before a width is measured at a batch size: a step of width w costs (1 + PRIOR_SLOPE * w) plain steps
PRIOR_SLOPE = 0.1
# samples at a batch size after which the line through its measured step times is refitted
REFIT_SAMPLES = 8
# weight of a new drafting step in the moving average of the tokens per second drafting steps realized
REALIZED_RATE = 0.2
# drafting steps measured at a batch size and width before their realized rate can switch that width off there
REALIZED_SAMPLES = 4
# steps at a batch size after which a plain step re-measures the plain step's time (whose steps a drafter that
# pays may never take): at most one step in this many is made plain for it
PLAIN_REFRESH = 64


def lower_quantile(values: Sequence[float]) -> float:
    """The `TIME_QUANTILE` quantile of a few values, interpolated linearly between the two nearest order statistics
    (numpy's default method), in plain Python: `np.quantile` costs tens of microseconds per call, every step."""
    ordered = sorted(values)
    position = TIME_QUANTILE * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Slope and intercept of the least-squares line through two or more points with distinct xs, in plain Python
    (`np.polyfit` costs tens of microseconds per call, and the table refits every few steps)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return slope, mean_y - slope * mean_x


class AcceptanceEstimate:
    """Per row and draft position: an exponential moving average of whether the draft there was accepted, updated
    only where the row drafted and every earlier draft was accepted (where the outcome was observed). A position
    never observed yet takes the estimate of the position before it (a row that drafts one token well is expected
    to draft the next about as well, not at an optimistic prior), and starts its average from there; the position
    just past a draft accepted whole (reached, not drafted) moves towards the one before it.

    Proposers that draft on the host (n-gram lookup, suffix decoding) report how deep each row really drafted: a
    row allowed k tokens that found no match drafted nothing, and its step was a plain one. Positions it did not
    draft are not observed; instead `draft_rate` (per row, a moving average of whether it drafted when allowed)
    says how often asking brings a draft at all."""

    def __init__(self, batch_size: int, max_k: int, prior: np.ndarray | None = None, rate: float | None = None,
                 prior_count: float | None = None) -> None:
        # [K] prior (default ACCEPTANCE_PRIOR everywhere): what earlier calls measured, `CostTable.acceptance_prior`
        start = np.full(max_k, ACCEPTANCE_PRIOR) if prior is None else prior
        # a new observation's weight: `rate` (default ACCEPTANCE_RATE, read here so that a benchmark can vary it), or
        # with `prior_count` at least 1 / (observations + prior_count)
        self.rate = ACCEPTANCE_RATE if rate is None else rate
        self.prior_count = prior_count
        self.raw = np.tile(start, (batch_size, 1))  # the averages, at observed positions
        self.seen = np.zeros((batch_size, max_k), dtype=bool)
        self.observations = np.zeros((batch_size, max_k))
        self.values = self.raw.copy()  # [B, K]: the estimates (observed averages, carried to unobserved positions)
        self.all_seen = False  # whether every position of every row was observed (`values` is then `raw`)
        self.positions = np.arange(max_k)[None, :]  # [1, K]
        self.draft_rate = np.ones(batch_size)  # [B]

    def update(
        self,
        # per row: drafts allowed this step (after the length budget)
        allowed: Sequence[int],
        # per row: drafts accepted
        accepted: Sequence[int],
        # per row: the depth it drafted (at most `allowed`), where the proposer reports it; None: as allowed
        drafted: Sequence[int] | None = None,
        # per row: the estimate row its observation goes to (None: its own); rows sharing one are pooled, n
        # observations at once moving an average as n in turn would by their mean
        into: Sequence[int] | None = None,
    ) -> None:
        allowed_rows = np.asarray(allowed)
        drafted_rows = allowed_rows if drafted is None else np.minimum(np.asarray(drafted), allowed_rows)
        asked = allowed_rows > 0
        if not asked.any():  # a plain step: nothing drafted, nothing observed
            return
        # [E, B]: which estimate each row's observation goes to
        members = None
        if into is not None:
            members = (np.arange(self.values.shape[0])[:, None] == np.asarray(into)[None, :]).astype(float)

        def pooled(values: np.ndarray) -> np.ndarray:  # [B, ...] -> [E, ...]: sums over the rows of each estimate
            return values if members is None else members @ values.astype(float)

        def weight(count: np.ndarray, rate: float) -> np.ndarray:  # of `count` observations' mean
            return 1.0 - (1.0 - rate) ** count

        times_asked = pooled(asked)
        self.draft_rate = np.where(times_asked > 0, self.draft_rate + weight(times_asked, DRAFT_RATE_WEIGHT) * (
            pooled(asked & (drafted_rows > 0)) / np.maximum(times_asked, 1) - self.draft_rate), self.draft_rate)
        positions = self.positions
        accepted_rows = np.asarray(accepted)[:, None]
        observed = (positions < drafted_rows[:, None]) & (positions <= accepted_rows)
        count = pooled(observed)
        mean = pooled(observed & (positions < accepted_rows)) / np.maximum(count, 1)
        start = self.raw if self.all_seen else np.where(self.seen, self.raw, self.values)
        self.observations += count
        step = weight(count, self.rate)
        if self.prior_count is not None:
            step = np.maximum(step, count / (self.observations + self.prior_count))
        self.raw = np.where(count > 0, (1 - step) * start + step * mean, self.raw)
        if not self.all_seen:
            self.seen |= count > 0
            self.all_seen = bool(self.seen.all())
        self._carry()
        # the position just past a draft accepted whole was reached but not drafted: its average moves towards the
        # position before it as an observation would. Otherwise a deeper position's average, once low, would stay
        # low while the row drafts short (it is observed only when drafted), and the row never drafts deeper again
        # however well its drafts go
        seen = self.seen if into is None else self.seen[np.asarray(into)]
        reached = pooled((positions == drafted_rows[:, None]) & (drafted_rows[:, None] > 0)
                         & (accepted_rows >= drafted_rows[:, None]) & seen)
        if reached.any():
            before = np.concatenate([self.values[:, :1], self.values[:, :-1]], axis=1)
            self.raw = self.raw + weight(reached, self.rate) * (before - self.raw)
            self._carry()

    def update_classes(
        self,
        # [B] per row: its draft class (this estimate's row), 0 for none
        classes: Sequence[int],
        # per row: drafts allowed, accepted, and the depth it drafted (as in `update`)
        allowed: Sequence[int],
        accepted: Sequence[int],
        drafted: Sequence[int] | None = None,
    ) -> None:
        """A pooled estimate, one row per draft class: the observations of a step's rows of each class at once
        (a row of class 0 has no draft, and its class is never observed)."""
        classes = np.asarray(classes)
        self.update(np.where(classes > 0, np.asarray(allowed), 0), accepted, drafted, into=classes)

    def _carry(self) -> None:
        """Each position reads the nearest observed position at or before it (position 0: its own, prior or not)."""
        if self.all_seen:
            self.values = self.raw
            return
        source = np.maximum.accumulate(np.where(self.seen, self.positions, 0), axis=1)
        self.values = self.raw[np.arange(source.shape[0])[:, None], source]


def _locked(method):
    """`method` run under its table's lock: `generate` calls in threads on one model share its tables."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class CostTable:
    """Wall time of a step, by (rows computed, width): lower quartiles of recent measurements, and a prediction for every
    width at a batch size (measured widths as measured; the others on a line through the measured ones, or the
    prior slope from a single one; where two or more widths have settled, `SETTLED_SAMPLES` measurements or more,
    the line goes through those alone, and a drafting width not settled reads at most the line).

    The line through a batch size's measurements is fitted once and kept: refitted when a width is measured there
    for the first time, and otherwise after `REFIT_SAMPLES` more samples at that batch size (measured widths always
    read their latest estimates; only the widths never measured wait for the refit).

    Shared by every call on the model (`cost_table`), in any thread: its methods hold the table's lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # [K]: the acceptance estimates rows ended earlier calls with, averaged (a new call's rows start there)
        self.acceptance: np.ndarray | None = None
        # per (batch size, width): the estimate (the lower quartile of `recent`), and the last measurements
        self.times: dict[tuple[int, int], float] = {}
        self.recent: dict[tuple[int, int], deque] = {}
        # acceptance by draft class (`Proposer.draft_classes`), pooled over the rows of every call (`class_estimate`)
        self.class_acceptance: AcceptanceEstimate | None = None
        # samples observed at each batch size
        self.samples: dict[int, int] = {}
        # per batch size: the fitted line (slope, intercept), and the widths and sample count it was fitted on
        self.lines: dict[int, tuple[float, float, tuple[int, ...], int]] = {}
        # per (batch size, width): tokens per second realized by the steps that drafted (a moving average), and
        # their number
        self.realized: dict[tuple[int, int], tuple[float, int]] = {}
        # per batch size a call started with: the plain steps in a row its probes waited for when it ended
        self.probe_wait: dict[int, int] = {}
        # per (batch size, width): the batch size's sample count when the width was last measured there
        self.last_measured: dict[tuple[int, int], int] = {}
        # per (batch size, max_k): `predict`'s answer, kept until a measurement moves it (`_keep`, `observe` clear
        # it; the schedule asks every step)
        self.predicted: dict[tuple[int, int], np.ndarray] = {}

    @_locked
    def observe(self, batch_size: int, width: int, seconds: float) -> None:
        """A step of `width` at `batch_size` took `seconds`. A narrower drafting width whose estimate stands above
        this width's comes down to it: a narrower step does not cost more than a wider one, and a width the decision
        stops choosing because of a high estimate is not measured again to correct it."""
        key = (batch_size, width)
        self._keep(key, [*self.recent.get(key, ()), seconds])
        for narrower in range(1, width):  # the plain step's estimate is its own (`plain_due` refreshes it)
            if self.times.get((batch_size, narrower), 0.0) > self.times[key]:
                self._keep((batch_size, narrower), [self.times[key]])
        self.samples[batch_size] = self.samples.get(batch_size, 0) + 1
        self.last_measured[key] = self.samples[batch_size]
        kept = self.lines.get(batch_size)
        if kept is not None and self.samples[batch_size] - kept[3] >= REFIT_SAMPLES:  # the next prediction refits
            self.predicted.clear()

    def _keep(self, key: tuple[int, int], measurements: list[float]) -> None:
        """The last `TIME_WINDOW` of `measurements` become the window of `key`, and their lower quartile its
        estimate."""
        self.recent[key] = deque(measurements, maxlen=TIME_WINDOW)
        estimate = lower_quantile(self.recent[key])
        if self.times.get(key) != estimate or len(self.recent[key]) == SETTLED_SAMPLES:  # the prediction moves
            self.times[key] = estimate
            self.predicted.clear()

    @_locked
    def plain_due(self, batch_size: int) -> bool:
        """Whether the next step at this batch size should be plain, to measure the plain step's time: never
        measured; last measured `PLAIN_REFRESH` or more steps ago; or at or above what a wider step measured since.
        A wider step does not cost less, nor the same with a drafter run in it: the plain time is stale (from a
        call with a longer context, or a stall), and the decision, which never predicts a wider step cheaper than a
        narrower one, would read drafting as free and draft every step, so that no plain step would correct it. (A
        plain time measured after the wider one is the fresher: drafting re-measures the wider width, as the
        decision then chooses.)"""
        plain = self.times.get((batch_size, 0))
        if plain is None:
            return True
        plain_at = self.last_measured[(batch_size, 0)]
        if self.samples[batch_size] - plain_at >= PLAIN_REFRESH:
            return True
        return any(seconds <= plain and self.last_measured[(size, width)] > plain_at
                   for (size, width), seconds in self.times.items() if size == batch_size and width > 0)

    @_locked
    def observe_realized(self, batch_size: int, width: int, tokens: float, seconds: float, rows: int) -> None:
        """A step of `rows` generating rows that drafted at `width`: the tokens it emitted over its wall time. When
        this width's steps come to beat a plain step (probes, say, after the text became predictable), what the
        other widths measured at this batch size is cleared: the estimates choose among them again, measured
        afresh."""
        rate = tokens / max(seconds, 1e-12)
        old, count = self.realized.get((batch_size, width), (rate, 0))
        plain = self.times.get((batch_size, 0))

        def proven(rate: float, count: int) -> bool:  # measured enough, and paying
            return plain is not None and count >= REALIZED_SAMPLES and rate * plain >= rows

        was_proven = proven(old, count)
        rate = (1 - REALIZED_RATE) * old + REALIZED_RATE * rate if count else rate
        self.realized[(batch_size, width)] = (rate, count + 1)
        if proven(rate, count + 1) and not was_proven:
            for key in [key for key in self.realized if key[0] == batch_size and key[1] != width]:
                del self.realized[key]

    @_locked
    def unpaid_widths(self, batch_size: int, rows: int) -> set[int]:
        """The widths whose steps at this batch size (`REALIZED_SAMPLES` or more) emitted fewer tokens per second
        than a plain step of `rows` generating rows does (`rows` tokens in its measured time): the estimates chose
        drafts there that did not pay, whatever they predict. Steps of those widths come only from probes, whose
        measurements decide when a width pays again."""
        plain = self.times.get((batch_size, 0))
        if plain is None:
            return set()
        return {width for (size, width), (rate, count) in self.realized.items()
                if size == batch_size and count >= REALIZED_SAMPLES and rate * plain < rows}

    @_locked
    def acceptance_prior(self, max_k: int) -> np.ndarray | None:
        """[max_k] where a new call's rows start their acceptance estimates: what earlier calls ended with (None
        before any, or for another k)."""
        kept = self.acceptance
        return kept.copy() if kept is not None and kept.shape[0] == max_k else None

    @_locked
    def class_estimate(self, num_classes: int, max_k: int) -> AcceptanceEstimate:
        """The acceptance of each draft class (row c: class c; row 0, no draft, is never observed), kept for the
        life of the process like the step times."""
        kept = self.class_acceptance
        if kept is None or kept.values.shape != (num_classes + 1, max_k):
            self.class_acceptance = AcceptanceEstimate(num_classes + 1, max_k, rate=CLASS_ACCEPTANCE_RATE,
                                                       prior_count=CLASS_PRIOR_COUNT)
        return self.class_acceptance

    @_locked
    def record_acceptance(self, estimate: AcceptanceEstimate) -> None:
        """A call ended: its rows' estimates, averaged, move the prior of later calls towards them (by
        `CALL_PRIOR_WEIGHT`)."""
        ended = estimate.values.mean(axis=0)
        kept = self.acceptance
        self.acceptance = (ended if kept is None or kept.shape != ended.shape
                           else kept + CALL_PRIOR_WEIGHT * (ended - kept))

    @_locked
    def predict(self, batch_size: int, max_k: int) -> np.ndarray:
        """[max_k + 1] predicted step time at widths 0..max_k for `batch_size` rows (relative units before any
        measurement: only ratios between widths matter to the decision)."""
        key = (batch_size, max_k)
        if key not in self.predicted:
            self.predicted[key] = self._predict(batch_size, max_k)
        return self.predicted[key].copy()

    def _predict(self, batch_size: int, max_k: int) -> np.ndarray:
        widths = np.arange(max_k + 1, dtype=float)
        sizes = {b for b, _ in self.times}
        if not sizes:
            return 1.0 + PRIOR_SLOPE * widths
        # the nearest batch size measured stands in for one never measured (ratios between widths vary slowly)
        source = min(sizes, key=lambda b: (abs(np.log(b / batch_size)), b))
        points = {w: t for (b, w), t in self.times.items() if b == source}
        settled = {w: t for w, t in points.items() if len(self.recent[(source, w)]) >= SETTLED_SAMPLES}
        fitted = settled if len(settled) >= 2 else points
        if len(fitted) == 1:
            (only, seconds), = fitted.items()
            line = seconds / (1.0 + PRIOR_SLOPE * only) * (1.0 + PRIOR_SLOPE * widths)
        else:
            slope, intercept = self.line(source, fitted)
            line = intercept + max(slope, 0.0) * widths
            line = np.maximum(line, min(fitted.values()) * 0.5)
        for w, t in points.items():
            if w <= max_k:
                # a drafting width not yet settled reads at most the line through the settled ones (the plain
                # step is its own: `plain_due` measures it again)
                line[w] = t if w in fitted or w == 0 else min(t, line[w])
        return np.maximum.accumulate(line)  # a wider step never costs less than a narrower one

    def line(self, batch_size: int, points: dict[int, float]) -> tuple[float, float]:
        """Slope and intercept of the least-squares line through `points` (width: time, two or more, measured at
        `batch_size`): the kept fit, refitted as the class says."""
        widths, samples = tuple(sorted(points)), self.samples.get(batch_size, 0)
        kept = self.lines.get(batch_size)
        if kept is None or kept[2] != widths or samples - kept[3] >= REFIT_SAMPLES:
            slope, intercept = least_squares_line(widths, [points[w] for w in widths])
            kept = self.lines[batch_size] = (slope, intercept, widths, samples)
        return kept[0], kept[1]


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cost_table(model: object, key: str) -> CostTable:
    """The step-time table of `model` with the proposer named `key`, kept for the life of the process."""
    per_model = _TABLES.setdefault(model, {})
    return per_model.setdefault(key, CostTable())
