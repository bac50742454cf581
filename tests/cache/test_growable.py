import torch
from transformers import DynamicCache

from hf_specdec.cache.growable import MIN_CAPACITY, GrowableCache, GrowableLayer


def _states(generator: torch.Generator, width: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(3, 2, width, 4, generator=generator).to(dtype),
            torch.randn(3, 2, width, 4, generator=generator).to(dtype))


def test_matches_dynamic_cache_over_appends_and_crops():
    generator = torch.Generator().manual_seed(0)
    growable, dynamic = GrowableCache(), DynamicCache()
    assert isinstance(growable, DynamicCache)
    widths = [40, 6, 6, 1, 30, 6, 70, 6, 2]
    crops = [0, -5, 0, 0, -29, -3, 0, -60, 0]
    for width, crop in zip(widths, crops):
        for layer_idx in range(2):
            keys, values = _states(generator, width)
            got = growable.update(keys, values, layer_idx)
            want = dynamic.update(keys, values, layer_idx)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        if crop:
            growable.crop(crop)
            dynamic.crop(crop)
        assert growable.get_seq_length() == dynamic.get_seq_length()
    assert all(isinstance(layer, GrowableLayer) for layer in growable.layers)


def test_appends_in_place_until_full_then_doubles():
    generator = torch.Generator().manual_seed(1)
    layer = GrowableLayer()
    layer.update(*_states(generator, 10))
    buffer = layer._key_buffer
    assert buffer.shape[-2] == MIN_CAPACITY
    for _ in range((MIN_CAPACITY - 10) // 6):
        layer.update(*_states(generator, 6))
        assert layer._key_buffer is buffer  # no reallocation, no copy of the old slots
        assert layer.keys.data_ptr() == buffer.data_ptr()
    length = layer.keys.shape[-2]
    old = layer.keys.clone()
    layer.update(*_states(generator, MIN_CAPACITY))
    assert layer._key_buffer is not buffer
    assert layer._key_buffer.shape[-2] == 2 * (length + MIN_CAPACITY)
    torch.testing.assert_close(layer.keys[..., :length, :], old, rtol=0, atol=0)


def test_replace_and_dtype_follow_the_states():
    generator = torch.Generator().manual_seed(2)
    layer = GrowableLayer()
    layer.update(*_states(generator, 20, torch.bfloat16))
    keys, values = _states(generator, 7, torch.bfloat16)
    layer.replace(keys, values)
    assert layer.keys.dtype == torch.bfloat16 and layer.get_seq_length() == 7
    torch.testing.assert_close(layer.keys, keys, rtol=0, atol=0)
    torch.testing.assert_close(layer.values, values, rtol=0, atol=0)
    more_keys, more_values = _states(generator, 3, torch.bfloat16)
    layer.update(more_keys, more_values)
    torch.testing.assert_close(layer.keys, torch.cat([keys, more_keys], dim=-2), rtol=0, atol=0)
    big_keys, big_values = _states(generator, 3 * MIN_CAPACITY, torch.bfloat16)
    layer.replace(big_keys, big_values)
    torch.testing.assert_close(layer.values, big_values, rtol=0, atol=0)


def test_batch_select_indices_keeps_rows_and_goes_on_appending():
    generator = torch.Generator().manual_seed(3)
    growable, dynamic = GrowableCache(), DynamicCache()
    for width in (9, 6):
        states = _states(generator, width)
        growable.update(*states, 0)
        dynamic.update(*states, 0)
    rows = torch.tensor([2, 0])
    growable.batch_select_indices(rows)
    dynamic.batch_select_indices(rows)
    keys, values = (tensor[:2] for tensor in _states(generator, 4))
    got, want = growable.update(keys, values, 0), dynamic.update(keys, values, 0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
