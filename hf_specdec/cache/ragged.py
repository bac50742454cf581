"""A KV cache in which every batch row keeps its own number of tokens.

Batched speculative decoding accepts a different number of draft tokens in every row at every step.
transformers' assisted generation gives up here (batch size 1 only); this module is how we don't.

Design
------
* Slot = order. Row b's committed tokens sit in slots [0, lengths[b]), each at its *order*: its index in the cache
  plain `generate` would have built for that row, prompt padding included (`valid` marks the padding slots, which
  no query sees). There are no holes and nothing to compact.
* A step writes its tokens (the last committed token, drafts, a tree) into the *region*: slots shared by every
  row, right after the committed part, [width, width + R), where `width` is a host int at least every row's
  length. Several forwards may write into one region (a draft model drafting depth by depth). A new token sees
  the committed slots before it (causal and windowed, on orders) and the region slots its caller names (its
  ancestors; for a chain, every earlier real one). Rows with fewer tokens fill the rest with dummies, which nobody
  sees.
* `commit` ends the region: each row keeps some of its region slots (a chain's prefix, a tree's accepted path),
  moved right after its committed tokens: a chain's prefix, known on the host, by one copy per row that is not
  already there (a row whose length is the region's start is); a tree's path, known on the device, by one indexed
  read and write. The slots after a row's length are stale and masked.
* Host facts stay on the host: `width`, the region's extent and whether a forward needs a mask at all come from
  host ints and flags (the row lengths the engine learns in its one host read per step, or a bound on them), never
  from reading the device. Masks are built on the device from the per-row lengths, by
  `hf_specdec.kernels.tree_mask` (the Triton kernel on CUDA for verify steps).
* Sliding windows are applied on orders through the mask, so a window covers exactly the tokens it covers in plain
  `generate`; sliding-window layers keep their whole history. Position ids (`next_position`) only go to the
  model: they equal orders minus the left padding, but differ after right padding, whose trailing pads carry
  position 0.
* Rows that finished can be dropped (`select_rows`), so they stop costing compute; the engine maps the rows the
  cache holds to batch rows.
* While no row has padding, every row has the same length and a chain has no dummies (batch 1, say), and there is
  no sliding window, a forward needs only a plain causal mask, or none for one query per row.
* Capacity: the buffers grow by doubling (`hf_specdec.cache.storage`).
* Static shapes (`make_static`, for compiled forwards; see `hf_specdec.compile`): a fixed capacity allocated once,
  `width` fixed at the committed capacity, so the region always starts at the same slot; a forward writes through
  an index tensor and attends over the whole buffers under a mask that covers every slot (built into a buffer kept
  per shape), and the model call can be a compiled one. The shapes of a forward then depend only on its width, so
  each kind of forward is one compiled graph. Prompts (`prefill`, `prefill_chain`) stay eager, as in transformers.

* A hybrid model's recurrent layers (state-space, linear-attention, short-convolution) keep a state per row in
  place of slots (`hf_specdec.cache.recurrent`): a step's forward keeps the states before it, `commit` rolls each row
  back to its kept tokens; such a model verifies chains only, with dynamic shapes.

The prefill goes through the model's own mask preparation (a 2-D mask), as plain `generate` does, so the prompt
is encoded with the same kernels and gives the same numbers; a model whose attention takes no custom mask (flash or
flex attention) runs SDPA for every forward of the call, the prefill included (`hf_specdec.cache.attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_specdec.cache.attention import PACKED_SDPA, EngineAttention, takes_no_custom_mask
from hf_specdec.cache.exchange import LayerEntry, filled_layers
from hf_specdec.cache.features import FeatureTap
from hf_specdec.cache.naming import cache_keyword
from hf_specdec.cache.reach import DrafterReach
from hf_specdec.cache.recurrent import (
    CACHELESS_LAYER_TYPES,
    RECURRENT_LAYER_TYPES,
    RecurrentRollback,
    check_continues_from_state,
    find_mixers,
    recurrent_layer_indices,
)
from hf_specdec.cache.storage import MIN_CAPACITY, SlotCache
from hf_specdec.compile import CompiledForward, static_room
from hf_specdec.kernels.tree_mask import ancestry_attention_mask
from hf_specdec.step.state import MODALITY_TYPE_INPUTS, PromptInputs

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ATTENTION = ("sdpa", "eager", PACKED_SDPA)  # the last: inside another call's forward, or set so


@dataclass(frozen=True)
class AttentionLayout:
    """Which masks a model's layers want: full causal, sliding window, or one per layer type."""

    sliding_window: int | None
    # True when the model takes {layer_type: mask} (config.layer_types mixes full and sliding layers).
    per_layer_type: bool
    # False for a model with no attention layer (a state-space model alone, or an early-exit view of its recurrent
    # first layers): it takes no mask (Mamba's mixers would apply one to their inputs)
    attends: bool = True

    @classmethod
    def from_model(cls, model) -> AttentionLayout:
        config = model.config.get_text_config(decoder=True)
        _check_running_states(model, config)
        _check_positions_come_from_the_mask(model, config)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in SUPPORTED_ATTENTION and not takes_no_custom_mask(attn):
            raise ValueError(
                f"attn_implementation={attn!r} cannot take the custom 4-D attention masks speculative decoding "
                "needs, and hf_specdec knows no stand-in for it (flash and flex attention run as SDPA); load the "
                "model with attn_implementation='sdpa' (or 'eager')"
            )
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION, *RECURRENT_LAYER_TYPES,
                                          *CACHELESS_LAYER_TYPES}
            if unknown:
                raise ValueError(
                    f"{type(model).__name__}: layer types {sorted(unknown)} are not supported by hf_specdec, which "
                    f"supports layers that attend over a KV cache ({FULL_ATTENTION!r}, {SLIDING_ATTENTION!r}) and "
                    f"recurrent layers it can roll back ({', '.join(map(repr, RECURRENT_LAYER_TYPES))}); use plain "
                    "generate for this model"
                )
            attends = bool({FULL_ATTENTION, SLIDING_ATTENTION} & set(layer_types[: config.num_hidden_layers]))
            if SLIDING_ATTENTION in layer_types:
                if window is None:
                    raise ValueError(f"{type(model).__name__}: sliding-attention layers but config.sliding_window is None")
                return cls(sliding_window=int(window), per_layer_type=True, attends=attends)
            return cls(sliding_window=None, per_layer_type=False, attends=attends)
        return cls(sliding_window=None if window is None else int(window), per_layer_type=False)


def _check_running_states(model, config) -> None:
    """Refuse models with a running state the engine cannot roll back: layers whose state it does not know (an RNN
    such as RWKV, which takes no cache; layers holding a state and keys and values at once, Falcon-H1's; a stateful
    model without layer types to tell its recurrent layers), layers whose mixer it cannot find, or that restart from
    a zero state in a forward of several tokens (`hf_specdec.cache.recurrent`)."""
    layer_types = getattr(config, "layer_types", None)
    known = {FULL_ATTENTION, SLIDING_ATTENTION, *RECURRENT_LAYER_TYPES, *CACHELESS_LAYER_TYPES}
    if getattr(model, "_is_stateful", False) and (not layer_types or not set(layer_types) <= known):
        kinds = sorted(set(layer_types or ()) - known)
        raise ValueError(
            f"{type(model).__name__}: its layers keep a running state that every token updates in place"
            + (f" (layer types {kinds})" if kinds else "")
            + ", of a kind hf_specdec cannot roll back to the last accepted token when a draft is rejected; it rolls "
            f"back layers of types {list(RECURRENT_LAYER_TYPES)} beside attention layers (Qwen3-Next, Qwen3.5, "
            "Nemotron-H, Bamba, Granite-4.0-H, LFM2, Mamba-2, ...); use plain generate for this model"
        )
    recurrent = recurrent_layer_indices(model)
    if recurrent:
        find_mixers(model, recurrent)  # each recurrent layer's mixer, found or refused
        check_continues_from_state(model)


def _check_positions_come_from_the_mask(model, config) -> None:
    """Refuse models that place tokens by cache slot or by a 2-D mask inside their own code: slots here have holes
    and rows roll back on their own, so such a model would see the wrong distances (wrong output, or a crash)."""
    name = type(model).__name__
    if config.model_type == "bloom" or getattr(config, "alibi", False):
        raise ValueError(
            f"{name}: its ALiBi biases are built inside the model from a 2-D attention mask, which cannot describe "
            "per-row speculation (rows accept different numbers of tokens); hf_specdec does not support ALiBi models "
            "that do this; use plain generate for this model"
        )
    if config.model_type == "mpt":
        raise ValueError(
            f"{name}: its ALiBi biases are indexed by cache slot inside the model, and slots here stop matching token "
            "distances once batch rows accept different numbers of tokens; use plain generate for this model"
        )
    if "local" in (getattr(config, "attention_layers", None) or ()):
        raise ValueError(
            f"{name}: its local-attention layers apply their window by cache slot inside the model, and slots here "
            "stop matching token distances once batch rows accept different numbers of tokens; hf_specdec supports "
            "this model only without local layers (config.attention_types all 'global'); use plain generate"
        )


@dataclass(frozen=True)
class StaticLayout:
    """Fixed capacity: slots for committed tokens, then slots for one step's region."""

    committed: int
    region: int


@dataclass(frozen=True)
class ModelOutputs:
    """The model's per-layer outputs of one forward, and the order of every slot it attended over."""

    # per layer [B, W, H], or None
    hidden_states: tuple | None
    # per layer [B, heads, W, S], or None (empty for attention kernels that return none)
    attentions: tuple | None
    # [B, S]: the order of every key slot
    orders: torch.Tensor


class RaggedKVCache:
    """KV cache with per-row lengths and a shared region for each step's tokens; see the module docstring."""

    def __init__(self, model) -> None:
        self.model = model
        self.model_call = model  # what runs a forward (a compiled forward under static shapes)
        # entered for the prompt's forward, and for every later one
        self.prefill_attention, self.decode_attention = EngineAttention.for_prompt_and_decode(model)
        self.cache_keyword = cache_keyword(model)
        self.layout = AttentionLayout.from_model(model)
        self.num_layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        recurrent = recurrent_layer_indices(model)
        self.kv = SlotCache(MIN_CAPACITY, num_layers=self.num_layers, recurrent=recurrent)
        # a hybrid model's layers with a running state, rolled back to each row's kept tokens at every commit
        self.rollback = RecurrentRollback(model, {index: self.kv.layers[index] for index in recurrent}) \
            if recurrent else None
        self.static: StaticLayout | None = None
        self._mask_buffers: dict[tuple, torch.Tensor] = {}  # static shapes: one mask buffer per (width, window)
        self._tail_masks: dict[tuple, torch.Tensor] = {}  # dense chains: [W, S] per (width, dtype, device)
        # device state
        self.valid: torch.Tensor | None = None  # [B, capacity] bool: False at prompt padding
        self.lengths: torch.Tensor | None = None  # [B] long: committed slots of each row (= its next order)
        # [B] long: position id of each row's next token; [A, B] for a model whose positions have A axes (multimodal
        # rotary positions, M-RoPE: Qwen2-VL's text axis and three rotary ones), each advancing by one a token
        self.next_position: torch.Tensor | None = None
        self.region_orders: torch.Tensor | None = None  # [B, R] long: order of each region slot
        self.region_real: torch.Tensor | None = None  # [B, R] bool: region slots that hold a real token
        # host state
        self.width = 0  # committed slots: at least every row's length
        self.region = 0  # region slots written since the last commit
        self.host_lengths: list[int] | None = None  # every row's length, when the host knows it exactly
        self.padded = False  # the prompt had padding (known once, at the prefill)
        self.dense_region = True  # every region slot so far is real and each sees all the earlier ones
        # entries of the model's `hidden_states` each forward keeps for its new tokens, concatenated (-1: the final
        # one, after the last norm; i < num_layers: the residual stream entering layer i); None keeps nothing
        self.feature_layers: tuple[int, ...] | None = None
        # when True (and feature_layers is set), the prefill keeps the features of every prompt position
        self.record_prompt_features = False
        self.hidden_states: torch.Tensor | None = None  # [B, W, F] of the last forward, when recorded
        self._tap: FeatureTap | None = None  # records them on eager forwards (built for `feature_layers`)
        # per-row model inputs every new token repeats ({name: [B]}, e.g. the row's last token_type_ids)
        self.row_inputs: dict[str, torch.Tensor] = {}
        # the model's own per-layer outputs of the last forward, kept when these are set
        self.output_hidden_states = False
        self.output_attentions = False
        self.model_outputs: ModelOutputs | None = None
        # slots a row can need in the call at most (its length limit plus one step's region), when known: the first
        # allocation is no larger (a short generation after a long prompt does not pay for twice the prompt)
        self.expected_slots: int | None = None
        # a drafter's cache: the position ids and token ids its model can read (`DrafterReach`), to which every
        # forward's are cut: drafting nodes deeper than their row's budget (in blocks of fixed width, whose drafts
        # are dropped), a context longer than its table of learned positions, ids it does not embed
        self.reach = DrafterReach()

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def make_static(self, committed: int, region: int, model_call=None) -> None:
        """Static shapes from the next prefill on (see the module docstring): room for `committed` committed
        tokens per row and `region` slots of a step, allocated once; `model_call` runs the forwards after the
        prompt (a compiled forward; default the model). The room for committed tokens is rounded up to its
        bucket (`static_room`), so calls of similar lengths share compiled graphs."""
        if self.rollback is not None:
            raise ValueError(f"{type(self.model).__name__}: static shapes (compiled forwards) are not supported for "
                             "a model with recurrent layers; drop the compile config or the static cache")
        self.static = StaticLayout(static_room(committed), region)
        self.kv = SlotCache(self.static.committed + region, static=True, num_layers=self.num_layers)
        self.model_call = self.model if model_call is None else model_call

    def release(self) -> None:
        """The call is over: the key/value buffers go (on a CPU, their memory to the next call: `SlotCache.release`);
        nothing may read this cache afterwards."""
        self.kv.release()

    def prefill(
        self,
        # [B, P]
        input_ids: torch.Tensor,
        # [B, P] (1 = real token, 0 = padding, left or right); None when nothing is padded
        attention_mask: torch.Tensor | None,
        logits_to_keep: int = 1,
        # [B, P] or [A, B, P] or None: the position ids `generate` prepared (None: from the mask, as `generate`
        # computes them)
        position_ids: torch.Tensor | None = None,
        # [B, P] or None: segment ids; every later token of a row gets the row's last one (as `generate` does)
        token_type_ids: torch.Tensor | None = None,
        # [B, P, H] or None: the prompt as embeddings; `input_ids` is then [B, 0]
        inputs_embeds: torch.Tensor | None = None,
        # a filled transformers cache holding the first C < P prompt tokens (from an earlier call), or None
        past_key_values=None,
        # multimodal inputs for the prompt's forward (pixel values, ...), as plain `generate` feeds them, and each
        # prompt token's modality ({name in MODALITY_TYPE_INPUTS: [B, P]}; every later token is text, 0); or None
        multimodal: dict | None = None,
    ) -> torch.Tensor | None:
        """Encode the prompt through the model's own input preparation; returns logits [B, logits_to_keep, V]
        (None for an empty prompt, which just starts an empty cache)."""
        batch, length = input_ids.shape
        if inputs_embeds is not None:
            length = inputs_embeds.shape[1]
        if token_type_ids is not None:
            self.row_inputs["token_type_ids"] = token_type_ids[:, -1]
        multimodal = multimodal or {}
        for name in MODALITY_TYPE_INPUTS:
            if name in multimodal:
                self.row_inputs[name] = multimodal[name].new_zeros(batch)
        prompt = self._start_prompt(batch, length, input_ids.device, attention_mask, position_ids)
        if prompt is None:
            self._settle_width()
            return None
        attention_mask, position_ids = prompt
        position_ids = self.reach.positions(position_ids)
        inputs = PromptInputs(attention_mask, position_ids, token_type_ids, inputs_embeds, multimodal=multimodal)
        if past_key_values is not None:
            return self._prefill_after(past_key_values, input_ids, inputs, logits_to_keep)
        return self._encode(input_ids, inputs, logits_to_keep)

    def _encode(
        self,
        # [B, P] ([B, 0] for a prompt given as embeddings)
        input_ids: torch.Tensor,
        # the prompt's mask [B, P] and positions [B, P] or [A, B, P] (as `_start_prompt` completed them), segment
        # ids, embeddings and multimodal inputs
        prompt: PromptInputs,
        logits_to_keep: int,
        # the prompt's first positions already in the cache (continuing a filled one)
        cached: int = 0,
    ) -> torch.Tensor:
        """The prompt's positions after the first `cached` through the model's own input preparation and masks, as
        plain `generate` encodes a prompt; returns logits [B, logits_to_keep, V]."""
        length = prompt.attention_mask.shape[1]
        model_kwargs = {
            # a model continuing its cache reads the cache's length from the mask
            "attention_mask": prompt.attention_mask if self.padded or cached else None,
            "position_ids": prompt.position_ids,
            self.cache_keyword: self.kv,
            "use_cache": True,
            "is_first_iteration": True,
            **prompt.multimodal,
        }
        if prompt.token_type_ids is not None:
            model_kwargs["token_type_ids"] = prompt.token_type_ids
        if prompt.inputs_embeds is not None:
            model_kwargs["inputs_embeds"] = prompt.inputs_embeds
        if cached:
            model_kwargs["next_sequence_length"] = length - cached
        if self.model._supports_logits_to_keep():
            model_kwargs["logits_to_keep"] = logits_to_keep
        keep = length - cached if self.record_prompt_features else logits_to_keep
        self.kv.write_start, self.kv.write_index = cached, None  # new keys and values go after the cached ones
        with self.prefill_attention:  # before the input preparation, which may build masks for the attention
            inputs = self.model.prepare_inputs_for_generation(input_ids, **model_kwargs)
            logits = self._call_model(inputs, keep_hidden=keep, orders=self._slot_orders(length),
                                      call=self.model)
        self._settle_width()
        return logits[:, -logits_to_keep:]  # models without `logits_to_keep` return every position's

    def prefill_shared(
        self,
        source: RaggedKVCache,
        length: int,
        # [B, length] (1 = real token, 0 = padding) or None when nothing is padded
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Start from the first `length` prompt slots of `source` (a cache whose prefill wrote the prompt at slot =
        order), copied for this cache's layers from `source`'s first ones: a model made of another's embeddings
        and first layers (an early-exit draft) computes those very keys and values over the prompt, so its prefill
        computes nothing."""
        if self._start_prompt(source.batch_size, length, source.lengths.device, attention_mask, None) is not None:
            # (a hybrid's recurrent layers: their states after the prompt)
            self._write_layers(source.kv.entries(length)[: self.num_layers])
        self._settle_width()

    def prefill_from(
        self,
        # per layer ([B, H, L, D] keys, values): an earlier cache's `layers_by_order(L)` for this cache's model
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        # [B] long: that cache's lengths (rows whose slots end before L hold zeros after them)
        lengths: torch.Tensor,
        # the same on the host
        lengths_on_host: Sequence[int],
        # [B] long: that cache's next position ids
        next_position: torch.Tensor,
        # [B, L] bool: that cache's slots holding a real token
        valid: torch.Tensor,
    ) -> None:
        """Start from an earlier call's keys and values of this cache's model (a drafter's context carried with the
        target's cache, `hf_specdec.cache.carried`): copied, so the source stays as it was; nothing is computed."""
        width = layers[0][0].shape[2]
        if self._start_prompt(lengths.shape[0], width, lengths.device, valid, None) is not None:
            self._write_layers(layers)
        self.lengths, self.next_position = lengths.clone(), next_position.clone()
        self.host_lengths, self.width = list(lengths_on_host), max(lengths_on_host, default=0)
        self._settle_width()

    def _write_layers(
        self,
        # per layer ([B, H, L, D] keys, values), a recurrent layer's states, or None
        layers: list[LayerEntry],
    ) -> None:
        """Copy keys and values computed elsewhere into the first L slots of every row (and recurrent layers'
        states into those layers)."""
        self.kv.write_start, self.kv.write_index = 0, None
        for index, entry in enumerate(layers):
            if isinstance(entry, dict):
                self.kv.layers[index].load(entry)
            elif entry is not None:
                self.kv.update(*entry, index)

    def _start_prompt(
        self,
        batch: int,
        length: int,
        device: torch.device,
        # [B, P] or None (nothing padded)
        attention_mask: torch.Tensor | None,
        # [B, P] or None (from the mask, as `generate` computes them)
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Room for a prompt of `length` tokens per row and its per-row state (lengths, valid slots, padding, next
        positions); returns its ([B, P] mask, [B, P] position ids), or None for an empty prompt."""
        self._reserve(batch, length, device)
        self.lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        self.host_lengths, self.width = [length] * batch, length
        if self.static is not None and length > self.static.committed:
            raise ValueError(f"the prompt ({length} tokens) does not fit the static cache's {self.static.committed} "
                             "committed slots")
        if length == 0:
            self.next_position = self.lengths.new_zeros(batch)
            return None
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long, device=device)
        self.valid[:, :length] = attention_mask.bool()
        self.padded = bool((attention_mask == 0).any())  # once per call: the prompt's padding is a host fact
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        self.next_position = position_ids[..., -1] + 1  # as `generate` continues positions, right padding or not
        return attention_mask, position_ids

    def _prefill_after(
        self,
        past_key_values,
        # [B, P]
        input_ids: torch.Tensor,
        # as `_encode` takes it
        prompt: PromptInputs,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """Start from a filled transformers cache of the first C prompt tokens and encode the other P - C as one
        chain, kept whole; with new images, through the model's own input preparation and masks, as plain
        `generate` encodes them (its image tokens may see each other both ways, as Gemma-3's do)."""
        cached = past_key_values.get_seq_length()
        batch, length = prompt.attention_mask.shape
        self._write_layers(filled_layers(past_key_values, cached))
        if prompt.images:
            return self._encode(input_ids, prompt, logits_to_keep, cached)
        self.lengths = self.lengths.new_full((batch,), cached)
        self.host_lengths, self.width = [cached] * batch, cached
        rest = {"position_ids": prompt.position_ids[..., cached:]}
        rest.update({name: value[:, cached:] for name, value in prompt.multimodal.items()})
        if prompt.token_type_ids is not None:
            rest["token_type_ids"] = prompt.token_type_ids[:, cached:]
        if prompt.inputs_embeds is not None:
            rest["inputs_embeds"] = prompt.inputs_embeds[:, cached:]
        logits = self.prefill_chain(None if prompt.inputs_embeds is not None else input_ids[:, cached:],
                                    prompt.attention_mask[:, cached:].bool(), [length - cached] * batch,
                                    keep_all=True, **rest)
        self.next_position = prompt.position_ids[..., -1] + 1
        return logits[:, -logits_to_keep:]

    def prefill_chain(
        self,
        # [B, W] (None when `model_inputs` give `inputs_embeds`)
        input_ids: torch.Tensor | None,
        # [B, W] bool: each row's real tokens
        real: torch.Tensor,
        # per row, the tokens it keeps: its real ones (a prefix of its W), or all W with `keep_all`
        kept_on_host: list[int],
        keep_all: bool = False,
        **model_inputs,
    ) -> torch.Tensor:
        """Feed W tokens per row right after the committed ones as one chain and commit them: a prompt the model's
        own input preparation does not take (a draft head's, or the rest of a prompt after a filled cache). It runs
        eagerly and at the committed slots, also under static shapes. Returns logits [B, W, V]."""
        static, self.static = self.static, None
        self.width = max(self.host_lengths)  # every row's length: the chain goes right after it
        try:
            logits = self.forward(input_ids, torch.arange(real.shape[1], device=real.device).expand_as(real), real,
                                  **model_inputs)
            kept = torch.full_like(self.lengths, real.shape[1]) if keep_all else real.sum(dim=1).to(self.lengths.device)
            self.commit(kept, kept_on_host=kept_on_host)
        finally:
            self.static = static
        self._settle_width()
        return logits

    def forward(
        self,
        # [B, W] (None when the model inputs give `inputs_embeds`)
        input_ids: torch.Tensor | None,
        # [B, W] long: each new token's distance from its row's next order (its order is lengths + depth, its
        # position id next_position + depth)
        depths: torch.Tensor,
        # [B, W] bool or None (all real): dummies are seen by nobody and are never kept
        real: torch.Tensor | None = None,
        # [B, W, R] bool, R = region slots after this forward: the region slots each new token sees (its ancestors
        # and itself); None: a chain, each new token seeing every real region slot up to its own
        visible: torch.Tensor | None = None,
        **model_inputs,
    ) -> torch.Tensor:
        """Run the model on W new tokens per row, written to the next W region slots; returns logits [B, W, V].
        `model_inputs` go to the model as they are (a draft head's features)."""
        batch, width = depths.shape
        start = self.region
        end = start + width
        if self.rollback is not None and visible is not None:
            raise ValueError("a token tree cannot be verified by a model with recurrent layers (each branch would "
                             "need a state of its own); draft chains")
        orders = self.lengths[:, None] + depths
        real_or_all = torch.ones_like(depths, dtype=torch.bool) if real is None else real
        if self.static is not None:
            if end > self.static.region:
                raise RuntimeError(f"a step wrote {end} region slots; the static cache holds {self.static.region}")
            if start == 0 and (self.region_orders is None or self.region_orders.shape != (batch, self.static.region)):
                self.region_orders = orders.new_zeros(batch, self.static.region)
                self.region_real = torch.zeros(batch, self.static.region, dtype=torch.bool, device=orders.device)
            self.region_orders[:, start:end] = orders
            self.region_real[:, start:end] = real_or_all
            self.kv.write_index = self._write_index(start, width, depths.device)
        else:
            self._reserve(batch, self.width + end, depths.device)
            if start == 0:
                self.region_orders, self.region_real = orders, real_or_all
            else:
                self.region_orders = torch.cat([self.region_orders, orders], dim=1)
                self.region_real = torch.cat([self.region_real, real_or_all], dim=1)
            self.kv.write_start, self.kv.write_index = self.width + start, None
        self.region = end
        self.dense_region &= real is None and visible is None
        if self.layout.attends:
            mask = self._dense_mask(batch, width, depths.device) if self._dense() else self._mask(orders, visible, start)
        else:  # a state-space model alone: no layer attends (and its mixers would apply a mask to their inputs)
            mask = None
        positions = self.next_position[..., None] + depths  # [B, W], or [A, B, W]
        if real is not None:
            # a dummy (a node past its row's draft, in a block as wide as the widest row's) takes its row's position
            # before this step's first token: never past what plain generate feeds, where a model's table of learned
            # positions ends (GPT-2, OPT), and seen by nobody
            positions = torch.where(real, positions, (self.next_position[..., None] - 1).clamp(min=0))
        positions = self.reach.positions(positions)
        inputs = dict(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            **{self.cache_keyword: self.kv},
            use_cache=True,
            **{name: value[:, None].expand(-1, width) for name, value in self.row_inputs.items()},
        )
        inputs.update(model_inputs)  # an explicit `position_ids` (a prompt's) replaces the computed ones
        if input_ids is None:
            del inputs["input_ids"]
        region_orders = self.region_orders[:, : self.region if self.static is None else None]
        call = self.model if self.static is None else self.model_call
        if self.rollback is not None:
            self.rollback.begin(width, real)
        try:
            with self.decode_attention:
                return self._call_model(inputs, keep_hidden=width, call=call,
                                        orders=lambda: torch.cat([self._slot_orders(self.width), region_orders], 1))
        finally:
            if self.rollback is not None:
                self.rollback.end()

    def commit(
        self,
        # [B] long: region slots each row keeps (they become its next committed tokens)
        num_kept: torch.Tensor,
        # [B, M] long or None: the region slot each kept token comes from, in order (a tree's accepted path);
        # None: the first num_kept region slots (a chain's prefix)
        sources: torch.Tensor | None = None,
        # num_kept on the host (needed unless shapes are static, whose widths need no lengths)
        kept_on_host: Sequence[int] | None = None,
    ) -> None:
        """End the region: each row keeps `num_kept` of its region slots, moved right after its committed tokens
        (a chain's prefix on the host: one copy per row not already there; else one indexed read and write)."""
        if self.rollback is not None:
            if kept_on_host is None:
                raise ValueError("a model with recurrent layers keeps tokens told on the host")
            self.rollback.commit(kept_on_host, sources)
        host_spans = (self.static is None and sources is None and self.host_lengths is not None
                      and kept_on_host is not None)
        if host_spans:  # a chain's prefix, all on the host: rows already in place copy nothing
            self.kv.move_spans([(row, self.width, length, kept)
                                for row, (length, kept) in enumerate(zip(self.host_lengths, kept_on_host))
                                if kept and length != self.width])
        elif self.region:
            # a row keeps at most the region's slots: a path's entries past them (a path as long as the draft's
            # depth, over a tree of fewer nodes) are padding, whose writes could fall past the reserved room
            count = self.region if sources is None else min(sources.shape[1], self.region)
            steps = torch.arange(count, device=num_kept.device)[None, :]
            read = self.width + (steps if sources is None else sources[:, :count])
            self.kv.move(read.expand(self.batch_size, -1), self.lengths[:, None] + steps)
        self.lengths = self.lengths + num_kept
        self.next_position = self.next_position + num_kept
        if kept_on_host is not None and self.host_lengths is not None:
            self.host_lengths = [n + k for n, k in zip(self.host_lengths, kept_on_host)]
            self.width = max(self.host_lengths, default=0)
        else:
            if self.static is None:
                raise ValueError("RaggedKVCache.commit: kept_on_host is needed unless shapes are static")
            self.host_lengths = None
        self.region, self.dense_region = 0, True
        self._settle_width()

    def select_rows(
        self,
        # [B'] long: indices of the rows to keep, in order
        rows: torch.Tensor,
        # the same indices on the host
        rows_on_host: Sequence[int],
    ) -> None:
        """Keep only these rows (the others, finished, stop costing compute): one copy of the cache."""
        if self.rollback is not None:
            self.rollback.select_rows(rows)
        self.kv.select_rows(rows)
        rows = rows.to(self.valid.device)
        self.valid, self.lengths = self.valid[rows], self.lengths[rows]
        self.next_position = self.next_position[..., rows]
        self.row_inputs = {name: value[rows.to(value.device)] for name, value in self.row_inputs.items()}
        if self.host_lengths is not None:
            self.host_lengths = [self.host_lengths[i] for i in rows_on_host]
            self.width = max(self.host_lengths, default=0)

    def layers_by_order(self, length: int) -> list[LayerEntry]:
        """Per layer ([B_held, H, length, D] keys, values): every row's slots at orders < length (zeros at
        padding and after the row's length); a recurrent layer's states after every row's kept tokens; None for a
        layer that holds nothing (an MLP layer of a hybrid)."""
        keep = (self.valid[:, :length] & (self._slot_orders(length) < self.lengths[:, None]))[:, None, :, None]
        if self.rollback is not None:
            self.rollback.settle()
        return self.kv.entries(length, keep)

    def _settle_width(self) -> None:
        """Under static shapes the region always starts after the committed capacity."""
        if self.static is not None:
            self.width = self.static.committed

    def _write_index(self, start: int, width: int, device: torch.device) -> torch.Tensor:
        """[W]: the slots a static forward writes (after the committed capacity)."""
        return torch.arange(width, device=device) + (self.static.committed + start)

    def _reserve(self, batch: int, slots: int, device: torch.device) -> None:
        """Room for `slots` slots per row (buffers doubled when full; allocated once under static shapes)."""
        capacity = self.kv.capacity
        if self.valid is None:
            if not self.kv.static:
                capacity = max(2 * slots, MIN_CAPACITY)
                if self.expected_slots is not None:
                    capacity = max(slots, min(capacity, self.expected_slots))
                self.kv.plan(capacity)
            self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        elif slots > capacity:
            if self.kv.static:
                raise RuntimeError(f"{slots} slots do not fit the static cache's {capacity}")
            capacity = 2 * slots
            grown = torch.ones(self.valid.shape[0], capacity, dtype=torch.bool, device=self.valid.device)
            grown[:, : self.valid.shape[1]] = self.valid
            self.valid = grown
        self.kv.grow(capacity)

    def _slot_orders(self, count: int) -> torch.Tensor:
        """[B, count]: the order of committed slot s is s."""
        return torch.arange(count, device=self.lengths.device).expand(self.batch_size, -1)

    def _dense(self) -> bool:
        """A plain causal mask (or none) is exact: no padding, rows of one length, a chain without dummies, no
        window (all host facts)."""
        return (self.static is None and self.dense_region and not self.padded and self.layout.sliding_window is None
                and self.host_lengths is not None and all(n == self.width for n in self.host_lengths))

    def _dense_mask(self, batch: int, width: int, device: torch.device) -> torch.Tensor | None:
        """Each of the W chained queries sees every slot up to its own: a causal mask over the last W slots, or none
        for one query per row."""
        if width == 1:
            return None
        slots, key = self.width + self.region, (width, self.model.dtype, device)
        tail = self._tail_masks.get(key)
        if tail is None or tail.shape[1] < slots:  # grown by doubling: a call's masks are views of one buffer
            capacity = max(slots, 0 if tail is None else 2 * tail.shape[1])
            tail = self._tail_masks[key] = _causal_tail_mask(capacity, width, self.model.dtype, device)
        return tail[:, tail.shape[1] - slots :].expand(batch, 1, width, slots)

    def _mask(
        self,
        # [B, W] long: the queries' orders
        query_orders: torch.Tensor,
        # [B, W, R] bool or None (a chain)
        visible: torch.Tensor | None,
        # region slot of the first query
        start: int,
    ):
        """Additive mask(s) [B, 1, W, width + R]: committed slots before the row's length (valid, windowed), the
        region slots `visible` names (real ones), always the query's own slot; sliding windows on orders."""
        width = query_orders.shape[1]
        window = self.layout.sliding_window
        committed = self.valid[:, : self.width] & (self._slot_orders(self.width) < self.lengths[:, None])
        if width == 1 and start == 0 and visible is None and window is None and self.static is None:
            # one query per row in a new region (a step without drafts): the row's committed slots and itself
            mask = torch.zeros(committed.shape[0], 1, 1, self.width + 1, dtype=self.model.dtype,
                               device=committed.device)
            mask[:, 0, 0, : self.width].masked_fill_(~committed, torch.finfo(mask.dtype).min)
            return mask
        if visible is None:  # a chain: every earlier region slot and itself
            slots = torch.arange(self.region, device=query_orders.device)
            visible = (slots[None, :] <= start + torch.arange(width, device=slots.device)[:, None])[None]
        region = self.region_real.shape[1]  # the region so far, or its whole capacity under static shapes
        if visible.shape[2] < region:
            visible = torch.nn.functional.pad(visible, (0, region - visible.shape[2]))
        visible = visible & self.region_real[:, None, :]

        def mask(window: int | None) -> torch.Tensor:
            built = ancestry_attention_mask(committed, self._slot_orders(self.width), query_orders, visible, window,
                                            self.model.dtype, self.region_orders, start)
            if self.static is None:
                return built
            buffer = self._mask_buffers.get((width, window))
            if buffer is None or buffer.shape != built.shape:  # kept per shape: a fixed address for CUDA graphs
                buffer = self._mask_buffers[(width, window)] = torch.empty_like(built)
            return buffer.copy_(built)

        if window is None:
            return mask(None)
        if self.layout.per_layer_type:  # recurrent layers (of a hybrid model) take no mask after the prompt
            return {FULL_ATTENTION: mask(None), SLIDING_ATTENTION: mask(window),
                    **dict.fromkeys(RECURRENT_LAYER_TYPES)}
        return mask(window)

    def _call_model(self, inputs: dict, keep_hidden: int, orders, call) -> torch.Tensor:
        """The model's logits (run by `call`); also its features (`feature_layers`) of the last `keep_hidden`
        tokens, and its per-layer hidden states and attentions when `output_hidden_states` / `output_attentions` are
        set (with `orders`, [B, S] or a function giving it: the order of every key slot)."""
        if self.reach.embedded_ids is not None and inputs.get("input_ids") is not None:
            inputs = {**inputs, "input_ids": self.reach.ids(inputs["input_ids"])}
        record = self.feature_layers is not None
        # the features through hooks that keep only their layers' states, when every forward runs eagerly and need
        # not return every layer's anyway (compiled forwards ask for `output_hidden_states`, whose capturing hooks
        # transformers installs at the first such call: the eager prefill's)
        tap = None
        if record and call is self.model and self.model_call is self.model and not self.output_hidden_states:
            if self._tap is None or self._tap.entries != self.feature_layers:
                self._tap = FeatureTap(self.model, self.feature_layers)
            tap = self._tap if self._tap.supported else None
        flags = {"output_hidden_states": True} if (record and tap is None) or self.output_hidden_states else {}
        if self.output_attentions:
            flags["output_attentions"] = True

        def kept(out) -> tuple:
            """What the step keeps of the output (all a compiled forward copies under CUDA graphs): the logits, the
            feature layers' states of the last `keep_hidden` tokens (unless hooks recorded them), and every layer's
            hidden states and attentions when asked for."""
            features = None if not record or tap is not None else [
                out.hidden_states[i][:, -keep_hidden:] for i in self.feature_layers]
            return (out.logits, features, out.hidden_states if self.output_hidden_states else None,
                    out.attentions if self.output_attentions else None)

        with tap if tap is not None else contextlib.nullcontext():
            if isinstance(call, CompiledForward):
                logits, features, hidden_states, attentions = call(keep=kept, **inputs, **flags, return_dict=True)
            else:
                logits, features, hidden_states, attentions = kept(call(**inputs, **flags, return_dict=True))
        if self.output_hidden_states or self.output_attentions:
            self.model_outputs = ModelOutputs(hidden_states=hidden_states, attentions=attentions,
                                              orders=orders() if callable(orders) else orders)
        self.hidden_states = None
        if record:
            layers = features if tap is None else [state[:, -keep_hidden:] for state in tap.features()]
            self.hidden_states = layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1)
        return logits


def _causal_tail_mask(num_slots: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [W, S] for W queries in the last W of S slots, all of them valid: each query sees every slot up
    to its own (its last S' columns are the same mask over S' >= W slots)."""
    mask = torch.zeros(width, num_slots, dtype=dtype, device=device)
    blocked = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    mask[:, num_slots - width :] = blocked
    return mask
