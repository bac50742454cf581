"""The schedule the decode loop consults before each step: per-row draft limits, from the estimates
(`hf_specdec.schedule.estimates`) through the decision rule (`hf_specdec.schedule.decision`), within the user's
batch-size rules (`hf_specdec.schedule.rules`).

Lossless by construction: a limit only masks draft positions, and the limits depend on nothing but the accepted
counts and step times of earlier steps (never on the target's probabilities at the positions being decided), so
every step verifies its drafts exactly as a fixed-k step does.

Timing reads the host clock at the start of a step and after its one host sync (`DecodeState.report`, which
waits for the device), so a step's measured time covers its device work; nothing else is read from the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hf_specdec.config import SpeculativeConfig
from hf_specdec.schedule.decision import Decision, decide, expected_accepted, width_ladder
from hf_specdec.schedule.estimates import AcceptanceEstimate, CostTable, cost_table
from hf_specdec.schedule.rules import batch_size_cap
from hf_specdec.stats import ScheduleStats
from hf_specdec.step import DecodeState

# a row that has not drafted for this many steps probes; each probe that finds nothing doubles the wait, up to
# PROBE_MAX_INTERVAL
PROBE_INTERVAL = 4
PROBE_MAX_INTERVAL = 64
# draft positions a probe asks for (within the step's cap)
PROBE_LENGTH = 2


class Schedule:
    """Per-row draft limits for each step. `adaptive=False` applies the batch-size rules alone (k otherwise)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_k: int,
        costs: CostTable,
        static_shapes: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.adaptive = config.schedule == "adaptive"
        self.max_k = max_k
        self.disable_by_batch_size = config.disable_by_batch_size
        self.per_batch_size = config.num_speculative_tokens_per_batch_size
        self.costs = costs
        self.widths = width_ladder(max_k) if static_shapes else tuple(range(max_k + 1))
        self.clock = clock

    def start(self, batch_size: int) -> None:
        """A new call: per-row estimates start afresh (step times carry over)."""
        self.acceptance = AcceptanceEstimate(batch_size, self.max_k)
        self.idle = np.zeros(batch_size, dtype=int)  # steps since each row last drafted
        self.interval = np.full(batch_size, PROBE_INTERVAL)
        self.histogram = np.zeros((batch_size, self.max_k + 1), dtype=np.int64)
        self.estimated = np.zeros(batch_size)
        self.allowed_total = np.zeros(batch_size, dtype=np.int64)
        self.accepted_total = np.zeros(batch_size, dtype=np.int64)
        self.steps = 0
        self.decision: Decision | None = None

    def plan(self, state: DecodeState, rows_computed: int) -> Decision:
        """Set the next proposal's limits on `state`; `rows_computed`: the rows the verify forward computes."""
        active = [not done for done in state.host.finished]
        cap = batch_size_cap(sum(active), self.max_k, self.disable_by_batch_size, self.per_batch_size)
        widths = [w for w in self.widths if w <= cap] or [0]
        probe = (self.idle >= self.interval) & np.asarray(active, dtype=bool)
        if not self.adaptive:
            limits = tuple(cap if a else 0 for a in active)
            decision = Decision(cap, limits, 0.0, 0.0, (0.0,) * len(limits))
        else:
            if self.steps == 1 and not self.costs.measured(rows_computed, 0):
                widths = [0]  # calibrate: one plain step at this batch size (the first step drafted)
            step_time = self.costs.predict(rows_computed, self.max_k)
            decision = decide(self.acceptance.values, step_time, active, probe, widths, min(PROBE_LENGTH, cap))
        self.allowed = np.minimum(decision.limits, state.host_draft_budget())  # the length limit cuts too
        self.expected = expected_accepted(self.acceptance.values)[np.arange(len(active)), self.allowed]
        state.set_draft_limits(list(decision.limits), decision.width)
        self.decision, self.active, self.probed = decision, np.asarray(active, dtype=bool), probe
        self.rows_computed, self.started = rows_computed, self.clock()
        return decision

    def observe(self, state: DecodeState) -> None:
        """After the step's host sync: its time and each row's accepted count update the estimates."""
        seconds = self.clock() - self.started
        decision = self.decision
        self.steps += 1
        if self.adaptive:
            self.costs.observe(self.rows_computed, decision.width, seconds)
        accepted = np.asarray(state.host.num_accepted)
        self.acceptance.update(self.allowed, accepted)
        drafted = self.allowed > 0
        self.histogram[np.arange(len(self.active)), np.asarray(decision.limits)] += self.active
        self.estimated += self.expected
        self.allowed_total += self.allowed
        self.accepted_total += accepted * drafted
        # a probe that found nothing doubles the wait before the next; an accepted draft resets it
        self.interval = np.where(drafted & (accepted > 0), PROBE_INTERVAL,
                                 np.where(self.probed & (accepted == 0),
                                          np.minimum(self.interval * 2, PROBE_MAX_INTERVAL), self.interval))
        self.idle = np.where(drafted, 0, self.idle + 1)
        state.draft_limits = state.draft_limit_tensor = state.draft_width = None

    def finish(self) -> list[ScheduleStats]:
        return [
            ScheduleStats(
                schedule="adaptive" if self.adaptive else "fixed",
                k_histogram=self.histogram[b].tolist(),
                plain_steps=int(self.histogram[b, 0]),
                estimated_accepted_tokens=float(self.estimated[b]),
                scheduled_draft_tokens=int(self.allowed_total[b]),
                scheduled_accepted_tokens=int(self.accepted_total[b]),
            )
            for b in range(self.histogram.shape[0])
        ]


def build_schedule(config: SpeculativeConfig, model: object, key: str, max_k: int,
                   static_shapes: bool) -> Schedule | None:
    """The step schedule `config` asks for; None for `schedule="fixed"` without batch-size rules (k every step)."""
    if (config.schedule == "fixed" and config.disable_by_batch_size is None
            and config.num_speculative_tokens_per_batch_size is None):
        return None
    return Schedule(config, max_k, cost_table(model, key), static_shapes)
