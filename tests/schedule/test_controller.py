"""The schedule on synthetic traces: accepted counts from a script, step times from an injected clock."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_specdec import SpeculativeConfig
from hf_specdec.schedule.controller import PROBE_BUDGET, PROBE_INTERVAL, DraftClasses, Schedule
from hf_specdec.schedule.estimates import (
    ACCEPTANCE_PRIOR,
    ACCEPTANCE_RATE,
    LOOKAHEAD_PRIOR_COUNT,
    PLAIN_REFRESH,
    CostTable,
)
from hf_specdec.schedule.lookahead import LookaheadTree, ShippedTrees
from hf_specdec.step.state import DecodeState, HostView
from tests.conftest import InjectedCosts


class FakeClock:
    """Step time = `cost(width)`; the schedule reads it at the start and the end of each step."""

    def __init__(self, cost) -> None:
        self.now, self.cost, self.width = 0.0, cost, 0

    def __call__(self) -> float:
        return self.now

    def run_step(self, width: int) -> None:
        self.now += self.cost(width)


def simulate(schedule: Schedule, batch: int, accept, steps: int, clock: FakeClock | None = None, drafted=None):
    """Runs `steps` steps; `accept(step, limits)` gives each row's accepted count, `drafted(step, limits)` (None:
    as allowed) each row's draft depth as a proposer drafting on the host reports it (the clock then charges the
    deepest). Returns the limits per step."""
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)
    schedule.start(batch)
    history = []
    for step in range(steps):
        decision = schedule.plan(state, batch)
        if step == 0:
            buffer = state.limit_buffer
        assert state.limit_buffer is buffer  # one host buffer per call, refilled each step
        assert state.host_draft_budget() == list(decision.limits)
        assert state.draft_budget().tolist() == list(decision.limits)
        limits = list(decision.limits)
        depths = None if drafted is None else [min(d, k) for d, k in zip(drafted(step, limits), limits)]
        width = decision.width if depths is None else max(depths)
        if clock is not None:
            clock.run_step(width)
        accepted = [min(a, k) for a, k in zip(accept(step, limits), depths or limits)]
        host = state.host
        state.host = HostView(host.lengths, host.finished, [a + 1 for a in accepted], accepted)
        schedule.observe(state, SimpleNamespace(host_depths=depths, drafted_positions=None,
                                                tree=SimpleNamespace(max_depth=width)))
        assert state.draft_limits is None  # the limits last one step
        history.append(limits)
    return np.array(history)


def run_looking_ahead(schedule: Schedule, state: DecodeState, steps: int, drafted) -> np.ndarray:
    """Runs `steps` steps of a schedule whose candidate looks ahead, every row emitting 5s; `drafted(limits)` gives
    each row's draft depth (None: as allowed) and accepted count. Returns the limits per step."""
    batch = state.batch_size
    schedule.start(batch)
    history = []
    for _ in range(steps):
        limits = list(schedule.plan(state, batch).limits)
        schedule.look_ahead(state)
        depths, accepted = drafted(limits)
        host = state.host
        state.host = HostView(host.lengths, host.finished, [a + 1 for a in accepted], accepted,
                              np.full((batch, schedule.max_k + 1), 5))
        schedule.observe(state, SimpleNamespace(host_depths=depths, drafted_positions=None,
                                                tree=SimpleNamespace(max_depth=max(depths or limits))))
        history.append(limits)
    return np.array(history)


def _schedule(costs: CostTable, k: int = 4, clock=None, **config) -> Schedule:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, **config)
    return Schedule(config, k, {None: costs}, static_shapes=False, **({} if clock is None else {"clock": clock}))


def test_turns_off_under_zero_acceptance_and_probes():
    history = simulate(_schedule(InjectedCosts(0.1)), 2, lambda step, limits: [0, 0], steps=80)
    assert history[0].tolist() == [4, 4]  # a new row drafts (its estimate starts optimistic)
    # the estimate at the first position falls from the prior 0.7 by a factor 1 - ACCEPTANCE_RATE per rejection,
    # below the cost of a drafted position (0.1 plain steps) after 19 rejections
    first_off = int(np.argmax(history[:, 0] == 0))
    assert history[:first_off].min() > 0
    assert first_off == int(np.ceil(np.log(0.1 / ACCEPTANCE_PRIOR) / np.log(1 - ACCEPTANCE_RATE)))
    off = history[first_off:]
    assert (off == 0).mean() > 0.85, off.tolist()
    probes = np.flatnonzero(off[:, 0] > 0)
    assert len(probes) >= 2 and np.all(np.diff(probes) >= PROBE_INTERVAL)  # probes, further and further apart
    assert np.all(np.diff(np.diff(probes)) >= 0)


def test_shared_probes_that_cost_much_wait_within_the_probe_budget():
    """Zero acceptance at batch 4: where a probe's width costs a whole plain step more (slope 0.5), steps widened
    for probes take at most PROBE_BUDGET of the time after drafting stopped; where it costs little (slope 0.05),
    or where a single row pays for its own probes (batch 1), the first probe still comes after PROBE_INTERVAL plain
    steps."""
    for batch, slope in ((4, 0.5), (4, 0.05), (1, 0.5)):
        history = simulate(_schedule(InjectedCosts(slope)), batch, lambda step, limits: [0] * batch, steps=64)
        widths = history.max(axis=1)
        after = widths[int(np.argmax(widths == 0)):]  # from the first plain step on
        probes = np.flatnonzero(after)
        assert len(probes) >= 1
        if (batch, slope) == (4, 0.5):
            assert (slope * after).sum() / (1 + slope * after).sum() <= PROBE_BUDGET
        else:
            assert probes[0] == PROBE_INTERVAL


def test_turns_on_again_when_acceptance_returns():
    """Unpredictable text for 40 steps, then a repeated passage: every draft accepted."""
    history = simulate(_schedule(InjectedCosts(0.1)), 1, lambda step, limits: [0 if step < 40 else 99],
                       steps=120)
    assert (history[30:40] == 0).mean() > 0.5
    assert history[-20:].min() == 4, history[40:].ravel().tolist()


def test_longer_drafts_when_acceptance_is_high_and_drafting_cheap():
    def accept_with(p):
        rng = np.random.default_rng(0)
        return lambda step, limits: [int(np.argmin(np.append(rng.random(8) < p, False)))]

    def mean_limit(p, slope):
        history = simulate(_schedule(InjectedCosts(slope), k=8), 1, accept_with(p), steps=200)
        return history[50:].mean()

    assert mean_limit(0.9, 0.02) > mean_limit(0.5, 0.02) > mean_limit(0.2, 0.02)
    assert mean_limit(0.9, 0.02) > mean_limit(0.9, 0.3)
    assert mean_limit(0.9, 0.02) > 6


def test_measured_step_times_drive_the_decision():
    """Clock-measured costs: when a drafted position costs more than it brings (acceptance 0.3, each position
    0.5 plain steps), the schedule learns it and stops; when it costs little, it keeps drafting."""
    for slope, expect_off in ((0.5, True), (0.01, False)):
        rng = np.random.default_rng(1)

        def accept(step, limits):
            return [int(np.argmin(np.append(rng.random(8) < 0.3, False)))]

        clock = FakeClock(lambda width, s=slope: 1.0 + s * width)
        costs = CostTable()
        history = simulate(_schedule(costs, clock=clock), 1, accept, steps=80, clock=clock)
        # the first steps calibrate: width 4 (not timed: a call's first drafting step reads the prompt), a plain
        # step, then drafting widths
        assert history[0].tolist() == [4] and history[1].tolist() == [0]
        assert (1, 0) in costs.times and any(width for _, width in costs.times)
        plain_share = (history[20:] == 0).mean()
        assert (plain_share > 0.7) if expect_off else (plain_share < 0.2), (slope, history.ravel().tolist())


def test_a_calls_first_drafting_step_is_not_timed():
    """A call's first drafting step carries the proposer's reading of the prompt (a cost of the call whatever the
    width): its time stays out of the table, and the call's later drafting steps at that width are timed."""
    clock = FakeClock(lambda width: 1.0 + 0.1 * width)
    costs = CostTable()
    history = simulate(_schedule(costs, clock=clock), 1, lambda step, limits: [limits[0]], steps=1, clock=clock)
    assert history[0].tolist() == [4] and costs.times == {}
    history = simulate(_schedule(costs, clock=clock), 1, lambda step, limits: [limits[0]], steps=6, clock=clock)
    drafting = history[:, 0] > 0
    assert drafting[0] and drafting.sum() >= 3 and costs.times[(1, 0)] == 1.0
    # a new call's first drafting step is again left out: every later drafting step is timed
    assert sum(len(costs.recent[key]) for key in costs.recent if key[1] > 0) == drafting.sum() - 1


def test_a_stale_plain_step_time_is_measured_again():
    """An earlier call's plain steps, over a longer context, measured 3 time units; this call's plain step costs 1
    and each drafted position 0.25, at acceptance 0.1. Read as it was, the stale time makes drafting look free (a
    wider step is never predicted cheaper than a narrower one), and no plain step would ever correct it; the
    schedule measures a plain step again and stops drafting."""
    rng = np.random.default_rng(2)

    def accept(step, limits):
        return [int(np.argmin(np.append(rng.random(8) < 0.1, False)))]

    clock = FakeClock(lambda width: 1.0 + 0.25 * width)
    costs = CostTable()
    costs.observe(1, 0, 3.0)  # the earlier, longer-context call
    history = simulate(_schedule(costs, clock=clock), 1, accept, steps=80, clock=clock)
    assert costs.times[(1, 0)] < 1.5
    assert (history[20:] == 0).mean() > 0.7, history.ravel().tolist()


def test_a_drafter_that_pays_takes_a_plain_step_now_and_then_to_measure_it():
    """Every draft accepted and drafting nearly free: the schedule drafts every step but one in PLAIN_REFRESH,
    which re-measures the plain step."""
    clock = FakeClock(lambda width: 1.0 + 0.01 * width)
    history = simulate(_schedule(CostTable(), clock=clock), 1, lambda step, limits: [99], steps=4 * PLAIN_REFRESH,
                       clock=clock)
    plain = np.flatnonzero(history[:, 0] == 0)
    assert plain[0] == 1  # the first steps calibrate
    assert len(plain) == 4 and np.all(np.diff(plain) == PLAIN_REFRESH + 1), plain.tolist()


def test_batch_size_rules_cap_the_adaptive_and_the_fixed_schedule():
    always = lambda step, limits: [99] * len(limits)  # noqa: E731
    for schedule in ("adaptive", "fixed"):
        capped = simulate(_schedule(InjectedCosts(0.01), schedule=schedule,
                                    num_speculative_tokens_per_batch_size=[[1, 2, 4], [3, 8, 2]]), 3, always, 10)
        assert capped.max() == 2 and capped[-1].tolist() == [2, 2, 2]
        off = simulate(_schedule(InjectedCosts(0.01), schedule=schedule, disable_by_batch_size=3), 3, always, 10)
        assert off.max() == 0


def test_schedule_stats_count_decisions():
    schedule = _schedule(InjectedCosts(0.1))
    simulate(schedule, 2, lambda step, limits: [limits[0], 0], steps=60)
    rows = schedule.finish()
    assert all(sum(r.k_histogram) == 60 for r in rows)
    assert rows[0].plain_steps == 0 and rows[1].plain_steps > 30
    assert rows[0].measured_acceptance_rate == 1.0 and rows[1].measured_acceptance_rate == 0.0
    # the call's average estimate: from the prior (0.7) towards 1 over the call
    assert rows[0].estimated_acceptance_rate > 0.85 and schedule.acceptance[None].values[0].min() > 0.99


def test_static_shapes_keep_the_batch_size_rules_ks_among_the_compiled_widths():
    """Under static shapes a step's width is a compiled one: a rule's k (3 here, off the ladder 0, 1, 2, 4) is one
    of them, so the fixed schedule drafts exactly that k."""
    always = lambda step, limits: [99] * len(limits)  # noqa: E731
    for schedule in ("adaptive", "fixed"):
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, schedule=schedule,
                                   num_speculative_tokens_per_batch_size=[[1, 8, 3]])
        static = Schedule(config, 4, {None: InjectedCosts(0.01)}, static_shapes=True)
        assert static.widths == (0, 1, 2, 3, 4)
        history = simulate(static, 2, always, 6)
        assert set(history.ravel()) <= set(static.widths) and history.max() <= 3
    assert simulate(static, 2, always, 6)[-1].tolist() == [3, 3]


def test_probes_of_a_large_batch_do_not_keep_every_step_drafting():
    """16 rows whose drafts are sometimes accepted (first position 0.3) but never pay (each position costs half a
    plain step): a probe that has a draft accepted is no reason to probe again soon, so most steps are plain for
    the whole batch, not widened by one row's probe or another's."""
    rng = np.random.default_rng(2)

    def accept(step, limits):
        return [int(np.argmin(np.append(rng.random(8) < 0.3, False))) for _ in limits]

    clock = FakeClock(lambda width: 1.0 + 0.5 * width)
    history = simulate(_schedule(CostTable(), clock=clock), 16, accept, steps=200, clock=clock)
    steps_drafting = (history[40:].max(axis=1) > 0).mean()
    assert steps_drafting < 0.35, steps_drafting


def test_a_lookup_that_rarely_finds_a_match_keeps_asking():
    """An n-gram row finds a match one step in five (then every draft is accepted) and each drafted position costs
    a tenth of a plain step: a step without a match is a plain one, so asking costs nothing then; the schedule
    keeps allowing drafts instead of turning off on the steps that found nothing."""
    rng = np.random.default_rng(3)
    matches = rng.random(300) < 0.2
    clock = FakeClock(lambda width: 1.0 + 0.1 * width)
    history = simulate(_schedule(CostTable(), clock=clock), 1, lambda step, limits: [99], steps=300, clock=clock,
                       drafted=lambda step, limits: [99 if matches[step] else 0])
    assert (history[20:] > 0).mean() > 0.9, history.ravel().tolist()
    assert history[20:].mean() > 3



def test_a_new_call_starts_from_what_earlier_calls_measured():
    """A first call's rows start optimistic and draft; after a call whose drafts were never accepted, the next
    call on the same model and proposer (the same step-time table) starts from what those rows ended with, and drafts
less than k."""
    costs, clock = CostTable(), FakeClock(lambda width: 1.0 + 0.1 * width)  # measured, on an injected clock
    schedule = _schedule(costs, clock=clock)
    first = simulate(schedule, 4, lambda step, limits: [0] * 4, steps=30, clock=clock)
    assert first[0].tolist() == [4] * 4
    ended = schedule.acceptance[None].values.mean(axis=0)
    schedule.finish()  # the call ends
    np.testing.assert_allclose(costs.acceptance_prior(4), ended)
    later = _schedule(costs, clock=clock)
    history = simulate(later, 4, lambda step, limits: [0] * 4, steps=1, clock=clock)
    assert history[0].max() < 4, history.tolist()


class Optimistic(InjectedCosts):
    """Step-time predictions injected, measurements kept (step times and the rates drafting steps realized)."""

    observe = CostTable.observe
    observe_realized = CostTable.observe_realized

    plain_due = CostTable.plain_due


def test_drafting_stops_where_drafting_steps_delivered_less_than_plain_ones():
    """Step-time predictions that make drafting look nearly free (slope 0.01) while the clock charges a plain step
    per drafted position: the acceptance estimates alone keep drafting; the tokens per second the drafting steps
    realized, against the measured plain step, switch it off (probes still draft now and then)."""

    rng = np.random.default_rng(3)

    def accept(step, limits):
        return [int(np.argmin(np.append(rng.random(8) < 0.5, False))) for _ in limits]

    for guarded in (True, False):
        costs = Optimistic(0.01)
        if not guarded:
            costs.unpaid_widths = lambda batch_size, rows: set()
        clock = FakeClock(lambda width: 1.0 + 1.0 * width)
        history = simulate(_schedule(costs, clock=clock), 2, accept, steps=80, clock=clock)
        plain_share = (history[20:] == 0).mean()
        if guarded:
            assert plain_share > 0.7, history.ravel().tolist()
            assert (history[20:] > 0).any()  # probes
        else:
            assert plain_share < 0.2, history.ravel().tolist()


def test_later_calls_keep_the_probe_wait_where_drafting_does_not_pay():
    """Where drafting has not paid at a batch size, a new call's probes wait as long as the last call's had grown
    to, instead of starting over after 4 plain steps."""
    costs = Optimistic(0.01)
    clock = FakeClock(lambda width: 1.0 + 1.0 * width)
    schedule = _schedule(costs, clock=clock)
    first_probes = []
    for call in range(3):
        history = simulate(schedule, 8, lambda step, limits: [0] * len(limits), steps=40, clock=clock)
        schedule.finish()
        drafting = np.flatnonzero(history.max(axis=1) > 0)
        first_probes.append(int(drafting[drafting > 1][0]) if (drafting > 1).any() else 40)
    assert costs.unpaid_widths(8, 8)
    assert first_probes[2] > first_probes[0] + PROBE_INTERVAL, first_probes


def test_a_narrower_width_keeps_drafting_where_wide_steps_did_not_pay():
    """The predictions make every width look nearly free; the clock charges 0.1 w^3 plain steps for width w, so
    only width 1 pays at acceptance 0.5. The widths whose steps realized less than a plain step drop out one by one,
    and the schedule settles on drafting one token rather than on plain steps."""
    rng = np.random.default_rng(5)

    def accept(step, limits):
        return [int(np.argmin(np.append(rng.random(8) < 0.5, False))) for _ in limits]

    costs = Optimistic(0.01)
    clock = FakeClock(lambda width: 1.0 + 0.1 * width ** 3)
    history = simulate(_schedule(costs, clock=clock), 2, accept, steps=120, clock=clock)
    assert costs.unpaid_widths(2, 2) >= {3, 4}
    late = history[-40:].max(axis=1)
    assert (late == 1).mean() > 0.6, history.tolist()


def test_a_single_row_is_left_to_its_estimates_and_a_paying_step_clears_the_switch():
    """One row shares its steps with no one: its own estimates decide, and nothing is recorded for the switch. At
    a batch, once a width's steps beat a plain step, the estimates choose the other widths again."""
    costs = Optimistic(0.01)
    clock = FakeClock(lambda width: 1.0 + 1.0 * width)
    simulate(_schedule(costs, clock=clock), 1, lambda step, limits: [0], steps=40, clock=clock)
    assert not costs.realized
    table = CostTable()
    table.observe(4, 0, 1.0)
    for _ in range(4):
        table.observe_realized(4, 4, 4.0, 2.0, 4)  # 2 tokens per plain-step time: half a plain step's 4
    assert table.unpaid_widths(4, 4) == {4}
    for _ in range(3):
        table.observe_realized(4, 2, 9.0, 1.5, 4)  # 6 per plain-step time, fewer times than the switch counts
    assert table.unpaid_widths(4, 4) == {4}
    table.observe_realized(4, 2, 9.0, 1.5, 4)
    assert table.unpaid_widths(4, 4) == set()


def test_the_switch_judges_the_width_the_decision_chose():
    """A proposer drafting on the host verifies less than it was allowed (lookups find 1 token where 4 were
    allowed): the steps' results count against the width the decision chose, so it is that width that drops out."""
    costs = Optimistic(0.01)
    clock = FakeClock(lambda width: 1.0 + 2.0 * width)  # a verified draft token costs two plain steps
    simulate(_schedule(costs, clock=clock), 2, lambda step, limits: [99] * len(limits), steps=40, clock=clock,
             drafted=lambda step, limits: [min(1, k) for k in limits])  # every lookup finds one token, accepted
    assert 4 in costs.unpaid_widths(2, 2)


@pytest.mark.parametrize("drafts", ["chains", "shipped trees"])
def test_a_proposer_that_looks_ahead_turns_rows_back_on_without_waiting_for_a_probe(drafts):
    """Rows of a proposer that looks ahead (n-gram lookup, suffix decoding: chains on the host; token recycling:
    trees built on the device, shipped with the step's host read): their lookahead drafts, walked down by the tokens
    they emit, keep their estimates current. Unpredictable text for 40 steps (every draft wrong at its first
    token), then a repeated passage (every draft right)."""
    batch, k = 2, 4
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    asked = []
    # the tree: root's children 8 and 5, then 5s below the 5 (and a 7 beside the second one)
    tree_tokens, tree_parents = torch.tensor([8, 5, 5, 7, 5, 5]), np.array([-1, -1, 1, 1, 2, 4])

    def lookahead(state, rows):  # the chain (tree path) is always 5s
        asked[-1] = rows
        if drafts == "shipped trees":
            return ShippedTrees(state.ship(tree_tokens.expand(batch, -1)), tree_parents)
        return [LookaheadTree.chain(np.full(k, 5)) for _ in rows]

    schedule = Schedule(config, k, {None: InjectedCosts(0.1)}, static_shapes=False, lookahead={None: lookahead})
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)
    schedule.start(batch)
    history = []
    for step in range(120):
        predictable = step >= 40
        limits = list(schedule.plan(state, batch).limits)
        asked.append([])
        schedule.look_ahead(state)
        accepted = [limit if predictable else 0 for limit in limits]
        emitted = np.full((batch, k + 1), 5 if predictable else 9)
        host = state.host
        state.host = HostView(host.lengths, host.finished, [a + 1 for a in accepted], accepted, emitted,
                              shipped=tuple(part.numpy() for part in state.shipments))
        state.shipments = []
        schedule.observe(state, SimpleNamespace(host_depths=None, drafted_positions=None,
                                                tree=SimpleNamespace(max_depth=max(limits))))
        history.append(limits)
    history = np.array(history)
    first_off = int(np.argmax(history[:, 0] == 0))
    # off while the text stays wrong, without probes: the lookahead learns what a probe would
    assert 0 < first_off < 30 and (history[first_off:40] == 0).all()
    plain_steps = [step for step in range(first_off, 40) if not history[step].any()]
    assert all(asked[step] == [0, 1] for step in plain_steps)  # every plain step asks again after a mismatch
    back_on = 40 + int(np.argmax(history[40:, 0] > 0))
    assert back_on < 40 + 2 * k  # a chain settles after k matching tokens: a few plain steps, then drafting
    assert (history[back_on:] > 0).all() and (history[-20:] == k).all()  # on for good, up to k as estimates rise
    # without lookahead the rows find out only from a probe, which comes only after PROBE_INTERVAL plain steps or
    # more (their waits doubling)
    schedule = Schedule(config, k, {None: InjectedCosts(0.1)}, static_shapes=False)
    blind = simulate(schedule, batch, lambda step, limits: [limit if step >= 40 else 0 for limit in limits],
                     steps=120)
    assert 40 + int(np.argmax(blind[40:, 0] > 0)) > back_on


def test_a_step_that_compiles_a_graph_is_not_a_step_time():
    """Each width's first step in each call costs 100 plain steps more (its graph compiles for the call's cache
    capacity; dynamo's graph count grows); every draft is accepted. Timing those steps would make every width
    look far too costly for good; they are left out, in the first call and in later ones, and the row drafts."""
    k = 4
    compiled: set[int] = set()
    graphs = [0]

    def cost(width):
        if width not in compiled:
            compiled.add(width)
            graphs[0] += 1
            return 101.0 + 0.1 * width
        return 1.0 + 0.1 * width

    clock = FakeClock(cost)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    costs = CostTable()
    schedule = Schedule(config, k, {None: costs}, static_shapes=True, clock=clock, graphs_compiled=lambda: graphs[0])
    for _ in range(2):  # a second call: a new capacity compiles every width again
        compiled.clear()
        history = simulate(schedule, 1, lambda step, limits: limits, steps=60, clock=clock)
        assert max(costs.times.values()) < 2.0, costs.times
        assert (history[-20:] == k).all(), history.ravel().tolist()
    assert graphs[0] >= 4


def test_draft_classes_draft_where_their_class_pays_and_never_without_a_draft():
    """A host proposer that tells its drafts apart (`Proposer.draft_classes`, n-gram lookup: the matched n-gram's
    length): class 1 drafts are always wrong, class 3 drafts always right, and rows of class 0 have no draft. The
    pooled class estimates learn it from lookahead and drafts alike: class 1 rows stop drafting, class 3 rows draft
    k, class 0 rows never draft, and no row probes."""
    batch, k = 3, 4
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    costs = InjectedCosts(0.1)
    classes = np.array([1, 3, 0])
    # class 1 chains start with 7 (the text goes on with 5), class 3 chains are right
    schedule = Schedule(config, k, {None: costs}, static_shapes=False,
                        lookahead={None: lambda state, rows: [LookaheadTree.chain(np.full(k, 7 if classes[r] == 1 else 5)) for r in rows]},
                        draft_classes={None: DraftClasses(lambda state: classes, 3)})
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)

    def drafted(limits):  # a row of class 0 drafts nothing; class 3's drafts are right, class 1's wrong
        depths = [limit if classes[row] else 0 for row, limit in enumerate(limits)]
        return depths, [depth if classes[row] == 3 else 0 for row, depth in enumerate(depths)]

    history = run_looking_ahead(schedule, state, 60, drafted)
    assert (history[-40:, 0] == 0).all()  # class 1: off
    assert (history[-40:, 1] == k).all()  # class 3: k
    assert (history[:, 2] == 0).all()  # no draft, no limit: not even a probe
    estimate = costs.class_acceptance.values
    assert estimate[1, 0] < 0.1 and estimate[3].min() > 0.9
    # the estimates outlive the call: a new call's class 1 rows do not draft from its first step
    schedule.start(batch)
    assert schedule.plan(state, batch).limits[0] == 0


def test_a_row_known_to_have_no_draft_neither_drafts_nor_looks_ahead():
    """A proposer with per-row estimates that knows before the decision which rows have no draft (token recycling:
    a row whose last token has no row in its table): those rows get no limit, however well their estimates read,
    and are not asked for a lookahead (it would be a tree of unseen nodes); the others draft as their estimates
    say and look ahead when they do not draft. Row 0's drafts are right, row 2's wrong, row 1 has none."""
    batch, k = 3, 2
    config = SpeculativeConfig(method="recycling", num_speculative_tokens=k)
    depths = np.array([k, 0, k])
    asked = []

    def lookahead(state, rows):  # chains of 7s: the text goes on with 5s
        asked.append(list(rows))
        return [LookaheadTree.chain(np.full(k, 7)) for _ in rows]

    schedule = Schedule(config, k, {None: InjectedCosts(0.1)}, static_shapes=False, lookahead={None: lookahead},
                        draft_depths={None: lambda state: depths})
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)
    history = run_looking_ahead(schedule, state, 40, lambda limits: (None, [limits[0], 0, 0]))
    assert (history[:, 1] == 0).all() and (history[-10:, 0] == k).all() and (history[-10:, 2] == 0).all()
    assert any(2 in rows for rows in asked) and all(1 not in rows for rows in asked)
    depths[:] = 0  # no row has a draft: a plain step, whatever the estimates say
    assert schedule.plan(state, batch).width == 0


def test_draft_classes_are_not_consulted_by_the_fixed_schedule():
    calls = []
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, schedule="fixed", disable_by_batch_size=8)
    schedule = Schedule(config, 3, {None: CostTable()}, static_shapes=False,
                        draft_classes={None: DraftClasses(lambda state: calls.append(1) or np.zeros(2, dtype=int), 3)})
    limits = simulate(schedule, 2, lambda step, limits: [0, 0], steps=5)
    assert not calls and (limits == 3).all()


def test_the_width_is_the_critical_rows_and_rows_ahead_ride_along():
    """The call lasts as long as its rows with the most tokens left: rows ahead of them draft only within the width
    those rows choose. Row 1 is three tokens behind rows 0 and 2, which draft well; when row 1's drafts do not pay
    the step is plain, when they do all three draft."""
    batch, k = 3, 4
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)  # per-row estimates (no lookahead here)
    schedule = Schedule(config, k, {None: InjectedCosts(0.2)}, static_shapes=False)
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=100, extra_capacity=8,
                              pad_token_id=0)
    schedule.start(batch)
    state.host = HostView([20, 17, 20], [False] * batch, [1] * batch, [0] * batch)
    estimate = schedule.acceptance[None]
    estimate.raw[:] = estimate.values[:] = np.array([[0.95], [0.0], [0.95]])
    assert schedule.plan(state, batch).width == 0  # rows 0 and 2 would pay, but they are not the call's length
    state.draft_limits = state.draft_limit_tensor = state.draft_width = None
    estimate.raw[1] = estimate.values[1] = 0.95
    decision = schedule.plan(state, batch)
    assert decision.width == k and decision.limits == (k, k, k)
    # all rows equally far from max_length: each counts (the first steps of every call)
    state.draft_limits = state.draft_limit_tensor = state.draft_width = None
    state.host = HostView([20, 20, 20], [False] * batch, [1] * batch, [0] * batch)
    estimate.raw[1] = estimate.values[1] = 0.0
    assert schedule.plan(state, batch).limits == (k, 0, k)


def _auto_step(schedule: Schedule, state: DecodeState, accepted: dict, depths: dict | None = None,
               rows: bool = False) -> tuple:
    """One step of a schedule with several candidates: each row accepts `accepted[method][row]` of what it drafted
    with its candidate, at most its known depth. Returns (the step's candidate, the limits), and with `rows` each
    row's candidate too."""
    decision = schedule.plan(state, len(state.host.lengths))
    limits = list(decision.limits)
    methods = state.draft_methods
    drafted = [min(limit, (depths or {}).get(method, [limit] * len(limits))[row])
               for row, (limit, method) in enumerate(zip(limits, methods))]
    taken = [min(accepted[method][row], d) for row, (method, d) in enumerate(zip(methods, drafted))]
    host = state.host
    state.host = HostView(host.lengths, host.finished, [a + 1 for a in taken], taken)
    step = (schedule.method, limits, methods) if rows else (schedule.method, limits)
    schedule.observe(state, SimpleNamespace(host_depths=drafted, drafted_positions=None,
                                            tree=SimpleNamespace(max_depth=max(drafted))))
    return step


def test_auto_weighs_a_lookups_draft_classes_against_a_model_drafters_row_estimates():
    """method="auto" with a host lookup that tells its drafts apart (classes: 0 none, 1 a short match whose drafts
    fail, 3 a long match whose drafts hold) and a model drafter accepted about half the time: a step goes to the
    lookup where a row has a long match and to the model drafter where it has none or a short one, each learning
    its own estimates (the lookup's by class, pooled; the model drafter's by row)."""
    k = 4
    config = SpeculativeConfig(method="auto", num_speculative_tokens=k)
    costs = {"ngram": InjectedCosts(0.05), "eagle": InjectedCosts(0.1)}
    phase = [0]  # the row's class in turn: none, short, long
    classes = DraftClasses(lambda state: np.array([phase[0]]), 3)
    schedule = Schedule(config, k, costs, static_shapes=False, draft_classes={"ngram": classes})
    state = DecodeState.start(torch.zeros(1, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)
    schedule.start(1)
    rng = np.random.default_rng(0)
    chosen = {0: [], 1: [], 3: []}
    for step in range(300):
        phase[0] = (0, 1, 3)[step % 3]
        model_accepts = int(np.argmin(np.append(rng.random(k) < 0.6, False)))
        method, limits = _auto_step(schedule, state, {"ngram": [k if phase[0] == 3 else 0], "eagle": [model_accepts]})
        chosen[phase[0]].append(method if limits[0] else None)
    late = {cls: methods[-40:] for cls, methods in chosen.items()}
    assert late[3].count("ngram") == 40, late[3]  # a long match: the lookup's drafts, every time
    assert late[0].count("eagle") == 40, late[0]  # no match: the model drafter
    assert late[1].count("eagle") >= 36, late[1]  # a short match, whose drafts fail: the model drafter
    # class 1 is observed until the model drafter's estimate (about 0.6 at the first position) wins its steps
    estimate = costs["ngram"].class_acceptance.values
    assert estimate[1, 0] < schedule.acceptance["eagle"].values[0, 0] and estimate[3].min() > 0.9


def test_a_known_draft_depth_caps_what_a_class_is_expected_to_bring():
    """A lookup that says how deep each row's draft goes (`draft_depths`, suffix decoding: often shorter than
    k): its class estimates promise every position, but a row whose draft is one token deep is expected to gain
    one token at most, so a model drafter whose first token is always accepted (and nothing after) wins its steps;
    with drafts k deep the lookup wins them."""
    k = 4
    for depth, winner in ((1, "eagle"), (k, "suffix")):
        config = SpeculativeConfig(method="auto", num_speculative_tokens=k)
        costs = {"eagle": InjectedCosts(0.05), "suffix": InjectedCosts(0.05)}
        classes = DraftClasses(lambda state: np.array([1]), 1)
        schedule = Schedule(config, k, costs, static_shapes=False, draft_classes={"suffix": classes},
                            draft_depths={"suffix": lambda state, depth=depth: np.array([depth])})
        state = DecodeState.start(torch.zeros(1, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                                  pad_token_id=0)
        schedule.start(1)
        methods = [_auto_step(schedule, state, {"eagle": [1], "suffix": [k]}, depths={"suffix": [depth]})[0]
                   for _ in range(60)]
        assert methods[-20:].count(winner) == 20, (depth, methods)


def test_auto_chooses_per_row_and_each_candidate_learns_from_its_own_rows():
    """A batch of 4 under method="auto": rows 0 and 1 have a long n-gram match whose drafts always hold, rows 2 and
    3 none; the EAGLE head's drafts are accepted with probability p. Its steps draft with the head for rows 2 and 3
    while rows 0 and 1 draft with the lookup in the same step (the lookup costs no drafting of its own): at p = 0.6
    all four k deep; at p = 0.3 the head's rows 2 deep at most (deeper guesses do not pay for their drafting) and
    the lookup's rows still k deep (verifying them costs the lookup's own step times). The head's estimates learn
    from rows 2 and 3 only (rows 0 and 1 keep theirs once the lookup's class estimate has left the prior it shares
    with the head at the first step). Once every row has a long match, the lookup alone drafts (a step the head
    would pay for brings nothing more)."""
    k, batch = 4, 4
    for p, head_depth in ((0.6, k), (0.3, 2)):
        config = SpeculativeConfig(method="auto", num_speculative_tokens=k)
        costs = {"ngram": InjectedCosts(0.05), "eagle": InjectedCosts(0.07)}
        matched = np.array([3, 3, 0, 0])
        classes = DraftClasses(lambda state, matched=matched: matched.copy(), 3)
        schedule = Schedule(config, k, costs, static_shapes=False, draft_classes={"ngram": classes})
        state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000,
                                  extra_capacity=8, pad_token_id=0)
        schedule.start(batch)
        rng = np.random.default_rng(0)
        steps = []
        for step in range(300):
            if step == 10:
                kept = schedule.acceptance["eagle"].values[:2].copy()
            model = [int(np.argmin(np.append(rng.random(k) < p, False))) for _ in range(batch)]
            steps.append(_auto_step(schedule, state, {"ngram": [k, k, 0, 0], "eagle": model}, rows=True))
        late = [(method, tuple(methods), limits) for method, limits, methods in steps[-40:] if max(limits) > 0]
        assert len(late) >= 36 and all(method == "eagle" and methods == ("ngram", "ngram", "eagle", "eagle")
                                       for method, methods, _ in late), (p, late)
        assert all(limits[:2] == [k, k] for _, _, limits in late), (p, late)
        assert max(max(limits[2:]) for _, _, limits in late) == head_depth, (p, late)
        eagle = schedule.acceptance["eagle"].values
        np.testing.assert_array_equal(eagle[:2], kept)
        assert abs(eagle[2:, 0].mean() - p) < 0.15, (p, eagle)
        stats = schedule.finish()
        assert [row.method_steps["ngram"] > 250 for row in stats] == [True, True, False, False]
    matched[:] = 3
    schedule.start(batch)
    later = [_auto_step(schedule, state, {"ngram": [k] * batch, "eagle": [0] * batch}, rows=True)
             for _ in range(20)]
    assert all(method == "ngram" and set(methods) == {"ngram"} for method, limits, methods in later[-10:]), later


def test_draft_classes_must_belong_to_candidates():
    config = SpeculativeConfig(method="auto", num_speculative_tokens=3)
    try:
        Schedule(config, 3, {"ngram": CostTable()}, static_shapes=False,
                 draft_classes={"suffix": DraftClasses(lambda state: np.zeros(1, dtype=int), 2)})
    except ValueError as error:
        assert "suffix" in str(error)
    else:
        raise AssertionError("draft classes of a non-candidate were accepted")


def test_auto_candidates_share_the_plain_steps_they_measure():
    """A plain step is the same target forward whichever candidate is idle: each candidate's table takes its time, so
    one plain step serves them all (three candidates used to spend three plain steps measuring it, and more each
    time one's drafting widths read below its own plain time)."""
    k, batch = 4, 2
    config = SpeculativeConfig(method="auto", num_speculative_tokens=k)
    costs = {name: CostTable() for name in ("ngram", "suffix", "eagle")}
    clock = FakeClock(lambda width: 1.0 + 0.05 * width)
    schedule = Schedule(config, k, costs, static_shapes=False, clock=clock)
    state = DecodeState.start(torch.zeros(batch, 4, dtype=torch.long), None, max_length=10_000, extra_capacity=8,
                              pad_token_id=0)
    schedule.start(batch)
    plain_steps = []
    for step in range(12):
        decision = schedule.plan(state, batch)
        if decision.width == 0:
            plain_steps.append(step)
        clock.run_step(decision.width)
        host = state.host
        state.host = HostView(host.lengths, host.finished, [1] * batch, [0] * batch)
        schedule.observe(state, SimpleNamespace(host_depths=None, drafted_positions=None,
                                                tree=SimpleNamespace(max_depth=decision.width)))
    assert plain_steps[:1] == [1]  # the call's first step drafts; its second measures the plain step
    assert plain_steps == [1]  # one plain step for the three candidates
    assert all(abs(table.times[(batch, 0)] - 1.0) < 1e-9 for table in costs.values())
    assert all(len(table.recent[(batch, 0)]) == len(plain_steps) for table in costs.values())
    assert not any(table.plain_due(batch) for table in costs.values())


def test_a_candidate_that_looks_ahead_lets_its_prior_give_way_within_a_few_observations():
    """Its rows are observed every step, drafting or not: their estimates average their first observations as a
    running mean after LOOKAHEAD_PRIOR_COUNT prior ones, not at the slow moving average's weight."""
    k = 3
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    looking = Schedule(config, k, {None: InjectedCosts(0.1)}, static_shapes=False,
                       lookahead={None: lambda state, rows: [LookaheadTree.chain([5]) for _ in rows]})
    blind = Schedule(config, k, {None: InjectedCosts(0.1)}, static_shapes=False)
    for schedule in (looking, blind):
        schedule.start(1)
        schedule.acceptance[None].update([k], [0])  # one draft, rejected at its first token
    first = {name: s.acceptance[None].values[0, 0] for name, s in (("looking", looking), ("blind", blind))}
    assert first["looking"] == pytest.approx(ACCEPTANCE_PRIOR * LOOKAHEAD_PRIOR_COUNT / (LOOKAHEAD_PRIOR_COUNT + 1))
    assert first["blind"] == pytest.approx(ACCEPTANCE_PRIOR * (1 - ACCEPTANCE_RATE))
