"""Speculation statistics, with vLLM's definitions.

acceptance_rate = accepted / drafted; mean_acceptance_length = 1 + accepted / num_drafts (it counts the bonus
token, as vLLM does). A draft is one step of one row that proposed at least one token. target_forward_passes
counts every target forward, the prefill included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RowSpecStats:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    # [k]: how often the draft token at each position was accepted
    accepted_per_position: list[int]
    target_forward_passes: int

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
        }


@dataclass(frozen=True)
class SpecStats(RowSpecStats):
    per_row: tuple[RowSpecStats, ...] = ()

    def to_dict(self) -> dict:
        return super().to_dict() | {"per_row": [row.to_dict() for row in self.per_row]}


class SpecStatsRecorder:
    """Accumulates per-row counts on the host during decoding."""

    def __init__(self, batch_size: int, num_speculative_tokens: int) -> None:
        self.num_drafts = torch.zeros(batch_size, dtype=torch.long)
        self.num_draft_tokens = torch.zeros(batch_size, dtype=torch.long)
        self.num_accepted = torch.zeros(batch_size, dtype=torch.long)
        self.accepted_per_position = torch.zeros(batch_size, num_speculative_tokens, dtype=torch.long)
        self.forwards = torch.zeros(batch_size, dtype=torch.long)
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
        active, drafted, accepted = active.cpu(), num_draft_tokens.cpu(), num_accepted.cpu()
        self.total_forwards += 1
        self.forwards += active.long()
        drafted = torch.where(active, drafted, 0)
        accepted = torch.where(active, accepted, 0)
        self.num_drafts += (drafted > 0).long()
        self.num_draft_tokens += drafted
        self.num_accepted += accepted
        positions = torch.arange(self.accepted_per_position.shape[1])[None, :]
        self.accepted_per_position += (positions < accepted[:, None]).long()

    def finish(self) -> SpecStats:
        rows = tuple(
            RowSpecStats(
                num_drafts=int(self.num_drafts[b]),
                num_draft_tokens=int(self.num_draft_tokens[b]),
                num_accepted_tokens=int(self.num_accepted[b]),
                accepted_per_position=self.accepted_per_position[b].tolist(),
                target_forward_passes=int(self.forwards[b]),
            )
            for b in range(self.num_drafts.shape[0])
        )
        return SpecStats(
            num_drafts=int(self.num_drafts.sum()),
            num_draft_tokens=int(self.num_draft_tokens.sum()),
            num_accepted_tokens=int(self.num_accepted.sum()),
            accepted_per_position=self.accepted_per_position.sum(dim=0).tolist(),
            target_forward_passes=self.total_forwards,
            per_row=rows,
        )
