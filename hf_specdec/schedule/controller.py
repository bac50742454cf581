"""The schedule the decode loop consults before each step: per-row draft limits, from the estimates
(`hf_specdec.schedule.estimates`) through the decision rule (`hf_specdec.schedule.decision`), within the user's
batch-size rules (`hf_specdec.schedule.rules`).

Lossless by construction: a limit only masks draft positions, and the limits depend on nothing but the accepted
counts and step times of earlier steps (never on the target's probabilities at the positions being decided), so
every step verifies its drafts exactly as a fixed-k step does.

Timing reads the host clock at the start of a step and after its one host sync (`DecodeState.report`, which
waits for the device), so a step's measured time covers its device work; nothing else is read from the device.
A step during which torch.compile built a graph (a shape first met, in this call or after an earlier one) is not
timed.

Lookahead: a proposer that drafts without a model (n-gram lookup, suffix decoding, token recycling:
`Proposer.looks_ahead`) says what it would draft for the rows that do not draft with it (they decode plainly, or,
under `method="auto"`, draft with another candidate); the schedule walks each such draft (a chain or a tree) down
with the tokens the row then emits, over as many steps as it takes (`hf_specdec.schedule.lookahead`), and updates
the estimates as that draft, drafted, would have: a row's estimates follow the text at no cost, and it drafts
again as soon as they say drafting pays. Its rows do not probe: a probe would learn nothing the lookahead does not,
at a wide verify's cost (token recycling's 8-node tree is a 9-token verify, 1.65 one-token forwards of SmolLM2 on a
2-core CPU; on three QA questions it drafted in 10 of 184 steps with probes, 3 of 189 without,
`benchmarks/results/smollm2_recycling_{no_lookahead,lookahead}_bf16_cpu.json`). Step times are measured when
drafting pays by the estimates (the cost table's prior reads a width cheap until then).

Known draft depths: a proposer that can say before the decision how deep each row's draft goes
(`Proposer.draft_depths`; suffix decoding, alongside its classes; token recycling, whose table may hold nothing after
a row's last token) has no draft position past it counted, and a row with none gets no limit and no lookahead: a
step where no row has a draft is plain, whatever the estimates say.

Draft classes: a host proposer that can say before the decision what kind of draft each row has
(`Proposer.draft_classes`; n-gram lookup: the length of the matched n-gram; suffix decoding: that of the context
its draft matched, bucketed; 0 for no draft) gets acceptance estimates per class instead of per row, pooled over
every row and call (`CostTable.class_estimate`), from its drafts and its lookahead drafts alike. A row without a
draft expects nothing from drafting and gets no limit; no row probes (lookahead observes every class for free). The
class is a function of the committed text (and, for suffix decoding, of earlier requests' outputs), so this stays
as lossless as the rest. Under `method="auto"` each candidate that tells its drafts apart keeps its own class
estimates, and the others their per-row ones: a step weighs n-gram lookup's draft for a row by the length of the
n-gram it matched against an EAGLE head's row estimate.

Per row under `method="auto"`: a step is paid for by one candidate (its drafting and a verify of its width), and the
host lookups (n-gram, suffix: their drafting costs next to nothing) ride along: a row takes a lookup's draft where it
offers more than the step's candidate. The candidate's own width is chosen for the rows no lookup serves as well; a
lookup's rows may go deeper, each extra position priced at the lookups' own step times (a verify alone). Each
candidate's estimates learn from the rows that drafted with it.

The critical path: a call lasts as long as its rows with the most tokens left before `max_length`, so the width
is chosen for those rows' tokens; the rows ahead of them draft within that width where their own estimates say
so (the step costs its width whoever drafts), and do not widen a step by themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hf_specdec.compile import graphs_compiled
from hf_specdec.config import SpeculativeConfig
from hf_specdec.proposers.base import Proposer
from hf_specdec.schedule.decision import Decision, decide, expected_accepted, step_expectation, width_ladder
from hf_specdec.schedule.estimates import LOOKAHEAD_PRIOR_COUNT, AcceptanceEstimate, CostTable, cost_table
from hf_specdec.schedule.lookahead import LookaheadDrafts, LookaheadTree, ShippedTrees
from hf_specdec.schedule.rules import batch_size_cap
from hf_specdec.stats import ScheduleStats
from hf_specdec.step import DecodeState, Proposal

# a row that has not drafted for this many steps probes; each probe doubles the wait, up to PROBE_MAX_INTERVAL,
# until the row drafts again by its own estimate. Due rows probe in a step that drafts anyway; a plain step is
# widened for probes only after as many plain steps in a row (the batch's own wait, doubled by each probe step it
# takes), so the rows of a large batch probe together rather than each widening steps in turn
PROBE_INTERVAL = 4
PROBE_MAX_INTERVAL = 64
# draft positions a probe asks for (within the step's cap)
PROBE_LENGTH = 2
# where rows share a step (batch > 1), the share of wall time steps widened for probes may take: such a step comes
# only after enough plain steps that its extra cost (the predicted time of a probe's width over a plain step's) is
# at most this share of the time since the last (at batch 32 on a CPU a step of width 2 costs nearly two plain
# steps: probes after 4, 8 and 16 plain steps cost a 32-token call several plain steps). A single row's probes are
# its own: at batch 1 the budget delayed finding a repeated passage (n-gram on the demo's math question: 1.16
# instead of 1.83 tokens per target forward)
PROBE_BUDGET = 0.03


@dataclass(frozen=True)
class DraftClasses:
    """A host proposer's draft classes (`Proposer.draft_classes`): each row's class before a step (0: no draft), out
    of `count` classes."""

    of_rows: Callable[[DecodeState], np.ndarray]
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"DraftClasses.count: {self.count}; a proposer with draft classes has at least one")


class Schedule:
    """Per-row draft limits for each step. `adaptive=False` applies the batch-size rules alone (k otherwise).
    With several candidate proposers (`costs` keyed by method, `method="auto"`), each step also names the one
    expected to bring the most tokens per second, per row (`state.draft_methods`); a single proposer is keyed None."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_k: int,
        costs: dict[str | None, CostTable],
        static_shapes: bool,
        clock: Callable[[], float] = time.perf_counter,
        # per candidate (the keys of `costs`) that looks ahead: its `Proposer.lookahead`
        lookahead: dict[str | None, Callable[[DecodeState, list[int]], list[LookaheadTree] | ShippedTrees]] | None = None,
        graphs_compiled: Callable[[], int] = graphs_compiled,
        # per candidate (the keys of `costs`) that tells its drafts apart: its draft classes
        draft_classes: dict[str | None, DraftClasses] | None = None,
        # per candidate that knows before the decision how deep each row's draft goes (0: it has none this step): its
        # `Proposer.draft_depths`, read after its draft classes in the same step where it has both
        draft_depths: dict[str | None, Callable[[DecodeState], np.ndarray]] | None = None,
    ) -> None:
        self.adaptive = config.schedule == "adaptive"
        # candidates that look ahead: rows not drafting with one are checked against its lookahead drafts
        self.lookahead = dict(lookahead or {}) if self.adaptive else {}
        # host proposers that tell their drafts apart (`Proposer.draft_classes`): each row's acceptance is its draft
        # class's, pooled over all rows, and whether it drafts at all is known before the decision
        self.draft_classes = dict(draft_classes or {}) if self.adaptive else {}
        # candidates that say before the decision how deep each row's draft goes: a position past it is not drafted
        self.depth_readers = dict(draft_depths or {}) if self.adaptive else {}
        unknown = (set(self.draft_classes) | set(self.lookahead) | set(self.depth_readers)) - set(costs)
        if unknown:
            raise ValueError(f"Schedule: draft classes, depths or lookahead for {sorted(map(str, unknown))}, which "
                             "are not candidates")
        self.max_k = max_k
        self.disable_by_batch_size = config.disable_by_batch_size
        self.per_batch_size = config.num_speculative_tokens_per_batch_size
        self.costs = costs
        # under static shapes each width is a compiled shape: the ladder, and the k of each batch-size rule
        rule_ks = {k for _, _, k in self.per_batch_size or ()}
        self.widths = tuple(sorted(set(width_ladder(max_k)) | rule_ks)) if static_shapes else tuple(range(max_k + 1))
        self.clock = clock
        self.graphs_compiled = graphs_compiled  # a step during which this count grew compiled a graph

    def start(self, batch_size: int) -> None:
        """A new call: per-row estimates start from what earlier calls ended with (step times carry over)."""
        self.acceptance = {method: AcceptanceEstimate(batch_size, self.max_k, table.acceptance_prior(self.max_k),
                                                      prior_count=LOOKAHEAD_PRIOR_COUNT if method in self.lookahead
                                                      else None)
                           for method, table in self.costs.items()}
        self.idle = np.zeros(batch_size, dtype=int)  # steps since each row last drafted
        self.every_row = np.ones(batch_size, dtype=bool)
        self.lookahead_drafts = {method: LookaheadDrafts(batch_size, self.max_k) for method in self.lookahead}
        # per candidate whose lookahead this step is read with the step's host read: (rows, trees, classes)
        self.shipped: dict[str | None, tuple[list[int], ShippedTrees, np.ndarray]] = {}
        # per candidate with draft classes: [B] each row's draft class this step (and draft depth, where known),
        # and the classes' estimates
        self.classes: dict[str | None, np.ndarray] = {}
        self.depths: dict[str | None, np.ndarray] = {}
        self.class_estimate = {method: self.costs[method].class_estimate(classes.count, self.max_k)
                               for method, classes in self.draft_classes.items()}
        self.interval = np.full(batch_size, PROBE_INTERVAL)
        self.histogram = np.zeros((batch_size, self.max_k + 1), dtype=np.int64)
        self.estimated = np.zeros(batch_size)
        self.allowed_total = np.zeros(batch_size, dtype=np.int64)
        self.accepted_total = np.zeros(batch_size, dtype=np.int64)
        self.method_steps = {method: np.zeros(batch_size, dtype=np.int64) for method in self.costs}
        self.steps = 0
        self.drafted = False  # whether a step of this call drafted yet
        self.plain_run = 0  # plain steps in a row
        # plain steps in a row after which due rows may widen a step: where drafting has not paid at this batch size,
        # the wait earlier calls' probes had grown to (a call's probes would otherwise start over every call)
        self.batch_size = batch_size
        self.batch_interval = max([PROBE_INTERVAL] + [table.probe_wait.get(batch_size, PROBE_INTERVAL)
                                                      for table in self.costs.values()
                                                      if table.unpaid_widths(batch_size, batch_size)])
        self.decision: Decision | None = None

    def step_times(self, rows_computed: int) -> dict[str | None, np.ndarray]:
        """Predicted step time by width for each candidate; a candidate never measured is put on the scale of
        the others' plain step (a plain step costs about the same whichever proposer is idle)."""
        times = {method: table.predict(rows_computed, self.max_k) for method, table in self.costs.items()}
        known = [times[method][0] for method, table in self.costs.items() if table.times]
        if known:
            for method, table in self.costs.items():
                if not table.times:
                    times[method] = times[method] * min(known)
        return times

    def plan(self, state: DecodeState, rows_computed: int) -> Decision:
        """Set the next proposal's limits (and proposer) on `state`; `rows_computed`: the rows the verify forward
        computes."""
        active = np.asarray([not done for done in state.host.finished], dtype=bool)
        cap = batch_size_cap(int(active.sum()), self.max_k, self.disable_by_batch_size, self.per_batch_size)
        widths = [w for w in self.widths if w <= cap] or [0]
        self.cap = cap
        probe = (self.idle >= self.interval) & active
        # whether a row has a draft, and its kind, are known now (a candidate with classes has no probes: see _weigh)
        self.classes = {method: (np.asarray(classes.of_rows(state)) if cap else np.zeros(len(active), dtype=int))
                        for method, classes in self.draft_classes.items()}
        self.depths = {method: np.asarray(read(state)) for method, read in self.depth_readers.items() if cap}
        times = self.step_times(rows_computed)
        # (re)calibrate: a plain step measures the plain step's time where a candidate's is due
        # (`CostTable.plain_due`), from a call's second step on (its first drafts)
        if self.adaptive and self.steps >= 1:
            due = [method for method, table in self.costs.items() if table.plain_due(rows_computed)]
            if due:
                widths, times = [0], {due[0]: times[due[0]]}
        probe_length = min(PROBE_LENGTH, cap)
        wait = self.batch_interval
        if rows_computed > 1:  # within the probe budget
            wait = max(wait, min((t[probe_length] - t[0]) / t[0] for t in times.values()) / PROBE_BUDGET)
        self.probe_alone = self.plain_run >= wait  # due rows may widen a plain step
        rows = np.arange(len(active))
        no_draft = all((method in self.classes and not (self.classes[method][active] > 0).any())
                       or (method in self.depths and not (self.depths[method][active] > 0).any()) for method in times)
        if widths == [0] or no_draft:
            # a plain step whatever the estimates say (no width to draft at, or no row with a draft from any
            # candidate): nothing to weigh; the first candidate takes it (as it would a tie)
            method = next(iter(times))
            decision = Decision(0, (0,) * len(active), float(active.sum()), float(times[method][0]))
            accepted = np.zeros((len(active), self.max_k + 1))
            row_methods = np.full(len(active), method, dtype=object)
        else:
            # the call lasts as long as its rows with the most tokens left before max_length: their tokens shorten it,
            # the others' do not
            left = state.max_length - np.asarray(state.host.lengths)
            critical = active & (left == left[active].max())
            method, decision, accepted, row_methods = self._weigh(times, active, critical, probe, widths,
                                                                  probe_length, rows_computed)
        self.allowed = np.minimum(decision.limits, state.host_draft_budget())  # the length limit cuts too
        self.expected = accepted[rows, self.allowed]  # expected accepted drafts, how often the row drafts included
        state.set_draft_limits(list(decision.limits), decision.width)
        if len(self.costs) > 1:
            state.draft_methods = tuple(row_methods)
        # rows that probed: due and drafting with the step's candidate (a due row in a plain step waits; a
        # candidate with classes or lookahead has no probes)
        self.decision, self.method, self.row_methods, self.active = decision, method, row_methods, active
        self.probed = probe & (np.asarray(decision.limits) > 0) & self.rows_of(method) & self.probes(method)
        self.rows_computed, self.started, self.graphs = rows_computed, self.clock(), self.graphs_compiled()
        return decision

    def _weigh(
        self,
        # per candidate: [K + 1] predicted step time by width
        times: dict[str | None, np.ndarray],
        # [B] bool: rows generating; those on the call's critical path; rows due a probe
        active: np.ndarray,
        critical: np.ndarray,
        probe: np.ndarray,
        widths: list[int],
        probe_length: int,
        rows_computed: int,
    ) -> tuple[str | None, Decision, np.ndarray, np.ndarray]:
        """The candidate whose drafting the step pays for, the decision, its [B, K + 1] expected accepted drafts
        (how often each row drafts included) and [B] the candidate each row drafts with, with the most expected
        tokens per second (`decide`: the critical rows' tokens choose the width). Rows may draft with a host
        candidate that tells its drafts apart instead (`riders`: it drafts for any row at no cost of its own)
        where it expects more, within the width the step's candidate chose for itself or deeper where the extra
        verified positions pay for themselves."""
        expected = {}  # per candidate: [B, K + 1] expected accepted drafts, how often the row drafts included
        for method in times:
            estimate = self.acceptance[method]
            values, draft_rate = estimate.values, estimate.draft_rate
            probing = probe if self.probes(method) else np.zeros_like(probe)
            classes = self.classes.get(method)
            if classes is not None:
                # a row without a draft expects nothing from drafting: it gets no limit. No row probes: its class's
                # estimate is pooled over every row (and, with lookahead, observed for free)
                values = np.where(classes[:, None] > 0, self.class_estimate[method].values[classes], 0.0)
                draft_rate = np.ones(len(classes))
            if method in self.depths:  # a position past the row's draft is not drafted at all
                values = np.where(np.arange(self.max_k)[None, :] < self.depths[method][:, None], values, 0.0)
            expected[method] = (expected_accepted(values), draft_rate, probing)
        # per candidate: the widths whose steps delivered less than plain ones at this batch size (only probes draft
        # at them)
        unpaid_at = {method: set(self.costs[method].unpaid_widths(rows_computed, int(active.sum()))) for method in times}
        best: tuple[float, str | None, Decision, np.ndarray, np.ndarray] | None = None
        rows, positions = np.arange(len(active)), np.arange(self.max_k + 1)

        def weighed(accepted, step_time, draft_rate, probing, unpaid, rows_weighed=active) -> Decision:
            if not self.adaptive:  # the cap, or under static shapes the widest compiled width below it
                width = widths[-1]
                limits = np.where(rows_weighed, width, 0)
                return Decision(width, tuple(int(x) for x in limits),
                                *step_expectation(accepted, step_time, rows_weighed, limits, width, draft_rate))
            return decide(accepted, step_time, rows_weighed, probing, widths, probe_length, draft_rate,
                          self.probe_alone, [w for w in widths if w not in unpaid], critical)

        for method, step_time in times.items():
            accepted, draft_rate, probing = expected[method]
            unpaid = unpaid_at[method]
            names, offers = [method], (accepted * draft_rate[:, None])[None]  # [C, B, K + 1]: each candidate's offer
            riders = self.riders(method, times)
            if not riders:
                decision = weighed(accepted, step_time, draft_rate, probing, unpaid)
            else:
                # the candidate's own width, for the rows no rider serves as well at every length; it drafts for its
                # rows up to it. A rider's row takes its own draft where it offers more, deeper if it goes deeper, at
                # the cost of verifying more (the riders' own step times: their drafting costs next to nothing)
                ridden = np.max([expected[r][0] for r in riders], axis=0)
                served = (ridden >= offers[0]).all(axis=1) & (ridden[:, -1] > 0)
                own = weighed(accepted, step_time, draft_rate, probing, unpaid, active & ~served).width
                names += riders
                offers = np.stack([offers[0][:, np.minimum(positions, own)]] + [expected[r][0] for r in riders])
                verify = np.min([times[r] for r in riders], axis=0)
                step_time = np.where(positions <= own, step_time, step_time[own] + verify - verify[own])
                unpaid = {w for w in unpaid if w <= own} | {w for w in set.intersection(*(unpaid_at[r] for r in riders))
                                                          if w > own}
                accepted, draft_rate = offers.max(axis=0), np.ones(len(active))
                decision = weighed(accepted, step_time, draft_rate, probing, unpaid)
            rate = decision.expected_tokens / max(decision.expected_time, 1e-12)
            if best is None or rate > best[0] * (1.0 + 1e-9):
                # each row's candidate: the one offering the most at its limit (a tie: the step's candidate)
                row_methods = np.asarray(names, dtype=object)[offers[:, rows, np.asarray(decision.limits)].argmax(0)]
                best = (rate, method, decision, accepted * draft_rate[:, None], row_methods)
        _, method, decision, accepted, row_methods = best
        drafting = row_methods[np.asarray(decision.limits) > 0]
        if drafting.size and method not in drafting:  # no row drafts with it: the step is a rider's
            method = max(dict.fromkeys(drafting), key=lambda name: int((drafting == name).sum()))
        return method, decision, accepted, row_methods

    def rows_of(self, method: str | None) -> np.ndarray:
        """[B] bool: the rows this step's decision gave to `method` (every row, with a single candidate)."""
        if len(self.costs) == 1:
            return self.every_row
        return self.row_methods == method

    def probes(self, method: str | None) -> bool:
        """Whether a candidate's rows probe: not where its estimates learn without drafting (draft classes, pooled
        over every row; lookahead)."""
        return method not in self.classes and method not in self.lookahead

    def riders(self, method: str | None, candidates: Iterable[str | None]) -> list[str | None]:
        """The `candidates` other than `method` that may draft for a row in a step `method` drafts: those that draft
        on the host and tell their drafts apart (n-gram lookup, suffix decoding), whose drafting costs next to
        nothing and whose rows' drafts are known before the step."""
        return [other for other in candidates if other != method and other in self.classes]

    def lookahead_rows(self, method: str | None = None) -> list[int]:
        """The rows a candidate that looks ahead is asked for its draft this step (after proposing): generating,
        not drafting with it, with none of its drafts being checked."""
        if method not in self.lookahead or self.cap == 0:  # the batch-size rules allow no drafts: nothing to learn
            return []
        asked = self.active & ~((self.allowed > 0) & self.rows_of(method))
        if method in self.depths:  # a row known to have no draft now has nothing to look ahead with
            asked &= self.depths[method] > 0
        return self.lookahead_drafts[method].free_rows(asked)

    def look_ahead(self, state: DecodeState) -> None:
        """After the step's proposal: each candidate that looks ahead gives the draft it would make for its
        `lookahead_rows`, to be checked against what they emit."""
        for method, lookahead in self.lookahead.items():
            rows = self.lookahead_rows(method)
            if rows:
                classes = self.classes.get(method, np.zeros(len(self.active), dtype=int))
                drafts = lookahead(state, rows)
                if isinstance(drafts, ShippedTrees):  # read after the step's host read (`_check_lookahead`)
                    self.shipped[method] = (rows, drafts, classes)
                else:
                    self.lookahead_drafts[method].start(rows, drafts, classes)

    def _check_lookahead(self, state: DecodeState, drafted: np.ndarray) -> None:
        """Settle every candidate's lookahead drafts against what the step emitted, as observations of its drafts."""
        for method, (rows, shipped, classes) in self.shipped.items():
            tokens = shipped.tokens(state.host, rows)
            self.lookahead_drafts[method].start_shaped(rows, tokens, shipped.parents, classes)
        self.shipped = {}
        for method, drafts in self.lookahead_drafts.items():
            settled = drafts.settle(state.host, drafted & self.rows_of(method))
            if settled is None:
                continue
            if method in self.classes:
                self.class_estimate[method].update_classes(settled.classes, settled.asked, settled.matched,
                                                           settled.lengths)
            else:
                self.acceptance[method].update(settled.asked, settled.matched, settled.lengths)

    def observe(self, state: DecodeState, proposal: Proposal) -> None:
        """After the step's host sync: its time and each row's accepted count update the estimates. Where the
        proposal says how deep each row drafted (`Proposal.host_depths`), the step's time is that of the width it
        verified, and positions not drafted are not counted as rejected."""
        seconds = self.clock() - self.started
        decision = self.decision
        self.steps += 1
        depths = proposal.host_depths
        width = decision.width if depths is None else min(decision.width, proposal.tree.max_depth)
        # the width whose step time this step measured: a drafter that stopped its chains by confidence computed
        # one position more than it drafted (the one that stopped them), and verified what it drafted
        timed_width = width if proposal.drafted_positions is None else min(decision.width, proposal.drafted_positions)
        accepted = np.asarray(state.host.num_accepted)
        table = self.costs[self.method]
        # a step that compiled a graph (a shape met first: seconds to minutes on a CPU) is not a step time, nor a
        # call's first drafting step: a model drafter reads the prompt in it (the EAGLE-3 head on SmolLM2 at batch
        # 1: 6 ms more than its later steps, a tenth of a plain step, `benchmarks/schedule_trace.py`), a cost of the
        # call whatever the width, and the wide widths a new call's prior drafts at were measured mostly there
        compiled = self.graphs_compiled() != self.graphs
        first_draft = decision.width > 0 and not self.drafted
        self.drafted |= decision.width > 0
        # rows drafting with a rider deeper than the step's candidate drafted: the step cost its drafting to a
        # shallower depth and a verify of this width, which is no entry of its table
        own = self.allowed[self.rows_of(self.method) & self.active]
        deeper_riders = width > (int(own.max()) if own.size else 0)
        if not compiled and not first_draft and not deeper_riders and (self.adaptive or len(self.costs) > 1):
            # a plain step is the same target forward whichever candidate is idle (each skips it): every candidate's
            # table takes it, so that each need not pay plain steps of its own to measure it (`CostTable.plain_due`)
            for observer in (self.costs.values() if timed_width == 0 else [table]):
                observer.observe(self.rows_computed, timed_width, seconds)
            # what the width the decision chose delivered (a host proposer may verify less than it allowed); one
            # row's steps are its own, and its estimates decide for it
            if width and self.rows_computed > 1:
                table.observe_realized(self.rows_computed, decision.width, float(((accepted + 1) * self.active).sum()),
                                       seconds, int(self.active.sum()))
        # each candidate observes the rows that drafted with it
        for method in dict.fromkeys(self.row_methods) if len(self.costs) > 1 else (self.method,):
            allowed = np.where(self.rows_of(method), self.allowed, 0)
            if method in self.classes:
                self.class_estimate[method].update_classes(self.classes[method], allowed, accepted, depths)
            else:
                self.acceptance[method].update(allowed, accepted, depths)
        drafted = self.allowed > 0
        self._check_lookahead(state, drafted)
        self.histogram[np.arange(len(self.active)), np.asarray(decision.limits)] += self.active
        for method in self.method_steps:
            self.method_steps[method] += drafted & self.rows_of(method)
        self.estimated += self.expected
        self.allowed_total += self.allowed
        self.accepted_total += accepted * drafted
        # every probe doubles the wait before the next: that a probe had a draft accepted says nothing about
        # whether drafting pays (the estimates it updated decide that), and at a large batch rows probing in turn
        # would widen nearly every step; a row that drafts by its own estimate and has a draft accepted resets it
        chose = drafted & ~self.probed
        self.interval = np.where(self.probed, np.minimum(self.interval * 2, PROBE_MAX_INTERVAL),
                                 np.where(chose & (accepted > 0), PROBE_INTERVAL, self.interval))
        self.idle = np.where(drafted, 0, self.idle + 1)
        if decision.width == 0:
            self.plain_run += 1
        else:  # a step widened for probes doubles the batch's wait; one that drafts by the estimates resets it
            self.plain_run = 0
            self.batch_interval = (min(self.batch_interval * 2, PROBE_MAX_INTERVAL) if self.probe_alone
                                   else PROBE_INTERVAL)
        state.draft_limits = state.draft_limit_tensor = state.draft_width = state.draft_methods = None

    def finish(self) -> list[ScheduleStats]:
        """The call's statistics per row; its rows' acceptance becomes the next call's prior."""
        if self.steps:
            for method, table in self.costs.items():
                table.record_acceptance(self.acceptance[method])
                table.probe_wait[self.batch_size] = self.batch_interval
        return [
            ScheduleStats(
                schedule="adaptive" if self.adaptive else "fixed",
                k_histogram=self.histogram[b].tolist(),
                plain_steps=int(self.histogram[b, 0]),
                estimated_accepted_tokens=float(self.estimated[b]),
                scheduled_draft_tokens=int(self.allowed_total[b]),
                scheduled_accepted_tokens=int(self.accepted_total[b]),
                method_steps={m: int(v[b]) for m, v in self.method_steps.items() if m is not None},
            )
            for b in range(self.histogram.shape[0])
        ]


def build_schedule(config: SpeculativeConfig, model: object, proposer: Proposer, max_k: int,
                   static_shapes: bool) -> Schedule | None:
    """The step schedule `config` asks for; None for `schedule="fixed"` without batch-size rules (k every step)
    with a single proposer."""
    methods = getattr(proposer, "methods", None)
    if methods is not None:  # method="auto": a step-time table per candidate, and the candidates' draft classes
        costs = {m: cost_table(model, proposer.candidate_cost_key(m, static_shapes)) for m in methods}
        return Schedule(config, max_k, costs, static_shapes,
                        lookahead={m: c.lookahead for m, c in proposer.candidates.items() if _looks_ahead(c)},
                        draft_classes={m: _draft_classes(c) for m, c in proposer.candidates.items()
                                       if c.num_draft_classes},
                        draft_depths={m: c.draft_depths for m, c in proposer.candidates.items()
                                      if c.knows_draft_depths})
    if (config.schedule == "fixed" and config.disable_by_batch_size is None
            and config.num_speculative_tokens_per_batch_size is None):
        return None
    return Schedule(config, max_k, {None: cost_table(model, proposer.cost_key(config, static_shapes))},
                    static_shapes, lookahead={None: proposer.lookahead} if _looks_ahead(proposer) else None,
                    draft_classes={None: _draft_classes(proposer)} if proposer.num_draft_classes else None,
                    draft_depths={None: proposer.draft_depths} if proposer.knows_draft_depths else None)


def _looks_ahead(proposer: Proposer) -> bool:
    return proposer.looks_ahead and proposer.reads_emitted_tokens


def _draft_classes(proposer: Proposer) -> DraftClasses:
    return DraftClasses(proposer.draft_classes, proposer.num_draft_classes)
