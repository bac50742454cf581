"""Lookahead chains: what a host proposer (n-gram lookup, suffix decoding) would draft for a row that does not draft
with it, checked against the tokens the row then emits, over as many steps as it takes.

The first mismatch or the chain's end settles a chain: it is observed as a drafted chain of its length with the
tokens matched accepted (an empty chain, as a lookup that found nothing). A deterministic draft token is accepted
exactly when the target emits it (greedy), or with the target's probability of it, which is the chance that the
emitted token is it (sampling); and what a row emits does not depend on which drafter, if any, drafted for it. So
these observations count as real ones, whether the row decoded plainly or drafted with another proposer
(`method="auto"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_specdec.step.state import HostView


@dataclass(frozen=True)
class SettledChains:
    """The chains a step settled, as observations: per row (0 where none settled) the draft positions asked for, the
    tokens matched (accepted) and the chain's length (drafted), and the draft class each chain was looked up in."""

    # [B] each
    asked: np.ndarray
    matched: np.ndarray
    lengths: np.ndarray
    classes: np.ndarray


class LookaheadChains:
    """One proposer's pending chain per row ([B, K] tokens, the first `length` real; length -1: none), how many of
    its tokens the row emitted so far, and the draft class it was looked up in."""

    def __init__(self, batch_size: int, max_k: int) -> None:
        self.max_k = max_k
        self.tokens = np.zeros((batch_size, max_k), dtype=np.int64)
        self.length = np.full(batch_size, -1)
        self.matched = np.zeros(batch_size, dtype=int)
        self.classes = np.zeros(batch_size, dtype=int)

    def free_rows(
        self,
        # [B] bool: rows that may take a chain (generating, not drafting with this proposer)
        eligible: np.ndarray,
    ) -> list[int]:
        """The eligible rows with no chain being checked."""
        return np.flatnonzero(eligible & (self.length < 0)).tolist()

    def start(
        self,
        rows: list[int],
        # per row of `rows`: the chain the proposer would draft (at most k tokens; empty when none)
        chains: list[np.ndarray],
        # [B] each row's draft class this step (zeros for a proposer without classes)
        classes: np.ndarray,
    ) -> None:
        for row, chain in zip(rows, chains):
            chain = np.asarray(chain[: self.max_k], dtype=np.int64)
            self.tokens[row, : chain.size] = chain
            self.length[row] = chain.size
        self.matched[rows] = 0
        self.classes[rows] = classes[rows]

    def settle(
        self,
        host: HostView,
        # [B] bool: rows that drafted with this proposer this step (their drafts observe them: chains dropped)
        drafted: np.ndarray,
    ) -> SettledChains | None:
        """Check the pending chains against what the step emitted; the chains it settled, or None."""
        pending = self.length >= 0
        if not pending.any():
            return None
        dropped = pending & (drafted | np.asarray(host.finished))
        self.length[dropped] = -1
        pending &= ~dropped
        # [B, E]: each emitted token against the chain token it meets (the rows' next unmatched ones on)
        emitted, length, matched = host.emitted, self.length, self.matched
        column = np.arange(emitted.shape[1])[None, :]
        position = matched[:, None] + column
        chain = self.tokens[np.arange(len(length))[:, None], np.minimum(position, self.max_k - 1)]
        compared = pending[:, None] & (column < np.asarray(host.num_emitted)[:, None]) & (position < length[:, None])
        agreeing = (emitted == chain) & compared
        agree = np.argmin(np.concatenate([agreeing, np.zeros_like(agreeing[:, :1])], axis=1), axis=1)  # 1st mismatch
        count = matched + agree
        # all emitted tokens matched and the chain not through: wait for the next step
        waiting = pending & (agree == compared.sum(axis=1)) & (count < length)
        self.matched = np.where(waiting, count, matched)
        settled = pending & ~waiting
        lengths, matched = np.where(settled, length, 0), np.where(settled, count, 0)
        self.length[settled] = -1
        if not settled.any():
            return None
        # an empty chain: asked for max_k, drafted none (the row's draft rate learns it)
        asked = np.where(settled, np.maximum(lengths, self.max_k * (lengths == 0)), 0)
        return SettledChains(asked, matched, lengths, self.classes.copy())
