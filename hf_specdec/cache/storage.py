"""KV storage in preallocated buffers, written where the engine says: the layers of a transformers `Cache` that a
model updates as usual, while the engine (`hf_specdec.cache.ragged`) decides the slots.

Each layer keeps its keys and values in buffers [B, H, capacity, D]. Before a forward the owning `SlotCache` is
told where the new tokens go: `write_start`, a host int (the slots [write_start, write_start + W), the same for
every row), or, for compiled forwards, `write_index`, a tensor [W] of slots, so the slot can change from call to
call without a new graph. A layer's `update` writes there and returns the buffers up to the written slots (eager)
or whole (compiled: one shape for every call; the attention mask hides what is not in use).

Nothing here appends with `torch.cat` (which copies a layer's whole cache at every forward) or reads the device:
growing the buffers (eager, capacity doubled when full) and moving slots (`move`) are explicit calls. When every
layer's keys and values have one shape (told the number of layers, as the engine does), they are views of one
tensor [L, 2, B, H, capacity, D], so a move is one indexed read and one indexed write for the whole model.

On a CPU that joint tensor is recycled: a cache `release`d at the end of a call leaves its memory to the next call
(`spare_buffer`; at most two per dtype in the process). Freshly allocated, a tensor over the C library's mmap threshold
(32 MB in glibc: SmolLM2-135M at batch 16 and 100 slots is 38 MB) is new memory at every call, and its first touch
page-faults: 13 to 114 ms for 38 MB on a 2-core cloud CPU, up to 5% of a 2-second call. A GPU's caching allocator
reuses memory by itself, so nothing is kept there. `release_spare_buffers()` frees what is kept.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from hf_specdec.cache.recurrent import RecurrentSlotLayer

MIN_CAPACITY = 64

# CPU only: per dtype, flat tensors released caches left for later ones (see the module docstring); at most
# SPARES_PER_DTYPE (a target's cache and a draft model's), the largest kept
SPARES_PER_DTYPE = 2
_SPARES: dict[torch.dtype, list[torch.Tensor]] = {}
_SPARE_LOCK = threading.Lock()


def spare_buffer(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zeros of `shape` with `like`'s dtype and device: on a CPU, in the smallest memory a released cache left that
    is large enough (taken: no other cache gets it), else new."""
    count = math.prod(shape)
    if like.device.type == "cpu":
        with _SPARE_LOCK:
            spares = _SPARES.get(like.dtype, [])
            fitting = [index for index, spare in enumerate(spares) if spare.numel() >= count]
            index = min(fitting, key=lambda i: spares[i].numel(), default=None)
            spare = None if index is None else spares.pop(index)
        if spare is not None:
            return spare[:count].view(shape).zero_()
    return like.new_zeros(shape)


def keep_spare(tensor: torch.Tensor) -> None:
    """Leave a CPU tensor's memory (the whole of its storage) to a later `spare_buffer` of its dtype."""
    if tensor.device.type != "cpu":
        return
    flat = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())
    with _SPARE_LOCK:
        spares = _SPARES.setdefault(tensor.dtype, [])
        spares.append(flat)
        spares.sort(key=torch.Tensor.numel, reverse=True)
        del spares[SPARES_PER_DTYPE:]


def release_spare_buffers() -> None:
    """Free the memory released caches left for later calls (CPU only; the next call allocates afresh)."""
    with _SPARE_LOCK:
        _SPARES.clear()


class SlotLayer(DynamicLayer):
    """One layer's keys and values in buffers with a fixed slot axis; see the module docstring."""

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner
        self.index = len(owner.layers)  # the cache appends each layer as it creates it
        self.key_buffer: torch.Tensor | None = None  # [B, H, capacity, D]
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer, self.value_buffer = self.owner.allocate(self.index, key_states, value_states)
        if self.owner.static and not torch.compiler.is_compiling():
            # fixed addresses: compiled graphs (and CUDA graphs) update the buffers in place
            torch._dynamo.mark_static_address(self.key_buffer)
            torch._dynamo.mark_static_address(self.value_buffer)

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
        owner = self.owner
        if owner.write_index is not None:
            self.key_buffer.index_copy_(2, owner.write_index, key_states)
            self.value_buffer.index_copy_(2, owner.write_index, value_states)
            return self.key_buffer, self.value_buffer
        end = owner.write_start + key_states.shape[-2]
        self.key_buffer[:, :, owner.write_start : end].copy_(key_states)
        self.value_buffer[:, :, owner.write_start : end].copy_(value_states)
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.write_start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.write_start + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("slots are kept or dropped by hf_specdec.cache.ragged.RaggedKVCache.commit")

    def grow(self, capacity: int) -> None:
        """New buffers of `capacity` slots holding the old ones' slots (own buffers; see `SlotCache.grow`)."""
        if self.key_buffer is None or capacity <= self.key_buffer.shape[2]:
            return
        old = self.key_buffer.shape[2]
        for name in ("key_buffer", "value_buffer"):
            buffer = getattr(self, name)
            grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
            grown[:, :, :old].copy_(buffer)
            setattr(self, name, grown)

    def select_rows(
        self,
        # [B'] long
        rows: torch.Tensor,
    ) -> None:
        """Keep these batch rows (own buffers; see `SlotCache.select_rows`)."""
        if self.key_buffer is not None:
            self.key_buffer = self.key_buffer[rows.to(self.key_buffer.device)]
            self.value_buffer = self.value_buffer[rows.to(self.value_buffer.device)]

    def move(
        self,
        # [B, M] long: slots read
        sources: torch.Tensor,
        # [B, M] long: slots written (distinct within a row, or written twice from the same slot)
        targets: torch.Tensor,
        # [B] long: the buffer rows these are (default: every row, in order)
        rows: torch.Tensor | None = None,
    ) -> None:
        """buffer[rows[b], :, targets[b, i]] = buffer[rows[b], :, sources[b, i]], all reads before any write: one
        indexed read and one indexed write per buffer."""
        if self.key_buffer is None:
            return
        device = self.key_buffer.device
        rows = (torch.arange(sources.shape[0], device=device) if rows is None else rows.to(device))[:, None]
        sources, targets = sources.to(device), targets.to(device)
        for buffer in (self.key_buffer, self.value_buffer):
            buffer[rows, :, targets] = buffer[rows, :, sources]


class SlotCache(DynamicCache):
    """A `DynamicCache` (so every model treats it as one) of `SlotLayer`s, created lazily per layer."""

    def __init__(self, capacity: int, static: bool = False, num_layers: int | None = None,
                 recurrent: Sequence[int] = ()) -> None:
        Cache.__init__(self, layer_class_to_replicate=functools.partial(SlotLayer, self))
        if recurrent:  # a hybrid model: every layer made now, each of its kind (a layer's index is its place)
            for index in range(num_layers):
                self.layers.append(RecurrentSlotLayer() if index in recurrent else SlotLayer(self))
        self.capacity = capacity
        # True: the buffers never change address (compiled graphs write into them through `write_index`)
        self.static = static
        self.write_start = 0
        self.write_index: torch.Tensor | None = None
        self.num_layers = num_layers
        # [L, 2, B, H, capacity, D]: every layer's keys and values, while they all fit one shape (else None)
        self.joint: torch.Tensor | None = None
        self.joint_layers = 0  # layers whose buffers are views of `joint`

    def allocate(
        self,
        index: int,
        # [B, H, W, D]
        key_states: torch.Tensor,
        # [B, H, W, D]
        value_states: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s buffers [B, H, capacity, D]: views of the joint tensor when it fits, else its own."""
        batch, heads, _, dim = key_states.shape
        shape = (batch, heads, self.capacity, dim)
        fits = self.num_layers is not None and index < self.num_layers and value_states.shape == key_states.shape
        if fits and self.joint is None and index == 0:
            self.joint = (key_states.new_zeros(self.num_layers, 2, *shape) if self.static
                          else spare_buffer((self.num_layers, 2, *shape), key_states))
            if self.static and not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.joint)
        joint = self.joint
        if fits and joint is not None and joint.shape[2:] == shape and joint.dtype == key_states.dtype \
                and joint.device == key_states.device:
            self.joint_layers += 1
            return joint[index, 0], joint[index, 1]
        self.joint = None  # a layer of another shape: every layer moves on its own
        return (key_states.new_zeros(shape),
                value_states.new_zeros(batch, value_states.shape[1], self.capacity, value_states.shape[3]))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Every layer's tokens start at the slot the next forward writes (a model of recurrent layers alone asks
        too, and has no attention layer to ask)."""
        return self.write_start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """As every `SlotLayer` answers (a model whose layers here are recurrent ones alone builds a mask too)."""
        return self.write_start + query_length, 0

    def plan(self, capacity: int) -> None:
        """The slots the first forward allocates per layer (before any layer has buffers)."""
        if any(layer.key_buffer is not None for layer in self.layers):
            raise RuntimeError("SlotCache.plan: the buffers are allocated already (use grow)")
        self.capacity = capacity

    def release(self) -> None:
        """The call is over: drop every buffer, leaving the joint tensor's memory to the next call (`keep_spare`;
        not under static shapes, whose buffers compiled graphs may hold)."""
        if self.joint is not None and not self.static:
            keep_spare(self.joint)
        self.joint = None
        self.joint_layers = 0
        for layer in self.layers:
            layer.key_buffer = layer.value_buffer = None

    def _joint_ready(self) -> bool:
        return self.joint is not None and self.joint_layers == len(self.layers) == self.num_layers

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return  # every layer's buffers hold `self.capacity` slots (or are made so when allocated)
        if self._joint_ready():
            grown = self.joint.new_zeros(*self.joint.shape[:4], capacity, self.joint.shape[5])
            grown[..., : self.capacity, :].copy_(self.joint)
            self._repoint(grown)
        else:
            for layer in self.layers:
                layer.grow(capacity)
        self.capacity = max(self.capacity, capacity)

    def select_rows(
        self,
        # [B'] long
        rows: torch.Tensor,
    ) -> None:
        if self._joint_ready():
            self._repoint(self.joint[:, :, rows.to(self.joint.device)])
            return
        for layer in self.layers:
            layer.select_rows(rows)

    def _repoint(
        self,
        # [L, 2, B, H, capacity, D]
        joint: torch.Tensor,
    ) -> None:
        self.joint = joint
        for index, layer in enumerate(self.layers):
            layer.key_buffer, layer.value_buffer = joint[index, 0], joint[index, 1]

    def move(
        self,
        # [B, M] long
        sources: torch.Tensor,
        # [B, M] long
        targets: torch.Tensor,
    ) -> None:
        if not self._joint_ready():
            for layer in self.layers:
                layer.move(sources, targets)
            return
        # indexed read then write (a scatter with an expanded index is ~20x slower on a CPU in bfloat16)
        joint = self.joint
        rows = torch.arange(sources.shape[0], device=joint.device)[:, None]
        sources, targets = sources.to(joint.device), targets.to(joint.device)
        joint[:, :, rows, :, targets] = joint[:, :, rows, :, sources]

    def move_spans(
        self,
        # per span (row, source, target, count), source > target: the slots [target, target + count) of the row take
        # what [source, source + count) held
        spans: Sequence[tuple[int, int, int, int]],
    ) -> None:
        """`move` for spans the host knows (a chain's kept tokens): one narrow copy per span for the whole model
        when the layers share one tensor, with no index tensors (SmolLM2-135M at batch 4 on a CPU: a step's commit
        took 0.3 ms with `move`, under 0.1 ms so); layers of their own take one indexed move each, over the spans'
        rows."""
        if not spans:
            return
        if not self._joint_ready():
            # [S, M]: each span's slots, its last one repeated up to the longest (a repeated pair writes the same
            # value twice)
            device = next((layer.key_buffer.device for layer in self.layers if layer.key_buffer is not None), None)
            if device is None:  # nothing allocated yet: nothing to move
                return
            rows, sources, targets, counts = (torch.tensor(column, device=device) for column in zip(*spans))
            steps = torch.arange(max(count for *_, count in spans), device=device)[None, :]  # from the host's spans
            steps = torch.minimum(steps, counts[:, None] - 1)
            reads, writes = sources[:, None] + steps, targets[:, None] + steps
            for layer in self.layers:
                layer.move(reads, writes, rows)
            return
        joint = self.joint  # [L, 2, B, H, capacity, D]
        for row, source, target, count in spans:
            slots = joint.select(2, row)
            read = slots.narrow(3, source, count)
            if target + count > source:  # the spans overlap: read everything before writing
                read = read.clone()
            slots.narrow(3, target, count).copy_(read)

    def entries(
        self,
        length: int,
        # [B, 1, length, 1] bool or None: the slots to keep (the others read as zeros)
        keep: torch.Tensor | None = None,
    ) -> list:
        """Per layer what it holds (`hf_specdec.cache.exchange.LayerEntry`): its first `length` slots' keys and
        values, a recurrent layer's states, or None for a layer that holds nothing (an MLP layer of a hybrid)."""
        entries = []
        for layer in self.layers:
            if isinstance(layer, RecurrentSlotLayer):
                entries.append(layer.states())
            elif layer.key_buffer is None:
                entries.append(None)
            else:
                keys, values = layer.key_buffer[:, :, :length], layer.value_buffer[:, :, :length]
                entries.append((keys, values) if keep is None else (keys * keep, values * keep))
        return entries

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys [B, H, capacity, D], values)."""
        return [(layer.key_buffer, layer.value_buffer) for layer in self.layers]
