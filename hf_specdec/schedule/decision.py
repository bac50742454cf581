"""The adaptive schedule's decision rule, a pure function of estimates: how many tokens each row drafts this step.

Row b's estimate is `acceptance[b, j]`, the chance that its draft at position j + 1 is accepted given the ones
before it were. Drafting k tokens then emits `1 + sum_{j<k} reach[b, j]` tokens in expectation, with
`reach[b, j] = prod_{i<=j} acceptance[b, i]` (the chance to get that far). The step's cost `step_time[w]` is the
predicted wall time of a step whose widest row drafts w tokens (draft and verify together).

1. Each row's own length: position j pays for a row when its reach is at least the extra cost of one more
   position in tokens of a plain step, `(step_time[j] - step_time[j - 1]) / step_time[0]` (a batch of B rows
   shares a step: a plain step emits B tokens in `step_time[0]`, one more position per row costs
   `step_time[j] - step_time[j - 1]` for B slots). The row keeps the prefix with the largest net gain.
2. The step's width: among the allowed widths w, the one with the most expected tokens per second,
   `sum_b E_b(min(w, L_b)) / step_time[w]`; width 0 is the plain step. A proposer that drafts on the host drafts
   for row b only some of the time (`draft_rate[b]`, an n-gram lookup finds a match or not): its expected
   tokens are weighed by that rate, and the step costs `step_time[w]` only when some row drafts, `step_time[0]`
   otherwise (a row's own length is the same either way: gain and cost both come only with a draft).
3. Rows that have not drafted for a while probe (they draft `probe_length` tokens), so a row whose text becomes
   predictable turns speculation back on. A probe rides along a step that drafts anyway (within its width, at no
   extra cost to the batch); only when `probe_alone` may it turn a plain step into a drafting one.
4. Widths whose steps at this batch size have realized fewer tokens per second than a plain step
   (`CostTable.unpaid_widths`) are not the estimates' to choose (`estimate_widths`): only probes reach them.
5. The width is chosen for the `critical` rows' tokens alone (a call lasts as long as its rows with the most tokens
   left); the other rows draft within it, each to its own length, and neither widen a step nor probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Decision:
    # the step's draft width: the most tokens any row drafts (0: a plain step)
    width: int
    # per row: draft tokens allowed this step (0 for rows that decode plainly or are not generating)
    limits: tuple[int, ...]
    # expected tokens the step emits over the generating rows, and its predicted wall time
    expected_tokens: float
    expected_time: float


def expected_accepted(
    # [B, K]: conditional acceptance of each draft position
    acceptance: np.ndarray,
) -> np.ndarray:
    """[B, K + 1]: expected accepted drafts when drafting k = 0..K tokens."""
    reach = np.cumprod(np.clip(acceptance, 0.0, 1.0), axis=1)
    return np.concatenate([np.zeros((acceptance.shape[0], 1)), np.cumsum(reach, axis=1)], axis=1)


def row_lengths(
    # [B, K + 1]: expected accepted drafts when drafting k = 0..K tokens (`expected_accepted`)
    accepted: np.ndarray,
    # [K + 1]: predicted step time by width
    step_time: np.ndarray,
) -> np.ndarray:
    """[B] each row's own best draft length: the prefix whose expected accepted tokens exceed its cost the most
    (in tokens of a plain step; ties go to the shorter prefix)."""
    marginal = np.maximum(np.diff(step_time), 0.0) / max(float(step_time[0]), 1e-12)  # [K]
    gain = accepted - np.concatenate([[0.0], np.cumsum(marginal)])[None, :]
    return gain.argmax(axis=1)  # argmax keeps the first of equal maxima


def decide(
    # [B, K + 1]: expected accepted drafts per row when drafting k = 0..K tokens (`expected_accepted` of each
    # row's conditional acceptance per draft position)
    accepted: np.ndarray,
    # [K + 1]: predicted wall time of a step of each width 0..K at this batch size
    step_time: np.ndarray,
    # [B]: rows generating this step
    active: Sequence[bool],
    # [B]: rows due a probe
    probe: Sequence[bool],
    # the widths a step may take (0 included), ascending
    widths: Sequence[int],
    probe_length: int,
    # [B]: how often each row drafts when allowed (None: always)
    draft_rate: np.ndarray | None = None,
    # whether rows due a probe may widen a plain step (a probe step); otherwise they join a step that drafts anyway,
    # up to its width
    probe_alone: bool = True,
    # the widths the estimates may choose (None: all of `widths`); the others only probes reach (drafting at them
    # has not paid at this batch size)
    estimate_widths: Sequence[int] | None = None,
    # [B]: the rows whose tokens choose the width (None: every active row)
    critical: Sequence[bool] | None = None,
) -> Decision:
    batch, max_k = accepted.shape[0], accepted.shape[1] - 1
    active_rows = np.asarray(active, dtype=bool)
    critical_rows = active_rows if critical is None else active_rows & np.asarray(critical, dtype=bool)
    probing = np.asarray(probe, dtype=bool) & critical_rows
    widths = [w for w in widths if w <= max_k]
    own = np.where(active_rows, row_lengths(accepted, step_time), 0)
    # every candidate width at once (0 among them): limits [W, B], each row's own length within the width
    candidates = np.asarray([w for w in widths if estimate_widths is None or w == 0 or w in estimate_widths])
    tokens, time = step_expectation(accepted, step_time, critical_rows,
                                    np.minimum(own[None, :], candidates[:, None]), candidates, draft_rate)
    rate = tokens / np.maximum(time, 1e-12)
    # the narrowest width within a relative 1e-9 of the best rate (a tie goes to the narrower width)
    best_width = int(candidates[np.argmax(rate >= rate.max() * (1.0 - 1e-9))])
    limits = np.minimum(own, best_width)
    probe_to = min(probe_length, max_k) if probe_alone else min(probe_length, best_width)
    limits = np.where(probing, np.maximum(limits, probe_to), limits)
    limits = np.where(active_rows, limits, 0)
    width = int(limits.max()) if batch else 0
    if width and widths:  # round up to an allowed width (a fixed set of shapes)
        width = min((w for w in widths if w >= width), default=max(widths))
        limits = np.minimum(limits, width)
    tokens, time = step_expectation(accepted, step_time, active_rows, limits, width, draft_rate)
    return Decision(width=width, limits=tuple(int(x) for x in limits), expected_tokens=tokens, expected_time=time)


def step_expectation(
    # [B, K + 1]: expected accepted drafts per row when drafting k = 0..K tokens, given that it drafts
    accepted: np.ndarray,
    # [K + 1]: predicted wall time of a step of each width
    step_time: np.ndarray,
    # [B] bool: rows generating this step
    active: np.ndarray,
    # [B], or [W, B] for W candidate steps at once: each row's draft limit
    limits: np.ndarray,
    # the step's width, or [W] widths (one per row of `limits`)
    width: int | np.ndarray,
    # [B] in [0, 1]: how often each row drafts when allowed (None: always)
    draft_rate: np.ndarray | None = None,
) -> tuple[float, float] | tuple[np.ndarray, np.ndarray]:
    """Expected tokens a step with these limits and width emits over the generating rows, and its expected wall
    time: a row's drafts count as often as it drafts, and the step costs `step_time[width]` when some row drafts,
    `step_time[0]` otherwise. Floats for one step, [W] arrays for a stack of candidates."""
    limits = np.asarray(limits)
    rate = np.ones(limits.shape[-1]) if draft_rate is None else draft_rate
    gained = accepted[np.arange(limits.shape[-1]), limits]  # [B] or [W, B]
    tokens = ((1.0 + rate * gained) * active).sum(axis=-1)
    drafts_somewhere = 1.0 - np.prod(np.where((limits > 0) & active, 1.0 - rate, 1.0), axis=-1)
    time = step_time[0] + drafts_somewhere * (step_time[np.asarray(width)] - step_time[0])
    if limits.ndim == 1:
        return float(tokens), float(time)
    return tokens, time


def width_ladder(max_k: int) -> tuple[int, ...]:
    """The widths a step may take under static shapes: 0, the powers of two below k, and k (each a compiled
    shape)."""
    rungs = {0, max_k}
    power = 1
    while power < max_k:
        rungs.add(power)
        power *= 2
    return tuple(sorted(rungs))
