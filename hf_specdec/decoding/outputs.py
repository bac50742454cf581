"""`output_hidden_states` / `output_attentions` laid out as plain `generate` lays them out.

Plain generate returns one entry per generated token, each a tuple over layers: the first entry is the prefill
forward's ([B, P, H] hidden states, [B, heads, P, P] attentions); entry t >= 1 is the forward that fed token t - 1
([B, 1, H]; [B, heads, 1, kv] with kv = P + t keys, or the layer's window for sliding-window layers). A verify
forward computes several such positions at once: the token emitted at verified position j was chosen from that
position's outputs, so entry t of a row is taken from the position it was emitted at, and its attention weights are
put at the order (plain generate's cache index) of every slot they fell on. Rows that finished have zeros there
(plain generate computed them on padding).

With `use_cache=False` plain generate runs the whole sequence at every step, so entry t covers every position so far
([B, P + t, H]; [B, heads, P + t, P + t], sliding layers keeping their whole rows): the prefill's rows, then one row
per generated position, each as computed when it was verified (causal attention makes them the same). Left-padding
positions attend to nothing; they keep the prefill's values, where plain generate recomputes them to other ones.

With a static cache plain generate's attention weights span each layer's whole cache (its `max_cache_len`, a sliding
layer's window), zeros on the slots not written yet: `over_static_cache` lays the entries out the same way.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import Cache, DynamicCache, StaticCache

from hf_specdec.cache.ragged import ModelOutputs


class OutputLog:
    def __init__(self, model, batch_size: int, hidden_states: bool, attentions: bool,
                 whole_sequence: bool = False) -> None:
        self.hidden = hidden_states
        self.attention = attentions
        self.whole_sequence = whole_sequence  # use_cache=False: each entry covers the sequence so far
        self.first: ModelOutputs | None = None
        self.hidden_rows: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]  # per row: [L, H] per token
        self.attention_rows: list[list[tuple]] = [[] for _ in range(batch_size)]  # per row: per token, per layer
        layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
        # the keys each layer keeps for a query at order o: o + 1, or the window for sliding layers
        self.windows = [getattr(layer, "sliding_window", None) for layer in layers]

    def prefill(self, outputs: ModelOutputs, past: Cache | None = None) -> None:
        """The prompt's forward; `past`: the filled cache it continued, whose sliding-window layers hold only their
        last keys (transformers keeps window - 1): plain generate's first entry there spans those and the new
        positions' keys, where this forward's spans the whole conversation (zeros outside the window)."""
        if past is not None and outputs.attentions:
            held = [_held_keys(layer) if window is not None else None
                    for layer, window in zip(past.layers, self.windows, strict=False)]
            outputs = replace(outputs, attentions=tuple(
                weights if layer >= len(held) or held[layer] is None
                else weights[..., weights.shape[-1] - held[layer] - weights.shape[-2]:]
                for layer, weights in enumerate(outputs.attentions)
            ))
        self.first = outputs

    def add(
        self,
        outputs: ModelOutputs,
        # [B, D + 1]: the verified position each emitted token was chosen at
        positions: torch.Tensor,
        # per row: tokens emitted
        num_emitted: list[int],
        # per row: the order of its first verified position (its last committed token) + 1, i.e. its length
        # before the step
        lengths: list[int],
        # [B_held, ...] -> [B, ...]: puts the rows the cache holds back in batch order
        unheld,
    ) -> None:
        counts = num_emitted
        first_order = [length - 1 for length in lengths]
        if self.hidden:
            layers = torch.stack([unheld(h) for h in outputs.hidden_states], dim=2)  # [B, W, L, H]
            chosen = layers.gather(1, positions[:, :, None, None].expand(-1, -1, *layers.shape[2:]))
            for row, count in enumerate(counts):
                self.hidden_rows[row].extend(chosen[row, :count].unbind(0))
        if self.attention and outputs.attentions:
            self._add_attentions(outputs, positions, counts, first_order, unheld)

    def _add_attentions(self, outputs, positions, counts, first_order, unheld) -> None:
        orders = unheld(outputs.orders)  # [B, S]
        longest = max(first_order) + positions.shape[1]  # keys of the deepest query
        target = orders.clamp(max=longest).to(positions.device)  # later slots go to a spare column
        per_layer = []
        for weights in outputs.attentions:
            weights = unheld(weights)  # [B, heads, W, S]
            heads = weights.shape[1]
            chosen = weights.gather(2, positions[:, None, :, None].expand(-1, heads, -1, weights.shape[3]))
            placed = chosen.new_zeros(*chosen.shape[:3], longest + 1)
            placed.scatter_add_(3, target[:, None, None, :].expand(-1, heads, chosen.shape[2], -1), chosen)
            per_layer.append(placed)  # [B, heads, D + 1, longest + 1]
        for row, count in enumerate(counts):
            for j in range(count):
                keys = first_order[row] + j + 1
                self.attention_rows[row].append(
                    tuple(self._window(layer, placed[row, :, j, :keys]) for layer, placed in enumerate(per_layer))
                )

    def _window(self, layer: int, weights: torch.Tensor) -> torch.Tensor:
        window = self.windows[layer] if layer < len(self.windows) else None
        if window is None or self.whole_sequence:
            return weights
        return weights[:, -min(weights.shape[1], window) :]

    def hidden_steps(self, steps: int) -> tuple | None:
        if not self.hidden:
            return None
        later = _stack_steps(self.hidden_rows, steps - 1)  # per step [B, L, H]
        first = tuple(self.first.hidden_states)
        if not self.whole_sequence:
            return (first,) + tuple(tuple(step[:, layer, None] for layer in range(step.shape[1])) for step in later)
        entries = [first]
        for t in range(1, steps):
            entries.append(tuple(torch.cat([first[layer], *(step[:, layer, None] for step in later[:t])], dim=1)
                                 for layer in range(len(first))))
        return tuple(entries)

    def attention_steps(self, steps: int) -> tuple | None:
        if not self.attention:
            return None
        first = tuple(self.first.attentions)
        if not first:  # the attention kernel returns no weights (sdpa): as plain generate, empty entries
            return tuple(() for _ in range(steps))
        entries = [first]
        rows = []  # per step: per layer [B, heads, 1, keys]
        for t in range(steps - 1):
            template = next(r[t] for r in self.attention_rows if len(r) > t)
            rows.append(tuple(
                torch.stack([r[t][layer] if len(r) > t else torch.zeros_like(template[layer])
                             for r in self.attention_rows])[:, :, None]
                for layer in range(len(template))
            ))
        if not self.whole_sequence:
            return tuple(entries + rows)
        for t in range(1, steps):
            width = first[0].shape[-1] + t
            entries.append(tuple(
                torch.cat([_pad_keys(first[layer], width), *(_pad_keys(step[layer], width) for step in rows[:t])],
                          dim=2)
                for layer in range(len(first))
            ))
        return tuple(entries)


def over_static_cache(entries: tuple | None, cache: object) -> tuple | None:
    """The attention entries laid out over `cache`'s slots when it is the StaticCache plain generate would have
    used (the caller's, or the one transformers prepared for `cache_implementation="static"`): each layer's keys
    padded with zeros up to the layer's capacity (a prefill longer than a sliding window keeps its keys)."""
    if not entries or not isinstance(cache, StaticCache):
        return entries
    capacities = [getattr(layer, "max_cache_len", None) for layer in cache.layers]
    return tuple(
        tuple(weights if capacity is None else _pad_keys(weights, max(capacity, weights.shape[-1]))
              for weights, capacity in zip(step, capacities, strict=True)) if step else step
        for step in entries
    )


def _held_keys(layer) -> int | None:
    """The keys a cache layer holds (a sliding-window layer: at most its window), None if it holds none yet."""
    keys = getattr(layer, "keys", None)
    return None if keys is None or not getattr(layer, "is_initialized", True) else keys.shape[-2]


def _pad_keys(
    # [B, heads, Q, K]
    weights: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """[B, heads, Q, width]: zero weights on the keys after K (later positions, which causal attention never sees)."""
    return torch.nn.functional.pad(weights, (0, width - weights.shape[-1]))


def _stack_steps(rows: list[list[torch.Tensor]], steps: int) -> list[torch.Tensor]:
    """Per step, the rows' entries stacked [B, ...] (zeros for rows that had finished)."""
    if steps <= 0:
        return []
    template = next(r[0] for r in rows if r)
    return [torch.stack([r[t] if t < len(r) else torch.zeros_like(template) for r in rows]) for t in range(steps)]
