"""The engine's cache to and from transformers' own: what `generate` returns as `past_key_values`, and a filled
cache a user passes back in to continue (multi-turn chat).

Out: plain `generate` returns a `DynamicCache` holding, for every row, the keys and values of every position it fed
the model: the prompt (padding included) and all output tokens but the last; a row that stopped early kept feeding
padding. The engine's cache holds each row's slots in its own order, with holes, and stops computing rows that
finished; so rows whose cache is complete are gathered by order, and the others are computed again in one forward
over their final sequences, as plain `generate` saw them. Prompt padding is written as zeros: every later query
masks it.

In: a filled `DynamicCache` (from an earlier call) becomes the engine's first slots; sliding-window layers, which
keep only their window, are zero-filled in front (the window masks those slots anyway). An empty `StaticCache`
passed in sets the capacity of static shapes (`hf_specdec.compile`) and comes back filled.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hf_specdec.cache.naming import CACHE_KWARG
from hf_specdec.cache.recurrent import layer_states, load_states, recurrent_layer_indices
from hf_specdec.step.state import MODALITY_TYPE_INPUTS, PromptInputs

# one layer of a cache as the engine exchanges it with transformers: ([B, H, S, D] keys, [B, H, S, D] values) of an
# attention layer; {("conv" | "recurrent", state index): [B, ...]} of a recurrent layer's states; None for a layer
# that holds nothing (an MLP layer of a hybrid)
LayerEntry = tuple[torch.Tensor, torch.Tensor] | dict[tuple[str, int], torch.Tensor] | None


def layer_entries(cache: DynamicCache) -> list[LayerEntry]:
    """What every layer of a filled transformers cache holds."""
    return [layer_states(layer) if isinstance(layer, LinearAttentionCacheLayerMixin)
            else (layer.keys, layer.values) if getattr(layer, "keys", None) is not None else None
            for layer in cache.layers]


def entry_tensors(entry: LayerEntry) -> list[torch.Tensor]:
    """The tensors of a layer's entry, in a fixed order ([B, ...] each)."""
    if entry is None:
        return []
    return list(entry) if isinstance(entry, tuple) else [entry[key] for key in sorted(entry)]


def zeros_with_rows(
    entry: LayerEntry,
    batch: int,
) -> LayerEntry:
    """Zeros shaped as a layer's entry, with `batch` rows."""
    if entry is None:
        return None
    if isinstance(entry, tuple):
        return tuple(part.new_zeros(batch, *part.shape[1:]) for part in entry)
    return {key: state.new_zeros(batch, *state.shape[1:]) for key, state in entry.items()}


def _fill(
    cache,
    # per layer: its entry for every row
    layers: list[LayerEntry],
):
    """Put every layer's entry into a transformers cache (keys and values through its own `update`; a recurrent
    layer's states, copied, into its layer), and return it."""
    for index, entry in enumerate(layers):
        if isinstance(entry, dict):
            load_states(cache.layers[index], {key: state.clone() for key, state in entry.items()})
        elif entry is not None:
            cache.update(*entry, index)
    return cache


def full_layers(
    # per layer: its entry for every row
    layers: list[LayerEntry],
    config,
) -> DynamicCache:
    """A transformers `DynamicCache` laid out as `generate` makes it for this model (sliding layers keep their
    window), from every layer's full keys and values, and every recurrent layer's states."""
    return _fill(DynamicCache(config=config.get_text_config(decoder=True)), layers)


def fill_static_cache(
    cache: StaticCache,
    # per layer ([B, H, S, D] keys, [B, H, S, D] values), or None for a layer that holds nothing
    layers: list[LayerEntry],
) -> StaticCache:
    """An empty transformers `StaticCache` filled with every layer's keys and values, through its own `update` (its
    sliding-window layers keep their window), as plain `generate` leaves the StaticCache it was given."""
    return _fill(cache, layers)


def gather_by_order(
    # [B, H, S, D]
    states: torch.Tensor,
    # [B, S] long: the order (plain generate's cache index) of every slot
    orders: torch.Tensor,
    # [B, S] bool
    valid: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """[B, H, length, D]: each row's valid slots at orders < length put at their order; zeros elsewhere."""
    batch, heads, _, dim = states.shape
    target = torch.where(valid & (orders < length), orders, length).to(states.device)  # spare column for the rest
    out = states.new_zeros(batch, heads, length + 1, dim)
    out.scatter_(2, target[:, None, :, None].expand(-1, heads, -1, dim), states)
    return out[:, :, :length]


def recompute(
    model,
    # [R, T]: the rows' token ids fed after the prompt (the output tokens but the last)
    new_tokens: torch.Tensor,
    # [R, ...] prompt inputs of these rows
    prompt: PromptInputs,
    # [R, P] the prompt's token ids ([R, 0] for an embedded prompt)
    prompt_ids: torch.Tensor,
    # per layer ([R, H, C, D] keys, values) of the prompt's first C positions, and each recurrent layer's states
    # after them, from the filled cache the call continued (`filled_layers`), taken as they are; None: computed too
    cached: list[LayerEntry] | None = None,
) -> DynamicCache:
    """The cache `generate` fills over the rows' final sequences (per attention layer [R, H, P + T, D] keys and
    values; a recurrent layer's states after the last position): one forward over them (after the cached positions),
    as `generate` fed them; two for a prompt with images: the prompt with them, then the new tokens as text (a
    generated token can be an image placeholder, which the model would take for one more image)."""
    embeds = prompt.inputs_embeds
    prompt_length = embeds.shape[1] if embeds is not None else prompt_ids.shape[1]
    rows, new = new_tokens.shape
    device = new_tokens.device
    mask = prompt.attention_mask
    if mask is None:
        mask = torch.ones(rows, prompt_length, dtype=torch.long, device=device)
    positions = prompt.position_ids
    if positions is None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if recurrent_layer_indices(model):  # laid out by the config: a hybrid's recurrent layers hold states
        cache = full_layers(cached or [], model.config)
    else:  # every layer keeps all its keys (a sliding one's too: the output gathers them by order)
        cache = _fill(DynamicCache(), cached or [])
    start = 0 if cached is None else next(entry[0].shape[2] for entry in cached if isinstance(entry, tuple))
    inputs = {
        "attention_mask": torch.cat([mask, mask.new_ones(rows, new)], dim=1),
        # each axis of the positions ([R, P] or [A, R, P]) continues by one a token
        "position_ids": torch.cat([positions, positions[..., -1:] + 1 + torch.arange(new, device=device)], dim=-1),
        CACHE_KWARG: cache,
        "use_cache": True,
    }
    if prompt.token_type_ids is not None:
        types = prompt.token_type_ids
        inputs["token_type_ids"] = torch.cat([types, types[:, -1:].expand(-1, new)], dim=1)
    for name, value in prompt.multimodal.items():  # new tokens are text (modality 0)
        if name in MODALITY_TYPE_INPUTS:
            inputs[name] = torch.cat([value, value.new_zeros(rows, new)], dim=1)
    if embeds is not None:
        inputs["inputs_embeds"] = torch.cat([embeds, model.get_input_embeddings()(new_tokens)], dim=1)
    else:
        inputs["input_ids"] = torch.cat([prompt_ids, new_tokens], dim=1)
    if model._supports_logits_to_keep():
        inputs["logits_to_keep"] = 1
    # the positions fed, each split on its last dimension (the embeddings on their second)
    along = {name: inputs[name] for name in ("input_ids", "position_ids", "token_type_ids", *MODALITY_TYPE_INPUTS)
             if name in inputs}

    def fed(begin: int, end: int | None) -> dict:
        part = {name: value[..., begin:end] for name, value in along.items()}
        if embeds is not None:
            part["inputs_embeds"] = inputs["inputs_embeds"][:, begin:end]
        return part

    parts = [{**inputs, **fed(start, None)}]
    if prompt.images:  # the prompt with its images, then the new tokens as text, into the same cache
        # the prompt through the model's own preparation of a prompt's forward (Gemma-3 reads each token's type
        # from the start of the sequence, a continued prompt's too)
        whole = {name: value[..., :prompt_length] for name, value in along.items() if name != "input_ids"}
        if embeds is not None:
            whole["inputs_embeds"] = embeds
        ids = prompt_ids if embeds is None else prompt_ids[:, :0]
        parts = [model.prepare_inputs_for_generation(
            ids, next_sequence_length=prompt_length - start, attention_mask=mask, use_cache=True,
            is_first_iteration=True, **{CACHE_KWARG: cache}, **whole,
            **{name: prompt.multimodal[name] for name in prompt.images},
            **({"logits_to_keep": 1} if "logits_to_keep" in inputs else {}))]
        if new:
            parts.append({**inputs, **fed(prompt_length, None)})
    with torch.no_grad():
        for part in parts:
            model(**part)
    return cache


def filled_layers(
    cache: DynamicCache,
    length: int,
) -> list[LayerEntry]:
    """Per layer ([B, H, length, D] keys, values) of a filled transformers cache of `length` tokens; layers that
    kept fewer (sliding windows) are zero-filled in front; a recurrent layer's states as they are."""
    layers: list[LayerEntry] = []
    for entry in layer_entries(cache):
        if isinstance(entry, tuple):
            keys, values = entry
            missing = length - keys.shape[2]
            if missing > 0:
                keys = torch.cat([keys.new_zeros(*keys.shape[:2], missing, keys.shape[3]), keys], dim=2)
                values = torch.cat([values.new_zeros(*values.shape[:2], missing, values.shape[3]), values], dim=2)
            entry = (keys, values)
        layers.append(entry)
    return layers


def take_rows(
    entry: LayerEntry,
    # [R] long
    rows: torch.Tensor,
) -> LayerEntry:
    """A layer's entry for these rows."""
    if entry is None:
        return None
    if isinstance(entry, tuple):
        return tuple(part[rows.to(part.device)] for part in entry)
    return {key: state[rows.to(state.device)] for key, state in entry.items()}
