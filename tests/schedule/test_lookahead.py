"""Lookahead chains checked against what rows emit (`hf_specdec.schedule.lookahead`)."""

from __future__ import annotations

import numpy as np

from hf_specdec.schedule.lookahead import LookaheadChains
from hf_specdec.step.state import HostView


def test_chains_settle_at_their_first_mismatch_or_end_across_steps():
    """Each row's chain is checked against the tokens it emits, step after step: settled at its first mismatch or
    its end (observed as a chain of its length with the matched tokens accepted), kept while all emitted tokens
    match; a row that drafts with the proposer or finishes drops its chain unobserved."""
    batch, k = 6, 4
    chains = LookaheadChains(batch, k)
    assert chains.free_rows(np.ones(batch, dtype=bool)) == list(range(batch))
    chains.start([0, 1, 2, 3, 4, 5], [np.array([1, 2, 3, 4]), np.array([1, 2]), np.array([], dtype=np.int64),
                                      np.array([1, 2, 3]), np.array([7, 8]), np.array([4])],
                 classes=np.array([3, 2, 0, 1, 2, 1]))
    # step 1: row 0 emits 1 (matches, waits), row 1 emits 1, 2, 5 (chain through), row 2 (empty chain) settles, row 3
    # emits 1, 9 (mismatch at its second token), row 4 finishes, row 5 drafted with the proposer
    host = HostView([4] * batch, [False, False, False, False, True, False], [1, 3, 1, 2, 0, 1], [0] * batch,
                    np.array([[1, 0, 0], [1, 2, 5], [6, 0, 0], [1, 9, 0], [7, 0, 0], [4, 0, 0]]))
    settled = chains.settle(host, drafted=np.array([False] * 5 + [True]))
    assert (settled.asked.tolist(), settled.matched.tolist(), settled.lengths.tolist()) == (
        [0, 2, k, 3, 0, 0], [0, 2, 0, 1, 0, 0], [0, 2, 0, 3, 0, 0])
    assert settled.classes.tolist()[1:4] == [2, 0, 1]  # each chain observed in the class it was looked up in
    assert chains.free_rows(np.ones(batch, dtype=bool)) == [1, 2, 3, 4, 5]  # row 0 still waits
    # step 2: row 0 emits 2, 3, 8 (mismatch at its fourth token)
    host = HostView([5] * batch, [False] * 4 + [True, False], [3, 1, 1, 1, 0, 1], [0] * batch,
                    np.array([[2, 3, 8], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    settled = chains.settle(host, drafted=np.zeros(batch, dtype=bool))
    assert (settled.asked.tolist(), settled.matched.tolist(), settled.lengths.tolist()) == (
        [4, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0])
    assert chains.settle(host, drafted=np.zeros(batch, dtype=bool)) is None  # nothing pending


def test_only_eligible_rows_without_a_pending_chain_take_one():
    chains = LookaheadChains(3, 2)
    chains.start([1], [np.array([5, 6])], classes=np.zeros(3, dtype=int))
    assert chains.free_rows(np.array([True, True, False])) == [0]
