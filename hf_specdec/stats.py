"""Speculation statistics, with vLLM's definitions.

acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted / num_drafts (it counts the bonus
token, as vLLM does). A draft is one step of one row that proposed at least one token. target_forward_passes
counts every target forward, the prefill included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class ScheduleStats:
    """What the step schedule decided for a row (or, summed, for the batch)."""

    schedule: str
    # steps by the draft tokens allowed: entry k counts the steps that allowed k (entry 0: plain steps)
    k_histogram: list[int]
    plain_steps: int
    # accepted draft tokens the schedule expected at its decisions, and what was accepted in those steps
    estimated_accepted_tokens: float
    scheduled_draft_tokens: int
    scheduled_accepted_tokens: int
    # method="auto": steps in which the row drafted with each candidate proposer
    method_steps: dict[str, int] = field(default_factory=dict)

    @property
    def estimated_acceptance_rate(self) -> float:
        return self.estimated_accepted_tokens / self.scheduled_draft_tokens if self.scheduled_draft_tokens else 0.0

    @property
    def measured_acceptance_rate(self) -> float:
        return self.scheduled_accepted_tokens / self.scheduled_draft_tokens if self.scheduled_draft_tokens else 0.0

    @classmethod
    def total(cls, rows: list[ScheduleStats]) -> ScheduleStats:
        return cls(
            schedule=rows[0].schedule,
            k_histogram=[sum(column) for column in zip(*(r.k_histogram for r in rows))],
            plain_steps=sum(r.plain_steps for r in rows),
            estimated_accepted_tokens=sum(r.estimated_accepted_tokens for r in rows),
            scheduled_draft_tokens=sum(r.scheduled_draft_tokens for r in rows),
            scheduled_accepted_tokens=sum(r.scheduled_accepted_tokens for r in rows),
            method_steps={m: sum(r.method_steps.get(m, 0) for r in rows) for m in rows[0].method_steps},
        )

    def to_dict(self) -> dict:
        return asdict(self) | {
            "estimated_acceptance_rate": self.estimated_acceptance_rate,
            "measured_acceptance_rate": self.measured_acceptance_rate,
        }


@dataclass(frozen=True)
class RowSpecStats:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    # [k]: how often the draft token at each position was accepted
    accepted_per_position: list[int]
    target_forward_passes: int
    # the step schedule's decisions (None when every step drafted k: `schedule="fixed"` without batch-size rules)
    schedule: ScheduleStats | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
        }


@dataclass(frozen=True)
class SpecStats(RowSpecStats):
    per_row: tuple[RowSpecStats, ...] = ()
    # the deepest draft token a step proposed: k as asked, or fewer where the proposer drafts fewer (Medusa heads),
    # or a static tree's depth
    num_speculative_tokens: int = 0
    # the draft nodes a sized tree keeps (a dynamic tree's or an n-gram trie's `tree_total_tokens`, resolved where it
    # was "auto"); None: no such tree
    tree_total_tokens: int | None = None

    def to_dict(self) -> dict:
        return super().to_dict() | {"per_row": [row.to_dict() for row in self.per_row]}


class SpecStatsRecorder:
    """Accumulates per-row counts on the host, from the numbers each step's one host read brings (`HostView`): no
    device work per step."""

    def __init__(self, batch_size: int, num_speculative_tokens: int) -> None:
        # rows: num_drafts, num_draft_tokens, num_accepted, forwards
        self.counts = np.zeros((4, batch_size), dtype=np.int64)
        self.accepted_per_position = np.zeros((batch_size, num_speculative_tokens), dtype=np.int64)
        self.positions = np.arange(num_speculative_tokens)[None, :]
        self.total_forwards = 0

    def record(
        self,
        # per row: whether it took part in this step
        active: Sequence[bool],
        # per row: draft tokens it verified, and accepted
        num_draft_tokens: Sequence[int],
        num_accepted: Sequence[int],
    ) -> None:
        self.total_forwards += 1
        active_rows = np.asarray(active, dtype=np.int64)
        drafted = np.asarray(num_draft_tokens) * active_rows
        accepted = np.asarray(num_accepted) * active_rows
        self.counts += np.stack([drafted > 0, drafted, accepted, active_rows])
        self.accepted_per_position += self.positions < accepted[:, None]

    def record_forward(
        self,
        # per row: whether the forward ran for it
        rows: Sequence[bool],
    ) -> None:
        """A target forward that verified no drafts: a step in which no row drafted, or the returned cache computed
        again for rows that stopped."""
        self.total_forwards += 1
        self.counts[3] += np.asarray(rows, dtype=np.int64)

    def finish(self, schedule: list[ScheduleStats] | None = None) -> SpecStats:
        """The statistics, with the schedule's per-row decisions when there was a schedule."""
        drafts, drafted, accepted, forwards = self.counts.tolist()
        per_position = self.accepted_per_position
        rows = tuple(
            RowSpecStats(
                num_drafts=drafts[b],
                num_draft_tokens=drafted[b],
                num_accepted_tokens=accepted[b],
                accepted_per_position=per_position[b].tolist(),
                target_forward_passes=forwards[b],
                schedule=None if schedule is None else schedule[b],
            )
            for b in range(len(drafts))
        )
        return SpecStats(
            num_drafts=sum(drafts),
            num_draft_tokens=sum(drafted),
            num_accepted_tokens=sum(accepted),
            accepted_per_position=per_position.sum(axis=0).tolist(),
            target_forward_passes=self.total_forwards,
            per_row=rows,
            num_speculative_tokens=self.positions.shape[1],
            schedule=None if schedule is None else ScheduleStats.total(schedule),
        )
