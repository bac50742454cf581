"""The attention the engine's forwards run: grouped-query attention packed into the query rows (the same attention
as transformers' "sdpa" function, run by the engine's decode forwards on a CPU and nowhere else), and SDPA in place
of an attention that takes no custom mask (flash, flex)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.attention import PACKED_SDPA, EngineAttention, packed_sdpa_attention, takes_no_custom_mask
from tests.conftest import make_model, padded_batch

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


def test_decode_attention_swaps_and_restores():
    model = make_model("llama")
    config = model.config
    assert config._attn_implementation == "sdpa"
    with EngineAttention(model, decode=True):
        assert config._attn_implementation == PACKED_SDPA
        with EngineAttention(model, decode=True):  # a second forward inside the first (another thread's)
            assert config._attn_implementation == PACKED_SDPA
        assert config._attn_implementation == PACKED_SDPA
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), EngineAttention(model, decode=True):
        raise RuntimeError("inside")
    assert config._attn_implementation == "sdpa"


def test_other_attention_left_alone():
    model = make_model("gpt2")
    model.config._attn_implementation = "eager"
    with EngineAttention(model, decode=True):
        assert model.config._attn_implementation == "eager"


def test_a_model_set_to_the_packed_function_keeps_it():
    model = make_model("llama")
    model.config._attn_implementation = PACKED_SDPA
    with EngineAttention(model, decode=True):
        assert model.config._attn_implementation == PACKED_SDPA
    assert model.config._attn_implementation == PACKED_SDPA


def test_a_model_off_the_cpu_is_left_alone():
    model = make_model("llama").to("meta")
    with EngineAttention(model, decode=True):
        assert model.config._attn_implementation == "sdpa"


def test_threads_restore_when_the_last_leaves():
    model = make_model("llama")
    inside, release = threading.Barrier(3), threading.Event()

    def forward():
        with EngineAttention(model, decode=True):
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


@pytest.fixture
def flash_stand_in(monkeypatch):
    """transformers' dispatch for a model loaded with flash attention, on a CPU: the function registered as
    "flash_attention_2" records its calls and fails (a flash kernel takes no 4-D mask, and none runs on a CPU)."""
    calls = []

    def flash(module, query, key, value, attention_mask, **kwargs):
        calls.append(None if attention_mask is None else tuple(attention_mask.shape))
        raise AssertionError("the flash attention function ran")

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", flash)
    return calls


@pytest.mark.parametrize("attention", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2",
                                       "flex_attention"])
def test_an_attention_without_custom_masks_runs_as_sdpa(attention):
    assert takes_no_custom_mask(attention)
    model = make_model("llama")
    model.config._attn_implementation = attention
    prefill, decode = EngineAttention(model, decode=False), EngineAttention(model, decode=True)
    with prefill:
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == attention
    with decode:  # on a CPU the decode forwards run the packed SDPA
        assert model.config._attn_implementation == PACKED_SDPA
        with prefill:  # another thread's prompt meanwhile: counted, left as it is
            assert model.config._attn_implementation == PACKED_SDPA
        assert model.config._attn_implementation == PACKED_SDPA
    assert model.config._attn_implementation == attention
    with pytest.raises(RuntimeError, match="inside"), prefill:
        raise RuntimeError("inside")
    assert model.config._attn_implementation == attention
    assert not any(takes_no_custom_mask(name) for name in ["sdpa", "eager", PACKED_SDPA, "paged|eager", None])


def test_a_model_without_sdpa_runs_eager_for_flash():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    model._supports_sdpa = False
    with EngineAttention(model, decode=True):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("method", ["ngram", "draft", "early_exit", "eagle", "static"])
def test_a_flash_attention_model_generates_as_plain_generate(flash_stand_in, method):
    """A model loaded with flash attention: every forward of the call runs SDPA (the flash function never runs), the
    output is plain `generate`'s with SDPA (float32: the same numbers), and the model keeps its flash attention."""
    from tests.proposers.test_eagle import eagle_head

    model = make_model("llama")
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation))
    ids, mask = padded_batch([5, 9, 7], repeat_period=3)
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "do_sample": False}
    expected = model.generate(ids, **kwargs)
    extra: dict = {}
    if method == "draft":
        draft = make_model("llama", seed=1)
        draft.config._attn_implementation = "flash_attention_2"
        extra["speculative"] = SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3)
    elif method == "early_exit":
        extra["speculative"] = SpeculativeConfig(method="early_exit", early_exit_layer=1)
    elif method == "eagle":
        extra["speculative"] = SpeculativeConfig(method="eagle", heads=eagle_head(model), num_speculative_tokens=3)
    elif method == "static":
        extra = {"spec_method": "ngram", "cache_implementation": "static"}
    else:
        extra["spec_method"] = method
    model.config._attn_implementation = "flash_attention_2"
    seen.clear()
    got = hf_specdec.generate(model, ids, **kwargs, **extra)
    assert torch.equal(got, expected)
    assert flash_stand_in == [] and seen and set(seen) <= {"sdpa", PACKED_SDPA}
    assert model.config._attn_implementation == "flash_attention_2"
    if method == "draft":
        assert draft.config._attn_implementation == "flash_attention_2"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and is_flash_attn_2_available()),
                    reason="needs a CUDA device and the flash_attn package")
def test_a_model_loaded_with_flash_attention_on_a_gpu():
    target = make_model("llama").to("cuda", torch.bfloat16)
    target.set_attn_implementation("flash_attention_2")
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=4)
    kwargs = {"attention_mask": mask.cuda(), "max_new_tokens": 24, "do_sample": False, "eos_token_id": None}
    expected = target.generate(ids.cuda(), **kwargs)
    got = hf_specdec.generate(target, ids.cuda(), spec_method="ngram", **kwargs)
    # flash and SDPA kernels round differently in bfloat16: near-ties can part (README, Low precision)
    assert (got == expected).float().mean().item() > 0.9
    assert target.config._attn_implementation == "flash_attention_2"


def test_the_swap_writes_what_the_attention_layers_read():
    """The swap writes a plain config's attention straight into the entry its property reads (skipping the
    setter's validation hooks), and a composite config's through the property (which would also reach its
    sub-configs: given as {"": value}, only its own)."""
    from transformers import LlavaConfig

    from hf_specdec.cache.attention import _Attention

    plain = make_model("llama").config
    attention = _Attention(plain)
    assert attention.state is not None and attention.get() == "sdpa"
    attention.set("eager")
    assert plain._attn_implementation == "eager" and attention.get() == "eager"
    composite = LlavaConfig()
    composite._attn_implementation = "sdpa"
    attention = _Attention(composite)
    assert attention.state is None
    attention.set("eager")
    assert composite._attn_implementation == "eager" and composite.text_config._attn_implementation == "sdpa"
