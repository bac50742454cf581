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

`EngineAttention(model, decode)` makes the model run, for the forwards inside the block, the attention function the
engine's forwards need:
* on a CPU, for decode forwards (every forward after the prompt's), a model whose attention is "sdpa" runs this
  packed function. A model on a GPU is left alone (and tensors off the CPU go on to transformers' "sdpa" function
  unchanged): the layout has not been measured on a GPU, whose fused kernels take grouped heads differently
  (`benchmarks/gpu.sh` measures it there, `packed_sdpa` against that function). The prompt's prefill stays on the
  model's own attention, as in plain `generate`.
* a model loaded with an attention that takes no custom 4-D mask (flash attention in any packaging: FlashAttention
  2, 3 or 4, a Hub kernel such as "kernels-community/flash-attn2"; flex attention, whose masks are block masks) runs
  "sdpa" for every forward, the prefill included (or "eager" for a model without SDPA support): per-row lengths
  and token trees need such masks. It is the same attention computed by another kernel, so a forward gives the
  same numbers to rounding; in low precision greedy output can then part from plain `generate`'s at near-ties
  (README, Low precision).
The swap is counted per config under a lock, so calls in several threads on one model restore the model's own
attention only when the last one leaves; meanwhile another thread's forwards on that model (a plain `generate`,
say) run the swapped function too, which computes the same attention.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface, PretrainedConfig
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
# id(config) -> forwards inside an `EngineAttention` that swapped it, and the attention it had before
_ACTIVE: dict[int, tuple[int, str]] = {}


def takes_no_custom_mask(implementation: str | None) -> bool:
    """Whether a model's `attn_implementation` cannot take the custom 4-D masks of per-row lengths and token trees
    (flash attention in any packaging, flex attention), so that the engine runs SDPA in its place."""
    return isinstance(implementation, str) and ("flash" in implementation or implementation == "flex_attention")


# where a config's `_attn_implementation` property keeps its value
INTERNAL = "_attn_implementation_internal"


class _Attention:
    """One config's attention implementation, read and written as its attention layers read it. For a config without
    sub-configs the property's setter only stores `_attn_implementation_internal` (after validation hooks costing
    some 10 us a call, paid twice per forward here); that entry of the instance's `__dict__` is then used directly."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.config = config
        state = object.__getattribute__(config, "__dict__")
        self.state = state if not config.sub_configs and INTERNAL in state else None

    def get(self) -> str | None:
        return self.config._attn_implementation if self.state is None else self.state[INTERNAL]

    def set(self, value: str) -> None:
        if self.state is None:
            self.config._attn_implementation = {"": value}  # this config only, not its sub-configs
        else:
            self.state[INTERNAL] = value


class EngineAttention:
    """A reusable context: within it, `model` runs the attention function the engine's forwards need (the module
    docstring): SDPA for a model whose attention takes no custom mask, and on a CPU the packed function for decode
    forwards (`decode=True`) of a model whose attention is "sdpa". What changes is the config each attention layer
    reads: the decoder's, and every config of its class on the model's modules (an early-exit draft's layers are
    the target's and read the target's config), not a composite model's other parts (a vision tower). They are
    looked up once, when this is made (a decode call's cache enters it for every forward); what each runs instead
    is decided on entry, from its attention then."""

    def __init__(self, model: torch.nn.Module, decode: bool, attentions: list[_Attention] | None = None) -> None:
        self.packed = decode and model.device.type == "cpu"
        self.sdpa = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
        if attentions is None:
            decoder = model.config.get_text_config(decoder=True)
            configs = {id(decoder): decoder}
            for module in model.modules():
                config = getattr(module, "config", None)
                if type(config) is type(decoder):  # a decoder's config, not a composite's other parts (vision)
                    configs.setdefault(id(config), config)
            attentions = [_Attention(config) for config in configs.values()]
        self.attentions = attentions
        self.entered: list[list[_Attention]] = []  # per entry not yet left (entries nest): what it counts

    @classmethod
    def for_prompt_and_decode(cls, model: torch.nn.Module) -> tuple[EngineAttention, EngineAttention]:
        """The contexts of a model's prompt forward and of its later forwards, from one look over its modules."""
        prompt = cls(model, decode=False)
        return prompt, cls(model, decode=True, attentions=prompt.attentions)

    def swap(self, own: str | None) -> str | None:
        """What to run instead of the attention `own`, or None to leave it."""
        swap = self.sdpa if takes_no_custom_mask(own) else None
        if self.packed and (own if swap is None else swap) == "sdpa":
            swap = PACKED_SDPA
        return swap

    def __enter__(self) -> None:
        counted = []
        with _LOCK:
            for attention in self.attentions:
                key = id(attention.config)
                active = _ACTIVE.get(key)
                if active is None:
                    own = attention.get()
                    swap = self.swap(own)
                    if swap is None:
                        continue
                    attention.set(swap)
                    active = (0, own)
                _ACTIVE[key] = (active[0] + 1, active[1])
                counted.append(attention)
        self.entered.append(counted)

    def __exit__(self, *exc) -> None:
        counted = self.entered.pop()
        if counted:
            with _LOCK:
                for attention in counted:
                    key = id(attention.config)
                    count, own = _ACTIVE[key]
                    if count == 1:
                        del _ACTIVE[key]
                        attention.set(own)
                    else:
                        _ACTIVE[key] = (count - 1, own)
