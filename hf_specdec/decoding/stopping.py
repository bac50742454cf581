"""Stopping checked at every emitted token, so a row ends exactly where plain `generate` ends it.

transformers' assisted loop checks its criteria once per accepted block and overshoots (a custom stop at 9 new
tokens gives 12). Here the length limit and EOS are checked per token in one vectorised pass, and every other
criterion (stop strings, max_time, custom ones) is called per emitted position with that position's prefix,
grouped by prefix length.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_specdec.step.state import DecodeState


@dataclass(frozen=True)
class StopDecision:
    # [B]: tokens each row really emits, up to and including its first stopping token
    num_emitted: torch.Tensor
    # [B] bool: rows that stopped in this step
    stopped: torch.Tensor


class TokenStopper:
    def __init__(self, stopping_criteria: StoppingCriteriaList, device: torch.device) -> None:
        self.max_length: int | None = None
        eos: list[int] = []
        others = []
        for criterion in stopping_criteria:
            if isinstance(criterion, MaxLengthCriteria):
                limit = criterion.max_length
                self.max_length = limit if self.max_length is None else min(self.max_length, limit)
            elif isinstance(criterion, EosTokenCriteria):
                eos.extend(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
            else:
                others.append(criterion)
        self.eos_token_ids = torch.tensor(sorted(set(eos)), dtype=torch.long, device=device)
        self.others = StoppingCriteriaList(others)
        self.needs_scores = len(self.others) > 0  # custom criteria receive the scores
        # plain generate pads rows that stopped only when an EOS criterion is present
        self.pads_finished_rows = any(isinstance(c, EosTokenCriteria) for c in stopping_criteria)

    def check(
        self,
        state: DecodeState,
        # [B, W]: tokens already written after each row's committed length
        tokens: torch.Tensor,
        # [B]: how many of them each row emits
        num_emitted: torch.Tensor,
        # [B, W, V]: processed scores of those tokens (what custom criteria receive); None when `needs_scores` is False
        scores: torch.Tensor | None,
    ) -> StopDecision:
        width = tokens.shape[1]
        column = state.columns(width)
        prefix_lengths = state.lengths[:, None] + column + 1  # [B, W]: length once token j is appended
        emitted = column < num_emitted[:, None]
        stops = []  # [B, W] bool each: a stop at token j
        if self.max_length is not None:
            stops.append(prefix_lengths >= self.max_length)
        if self.eos_token_ids.numel():
            stops.append(torch.isin(tokens, self.eos_token_ids))
        done = emitted & functools.reduce(operator.or_, stops) if stops else torch.zeros_like(emitted)
        if len(self.others):
            for length in prefix_lengths[emitted].unique().tolist():
                rows, cols = ((prefix_lengths == length) & emitted).nonzero(as_tuple=True)
                done[rows, cols] |= self.others(state.sequences[rows, :length], scores[rows, cols]).to(done.device)
        first = torch.where(done, column, width).amin(dim=1)
        return StopDecision(num_emitted=torch.minimum(num_emitted, first + 1), stopped=done.any(dim=1))
