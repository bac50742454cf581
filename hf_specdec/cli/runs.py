"""One generate call, shared by the demo and the benchmark: same prompts, same settings, one record of its tokens,
its target forwards and its speculation statistics (timing is the caller's: `hf_specdec.cli.timing`).

Speculative calls ask for `return_dict_in_generate=True` (for `spec_stats`) with `use_cache=False`: hf_specdec
decodes with its own KV cache either way, and `use_cache=False` only skips building the transformers cache it would
return as `past_key_values`, which can cost a forward over the whole sequence that plain generate does not pay
(its cache is already there) and that the demo and the benchmark would throw away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.proposers.recycling import forget_recycled_tokens
from hf_specdec.stats import SpecStats

# generate options of every speculative call (see the module docstring)
SPECULATIVE_OUTPUTS = {"return_dict_in_generate": True, "use_cache": False}


@dataclass(frozen=True)
class Generation:
    # [B, P + new]
    sequences: torch.Tensor
    # new tokens of all rows, padding excluded
    new_tokens: int
    target_forward_passes: int
    target_forward_seconds: float
    # None for plain generate
    stats: SpecStats | None

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per row per target forward of the batch (the prefill counts as one, as in plain generate)."""
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


def forget_earlier_calls(config: SpeculativeConfig | None, target: torch.nn.Module) -> None:
    """Empty what a config drafts from across calls: the suffix cache it was given, and the target's recycled
    tokens for token recycling (a no-op for other configs). A measured pass then drafts only from the requests
    earlier in the same pass, never from an earlier pass's answers to the same prompts."""
    if config is None:
        return
    if config.suffix_cache is not None:
        config.suffix_cache.clear()
    if "recycling" in config.drafting_methods:
        forget_recycled_tokens(target)


def count_new_tokens(sequences: torch.Tensor, prompt_length: int, pad_token_id: int | None) -> int:
    new = sequences[:, prompt_length:]
    return int(new.numel() if pad_token_id is None else (new != pad_token_id).sum())


def run_generate(
    target: Any,
    # [B, P]
    input_ids: torch.Tensor,
    # [B, P]
    attention_mask: torch.Tensor,
    generate_kwargs: dict[str, Any],
    speculative: SpeculativeConfig | None = None,
) -> Generation:
    """Plain `generate` when speculative is None, else hf_specdec; greedy settings come from generate_kwargs."""
    forwards = ForwardTimer(target)
    try:
        if speculative is None:
            out = target.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True,
                                  **generate_kwargs)
        else:
            out = hf_specdec.generate(target, input_ids, attention_mask=attention_mask, speculative=speculative,
                                      **SPECULATIVE_OUTPUTS, **generate_kwargs)
    finally:
        forwards.close()
    pad = generate_kwargs.get("pad_token_id", target.generation_config.pad_token_id)
    return Generation(
        sequences=out.sequences,
        new_tokens=count_new_tokens(out.sequences, input_ids.shape[1], pad),
        target_forward_passes=forwards.calls,
        target_forward_seconds=forwards.seconds,
        stats=getattr(out, "spec_stats", None),
    )
