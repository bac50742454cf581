"""Up-front checks on the target: warnings for what speculative decoding cannot keep identical to plain `generate`."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from tests.conftest import make_model, padded_batch


def test_a_dynamically_quantized_target_is_named_in_a_warning():
    """torch.ao's dynamic quantization scales a forward's whole input at once, so a verify forward scores a token
    unlike a one-token forward: the call warns, naming the layer; the same model unquantized does not."""
    target = make_model("llama")
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    config = SpeculativeConfig(method="ngram")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_specdec.generate(target, ids, speculative=config, **kwargs)
    quantized = torch.ao.quantization.quantize_dynamic(target, {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM\.model\.layers\.0\.self_attn\.q_proj is dynamically "
                                         r"quantized .* greedy output can part from plain generate's"):
        hf_specdec.generate(quantized, ids, speculative=config, **kwargs)
