"""Lookahead drafts: what a proposer that drafts without a model (n-gram lookup, suffix decoding, token recycling)
would draft for a row that does not draft with it, checked against the tokens the row then emits, over as many
steps as it takes.

A draft is a token tree (a chain is the tree whose nodes each have one child). The emitted tokens walk down it from
its root, one node per token, while some child of the node reached holds the next emitted token. The first emitted
token no child holds, or a leaf reached, settles it: it is observed as a drafted tree of its depth with the tokens
walked accepted (an empty draft, as a lookup that found nothing). Deterministic draft tokens are accepted exactly
as far as that walk goes (greedy), or so in distribution (sampling: a child of the node reached is accepted with the
target's probability of its token, which is the chance that the emitted token is that child's); and what a row
emits does not depend on which drafter, if any, drafted for it. So these observations count as real ones, whether
the row decoded plainly or drafted with another proposer (`method="auto"`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from hf_specdec.step.state import HostView

# the parent of a padding slot: no node reached is ever it
NO_PARENT = -2


@dataclass(frozen=True)
class LookaheadTree:
    """What a proposer would draft for one row now: N nodes in an order where parents come before children."""

    # [N] int: each node's token
    tokens: np.ndarray
    # [N] int: each node's parent's index (-1: a child of the root, the row's last token)
    parents: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.ndim != 1:
            raise ValueError(f"LookaheadTree: tokens {tuple(self.tokens.shape)} and parents "
                             f"{tuple(self.parents.shape)} must be two vectors of one length")
        if (self.parents >= np.arange(self.parents.size)).any() or (self.parents < -1).any():
            raise ValueError(f"LookaheadTree: parents {self.parents.tolist()} must each be -1 or an earlier node")

    @classmethod
    def chain(cls, tokens: np.ndarray | list[int] | tuple[int, ...]) -> LookaheadTree:
        """The chain of `tokens`, in order."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return cls(tokens, np.arange(tokens.size, dtype=np.int64) - 1)

    def subtree(
        self,
        # [N] bool: the nodes to keep, each one's parent among them
        kept: np.ndarray,
    ) -> LookaheadTree:
        """The tree of the kept nodes, renumbered in order."""
        index = np.cumsum(kept) - 1  # a kept node's new index: the kept nodes before it
        parents = self.parents[kept]
        return LookaheadTree(self.tokens[kept], np.where(parents < 0, -1, index[np.maximum(parents, 0)]))

    def depths(self) -> np.ndarray:
        """[N] each node's depth (1: a child of the root), read-only."""
        return _depths(tuple(self.parents.tolist()))


@functools.lru_cache(maxsize=256)
def _depths(parents: tuple[int, ...]) -> np.ndarray:
    """Each node's depth, once per shape (drafts repeat their shapes: chains of each length, a template's tree)."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for node, parent in enumerate(parents):
        depths[node] = 1 if parent < 0 else depths[parent] + 1
    depths.setflags(write=False)
    return depths


@dataclass(frozen=True)
class ShippedTrees:
    """Trees a proposer built on the device (token recycling), read with the step's one host read
    (`DecodeState.ship`) rather than at a sync of their own: every row's tree is one template's nodes. A node it
    has no token for (-1) matches no emitted token: it is verified, and costs, as a rejected node would."""

    # the index of the [B, N] node tokens in `HostView.shipped`
    shipment: int
    # [N] int: the template's parents (-1: a child of the root), parents first
    parents: np.ndarray

    def tokens(self, host: HostView, rows: list[int]) -> np.ndarray:
        """[R, N] the rows' node tokens, after the step's host read."""
        return host.shipped[self.shipment][rows]


@dataclass(frozen=True)
class SettledDrafts:
    """The drafts a step settled, as observations: per row (0 where none settled) the draft positions asked for, the
    tokens matched (accepted) and the draft's depth (drafted), and the draft class each was looked up in."""

    # [B] each
    asked: np.ndarray
    matched: np.ndarray
    lengths: np.ndarray
    classes: np.ndarray


class LookaheadDrafts:
    """One proposer's pending draft per row ([B, M] node tokens and parents, padded; its depth, -1: none), the node
    the row's emitted tokens reached so far (-1: the root) and how many that is, and the draft class it was looked
    up in."""

    def __init__(self, batch_size: int, max_k: int) -> None:
        self.max_k = max_k
        self.tokens = np.zeros((batch_size, max_k), dtype=np.int64)
        self.parents = np.full((batch_size, max_k), NO_PARENT, dtype=np.int64)
        self.length = np.full(batch_size, -1)
        self.node = np.full(batch_size, -1)
        self.matched = np.zeros(batch_size, dtype=int)
        self.classes = np.zeros(batch_size, dtype=int)

    def free_rows(
        self,
        # [B] bool: rows that may take a draft (generating, not drafting with this proposer)
        eligible: np.ndarray,
    ) -> list[int]:
        """The eligible rows with no draft being checked."""
        return np.flatnonzero(eligible & (self.length < 0)).tolist()

    def start(
        self,
        rows: list[int],
        # per row of `rows`: the draft the proposer would make (nodes deeper than k are dropped)
        drafts: list[LookaheadTree],
        # [B] each row's draft class this step (zeros for a proposer without classes)
        classes: np.ndarray,
    ) -> None:
        for row, draft in zip(rows, drafts):
            self._place([row], draft.tokens[None, :], draft)
        self._restart(rows, classes)

    def start_shaped(
        self,
        rows: list[int],
        # [R, N]: each row's node tokens, all in one tree shape (a template's)
        tokens: np.ndarray,
        # [N] the shape's parents (-1: a child of the root)
        parents: np.ndarray,
        # [B] each row's draft class this step
        classes: np.ndarray,
    ) -> None:
        """`start` for drafts that share one shape (trees of one template): placed at once."""
        self._place(rows, tokens, LookaheadTree(np.zeros_like(parents), parents))
        self._restart(rows, classes)

    def _place(
        self,
        rows: list[int],
        # [R, N]: the rows' node tokens in `shape`
        tokens: np.ndarray,
        # the rows' tree shape (its parents; its own tokens unread)
        shape: LookaheadTree,
    ) -> None:
        depths = shape.depths()
        kept = depths <= self.max_k  # a kept node's parent is shallower: kept too
        if not kept.all():
            shape, tokens = shape.subtree(kept), tokens[:, kept]
        size = shape.parents.size
        if size > self.tokens.shape[1]:  # room for the largest draft so far
            extra = size - self.tokens.shape[1]
            self.tokens = np.pad(self.tokens, ((0, 0), (0, extra)))
            self.parents = np.pad(self.parents, ((0, 0), (0, extra)), constant_values=NO_PARENT)
        self.tokens[rows, :size] = tokens
        self.parents[rows, :size] = shape.parents
        self.parents[rows, size:] = NO_PARENT
        self.length[rows] = int(depths[kept].max(initial=0))

    def _restart(self, rows: list[int], classes: np.ndarray) -> None:
        """The rows' drafts just placed: walked from their roots, in this step's classes."""
        self.node[rows] = -1
        self.matched[rows] = 0
        self.classes[rows] = classes[rows]

    def _has_children(self, node: np.ndarray) -> np.ndarray:
        """[B] whether each row's node (-1: the root) has a child in its draft."""
        return (self.parents == node[:, None]).any(axis=1)

    def settle(
        self,
        host: HostView,
        # [B] bool: rows that drafted with this proposer this step (their drafts observe them: lookaheads dropped)
        drafted: np.ndarray,
    ) -> SettledDrafts | None:
        """Walk the pending drafts down with what the step emitted; the drafts it settled, or None."""
        pending = self.length >= 0
        if not pending.any():
            return None
        dropped = pending & (drafted | np.asarray(host.finished))
        self.length[dropped] = -1
        pending &= ~dropped
        emitted, num_emitted = host.emitted, np.asarray(host.num_emitted)
        walking, settled = pending.copy(), np.zeros_like(pending)
        node, matched = self.node.copy(), self.matched.copy()
        for column in range(emitted.shape[1] + 1):
            through = walking & ~self._has_children(node)  # a leaf reached (or an empty draft): through
            settled |= through
            walking &= ~through
            here = walking & (column < num_emitted)
            if column == emitted.shape[1] or not here.any():
                break
            # [B, M]: the child of the node reached that holds this emitted token
            child = (self.parents == node[:, None]) & (self.tokens == emitted[:, column, None])
            found = here & child.any(axis=1)
            node = np.where(found, child.argmax(axis=1), node)
            matched = matched + found
            missed = here & ~found
            settled |= missed
            walking &= ~missed
        # the rest matched every token they emitted, their drafts not through: they wait for the next step
        self.node, self.matched = np.where(walking, node, -1), np.where(walking, matched, 0)
        if not settled.any():
            return None
        lengths, matched = np.where(settled, self.length, 0), np.where(settled, matched, 0)
        self.length[settled] = -1
        # an empty draft: asked for max_k, drafted none (the row's draft rate learns it)
        asked = np.where(settled, np.maximum(lengths, self.max_k * (lengths == 0)), 0)
        return SettledDrafts(asked, matched, lengths, self.classes.copy())
