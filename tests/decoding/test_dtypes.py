"""Device placement and dtypes follow the model: bf16 on CPU here; fp16/bf16 on CUDA where a GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.cache.ragged import RaggedKVCache
from hf_specdec.heads import EagleConfig, EagleHead
from tests.conftest import make_draft, make_model, padded_batch


def test_bfloat16_models_generate_valid_tokens_and_masks_follow_the_dtype():
    target = make_model("llama").to(torch.bfloat16)
    draft = make_draft().to(torch.bfloat16)
    ids, mask = padded_batch([9, 5], seed=3, repeat_period=3)
    for config in (
        SpeculativeConfig(method="draft", draft_model=draft, num_speculative_tokens=3),
        SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        # a float32 head on a bf16 target, and a bf16 one: features and logits convert both ways
        SpeculativeConfig(method="eagle", heads=EagleHead(EagleConfig.for_target(target, "eagle")), top_k=2,
                          depth=2, total_tokens=3),
        SpeculativeConfig(method="eagle", heads=EagleHead(EagleConfig.for_target(target, "eagle3")).to(torch.bfloat16),
                          num_speculative_tokens=2),
    ):
        for sample in (False, True):
            out = hf_specdec.generate(target, ids, attention_mask=mask, speculative=config, max_new_tokens=10,
                                      do_sample=sample, eos_token_id=None, return_dict_in_generate=True)
            assert out.sequences.shape == (2, ids.shape[1] + 10)
            assert ((out.sequences >= 0) & (out.sequences < 128)).all()
    cache = RaggedKVCache(target)
    masks = []
    hook = target.register_forward_pre_hook(lambda module, args, kwargs: masks.append(kwargs["attention_mask"]),
                                            with_kwargs=True)
    with torch.no_grad():
        cache.prefill(ids, mask)
        cache.forward(ids[:, -1:], torch.zeros(2, 1, dtype=torch.long))  # the prompt is padded: a 4-D mask
    hook.remove()
    mask4d = masks[-1]
    assert mask4d.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_precision_self_draft_and_ngram(dtype):
    target = make_model("llama").to("cuda", dtype)
    ids, mask = padded_batch([12, 7, 10], seed=3, repeat_period=4)
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    eagle = EagleHead(EagleConfig.for_target(target, "eagle3")).to("cuda", dtype)
    for config in (
        SpeculativeConfig(method="draft", draft_model=copy.deepcopy(target), num_speculative_tokens=4),
        SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        SpeculativeConfig(method="eagle", heads=eagle, top_k=3, depth=3, total_tokens=8),
    ):
        out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
        assert out.sequences.device.type == "cuda"
        # half-precision kernels for k+1 rows may round differently from 1 row: near-ties can flip (vLLM #7627)
        agreement = (out.sequences == expected).float().mean().item()
        assert agreement > 0.9
