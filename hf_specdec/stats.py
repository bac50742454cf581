"""Speculation statistics, with vLLM's definitions.

acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted / num_drafts (it counts the bonus
token, as vLLM does). A draft is one step of one row that proposed at least one token. target_forward_passes
counts every target forward, the prefill included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


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
    """Accumulates per-row counts on the decoding device (no host copy per step); read once at the end."""

    def __init__(self, batch_size: int, num_speculative_tokens: int, device: torch.device) -> None:
        # rows: num_drafts, num_draft_tokens, num_accepted, forwards
        self.counts = torch.zeros(4, batch_size, dtype=torch.long, device=device)
        self.accepted_per_position = torch.zeros(batch_size, num_speculative_tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(num_speculative_tokens, device=device)[None, :]
        self.total_forwards = 0

    def record(
        self,
        # [B] bool: rows that took part in this step
        active: torch.Tensor,
        # [B]
        num_draft_tokens: torch.Tensor,
        # [B]
        num_accepted: torch.Tensor,
    ) -> None:
        self.total_forwards += 1
        drafted = num_draft_tokens * active
        accepted = num_accepted * active
        self.counts += torch.stack([(drafted > 0).long(), drafted, accepted, active.long()])
        self.accepted_per_position += self.positions < accepted[:, None]

    def record_forward(
        self,
        # [B] bool: the rows the forward ran for
        rows: torch.Tensor,
    ) -> None:
        """A target forward that verified no drafts: a step in which no row drafted, or the returned cache computed
        again for rows that stopped."""
        self.total_forwards += 1
        self.counts[3] += rows.long().to(self.counts.device)

    def finish(self, schedule: list[ScheduleStats] | None = None) -> SpecStats:
        """The statistics, with the schedule's per-row decisions when there was a schedule."""
        drafts, drafted, accepted, forwards = self.counts.cpu().tolist()
        per_position = self.accepted_per_position.cpu()
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
            accepted_per_position=per_position.sum(dim=0).tolist(),
            target_forward_passes=self.total_forwards,
            per_row=rows,
            num_speculative_tokens=self.positions.shape[1],
            schedule=None if schedule is None else ScheduleStats.total(schedule),
        )
