"""Where a row's draft stops by the drafter's own confidence (`SpeculativeConfig.draft_confidence`).

A drafter that drafts position by position (a draft model, an EAGLE head, MTP layers, early exit) knows, before it
draws position p, the distribution q_p it draws from. Its peak, max q_p, is a calibrated guess of the chance that
the target keeps the token (the EAGLE-2 paper's observation; on SmolLM2-135M-Instruct the EAGLE-1/2 head's first
drafted token was kept 9% of the time where its peak was under 0.2 and 95% where it was over 0.8:
`benchmarks/draft_confidence.py --calibration`). A row's running
confidence after p positions, the product of the peaks so far, estimates its chance to get that far; the row drafts
position p while that stays at or above the floor, so a confident stretch drafts deep and an unsure one stops early,
or at once. The position that stops a row has been computed (its forward ran), so a step costs one drafting forward
more than it drafts.

Lossless: whether position p is drafted depends on q_1..q_p and the tokens drawn before p, never on the token drawn
at p or on the target, so each drafted token is still a draw from q_p (greedy: its argmax) and verification is
exact, as for any k chosen before the draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def peak_probability(
    # [B, V]: a drafter's scores (greedy) or the distribution it draws from (sampling)
    values: torch.Tensor,
    is_distribution: bool,
) -> torch.Tensor:
    """[B] float: the largest probability of each row's draft distribution (softmax of the scores, or the
    distribution itself)."""
    if is_distribution:
        return values.amax(dim=-1).float()
    scores = values.float()
    return (scores.amax(dim=-1) - torch.logsumexp(scores, dim=-1)).exp()


@dataclass
class ConfidenceCut:
    """One step's cut: per row, its running confidence and the positions it drafts so far. Host lists: a step
    reads each position's peaks once (one small device read per drafted position)."""

    # the running confidence a row needs to draft a position
    floor: float
    # per row: the positions the schedule and the length limit allow
    limits: Sequence[int]
    # per row: the product of the peaks of the positions drafted so far
    reach: list[float] = field(init=False)
    # per row: positions drafted (a row stops for good at its first position below its floor)
    kept: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.reach = [1.0] * len(self.limits)
        self.kept = [0] * len(self.limits)

    def _going(self, row: int, position: int) -> bool:
        return self.kept[row] == position and position < self.limits[row]

    def may_draft(self, position: int) -> bool:
        """Whether some row may still draft `position` (a peak is at most 1, so a row whose confidence is already
        below the position's floor cannot): else the drafter need not run for it."""
        floor = self.floor
        return any(self._going(row, position) and self.reach[row] >= floor for row in range(len(self.kept)))

    def observe(self, position: int, peaks: Sequence[float]) -> None:
        """Position `position`'s peaks (one per row): rows still going draft it while their running confidence
        stays at or above its floor."""
        floor = self.floor
        for row, peak in enumerate(peaks):
            if self._going(row, position):
                self.reach[row] *= float(peak)
                if self.reach[row] >= floor:
                    self.kept[row] = position + 1

    @property
    def depth(self) -> int:
        """The most positions any row drafts."""
        return max(self.kept, default=0)
