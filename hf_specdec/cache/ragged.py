"""A KV cache in which every batch row keeps its own number of tokens.

Batched speculative decoding accepts a different number of draft tokens in every row at every step.
transformers' assisted generation gives up here (batch size 1 only); this module is how we don't.

Design
------
* The keys and values live in one `GrowableCache` (a transformers `DynamicCache` that appends in place, see
  `hf_specdec.cache.growable`) whose layers are all full-attention layers. All rows share one slot axis of length S.
* `valid [B, S]` says which slots a row may attend to; `positions [B, S]` holds the position id of each slot.
* A forward appends the same number of slots W to every row (for a verify step: the last committed token and k
  drafts). `rollback` then keeps, per row, only the first `num_kept` of the slots appended since a `CacheMark`
  (last token + accepted drafts) and marks the others invalid. No row waits for another, and no KV is copied.
* Trailing slots that no row keeps are cropped at once. Holes in the middle (one row rejected while another
  accepted) are squeezed out by `_compact`, which runs only when the holes outnumber the longest row's valid
  slots: one gather per layer, amortised O(1) per generated token, so memory stays within about twice the
  longest row.
* Each slot also has an *order* (`orders [B, S]`): its index in the cache plain `generate` would have built for
  that row (prompt padding included). Attention gets a 4-D additive mask built from `valid` and `orders`:
  causality and sliding windows are computed on orders, never on slot indices (which holes and compaction move),
  so a window covers exactly the tokens it covers in plain `generate`. Sliding-window layers therefore keep their
  whole history here; the mask applies the window. Position ids (`positions`) only go to the model: they equal
  orders minus the left padding, but differ after right padding, whose trailing pads carry position 0.
* Rows that finished can be dropped (`select_rows`), so they stop costing compute; the engine maps the rows the
  cache holds to batch rows.
* While no row has padding, holes or dummies (batch 1, say) and there is no sliding window, a chain needs only a
  plain causal mask, or none for one query per row; `forward` skips the general construction then.
* Positions follow plain `generate`: the first real token of a left-padded row has position 0, and the first new
  token of a row goes at its last prompt position + 1 (also when the prompt ends in right padding).

The prefill goes through the model's own mask preparation (a 2-D mask), as plain `generate` does, so the prompt
is encoded with the same kernels and gives the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_specdec.cache.exchange import filled_layers, gather_by_order
from hf_specdec.cache.growable import GrowableCache
from hf_specdec.kernels.tree_mask import ancestry_attention_mask

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
SUPPORTED_ATTENTION = ("sdpa", "eager")
# Holes are squeezed out once they outnumber the longest row's tokens, and never for fewer than this many.
MIN_HOLES_BEFORE_COMPACTION = 32


@dataclass(frozen=True)
class AttentionLayout:
    """Which masks a model's layers want: full causal, sliding window, or one per layer type."""

    sliding_window: int | None
    # True when the model takes {layer_type: mask} (config.layer_types mixes full and sliding layers).
    per_layer_type: bool

    @classmethod
    def from_model(cls, model) -> AttentionLayout:
        config = model.config.get_text_config(decoder=True)
        _check_positions_come_from_the_mask(model, config)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attn_implementation={attn!r} cannot take the custom 4-D attention masks speculative decoding "
                f"needs; load the model with attn_implementation='sdpa' (or 'eager')"
            )
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ValueError(
                    f"{type(model).__name__}: layer types {sorted(unknown)} are not supported by hf_specdec "
                    f"(supported: {FULL_ATTENTION!r}, {SLIDING_ATTENTION!r})"
                )
            if SLIDING_ATTENTION in layer_types:
                if window is None:
                    raise ValueError(f"{type(model).__name__}: sliding-attention layers but config.sliding_window is None")
                return cls(sliding_window=int(window), per_layer_type=True)
            return cls(sliding_window=None, per_layer_type=False)
        return cls(sliding_window=None if window is None else int(window), per_layer_type=False)


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
class ModelOutputs:
    """The model's per-layer outputs of one forward, and the order of every slot it attended over."""

    # per layer [B, W, H], or None
    hidden_states: tuple | None
    # per layer [B, heads, W, S], or None (empty for attention kernels that return none)
    attentions: tuple | None
    # [B, S]
    orders: torch.Tensor


@dataclass(frozen=True)
class CacheMark:
    """Where the cache stood before a group of forwards, so `rollback` can keep a prefix of what came after."""

    num_slots: int
    # [B]
    next_position: torch.Tensor
    # [B]
    next_order: torch.Tensor


class RaggedKVCache:
    """KV cache plus per-row slot validity and positions; see the module docstring."""

    def __init__(self, model) -> None:
        self.model = model
        self.layout = AttentionLayout.from_model(model)
        self.kv = GrowableCache()
        self.valid: torch.Tensor | None = None  # [B, S] bool
        self.positions: torch.Tensor | None = None  # [B, S] long: position ids
        self.orders: torch.Tensor | None = None  # [B, S] long: index in plain generate's cache (masks use these)
        self.next_position: torch.Tensor | None = None  # [B] long: position id of each row's next token
        self.next_order: torch.Tensor | None = None  # [B] long: order of each row's next token
        # entries of the model's `hidden_states` each forward keeps for its new tokens, concatenated (-1: the final
        # one, after the last norm; i < num_layers: the residual stream entering layer i); None keeps nothing
        self.feature_layers: tuple[int, ...] | None = None
        # when True (and feature_layers is set), the prefill keeps the features of every prompt position
        self.record_prompt_features = False
        self.hidden_states: torch.Tensor | None = None  # [B, W, F] of the last forward, when recorded
        # per-row model inputs every new token repeats ({name: [B]}, e.g. the row's last token_type_ids)
        self.row_inputs: dict[str, torch.Tensor] = {}
        # the model's own per-layer outputs of the last forward, kept when these are set
        self.output_hidden_states = False
        self.output_attentions = False
        self.model_outputs: ModelOutputs | None = None

    @property
    def num_slots(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def prefill(
        self,
        # [B, P]
        input_ids: torch.Tensor,
        # [B, P] (1 = real token, 0 = padding, left or right); None when nothing is padded
        attention_mask: torch.Tensor | None,
        logits_to_keep: int = 1,
        # [B, P] or None: the position ids `generate` prepared (None: from the mask, as `generate` computes them)
        position_ids: torch.Tensor | None = None,
        # [B, P] or None: segment ids; every later token of a row gets the row's last one (as `generate` does)
        token_type_ids: torch.Tensor | None = None,
        # [B, P, H] or None: the prompt as embeddings; `input_ids` is then [B, 0]
        inputs_embeds: torch.Tensor | None = None,
        # a filled transformers cache holding the first C < P prompt tokens (from an earlier call), or None
        past_key_values=None,
    ) -> torch.Tensor | None:
        """Encode the prompt through the model's own input preparation; returns logits [B, logits_to_keep, V]
        (None for an empty prompt, which just starts an empty cache)."""
        batch, length = input_ids.shape
        if inputs_embeds is not None:
            length = inputs_embeds.shape[1]
        if token_type_ids is not None:
            self.row_inputs["token_type_ids"] = token_type_ids[:, -1]
        self.orders = torch.arange(length, device=input_ids.device).expand(batch, -1)
        self.next_order = input_ids.new_full((batch,), length)
        if length == 0:
            self.valid = torch.zeros_like(input_ids, dtype=torch.bool)
            self.positions = torch.zeros_like(input_ids)
            self.next_position = input_ids.new_zeros(batch)
            return None
        if attention_mask is None:
            attention_mask = torch.ones(batch, length, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        if past_key_values is not None:
            return self._prefill_after(past_key_values, input_ids, attention_mask, position_ids, token_type_ids,
                                       inputs_embeds, logits_to_keep)
        has_padding = bool((attention_mask == 0).any())
        model_kwargs = {
            "attention_mask": attention_mask if has_padding else None,
            "position_ids": position_ids,
            "past_key_values": self.kv,
            "use_cache": True,
            "is_first_iteration": True,
        }
        if token_type_ids is not None:
            model_kwargs["token_type_ids"] = token_type_ids
        if inputs_embeds is not None:
            model_kwargs["inputs_embeds"] = inputs_embeds
        if self.model._supports_logits_to_keep():
            model_kwargs["logits_to_keep"] = logits_to_keep
        inputs = self.model.prepare_inputs_for_generation(input_ids, **model_kwargs)
        keep = length if self.record_prompt_features else logits_to_keep
        logits = self._call_model(inputs, keep_hidden=keep)
        self.valid = attention_mask.bool()
        self.positions = position_ids
        self.next_position = position_ids[:, -1] + 1  # as `generate` continues positions, right padding or not
        return logits[:, -logits_to_keep:]  # models without `logits_to_keep` return every position's

    def _prefill_after(
        self,
        past_key_values,
        # [B, P]
        input_ids: torch.Tensor,
        # [B, P]
        attention_mask: torch.Tensor,
        # [B, P]
        position_ids: torch.Tensor,
        # [B, P] or None
        token_type_ids: torch.Tensor | None,
        # [B, P, H] or None: the prompt as embeddings (then `input_ids` is [B, 0])
        inputs_embeds: torch.Tensor | None,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """Start from a filled transformers cache of the first C prompt tokens and encode the other P - C."""
        cached = past_key_values.get_seq_length()
        batch, length = attention_mask.shape
        for index, (keys, values) in enumerate(filled_layers(past_key_values, cached)):
            self.kv.update(keys, values, index)
        self.valid = attention_mask[:, :cached].bool()
        self.positions, orders = position_ids[:, :cached], self.orders
        self.orders = orders[:, :cached]
        positions, width = position_ids[:, cached:], length - cached
        self._extend(positions, orders[:, cached:], attention_mask[:, cached:].bool())
        chain = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
        mask = self._attention_mask(self.orders[:, cached:], cached, chain.expand(batch, -1, -1))
        rest = {} if token_type_ids is None else {"token_type_ids": token_type_ids[:, cached:]}
        if inputs_embeds is not None:
            rest["inputs_embeds"] = inputs_embeds[:, cached:]
        else:
            rest["input_ids"] = input_ids[:, cached:]
        logits = self._call_model(
            dict(position_ids=positions, attention_mask=mask, past_key_values=self.kv, use_cache=True, **rest),
            keep_hidden=width,
        )
        self.next_position = position_ids[:, -1] + 1
        return logits[:, -logits_to_keep:]

    def layers_by_order(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ([B_held, H, length, D] keys, values): every row's slots at orders < length, at their order."""
        return [(gather_by_order(layer.keys, self.orders, self.valid, length),
                 gather_by_order(layer.values, self.orders, self.valid, length)) for layer in self.kv.layers]

    def mark(self) -> CacheMark:
        return CacheMark(
            num_slots=self.num_slots, next_position=self.next_position.clone(), next_order=self.next_order.clone()
        )

    def forward(
        self,
        # [B, W]: each row's real tokens first, then dummies
        input_ids: torch.Tensor,
        # [B]: real tokens per row; dummies are attended by nobody and invalidated after the forward
        num_real: torch.Tensor,
        **model_inputs,
    ) -> torch.Tensor:
        """Run the model on W new tokens per row, a chain after each row's tokens; returns logits [B, W, V].
        `model_inputs` go to the model as they are (a draft head's features)."""
        width = input_ids.shape[1]
        offsets = torch.arange(width, device=input_ids.device)
        positions = self.next_position[:, None] + offsets
        orders = self.next_order[:, None] + offsets
        real = offsets[None, :] < num_real[:, None]
        plain_causal = self.layout.sliding_window is None and bool(real.all()) and bool(self.valid.all())
        self._extend(positions, orders, real)
        if plain_causal:
            mask = self._dense_mask(input_ids)
        else:
            chain = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
            mask = self._attention_mask(orders, self.num_slots - width, chain.expand(input_ids.shape[0], -1, -1))
        logits = self._run(input_ids, positions, attention_mask=mask, **model_inputs)
        self.next_position = self.next_position + num_real
        self.next_order = self.next_order + num_real
        return logits

    def forward_tree(
        self,
        # [B, W]
        input_ids: torch.Tensor,
        # [B, W]: position id of each new token (the root's position plus its depth, for tree nodes)
        positions: torch.Tensor,
        # [B, W] bool: real tokens; the others attend only to themselves and stay invalid
        real: torch.Tensor,
        # slots from here on form the tree region: the new tokens see them only where `visible` says so
        region_start: int,
        # [B, W, R] bool, R = num_slots - region_start + W: the region slots each new token sees (its ancestors)
        visible: torch.Tensor,
        # the new tokens form one chain in node order (each sees exactly the ones before it): with no padding,
        # holes or dummies, a plain causal mask does
        chain: bool = False,
        **model_inputs,
    ) -> torch.Tensor:
        """Run the model on W new tokens per row; slots before the region are seen by order (causal, windowed).
        Does not move `next_position` (`keep` does, and `forward` for chains). Returns logits [B, W, V]."""
        orders = positions - self.next_position[:, None] + self.next_order[:, None]  # same offset from the row's next
        dense = (chain and region_start == self.num_slots and self.layout.sliding_window is None
                 and bool(real.all()) and bool(self.valid.all()))
        self._extend(positions, orders, real)
        mask = self._dense_mask(input_ids) if dense else self._attention_mask(orders, region_start, visible)
        return self._run(input_ids, positions, attention_mask=mask, **model_inputs)

    def _dense_mask(
        self,
        # [B, W]
        input_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """With no padding, holes or dummies, each of the W chained queries sees every slot up to its own: a plain
        causal mask over the last W slots, or none for one query per row."""
        batch, width = input_ids.shape
        if width == 1:
            return None
        return _causal_tail_mask(batch, width, self.num_slots, self.model.dtype, input_ids.device)

    def _extend(
        self,
        # [B, W]
        positions: torch.Tensor,
        # [B, W]
        orders: torch.Tensor,
        # [B, W] bool
        real: torch.Tensor,
    ) -> None:
        """Append W slots per row (their KV is written by the forward that follows)."""
        self.valid = torch.cat([self.valid, real], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.orders = torch.cat([self.orders, orders], dim=1)

    def _run(
        self,
        # [B, W]
        input_ids: torch.Tensor,
        # [B, W]
        positions: torch.Tensor,
        attention_mask: torch.Tensor | dict | None,
        **model_inputs,
    ) -> torch.Tensor:
        width = input_ids.shape[1]
        inputs = dict(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            past_key_values=self.kv,
            use_cache=True,
            **{name: value[:, None].expand(-1, width) for name, value in self.row_inputs.items()},
            **model_inputs,
        )
        return self._call_model(inputs, keep_hidden=input_ids.shape[1])

    def _call_model(self, inputs: dict, keep_hidden: int) -> torch.Tensor:
        """The model's logits; also its features (`feature_layers`) of the last `keep_hidden` tokens, and its
        per-layer hidden states and attentions when `output_hidden_states` / `output_attentions` are set."""
        record = self.feature_layers is not None
        flags = {"output_hidden_states": True} if record or self.output_hidden_states else {}
        if self.output_attentions:
            flags["output_attentions"] = True
        out = self.model(**inputs, **flags, return_dict=True)
        if self.output_hidden_states or self.output_attentions:
            self.model_outputs = ModelOutputs(
                hidden_states=out.hidden_states if self.output_hidden_states else None,
                attentions=out.attentions if self.output_attentions else None,
                orders=self.orders,
            )
        self.hidden_states = None
        if record:
            layers = [out.hidden_states[i][:, -keep_hidden:] for i in self.feature_layers]
            self.hidden_states = layers[0] if len(layers) == 1 else torch.cat(layers, dim=-1)
        return out.logits

    def rollback(
        self,
        mark: CacheMark,
        # [B]: how many of the valid slots appended since `mark` each row keeps (the rest are dropped)
        num_kept: torch.Tensor,
    ) -> None:
        """Keep a per-row prefix of the valid slots appended since `mark` (a chain's accepted tokens)."""
        appended = self.valid[:, mark.num_slots :]
        self.keep(mark, appended & (appended.long().cumsum(dim=1) <= num_kept[:, None]))

    def keep(
        self,
        mark: CacheMark,
        # [B, num_slots - mark.num_slots] bool: the slots appended since `mark` that each row keeps
        kept: torch.Tensor,
    ) -> None:
        """The one cache-rollback operation: of what was appended since `mark`, keep exactly `kept`.
        The kept slots must have consecutive positions from `mark.next_position` (a chain, or a root-to-node path
        of a tree); their KV was computed by the forwards themselves, so nothing is recomputed."""
        kept = kept & self.valid[:, mark.num_slots :]
        self.valid[:, mark.num_slots :] = kept
        self.next_position = mark.next_position + kept.sum(dim=1)
        self.next_order = mark.next_order + kept.sum(dim=1)
        self._crop_unused_tail()
        longest = self._longest_row()
        if self.num_slots - longest > max(MIN_HOLES_BEFORE_COMPACTION, longest):  # holes outnumber the longest row
            self._compact(longest)

    def select_rows(
        self,
        # [B'] long: indices of the rows to keep, in order
        rows: torch.Tensor,
    ) -> None:
        """Keep only these rows (the others, finished, stop costing compute): one copy of the cache."""
        self.kv.batch_select_indices(rows.to(self.valid.device))
        self.valid, self.positions, self.orders = self.valid[rows], self.positions[rows], self.orders[rows]
        self.next_position, self.next_order = self.next_position[rows], self.next_order[rows]
        self.row_inputs = {name: value[rows.to(value.device)] for name, value in self.row_inputs.items()}
        self._crop_unused_tail()

    def _attention_mask(
        self,
        # [B, W] long: the queries' orders
        query_orders: torch.Tensor,
        region_start: int,
        # [B, W, R] bool
        visible: torch.Tensor,
    ):
        """Additive mask(s) [B, 1, W, S]: before the region, valid slots at orders <= the query's; in the
        region, the valid slots `visible` names; always the query's own slot; sliding windows on orders.
        Built by `hf_specdec.kernels.tree_mask` (the Triton kernel on CUDA for verify steps), which names orders
        positions."""

        def mask(window: int | None) -> torch.Tensor:
            return ancestry_attention_mask(
                self.valid[:, :region_start], self.orders[:, :region_start], query_orders,
                visible & self.valid[:, None, region_start:], window, self.model.dtype,
                self.orders[:, region_start:],
            )

        window = self.layout.sliding_window
        if window is None:
            return mask(None)
        if self.layout.per_layer_type:
            return {FULL_ATTENTION: mask(None), SLIDING_ATTENTION: mask(window)}
        return mask(window)

    def _longest_row(self) -> int:
        return int(self.valid.sum(dim=1).max())

    def _crop_unused_tail(self) -> None:
        used = self.valid.any(dim=0).nonzero()
        new_len = int(used.max()) + 1 if used.numel() else 0
        excess = self.num_slots - new_len
        if excess > 0:
            self.kv.crop(-excess)
            self.valid = self.valid[:, :new_len]
            self.positions = self.positions[:, :new_len]
            self.orders = self.orders[:, :new_len]

    def _compact(self, longest: int) -> None:
        """Move each row's valid slots to the front, in order; one gather per layer."""
        num_slots = self.num_slots
        slot = torch.arange(num_slots, device=self.valid.device)
        order = torch.where(self.valid, slot, slot + num_slots).argsort(dim=1)[:, :longest]  # [B, longest]
        for layer in self.kv.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.replace(_gather_slots(layer.keys, order), _gather_slots(layer.values, order))
        self.positions = self.positions.gather(1, order)
        self.orders = self.orders.gather(1, order)
        self.valid = slot[None, :longest] < self.valid.sum(dim=1, keepdim=True)


def _gather_slots(
    # [B, H, S, D]
    states: torch.Tensor,
    # [B, S']
    order: torch.Tensor,
) -> torch.Tensor:
    index = order.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
    return states.gather(2, index)


def _causal_tail_mask(batch: int, width: int, num_slots: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [B, 1, W, S] for W queries in the last W of S slots, all of them valid: each query sees every
    slot up to its own."""
    mask = torch.zeros(width, num_slots, dtype=dtype, device=device)
    mask[:, num_slots - width :] = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask.expand(batch, 1, width, num_slots)

