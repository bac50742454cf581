"""Grouped-query attention packed into the query rows: the same attention as transformers' "sdpa" function, run by
the engine's decode forwards and nowhere else."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_specdec
from hf_specdec.cache.attention import PACKED_SDPA, PackedAttention, packed_sdpa_attention
from tests.conftest import make_model

BLOCKED = torch.finfo(torch.float32).min


def _inputs(batch, heads, kv_heads, width, slots, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, width, 8, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, slots, 8, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, slots, 8, generator=generator).to(dtype)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, query, key, value


def _ragged_mask(batch, width, slots, extra=0, boolean=False):
    """[B, 1, W, S + extra]: row b sees its first slots - 2 * b slots and the region causally; `extra` slots past
    the keys (a mask buffer longer than the cache, which the attention slices)."""
    seen = torch.zeros(batch, 1, width, slots + extra, dtype=torch.bool)
    for b in range(batch):
        seen[b, :, :, : slots - width - 2 * b] = True
        seen[b, 0, :, slots - width: slots] = torch.ones(width, width, dtype=torch.bool).tril()
    return seen if boolean else torch.zeros(seen.shape).masked_fill(~seen, BLOCKED)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("width,mask_kind", [(1, "none"), (1, "additive"), (3, "additive"), (7, "additive"),
                                             (3, "bool"), (7, "bool")])
def test_packed_matches_sdpa(heads, kv_heads, width, mask_kind):
    module, query, key, value = _inputs(3, heads, kv_heads, width, 13, torch.float32)
    mask = None if mask_kind == "none" else _ragged_mask(3, width, 13, extra=2, boolean=mask_kind == "bool")
    expected, _ = sdpa_attention_forward(module, query, key, value, mask if mask is None else mask[..., :13],
                                         scaling=0.3)
    got, weights = packed_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None
    assert got.shape == (3, width, heads, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_packed_matches_sdpa_in_bfloat16():
    module, query, key, value = _inputs(2, 9, 3, 6, 40, torch.bfloat16, seed=1)
    mask = _ragged_mask(2, 6, 40).to(torch.bfloat16)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)
    got, _ = packed_sdpa_attention(module, query, key, value, mask)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("case", ["no groups", "per-head mask", "causal flag", "softcap"])
def test_what_the_layout_does_not_cover_goes_to_sdpa(monkeypatch, case):
    heads, kv_heads, width = (4, 4, 3) if case == "no groups" else (4, 2, 3)
    module, query, key, value = _inputs(2, heads, kv_heads, width, 9, torch.float32)
    mask = _ragged_mask(2, width, 9)
    kwargs = {}
    if case == "per-head mask":
        mask = mask.expand(2, heads, width, 9).clone()
    elif case == "causal flag":
        mask = None
    elif case == "softcap":
        kwargs["softcap"] = 5.0
    calls = []
    monkeypatch.setattr("hf_specdec.cache.attention.sdpa_attention_forward",
                        lambda *args, **kw: calls.append(kw) or ("sdpa", None))
    assert packed_sdpa_attention(module, query, key, value, mask, **kwargs) == ("sdpa", None)
    assert len(calls) == 1


def test_packed_attention_swaps_and_restores():
    model = make_model("llama")
    config = model.config
    assert config._attn_implementation == "sdpa"
    with PackedAttention(model):
        assert config._attn_implementation == PACKED_SDPA
        with PackedAttention(model):  # a second forward inside the first (another thread's)
            assert config._attn_implementation == PACKED_SDPA
        assert config._attn_implementation == PACKED_SDPA
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), PackedAttention(model):
        raise RuntimeError("inside")
    assert config._attn_implementation == "sdpa"


def test_other_attention_left_alone():
    model = make_model("gpt2")
    model.config._attn_implementation = "eager"
    with PackedAttention(model):
        assert model.config._attn_implementation == "eager"


def test_a_model_set_to_the_packed_function_keeps_it():
    model = make_model("llama")
    model.config._attn_implementation = PACKED_SDPA
    with PackedAttention(model):
        assert model.config._attn_implementation == PACKED_SDPA
    assert model.config._attn_implementation == PACKED_SDPA


def test_a_model_off_the_cpu_is_left_alone():
    model = make_model("llama").to("meta")
    with PackedAttention(model):
        assert model.config._attn_implementation == "sdpa"


def test_threads_restore_when_the_last_leaves():
    model = make_model("llama")
    inside, release = threading.Barrier(3), threading.Event()

    def forward():
        with PackedAttention(model):
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=forward) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert model.config._attn_implementation == PACKED_SDPA
    release.set()
    for thread in threads:
        thread.join()
    assert model.config._attn_implementation == "sdpa"


def test_decode_steps_run_packed_and_the_prefill_does_not(monkeypatch):
    """The prompt goes through the model's own attention (as in plain generate), every later forward through the
    packed one; the output stays plain generate's and the model is left as it was."""
    model = make_model("llama")
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation))
    ids = torch.tensor([[0, 0, 5, 6, 7, 5, 6], [5, 6, 7, 5, 6, 7, 5]])
    kwargs = {"attention_mask": (ids != 0).long(), "max_new_tokens": 10, "do_sample": False}
    expected = model.generate(ids, **kwargs)
    seen.clear()
    got = hf_specdec.generate(model, ids, spec_method="ngram", **kwargs)
    assert torch.equal(got, expected)
    assert seen[0] == "sdpa" and len(seen) > 2 and set(seen[1:]) == {PACKED_SDPA}
    assert model.config._attn_implementation == "sdpa"
