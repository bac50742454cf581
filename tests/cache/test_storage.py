"""Slot storage: writes land where the owner says, buffers keep their address until they must grow, and a move
reads every source before it writes."""

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.cache.storage import SlotCache, SlotLayer, release_spare_buffers


def _states(generator: torch.Generator, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, width, 4, generator=generator), torch.randn(2, 3, width, 4, generator=generator)


def test_writes_at_the_given_slots_and_returns_the_used_part():
    generator = torch.Generator().manual_seed(0)
    cache = SlotCache(capacity=16)
    assert isinstance(cache, DynamicCache)
    first = _states(generator, 5)
    keys, values = cache.update(*first, 0)
    torch.testing.assert_close(keys, first[0], rtol=0, atol=0)
    cache.write_start = 9  # a region after a gap: slots 5..8 stay as they were (zeros)
    second = _states(generator, 3)
    keys, values = cache.update(*second, 0)
    assert keys.shape[2] == 12
    torch.testing.assert_close(keys[:, :, :5], first[0], rtol=0, atol=0)
    assert not keys[:, :, 5:9].any()
    torch.testing.assert_close(values[:, :, 9:], second[1], rtol=0, atol=0)
    assert isinstance(cache.layers[0], SlotLayer) and cache.get_seq_length() == 9


def test_plan_sets_the_first_allocation_and_only_before_it():
    generator = torch.Generator().manual_seed(3)
    cache = SlotCache(capacity=4)
    cache.plan(12)
    cache.update(*_states(generator, 5), 0)
    assert cache.layers[0].key_buffer.shape[2] == 12
    with pytest.raises(RuntimeError, match="allocated already"):
        cache.plan(20)


def test_index_writes_return_the_whole_buffer_at_a_fixed_address():
    generator = torch.Generator().manual_seed(1)
    cache = SlotCache(capacity=10, static=True)
    cache.update(*_states(generator, 4), 0)
    buffer = cache.layers[0].key_buffer
    cache.write_index = torch.tensor([7, 8])
    new = _states(generator, 2)
    keys, _ = cache.update(*new, 0)
    assert keys is buffer and keys.shape[2] == 10
    torch.testing.assert_close(keys[:, :, 7:9], new[0], rtol=0, atol=0)


def test_grow_keeps_the_slots_and_move_reads_before_it_writes():
    generator = torch.Generator().manual_seed(2)
    cache = SlotCache(capacity=8)
    states = _states(generator, 8)
    cache.update(*states, 0)
    cache.grow(20)
    assert cache.layers[0].key_buffer.shape[2] == 20
    torch.testing.assert_close(cache.layers[0].key_buffer[:, :, :8], states[0], rtol=0, atol=0)
    # row 0: slots 5, 6 -> 2, 3; row 1: 2, 3 -> 3, 4 (slot 3 is read before it is overwritten)
    cache.move(torch.tensor([[5, 6], [2, 3]]), torch.tensor([[2, 3], [3, 4]]))
    keys = cache.layers[0].key_buffer
    torch.testing.assert_close(keys[0, :, 2:4], states[0][0, :, 5:7], rtol=0, atol=0)
    torch.testing.assert_close(keys[1, :, 3:5], states[0][1, :, 2:4], rtol=0, atol=0)
    cache.select_rows(torch.tensor([1]))
    assert cache.layers[0].key_buffer.shape[0] == 1


def test_layers_of_one_shape_share_one_tensor_and_move_together():
    generator = torch.Generator().manual_seed(3)
    joint, single = SlotCache(capacity=8, num_layers=2), SlotCache(capacity=8)
    states = [_states(generator, 6) for _ in range(2)]
    for cache in (joint, single):
        for index, layer_states in enumerate(states):
            cache.update(*layer_states, index)
    assert joint.joint is not None and joint.layers[1].key_buffer.data_ptr() == joint.joint[1, 0].data_ptr()
    for cache in (joint, single):
        cache.move(torch.tensor([[4, 5], [1, 0]]), torch.tensor([[0, 1], [0, 1]]))
        cache.grow(12)
        cache.select_rows(torch.tensor([1, 0]))
    for ours, theirs in zip(joint.buffers(), single.buffers()):
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
        torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    assert joint.layers[0].key_buffer.shape[2] == 12


def test_a_released_cpu_cache_leaves_its_memory_zeroed_to_the_next_one():
    release_spare_buffers()
    generator = torch.Generator().manual_seed(4)
    first = SlotCache(capacity=10, num_layers=2)
    for index in range(2):
        first.update(*_states(generator, 6), index)
    memory = first.joint.data_ptr()
    first.release()
    assert first.joint is None and first.layers[0].key_buffer is None
    # a smaller cache takes the memory, zeroed; a larger one finds none left and allocates its own
    second, third = SlotCache(capacity=8, num_layers=2), SlotCache(capacity=16, num_layers=2)
    second.update(*_states(generator, 6), 0)
    assert second.joint.data_ptr() == memory
    assert not second.joint[1].any() and not second.joint[0, :, :, :, 6:].any()
    third.update(*_states(generator, 6), 0)
    assert third.joint.data_ptr() != memory
    # under static shapes buffers are never recycled (compiled graphs may hold them)
    static = SlotCache(capacity=8, static=True, num_layers=1)
    static.update(*_states(generator, 4), 0)
    held = static.joint  # alive, so only recycling could hand its memory out again
    static.release()
    fresh = SlotCache(capacity=8, num_layers=1)
    fresh.update(*_states(generator, 4), 0)
    assert fresh.joint.data_ptr() != held.data_ptr()
    release_spare_buffers()


@pytest.mark.parametrize("num_layers", [2, None])
def test_host_spans_move_as_the_indexed_move_does(num_layers):
    generator = torch.Generator().manual_seed(5)
    spans, indexed = SlotCache(capacity=12, num_layers=num_layers), SlotCache(capacity=12, num_layers=num_layers)
    states = [_states(generator, 10) for _ in range(2)]
    for cache in (spans, indexed):
        for index, layer_states in enumerate(states):
            cache.update(*layer_states, index)
    # row 0: slots 7, 8 -> 3, 4; row 1: slots 7, 8, 9 -> 5, 6, 7 (overlapping: slot 7 is read before it is written)
    spans.move_spans([(0, 7, 3, 2), (1, 7, 5, 3)])
    indexed.move(torch.tensor([[7, 8, 9], [7, 8, 9]]), torch.tensor([[3, 4, 11], [5, 6, 7]]))
    for ours, theirs in zip(spans.buffers(), indexed.buffers()):
        torch.testing.assert_close(ours[0][:, :, :10], theirs[0][:, :, :10], rtol=0, atol=0)
        torch.testing.assert_close(ours[1][:, :, :10], theirs[1][:, :, :10], rtol=0, atol=0)
    torch.testing.assert_close(spans.layers[1].value_buffer[1, :, 5:8], states[1][1][1, :, 7:10], rtol=0, atol=0)


@pytest.mark.parametrize("num_layers", [2, None])
def test_host_spans_of_some_rows_leave_the_other_rows_alone(num_layers):
    generator = torch.Generator().manual_seed(6)
    cache = SlotCache(capacity=12, num_layers=num_layers)
    states = [_states(generator, 10) for _ in range(2)]
    for index, layer_states in enumerate(states):
        cache.update(*layer_states, index)
    before = [(keys.clone(), values.clone()) for keys, values in cache.buffers()]
    cache.move_spans([(1, 8, 2, 1)])
    for (keys, values), (old_keys, old_values) in zip(cache.buffers(), before):
        torch.testing.assert_close(keys[0], old_keys[0], rtol=0, atol=0)
        torch.testing.assert_close(keys[1, :, 2], old_keys[1, :, 8], rtol=0, atol=0)
        torch.testing.assert_close(values[1, :, 2], old_values[1, :, 8], rtol=0, atol=0)
        torch.testing.assert_close(values[1, :, 3:], old_values[1, :, 3:], rtol=0, atol=0)
