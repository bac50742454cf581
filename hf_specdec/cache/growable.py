"""KV storage that appends in place: a buffer with spare room along the slot axis, grown by doubling.

transformers' `DynamicLayer` appends with `torch.cat`, which copies a layer's whole cache at every forward. A
speculative step appends a block of slots and then drops the rejected ones, so with `torch.cat` every step pays a
copy of the whole cache (under cProfile, `torch.cat` took 2.2 ms of a 15 ms step in `benchmarks/bench_engine.py`'s
batch-8 n-gram case on CPU). `GrowableLayer` keeps each layer's keys and
values in a buffer with spare capacity: appending writes only the new slots, cropping only moves the end, and the
buffer is reallocated (capacity doubled) when it is full, an amortised O(1) copy per slot. `keys`/`values` are
views of the buffer's used part, so the models' attention code reads them as usual.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

MIN_CAPACITY = 64


class GrowableLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare capacity (see the module)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer: torch.Tensor | None = None  # [B, H, capacity, D]
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    def update(
        self,
        # [B, H, W, D]
        key_states: torch.Tensor,
        # [B, H, W, D]
        value_states: torch.Tensor,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._reallocate(key_states, value_states, capacity=max(2 * end, MIN_CAPACITY))
        self._key_buffer[..., self._length : end, :].copy_(key_states)
        self._value_buffer[..., self._length : end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self._key_buffer is not None:
            self._set_length(self.keys.shape[-2])

    def batch_select_indices(
        self,
        # [B'] long: the rows to keep, in order
        indices: torch.Tensor,
    ) -> None:
        """Keep only these batch rows (one copy of their used slots; the buffers keep their capacity)."""
        if not self.is_initialized or self._key_buffer is None:
            return
        keys, values = self.keys[indices], self.values[indices]
        self._key_buffer = self._key_buffer.new_empty(indices.shape[0], *self._key_buffer.shape[1:])
        self._value_buffer = self._value_buffer.new_empty(indices.shape[0], *self._value_buffer.shape[1:])
        self.replace(keys, values)

    def replace(
        self,
        # [B, H, S, D]
        keys: torch.Tensor,
        # [B, H, S, D]
        values: torch.Tensor,
    ) -> None:
        """Make the cache exactly these keys and values (written into the buffer, which keeps its capacity)."""
        if self._key_buffer is None or keys.shape[-2] > self._key_buffer.shape[-2]:
            self._reallocate(keys, values, capacity=max(2 * keys.shape[-2], MIN_CAPACITY), keep=0)
        self._key_buffer[..., : keys.shape[-2], :].copy_(keys)
        self._value_buffer[..., : values.shape[-2], :].copy_(values)
        self._set_length(keys.shape[-2])

    def _reallocate(self, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int, keep: int | None = None) -> None:
        """New buffers of `capacity` slots (shaped like `key_like` / `value_like` otherwise) holding the first
        `keep` used slots (default: all of them)."""
        keep = self._length if keep is None else keep
        keys = key_like.new_empty(*key_like.shape[:-2], capacity, key_like.shape[-1])
        values = value_like.new_empty(*value_like.shape[:-2], capacity, value_like.shape[-1])
        if keep:
            keys[..., :keep, :].copy_(self._key_buffer[..., :keep, :])
            values[..., :keep, :].copy_(self._value_buffer[..., :keep, :])
        self._key_buffer, self._value_buffer = keys, values

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]


class GrowableCache(DynamicCache):
    """A `DynamicCache` (so models treat it as one) made of `GrowableLayer`s, created lazily per layer."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowableLayer)
