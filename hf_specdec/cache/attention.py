"""The attention function the engine's decode forwards run on a CPU: PyTorch's SDPA with grouped-query attention
packed into the query rows.

A model with grouped-query attention (H query heads sharing G = H / K key/value heads) reaches PyTorch's
`scaled_dot_product_attention` through transformers' "sdpa" function in one of three layouts: several queries under
a mask, the keys and values repeated to H heads (`repeat_kv`, a copy of the whole cache per layer and step); one
query without a mask, `enable_gqa=True`; one query under a mask, packed as here. On a CPU the first two are slow for
the few queries of a decode step: one layer of SmolLM2-135M (9 query heads, 3 key/value heads) over 768 cached
tokens took, in bfloat16, 0.59 ms for one query (`enable_gqa`) and 0.33 ms for six (`repeat_kv`) against 0.08 ms
and 0.19 ms packed, and in float32 0.32 ms for six against 0.19 ms (`python benchmarks/attention_layout.py`).
Packed, each key/value head attends once, for its G query heads' W queries at once: the query [B, H, W, D] is
viewed as [B, K, G * W, D] and the mask's rows repeated G times. It is the same attention, computed by the same
kernel on fewer, taller matrices; outputs agree with the "sdpa" function's to rounding.

`PackedAttention(model)` makes a model on a CPU whose attention is "sdpa" run it for the forwards inside the block.
A model on a GPU is left alone (and tensors off the CPU go on to transformers' "sdpa" function unchanged): the
layout has not been measured on a GPU, whose fused kernels take grouped heads differently (`benchmarks/gpu.sh`
measures it there, `packed_sdpa` against that function). The prompt's prefill stays on the model's own attention,
as in plain `generate`. The swap is counted per config under a lock, so calls in several threads on one model restore it only
when the last one leaves; meanwhile another thread's forwards on that model (a plain `generate`, say) run the packed
function too, which computes the same attention.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "hf_specdec_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    # [B, H, W, D]
    query: torch.Tensor,
    # [B, K, S, D]
    key: torch.Tensor,
    # [B, K, S, Dv]
    value: torch.Tensor,
    # [B or 1, 1, W, S' >= S] additive or bool, or None (every query sees every key slot)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([B, W, H, Dv], None) as its "sdpa" function does.
    Anything this layout does not cover (no grouping, per-head masks, a causal flag without a mask, position
    biases, soft-capping, a tensor off the CPU) goes to that function unchanged."""
    heads, width, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    groups = heads // kv_heads
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    implicit_causal = attention_mask is None and width > 1
    if (groups <= 1 or heads % kv_heads or query.device.type != "cpu" or per_head_mask or implicit_causal
            or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return packed_sdpa(query, key, value, attention_mask, dropout=dropout, scaling=scaling), None


def packed_sdpa(
    # [B, H, W, D]
    query: torch.Tensor,
    # [B, K, S, D]
    key: torch.Tensor,
    # [B, K, S, Dv]
    value: torch.Tensor,
    # [B or 1, 1, W, S' >= S] additive or bool, or None
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """The layout itself, on any device, for the tensors `packed_sdpa_attention` takes (H a multiple of K; the mask
    may be wider than the keys: its first S columns are read): [B, W, H, Dv], each key/value head attending once for
    its G query heads."""
    batch, heads, width, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * width, dim)  # head h = k * G + g: rows g * W + w of head k
    mask = attention_mask
    if mask is not None:
        mask = mask[..., :slots]
        if width > 1:  # one query's mask row broadcasts over its G packed rows as it is
            rows = mask.shape[0]
            mask = mask[:, :, None].expand(rows, 1, groups, width, slots).reshape(rows, 1, groups * width, slots)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(batch, heads, width, value.shape[-1]).transpose(1, 2).contiguous()


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)

_LOCK = threading.Lock()
_ACTIVE: dict[int, int] = {}  # id(config) -> forwards inside a `PackedAttention` that swapped it to PACKED_SDPA


class PackedAttention:
    """A reusable context: within it, `model` runs `packed_sdpa_attention` if it sat on a CPU when this was made and
    its decoder's attention is "sdpa" (the config its attention layers read; only that one changes, not a
    composite model's other parts). A model set to anything else, PACKED_SDPA included, is left as it is. The
    config and device are looked up once (a decode call's cache enters it for every forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config.get_text_config(decoder=True)
        self.on_cpu = model.device.type == "cpu"
        self.swapped: list[bool] = []  # per entry not yet left (entries nest)

    def __enter__(self) -> None:
        config, key = self.config, id(self.config)
        with _LOCK:
            swapped = key in _ACTIVE or (self.on_cpu and config._attn_implementation == "sdpa")
            if swapped:
                if key not in _ACTIVE:
                    config._attn_implementation = {"": PACKED_SDPA}
                _ACTIVE[key] = _ACTIVE.get(key, 0) + 1
        self.swapped.append(swapped)

    def __exit__(self, *exc) -> None:
        if self.swapped.pop():
            key = id(self.config)
            with _LOCK:
                _ACTIVE[key] -= 1
                if _ACTIVE[key] == 0:
                    del _ACTIVE[key]
                    self.config._attn_implementation = {"": "sdpa"}
