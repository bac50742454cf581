"""Acceptance moving averages and the step-time table, on injected numbers (no clocks)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hf_specdec.schedule.estimates import (
    ACCEPTANCE_PRIOR,
    ACCEPTANCE_RATE,
    CALL_PRIOR_WEIGHT,
    CLASS_ACCEPTANCE_RATE,
    CLASS_PRIOR_COUNT,
    PLAIN_REFRESH,
    PRIOR_SLOPE,
    REFIT_SAMPLES,
    SETTLED_SAMPLES,
    TIME_QUANTILE,
    TIME_WINDOW,
    AcceptanceEstimate,
    CostTable,
    cost_table,
    lower_quantile,
)
from tests.conftest import run_racing_threads


def test_acceptance_updates_only_observed_positions():
    estimate = AcceptanceEstimate(3, 4)
    # row 0: 4 allowed, 2 accepted (positions 1-2 accepted, 3 rejected, 4 unobserved: it carries position 3's);
    # row 1: none allowed; row 2: 2 allowed, both accepted (positions 3-4 carry position 2's)
    estimate.update([4, 0, 2], [2, 0, 2])
    p, r = ACCEPTANCE_PRIOR, ACCEPTANCE_RATE
    up, down = (1 - r) * p + r, (1 - r) * p
    np.testing.assert_allclose(estimate.values, [[up, up, down, down], [p] * 4, [up] * 4])
    # a first observation at a carried position starts from the carried estimate, not the prior
    estimate.update([0, 0, 3], [0, 0, 3])
    assert estimate.values[2, 2] == (1 - r) * up + r and estimate.values[2, 3] == estimate.values[2, 2]


def test_the_moving_average_weight_is_read_when_an_estimate_is_made(monkeypatch):
    """A benchmark varies `ACCEPTANCE_RATE` (`benchmarks/schedule_replay.py --rates`): estimates made after take it."""
    from hf_specdec.schedule import estimates

    monkeypatch.setattr(estimates, "ACCEPTANCE_RATE", 0.5)
    estimate = AcceptanceEstimate(1, 1)
    estimate.update([1], [0])
    assert estimate.values[0, 0] == ACCEPTANCE_PRIOR * 0.5


def test_a_calls_acceptance_moves_the_next_calls_prior_by_the_call_weight():
    costs = CostTable()
    for ended in (0.8, 0.2):
        estimate = AcceptanceEstimate(2, 2)
        estimate.values[:] = ended
        costs.record_acceptance(estimate)
    # the first call's ending is the prior; the second moves it by CALL_PRIOR_WEIGHT
    np.testing.assert_allclose(costs.acceptance_prior(2), [0.8 + CALL_PRIOR_WEIGHT * (0.2 - 0.8)] * 2)
    assert costs.acceptance_prior(3) is None  # another k starts from the optimistic prior


def test_allowed_and_drafted_but_rejected_counts_as_rejected():
    """A model drafter drafts what it is allowed: a row allowed 2 tokens that accepted none missed position 1."""
    estimate = AcceptanceEstimate(1, 2)
    for _ in range(60):
        estimate.update([2], [0])
    assert estimate.values[0, 0] < 0.01 and estimate.values[0, 1] == estimate.values[0, 0]
    assert estimate.draft_rate[0] == 1.0


def test_positions_not_drafted_are_not_observed():
    """An n-gram row allowed 3 tokens that found no match drafted nothing: its estimates stand, its draft rate
    falls; one that found 1 token, accepted, observed position 1 only."""
    estimate = AcceptanceEstimate(2, 3)
    for _ in range(60):
        estimate.update([3, 3], [0, 1], drafted=[0, 1])
    np.testing.assert_allclose(estimate.values[0], [ACCEPTANCE_PRIOR] * 3)
    assert estimate.draft_rate[0] < 0.01 and estimate.draft_rate[1] == 1.0
    assert estimate.values[1, 0] > 0.99 and not estimate.seen[1, 1:].any()


def test_cost_prediction_from_measurements():
    table = CostTable()
    np.testing.assert_allclose(table.predict(4, 3), 1 + PRIOR_SLOPE * np.arange(4))  # the prior, in plain steps
    table.observe(4, 0, 2.0)
    np.testing.assert_allclose(table.predict(4, 2), 2.0 * (1 + PRIOR_SLOPE * np.arange(3)))
    table.observe(4, 4, 3.0)
    np.testing.assert_allclose(table.predict(4, 4), [2.0, 2.25, 2.5, 2.75, 3.0])  # a line through both
    np.testing.assert_allclose(table.predict(8, 4), [2.0, 2.25, 2.5, 2.75, 3.0])  # nearest batch size stands in
    table.observe(8, 0, 5.0)
    assert table.predict(8, 4)[0] == 5.0


def test_the_line_is_refitted_on_a_new_width_or_after_refit_samples():
    """Unmeasured widths follow the kept line until a new width is measured or REFIT_SAMPLES samples arrived;
    measured widths read their latest averages at once."""
    table = CostTable()
    table.observe(2, 0, 1.0)
    table.observe(2, 4, 2.0)
    np.testing.assert_allclose(table.predict(2, 4), [1.0, 1.25, 1.5, 1.75, 2.0])
    table.observe(2, 4, 4 / 3)  # the width-4 estimate falls to 1.5 (the lower quartile of 2 and 4/3)
    # the kept line at widths 1-3 (never below a narrower width: 1.75 at 4), not the refit's 1.125, 1.25, 1.375
    np.testing.assert_allclose(table.predict(2, 4), [1.0, 1.25, 1.5, 1.75, 1.75])
    table.observe(2, 2, 1.25)  # a new width: refitted through (0, 1), (2, 1.25), (4, 1.5)
    np.testing.assert_allclose(table.predict(2, 4), [1.0, 1.125, 1.25, 1.375, 1.5])
    for _ in range(REFIT_SAMPLES - 1):
        table.observe(2, 4, 3.0)
    stale = table.predict(2, 4)
    np.testing.assert_allclose(stale[[0, 1, 2]], [1.0, 1.125, 1.25])
    assert stale[4] == table.times[(2, 4)]
    table.observe(2, 4, 3.0)  # the REFIT_SAMPLES-th sample since the fit
    points = np.array([0, 2, 4]), np.array([table.times[(2, w)] for w in (0, 2, 4)])
    slope, intercept = np.polyfit(*points, 1)
    assert table.predict(2, 4)[1] == pytest.approx(intercept + slope)


def test_a_step_time_is_the_lower_quartile_of_its_recent_measurements():
    """Stalls, even a run of five in a row (more than half the window), leave the estimate where the usual steps put
    it; a lasting change moves it once 7 of the 9 measurements are slower; measurements older than the window are
    forgotten."""
    assert (TIME_WINDOW, TIME_QUANTILE) == (9, 0.25)
    table = CostTable()
    table.observe(1, 2, 10.0)  # a first step's warm-up: the only measurement
    assert table.times[(1, 2)] == 10.0
    for _ in range(4):
        table.observe(1, 2, 1.0)
    assert table.times[(1, 2)] == 1.0
    for _ in range(5):
        table.observe(1, 2, 3.0)  # a run of stalls, the warm-up forgotten
    assert table.times[(1, 2)] == 1.0
    for _ in range(TIME_WINDOW):
        table.observe(1, 2, 1.0)
    for _ in range(6):
        table.observe(1, 2, 2.0)  # the steps got slower (a longer context)
    assert table.times[(1, 2)] == 1.0
    table.observe(1, 2, 2.0)
    assert table.times[(1, 2)] == 2.0
    for _ in range(TIME_WINDOW):
        table.observe(1, 2, 1.5)
    assert table.times[(1, 2)] == 1.5 and len(table.recent[(1, 2)]) == TIME_WINDOW


def test_a_width_measured_high_a_few_times_reads_the_line_until_it_settles():
    """Widths 3 and 5 measured once, slow (a first call's new shapes), read the line through the settled plain and
    width-1 steps, and the settled widths alone carry the line; measured at that cost until settled, a width reads
    its own median. With fewer than two settled widths every measured width reads its own."""
    table = CostTable()
    table.observe(1, 3, 1.9)
    table.observe(1, 5, 1.9)
    np.testing.assert_allclose(table.predict(1, 5)[[3, 5]], [1.9, 1.9])  # nothing settled: as measured
    for _ in range(SETTLED_SAMPLES):
        table.observe(1, 0, 1.0)
        table.observe(1, 1, 1.1)
    np.testing.assert_allclose(table.predict(1, 5), [1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    for _ in range(SETTLED_SAMPLES - 2):
        table.observe(1, 5, 1.9)
    assert table.predict(1, 5)[5] == pytest.approx(1.5)  # still short of settled
    table.observe(1, 5, 1.9)
    predicted = table.predict(1, 5)
    assert predicted[5] == pytest.approx(1.9)  # settled: its own
    # the line now runs through widths 0, 1 and 5; width 3, not settled, reads the lower of its time and the line
    slope, intercept = np.polyfit([0, 1, 5], [1.0, 1.1, 1.9], 1)
    assert predicted[3] == pytest.approx(min(1.9, intercept + 3 * slope))
    # the plain step, not settled, reads its own time (`plain_due` measures it again), not the line's 1.1
    table.observe(2, 0, 1.5)
    for _ in range(SETTLED_SAMPLES):
        table.observe(2, 1, 1.2)
        table.observe(2, 2, 1.3)
    assert table.predict(2, 2)[0] == 1.5


def test_predictions_never_fall_with_width():
    table = CostTable()
    table.observe(2, 0, 3.0)
    table.observe(2, 3, 2.0)  # noise: the wider step measured faster
    predicted = table.predict(2, 3)
    assert (np.diff(predicted) >= 0).all()


def test_a_plain_step_is_due_when_unmeasured_old_or_above_a_wider_step():
    table = CostTable()
    assert table.plain_due(1)  # never measured
    table.observe(1, 0, 1.0)
    table.observe(1, 1, 1.2)
    assert not table.plain_due(1) and table.plain_due(4)  # per batch size
    for _ in range(PLAIN_REFRESH - 2):
        table.observe(1, 1, 1.2)
    assert not table.plain_due(1)
    table.observe(1, 1, 1.2)  # PLAIN_REFRESH steps since the plain one
    assert table.plain_due(1)
    table.observe(1, 0, 1.0)
    assert not table.plain_due(1)
    # a wider step measured below the plain step's time since: the plain time is stale (a longer context's)
    for _ in range(TIME_WINDOW):
        table.observe(1, 0, 3.0)
    table.observe(1, 2, 1.1)
    assert table.times[(1, 2)] < table.times[(1, 0)] and table.plain_due(1)
    for _ in range(TIME_WINDOW // 2 + 1):  # faster measurements bring it down
        table.observe(1, 0, 1.0)
    assert not table.plain_due(1)
    # a plain time measured after a cheaper wider one is the fresher: drafting re-measures the wider width
    table.observe(1, 3, 0.5)
    table.observe(1, 0, 1.0)
    assert table.times[(1, 3)] < table.times[(1, 0)] and not table.plain_due(1)


def test_tables_are_kept_per_model_and_key_for_the_process():
    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert cost_table(model, "ngram") is cost_table(model, "ngram")
    assert cost_table(model, "ngram") is not cost_table(model, "draft")
    assert cost_table(other, "ngram") is not cost_table(model, "ngram")


def test_a_position_reached_but_not_drafted_moves_towards_the_one_before():
    """Position 2 was observed rejected; then the row drafts 1 token at a time, always accepted: it reaches
    position 2 without drafting it, and that position's average moves towards position 1's as an observation
    would (else it would stay low, and the row would never draft deeper again)."""
    estimate = AcceptanceEstimate(1, 3)
    estimate.update([2], [1])  # position 1 accepted, position 2 rejected
    low = estimate.values[0, 1]
    assert low < ACCEPTANCE_PRIOR
    estimate.update([1], [1])
    r = ACCEPTANCE_RATE
    assert estimate.values[0, 1] == pytest.approx((1 - r) * low + r * estimate.values[0, 0])
    for _ in range(40):
        estimate.update([1], [1])
    assert estimate.values[0, 1] > 0.9 and estimate.values[0, 2] == estimate.values[0, 1]
    before = estimate.values[0, 1]
    estimate.update([1], [0])  # rejected at position 1: position 2 was not reached, and stays
    assert estimate.values[0, 1] == pytest.approx(before)


def test_class_estimates_pool_rows_and_start_as_a_running_mean():
    """`update_classes`: each row's observation updates its class (row 0 of the estimate, no draft, never); a class's
    first observations weigh as a running mean after CLASS_PRIOR_COUNT prior ones, later ones at least
    CLASS_ACCEPTANCE_RATE; the estimates live in the step-time table, one per shape."""
    table = CostTable()
    estimate = table.class_estimate(num_classes=2, max_k=3)
    assert table.class_estimate(2, 3) is estimate and table.class_estimate(2, 4) is not estimate
    estimate = table.class_estimate(2, 3)
    # rows of classes 1, 1, 0, 2: the two class 1 rows drafted 3 and had 0 accepted; the class 2 row had all 3
    estimate.update_classes([1, 1, 0, 2], allowed=[3, 3, 3, 3], accepted=[0, 0, 3, 3])
    prior = ACCEPTANCE_PRIOR
    first = prior * CLASS_PRIOR_COUNT / (CLASS_PRIOR_COUNT + 1)
    assert estimate.values[1, 0] == pytest.approx(first * (CLASS_PRIOR_COUNT + 1) / (CLASS_PRIOR_COUNT + 2))
    assert np.allclose(estimate.values[0], prior)  # no draft: never observed
    assert np.allclose(estimate.values[2], (prior * CLASS_PRIOR_COUNT + 1) / (CLASS_PRIOR_COUNT + 1))
    for _ in range(200):
        estimate.update_classes([1], allowed=[3], accepted=[0])
    assert estimate.values[1, 0] < 1e-3
    estimate.update_classes([1], allowed=[3], accepted=[1])
    assert estimate.values[1, 0] == pytest.approx(CLASS_ACCEPTANCE_RATE, abs=1e-3)  # the weight's floor


def test_a_narrower_width_stalled_above_a_wider_one_comes_down_to_it():
    """Width 1 measured in a run of stalls and then left alone; width 2's steps, measured lower, bring it down (a
    narrower step does not cost more), and its own next measurements start from there; the plain step's own
    estimate is left to its own measurements."""
    table = CostTable()
    table.observe(1, 0, 1.5)
    for _ in range(3):
        table.observe(1, 1, 2.0)  # measured in a run of stalls only
    assert table.times[(1, 1)] == pytest.approx(2.0)
    table.observe(1, 2, 1.2)
    assert table.times[(1, 1)] == pytest.approx(1.2)
    table.observe(1, 2, 1.1)
    assert table.times[(1, 1)] == pytest.approx(1.125) == table.times[(1, 2)]
    assert table.times[(1, 0)] == 1.5
    table.observe(1, 1, 1.0)  # its own measurements move it below the wider width again
    assert table.times[(1, 1)] < table.times[(1, 2)]
    table.observe(2, 2, 0.5)  # another batch size's steps leave this one's alone
    assert table.times[(1, 1)] == pytest.approx(1.03125)


def test_lower_quantile_is_numpys():
    rng = np.random.default_rng(0)
    for count in range(1, TIME_WINDOW + 1):
        for _ in range(50):
            values = rng.exponential(size=count).tolist()
            assert lower_quantile(values) == pytest.approx(float(np.quantile(values, TIME_QUANTILE)), rel=1e-12)


def test_a_table_shared_by_threads_stays_consistent():
    """Calls in threads on one model share its table: its methods hold a lock (before, a prediction iterating the
    table while another thread measured a new width raised "dictionary changed size during iteration")."""
    table, errors = CostTable(), []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1000):
                batch, width = rng.choice([1, 2, 4, 8, 16, 32]), rng.randint(0, 6)
                table.observe(batch, width, rng.random())
                table.predict(batch, 6)
                table.plain_due(batch)
                table.observe_realized(batch, width, 10 * rng.random(), rng.random(), batch)
                table.unpaid_widths(batch, batch)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    run_racing_threads(work, 4)
    assert not errors
