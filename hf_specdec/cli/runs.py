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


class ForwardTimer:
    """Counts a module's forward calls and the time spent inside them."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        self.handles = []
        if module is not None:
            self.sync = torch.cuda.synchronize if module.device.type == "cuda" else (lambda: None)
            self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self.sync()
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.sync()
        self.calls += 1
        self.seconds += time.perf_counter() - self._start

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


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
    forwards = ForwardTimer(target)
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
        forwards.close()
    pad = generate_kwargs.get("pad_token_id", target.generation_config.pad_token_id)
    return RunResult(
        name=name,
        sequences=out.sequences,
        seconds=seconds,
        new_tokens=count_new_tokens(out.sequences, input_ids.shape[1], pad),
        target_forward_passes=forwards.calls,
        acceptance_rate=None if stats is None else stats.acceptance_rate,
        mean_acceptance_length=None if stats is None else stats.mean_acceptance_length,
        accepted_per_position=None if stats is None else stats.accepted_per_position,
    )
