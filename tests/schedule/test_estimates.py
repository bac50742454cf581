"""Acceptance moving averages and the step-time table, on injected numbers (no clocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_specdec.schedule.estimates import ACCEPTANCE_PRIOR, PRIOR_SLOPE, AcceptanceEstimate, CostTable, cost_table


def test_acceptance_updates_only_observed_positions():
    estimate = AcceptanceEstimate(3, 4)
    # row 0: 4 allowed, 2 accepted (positions 1-2 accepted, 3 rejected, 4 unobserved); row 1: none allowed;
    # row 2: 2 allowed, both accepted
    estimate.update([4, 0, 2], [2, 0, 2])
    p, up, down = ACCEPTANCE_PRIOR, 0.7 * ACCEPTANCE_PRIOR + 0.3, 0.7 * ACCEPTANCE_PRIOR
    np.testing.assert_allclose(estimate.values, [[up, up, down, p], [p] * 4, [up, up, p, p]])


def test_allowed_but_undrafted_counts_as_rejected():
    """A row allowed k tokens that drafted none (no n-gram match) accepted 0: position 1 was a miss."""
    estimate = AcceptanceEstimate(1, 2)
    for _ in range(20):
        estimate.update([2], [0])
    assert estimate.values[0, 0] < 0.01 and estimate.values[0, 1] == ACCEPTANCE_PRIOR


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


def test_faster_measurements_move_the_estimate_more():
    table = CostTable()
    table.observe(1, 2, 10.0)  # a first step's warm-up
    table.observe(1, 2, 1.0)
    assert table.times[(1, 2)] == pytest.approx(5.5)
    table.observe(1, 2, 10.0)
    assert table.times[(1, 2)] == pytest.approx(5.5 * 0.8 + 2.0)


def test_predictions_never_fall_with_width():
    table = CostTable()
    table.observe(2, 0, 3.0)
    table.observe(2, 3, 2.0)  # noise: the wider step measured faster
    predicted = table.predict(2, 3)
    assert (np.diff(predicted) >= 0).all()


def test_tables_are_kept_per_model_and_key_for_the_process():
    model, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert cost_table(model, "ngram") is cost_table(model, "ngram")
    assert cost_table(model, "ngram") is not cost_table(model, "draft")
    assert cost_table(other, "ngram") is not cost_table(model, "ngram")
