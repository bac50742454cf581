"""The decision rule as a pure function: acceptance estimates and a step-time curve in, per-row limits out."""

from __future__ import annotations

import numpy as np
import pytest

from hf_specdec.schedule.decision import decide, expected_accepted, row_lengths, step_expectation, width_ladder


def _decide(acceptance, slope, probe=None, widths=None, probe_length=2):
    acceptance = np.asarray(acceptance, dtype=float)
    batch, max_k = acceptance.shape
    step_time = 1.0 + slope * np.arange(max_k + 1)
    return decide(expected_accepted(acceptance), step_time, [True] * batch, probe or [False] * batch,
                  widths or list(range(max_k + 1)), probe_length)


def test_expected_accepted_is_the_sum_of_reach_probabilities():
    got = expected_accepted(np.array([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]]))
    np.testing.assert_allclose(got, [[0, 0.5, 0.75, 1.0], [0, 1.0, 1.0, 1.0]])


def test_zero_acceptance_decodes_plainly():
    decision = _decide(np.zeros((3, 5)), slope=0.05)
    assert decision.width == 0 and decision.limits == (0, 0, 0)
    assert decision.expected_tokens == 3.0


def test_high_acceptance_and_cheap_drafting_drafts_the_maximum():
    decision = _decide(np.full((2, 5), 0.9), slope=0.02)
    assert decision.width == 5 and decision.limits == (5, 5)


def test_costly_positions_shorten_the_draft():
    """reach 0.8, 0.64, 0.51, 0.41, 0.33 against a marginal cost of 0.45 plain steps per position: the row's own
    prefix keeps 3 positions (reach >= 0.45); tokens per unit time, (1 + 0.8 + 0.64) / 1.9 = 1.284 at width 2
    against 2.952 / 2.35 = 1.256 at width 3, take 2."""
    acceptance = np.full((1, 5), 0.8)
    assert row_lengths(expected_accepted(acceptance), 1.0 + 0.45 * np.arange(6)).tolist() == [3]
    assert _decide(acceptance, slope=0.45).width == 2
    assert _decide(acceptance, slope=0.9).width == 0  # not even the first position pays


def test_longer_drafts_when_acceptance_is_higher():
    widths = [_decide(np.full((1, 6), a), slope=0.2).width for a in (0.1, 0.4, 0.6, 0.8, 0.95)]
    assert widths == sorted(widths) and widths[0] == 0 and widths[-1] == 6


def test_rows_get_their_own_lengths_within_the_step_width():
    decision = _decide([[0.95] * 4, [0.5, 0.1, 0.1, 0.1], [0.0] * 4], slope=0.1)
    assert decision.width == 4
    assert decision.limits == (4, 1, 0)


def test_batch_wide_rate_decides_the_width():
    """One predictable row among many unpredictable ones: its gain does not pay for the whole batch's wider
    step when the width costs per row."""
    acceptance = np.vstack([np.full((1, 4), 0.9), np.zeros((15, 4))])
    step_time = np.array([1.0, 1.3, 1.6, 1.9, 2.2])  # a wide step costs the whole batch
    decision = decide(expected_accepted(acceptance), step_time, [True] * 16, [False] * 16, [0, 1, 2, 3, 4], 2)
    assert decision.width == 0


def test_probes_draft_where_estimates_say_no():
    decision = _decide(np.zeros((2, 4)), slope=0.05, probe=[True, False], probe_length=2)
    assert decision.limits == (2, 0) and decision.width == 2


def test_finished_rows_get_nothing():
    acceptance = np.full((2, 3), 0.9)
    decision = decide(expected_accepted(acceptance), 1.0 + 0.01 * np.arange(4), [True, False], [False, True],
                      [0, 1, 2, 3], 2)
    assert decision.limits == (3, 0)
    assert decision.expected_tokens == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_width_rounds_up_to_the_ladder():
    """Static shapes: the step takes an allowed width; rows keep their own limits below it."""
    assert width_ladder(5) == (0, 1, 2, 4, 5)
    assert width_ladder(1) == (0, 1)
    acceptance = np.array([[0.99, 0.99, 0.5, 0.0, 0.0], [0.99, 0.0, 0.0, 0.0, 0.0]])
    free = _decide(acceptance, slope=0.05)
    assert free.width == 3 and free.limits == (3, 1)
    laddered = _decide(acceptance, slope=0.05, widths=list(width_ladder(5)))
    assert laddered.width == 4 and laddered.limits == (3, 1)


def test_the_decision_reads_no_clock():
    """Same inputs, same decision (the rule is a pure function)."""
    acceptance = np.random.default_rng(0).uniform(size=(8, 5))
    assert _decide(acceptance, slope=0.1) == _decide(acceptance.copy(), slope=0.1)


def test_a_row_that_rarely_drafts_costs_a_wide_step_only_when_it_drafts():
    """A lookup that drafts one step in four: the same length as a drafter that always drafts (gain and cost come
    only with a draft), a quarter of its expected extra tokens, and the wide step's extra time a quarter of the time."""
    accepted = expected_accepted(np.full((1, 4), 0.9))
    step_time = 1.0 + 0.2 * np.arange(5)
    always = decide(accepted, step_time, [True], [False], range(5), 2)
    rarely = decide(accepted, step_time, [True], [False], range(5), 2, draft_rate=np.array([0.25]))
    assert rarely.limits == always.limits and always.width > 0
    assert rarely.expected_time == pytest.approx(1.0 + 0.25 * (step_time[always.width] - 1.0))
    assert rarely.expected_tokens == pytest.approx(1.0 + 0.25 * (always.expected_tokens - 1.0))


def test_due_rows_join_a_drafting_step_and_widen_a_plain_one_only_when_allowed():
    """Row 0 drafts 3 by its estimates; row 1 is due a probe. It rides along within the step's width; in a step
    that would be plain it waits, unless probes may widen a step."""
    acceptance = np.array([[0.95] * 4, [0.0] * 4])
    joined = _decide(acceptance, slope=0.01, probe=[False, True], probe_length=2)
    assert joined.limits[1] == 2 and joined.width == joined.limits[0] > 0
    idle = np.zeros((2, 4))
    step_time = 1.0 + 0.05 * np.arange(5)
    waits = decide(expected_accepted(idle), step_time, [True, True], [False, True], range(5), 2, probe_alone=False)
    assert waits.limits == (0, 0) and waits.width == 0
    probes = decide(expected_accepted(idle), step_time, [True, True], [False, True], range(5), 2, probe_alone=True)
    assert probes.limits == (0, 2) and probes.width == 2


def test_a_stack_of_candidate_steps_is_judged_as_each_alone():
    """`step_expectation` over [W, B] limits gives, per candidate, what it gives for that candidate alone."""
    rng = np.random.default_rng(3)
    accepted = expected_accepted(rng.uniform(0.0, 1.0, size=(4, 5)))
    step_time = np.maximum.accumulate(rng.uniform(1.0, 2.0, size=6))
    active, rate = np.array([True, False, True, True]), rng.uniform(0.0, 1.0, size=4)
    limits = rng.integers(0, 6, size=(7, 4))
    widths = limits.max(axis=1)
    tokens, times = step_expectation(accepted, step_time, active, limits, widths, rate)
    alone = [step_expectation(accepted, step_time, active, row, int(w), rate) for row, w in zip(limits, widths)]
    np.testing.assert_allclose(tokens, [t for t, _ in alone])
    np.testing.assert_allclose(times, [t for _, t in alone])
    assert isinstance(alone[0][0], float) and isinstance(alone[0][1], float)


def test_the_critical_rows_choose_the_width_and_the_others_draft_within_it():
    """Row 1 alone is critical: its acceptance decides the width; rows 0 and 2 draft within it to their own length."""
    accepted = expected_accepted(np.array([[0.95] * 4, [0.0] * 4, [0.95] * 4]))
    step_time = 1.0 + 0.1 * np.arange(5)
    args = (accepted, step_time, [True] * 3, [False] * 3, list(range(5)), 2)
    assert decide(*args, critical=[False, True, False]).width == 0
    assert decide(*args).limits == (4, 0, 4)  # every row critical: rows 0 and 2 choose
    accepted[1] = accepted[0]
    assert decide(*args, critical=[False, True, False]).limits == (4, 4, 4)
