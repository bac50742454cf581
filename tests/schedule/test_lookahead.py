"""Lookahead drafts, chains and trees, walked down with what rows emit (`hf_specdec.schedule.lookahead`)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_specdec.schedule.lookahead import LookaheadDrafts, LookaheadTree
from hf_specdec.step.state import HostView


def test_chains_settle_at_their_first_mismatch_or_end_across_steps():
    """Each row's chain is checked against the tokens it emits, step after step: settled at its first mismatch or
    its end (observed as a chain of its length with the matched tokens accepted), kept while all emitted tokens
    match; a row that drafts with the proposer or finishes drops its chain unobserved."""
    batch, k = 6, 4
    chains = LookaheadDrafts(batch, k)
    assert chains.free_rows(np.ones(batch, dtype=bool)) == list(range(batch))
    chains.start([0, 1, 2, 3, 4, 5], [LookaheadTree.chain(c) for c in ([1, 2, 3, 4], [1, 2], [], [1, 2, 3], [7, 8], [4])],
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
    chains = LookaheadDrafts(3, 2)
    chains.start([1], [LookaheadTree.chain([5, 6])], classes=np.zeros(3, dtype=int))
    assert chains.free_rows(np.array([True, True, False])) == [0]


def test_trees_are_walked_down_by_the_emitted_tokens():
    """A tree (root's children 1 and 2; 1's children 3 and 4; 4's child 5): each row's emitted tokens walk it from
    the root, a token no child of the node reached holds settles it, as does a leaf reached; its depth is the
    tree's deepest node, its matched count the nodes walked; a tree deeper than k is cut at depth k."""
    tree = LookaheadTree(np.array([1, 2, 3, 4, 5]), np.array([-1, -1, 0, 0, 3]))
    assert tree.depths().tolist() == [1, 1, 2, 2, 3]
    batch, k = 5, 3
    drafts = LookaheadDrafts(batch, k)
    drafts.start(list(range(batch)), [tree] * batch, classes=np.zeros(batch, dtype=int))
    # row 0: 2 (a leaf: through at 1); row 1: 1, 4, 5 (to the leaf at depth 3); row 2: 1, 3 (a leaf); row 3: 9 (no
    # child holds it); row 4: 1 then waits (4 next step, then 6: a miss below 4)
    host = HostView([4] * batch, [False] * batch, [1, 3, 2, 1, 1], [0] * batch,
                    np.array([[2, 0, 0], [1, 4, 5], [1, 3, 0], [9, 0, 0], [1, 0, 0]]))
    settled = drafts.settle(host, drafted=np.zeros(batch, dtype=bool))
    assert (settled.asked.tolist(), settled.matched.tolist(), settled.lengths.tolist()) == (
        [3, 3, 3, 3, 0], [1, 3, 2, 0, 0], [3, 3, 3, 3, 0])
    host = HostView([5] * batch, [False] * batch, [2, 1, 1, 1, 2], [1] * batch,
                    np.array([[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [4, 6, 0]]))
    settled = drafts.settle(host, drafted=np.zeros(batch, dtype=bool))
    assert (settled.matched.tolist(), settled.lengths.tolist()) == ([0, 0, 0, 0, 2], [0, 0, 0, 0, 3])
    # cut at depth 2: node 5 is dropped, 4 is a leaf; trees of one shape placed at once (`start_shaped`, a
    # template's trees shipped from the device) walk the same
    for shaped in (False, True):
        shallow = LookaheadDrafts(1, 2)
        if shaped:
            shallow.start_shaped([0], tree.tokens[None, :], tree.parents, classes=np.zeros(1, dtype=int))
        else:
            shallow.start([0], [tree], classes=np.zeros(1, dtype=int))
        host = HostView([4], [False], [3], [0], np.array([[1, 4, 5]]))
        settled = shallow.settle(host, drafted=np.zeros(1, dtype=bool))
        assert (settled.asked.tolist(), settled.matched.tolist(), settled.lengths.tolist()) == ([2], [2], [2])


def test_a_larger_tree_after_smaller_ones_gets_room():
    drafts = LookaheadDrafts(2, 4)
    drafts.start([0], [LookaheadTree.chain([1, 2])], classes=np.zeros(2, dtype=int))
    wide = LookaheadTree(np.arange(10, 22), np.array([-1] * 12))  # twelve children of the root
    drafts.start([1], [wide], classes=np.zeros(2, dtype=int))
    host = HostView([4, 4], [False, False], [1, 1], [0, 0], np.array([[1, 0], [21, 0]]))
    settled = drafts.settle(host, drafted=np.zeros(2, dtype=bool))
    assert (settled.matched.tolist(), settled.lengths.tolist()) == ([0, 1], [0, 1])  # row 0 waits on 2


@pytest.mark.parametrize("tokens, parents", [([1, 2], [-1]), ([1, 2], [1, -1]), ([1], [-2])])
def test_a_malformed_tree_is_refused(tokens, parents):
    with pytest.raises(ValueError, match="LookaheadTree"):
        LookaheadTree(np.array(tokens), np.array(parents))
