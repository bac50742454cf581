"""One timed generation run, shared by the demo and the benchmark: same prompts, same settings, one record."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig


@dataclass(frozen=True)
class RunResult:
    name: str
    # [B, P + new]
    sequences: torch.Tensor
    seconds: float
    new_tokens: int
    target_forward_passes: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    accepted_per_position: list[int] | None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per row per target forward (the prefill counts as one forward, as in plain generate)."""
        rows = self.sequences.shape[0]
        return self.new_tokens / rows / self.target_forward_passes


def count_new_tokens(sequences: torch.Tensor, prompt_length: int, pad_token_id: int | None) -> int:
    new = sequences[:, prompt_length:]
    return int(new.numel() if pad_token_id is None else (new != pad_token_id).sum())


def timed_generate(
    name: str,
    target: Any,
    # [B, P]
    input_ids: torch.Tensor,
    # [B, P]
    attention_mask: torch.Tensor,
    generate_kwargs: dict[str, Any],
    speculative: SpeculativeConfig | None = None,
) -> RunResult:
    """Plain `generate` when speculative is None, else hf_specdec; greedy settings come from generate_kwargs."""
    forwards = []
    handle = target.register_forward_hook(lambda *_: forwards.append(1))
    try:
        start = time.perf_counter()
        if speculative is None:
            out = target.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True, **generate_kwargs)
            stats = None
        else:
            out = hf_specdec.generate(
                target, input_ids, attention_mask=attention_mask, speculative=speculative,
                return_dict_in_generate=True, **generate_kwargs,
            )
            stats = out.spec_stats
        seconds = time.perf_counter() - start
    finally:
        handle.remove()
    pad = generate_kwargs.get("pad_token_id", target.generation_config.pad_token_id)
    return RunResult(
        name=name,
        sequences=out.sequences,
        seconds=seconds,
        new_tokens=count_new_tokens(out.sequences, input_ids.shape[1], pad),
        target_forward_passes=len(forwards),
        acceptance_rate=None if stats is None else stats.acceptance_rate,
        mean_acceptance_length=None if stats is None else stats.mean_acceptance_length,
        accepted_per_position=None if stats is None else stats.accepted_per_position,
    )
