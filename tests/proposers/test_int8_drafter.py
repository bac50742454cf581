"""`draft_quantization="int8"`: drafters read int8 copies of their weights; output stays plain generate's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from transformers import CompileConfig

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads.token_map import TokenMapLMHead
from hf_specdec.kernels import int8_linear as kernel
from hf_specdec.kernels.int8_linear import Int8Linear
from hf_specdec.proposers.int8_drafter import int8_view
from hf_specdec.suffix import SuffixCache
from tests.conftest import make_draft, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.heads.test_token_map import shared_medusa
from tests.proposers.test_eagle import eagle_head
from tests.proposers.test_mlp_speculator import random_speculator

pytestmark = pytest.mark.skipif(not kernel.int8_kernel_available(), reason="this torch has no _weight_int8pack_mm")


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts the int8 kernel's calls (one entry per call)."""
    calls: list[int] = []
    real = kernel.int8_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "int8_linear", counted)
    return calls


def _configs(target: torch.nn.Module) -> dict[str, Callable[[], SpeculativeConfig]]:
    int8 = {"draft_quantization": "int8"}
    return {
        # a float32 draft (its narrow calls in bfloat16) and a bfloat16 one, chain and dynamic tree
        "draft": lambda: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4, **int8),
        "draft_bf16_tree": lambda: SpeculativeConfig(method="draft", draft_model=make_draft().to(torch.bfloat16), top_k=2,
                                             depth=3, total_tokens=5, **int8),
        "draft_token_map": lambda: SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target),
                                             draft_token_map=torch.arange(0, 128, 2), num_speculative_tokens=3, **int8),
        "eagle": lambda: SpeculativeConfig(method="eagle", heads=eagle_head(target), num_speculative_tokens=3, **int8),
        "eagle3_bf16_tree": lambda: SpeculativeConfig(method="eagle", heads=eagle_head(target, "eagle3").to(torch.bfloat16),
                                              top_k=2, depth=2, total_tokens=3, **int8),
        "medusa": lambda: SpeculativeConfig(method="medusa", heads=heads_for(target), num_speculative_tokens=2, **int8),
        "medusa_shared": lambda: SpeculativeConfig(method="medusa", heads=shared_medusa(target, num_heads=2),
                                           num_speculative_tokens=2, **int8),
        "mlp_speculator": lambda: SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target),
                                            num_speculative_tokens=2, **int8),
        "auto": lambda: SpeculativeConfig(method="auto", draft_model=copy.deepcopy(target), **int8),
        "suffix_hybrid": lambda: SpeculativeConfig(method="suffix", suffix_cache=SuffixCache(), fallback_min_score=1.5,
                                           fallback=SpeculativeConfig(method="draft", draft_model=make_draft(),
                                                                      num_speculative_tokens=3, **int8)),
    }


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_greedy_output_is_plain_generate_and_the_kernel_drafts(arch, kernel_calls):
    target = make_model(arch)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    for name, make_config in _configs(target).items():
        if arch != "llama" and name not in ("draft", "auto"):
            continue  # the other architectures' own layers drafting (gpt2's are transformers' Conv1D)
        config = make_config()
        kernel_calls.clear()
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, expected), f"{arch}/{name}"
        assert out.spec_stats.num_draft_tokens > 0, f"{arch}/{name}"
        assert kernel_calls, f"{arch}/{name}: the int8 kernel never ran"


def test_the_drafters_own_modules_are_left_as_they_were():
    target = make_model("llama")
    draft = make_draft()
    before = {name: type(module) for name, module in draft.named_modules()}
    weights = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    view = int8_view(draft)
    assert {name: type(module) for name, module in draft.named_modules()} == before
    assert all(torch.equal(weights[name], tensor) for name, tensor in draft.state_dict().items())
    assert isinstance(view.get_output_embeddings(), Int8Linear)
    assert view.get_output_embeddings().weight is draft.get_output_embeddings().weight  # shared, not copied
    assert view.get_input_embeddings() is draft.get_input_embeddings()
    assert sum(isinstance(m, Int8Linear) for m in view.modules()) == sum(
        isinstance(m, torch.nn.Linear) for m in draft.modules())
    # the same view while the weights stand; a new one after a change, which it then reads
    assert int8_view(draft) is view
    with torch.no_grad():
        draft.lm_head.weight.mul_(2)
    again = int8_view(draft)
    assert again is not view
    assert torch.equal(again.lm_head.qweight, view.lm_head.qweight)  # scaled rows quantize alike
    assert torch.allclose(again.lm_head.scales.float(), 2 * view.lm_head.scales.float(), rtol=1e-2)
    hf_specdec.generate(target, torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False,
                        speculative=SpeculativeConfig(method="draft", draft_model=draft, draft_quantization="int8"))
    assert {name: type(module) for name, module in draft.named_modules()} == before


def test_a_token_map_lm_head_projects_with_its_int8_rows():
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(32, 128, bias=False)
    ids = torch.tensor([1, 5, 9, 40, 77])
    sliced = TokenMapLMHead(lm_head, ids, 128)
    view = int8_view(sliced)
    assert view is not sliced and sliced.projection is None and isinstance(view.projection, Int8Linear)
    hidden = torch.randn(1, 2, 32)
    exact, approx = sliced(hidden), view(hidden)
    outside = torch.ones(128, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(approx[..., outside]).all()
    torch.testing.assert_close(approx[..., ids], exact[..., ids], rtol=0.05, atol=0.05)


def test_sampling_keeps_the_target_law_with_int8_drafts(monkeypatch, kernel_calls):
    """The sampling suite's chi-square test with int8 copies drafting: its draws run as one batch of thousands of
    rows, so the kernel is let take calls of any width here (its result does not depend on it)."""
    from tests.decoding import test_sampling_lossless as lossless

    monkeypatch.setattr(kernel, "MAX_INT8_ROWS", 10**9)
    monkeypatch.setattr(kernel, "MAX_INT8_ROWS_FLOAT32", 10**9)
    target = lossless.make_target()
    law = lossless.exact_law(target, lossless.TEMPERATURE)
    for config in (
        SpeculativeConfig(method="draft", draft_model=lossless._noisy_draft(target), num_speculative_tokens=3,
                          seed=31, draft_quantization="int8"),
        SpeculativeConfig(method="mlp_speculator", heads=lossless._speculator(target), num_speculative_tokens=2,
                          seed=32, draft_quantization="int8"),
    ):
        kernel_calls.clear()
        pvalues = lossless.chi_square_pvalues(lossless.draws(target, lossless.TEMPERATURE, config), law)
        assert kernel_calls, config.method
        assert lossless.accepted(pvalues), f"{config.method}: p = {pvalues}"


@pytest.mark.parametrize(("config", "message"), [
    (dict(method="ngram"), r"draft_quantization='int8': for a drafter model .*method='ngram' drafts without a model"),
    (dict(method="early_exit", early_exit_layer=1), r"early exit drafts with the target's own layers"),
    (dict(method="suffix"), r"suffix decoding has no weights \(with a fallback, set it on the fallback's config\)"),
    (dict(method="auto"), r"method='auto' has no model drafter here"),
])
def test_methods_without_a_drafter_model_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(draft_quantization="int8", **config)


def test_unknown_quantization_and_unquantizable_drafters_are_refused():
    with pytest.raises(ValueError, match=r"draft_quantization: expected None or one of \['int8'\], got 'int4'"):
        SpeculativeConfig(method="draft", draft_model=make_draft(), draft_quantization="int4")
    on_gpu = make_draft()
    on_gpu.state_dict = lambda: {"weight": SimpleNamespace(device=torch.device("cuda:0"))}  # no GPU needed
    with pytest.raises(ValueError, match=r"the draft model is on cuda:0; the int8 kernel serves drafters on a CPU"):
        int8_view(on_gpu, "the draft model")
    odd = torch.nn.Sequential(torch.nn.Linear(24, 8))
    with pytest.raises(ValueError, match=r"the drafter \(Sequential\) has no linear layer of an inner size the int8 "
                                         r"kernel takes \(a multiple of 16\)"):
        int8_view(odd)


def test_compiled_drafting_is_refused_before_any_forward(forward_counter):
    target = make_model("llama")
    count = forward_counter(target)
    with pytest.raises(ValueError, match=r"draft_quantization='int8' runs the drafter eagerly"):
        hf_specdec.generate(target, torch.tensor([[1, 2, 3]]), max_new_tokens=4,
                            compile_config=CompileConfig(fullgraph=True),
                            speculative=SpeculativeConfig(method="draft", draft_model=make_draft(),
                                                          draft_quantization="int8"))
    assert count() == 0
