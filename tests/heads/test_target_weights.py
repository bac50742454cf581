"""Heads read the target's lm_head and embedding whatever module holds them: plain layers as they are, layers
quantized by torch.ao's dynamic quantization and weights held as tensor subclasses (torchao's) dequantized; every
head, with and without a token map, then drafts for such a target."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.heads.target_weights import bias_of, layer_spec, weight_of
from hf_specdec.heads.token_map import token_map_lm_head
from tests.conftest import VOCAB, make_model, padded_batch
from tests.heads.medusa.test_model import heads_for
from tests.heads.test_token_map import shared_medusa
from tests.proposers.test_eagle import eagle_head
from tests.proposers.test_mlp_speculator import random_speculator


def _quantized(module: torch.nn.Module) -> torch.nn.Module:
    return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)


def test_plain_layers_give_their_own_tensors_and_quantized_ones_their_dequantized_weights():
    torch.manual_seed(0)
    linear, embedding = torch.nn.Linear(16, 8), torch.nn.Embedding(8, 16)
    assert weight_of(linear) is linear.weight and bias_of(linear) is linear.bias
    assert weight_of(embedding) is embedding.weight and bias_of(embedding) is None
    packed = _quantized(torch.nn.Sequential(linear))[0]
    assert callable(packed.weight)  # what the heads used to read as a tensor
    assert weight_of(packed).dtype == torch.float32 and not weight_of(packed).is_quantized
    torch.testing.assert_close(weight_of(packed), linear.weight, atol=0.01, rtol=0)
    torch.testing.assert_close(bias_of(packed), linear.bias)
    assert bias_of(_quantized(torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False)))[0]) is None


def test_spec_and_token_map_slices_of_a_quantized_layer_read_no_weight_data(monkeypatch):
    """What drafting reads every step (shape, input dtype, device) and the token map's slice, kept across calls, come
    without dequantizing the packed weight again."""
    packed = _quantized(torch.nn.Sequential(torch.nn.Linear(16, 8)))[0]
    token_map = torch.tensor([1, 4, 6])
    sliced = token_map_lm_head(packed, token_map)
    torch.testing.assert_close(sliced.weight, weight_of(packed)[token_map])
    monkeypatch.setattr(type(packed), "weight", lambda self: pytest.fail("the packed weight was read"))
    assert layer_spec(packed) == (torch.Size((8, 16)), torch.float32, torch.device("cpu"))
    assert token_map_lm_head(packed, token_map) is sliced


class Packed(torch.Tensor):
    """A weight held as a tensor subclass, as torchao's quantized weights are: the lm_head's forward runs, slicing
    its rows does not, nor does the layer take an empty input (torchao's dynamic activation scales fail on one)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.index_select, torch.index_select):
            raise NotImplementedError("Packed: index_select")
        if func is torch.nn.functional.linear and args[0].numel() == 0:
            raise RuntimeError("Packed: no scale for an empty input")
        return super().__torch_function__(func, types, args, kwargs or {})

    def dequantize(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor) * 1


def test_a_tensor_subclass_weight_is_read_dequantized():
    linear = torch.nn.Linear(16, 8)
    plain = linear.weight.detach().clone()
    linear.weight = torch.nn.Parameter(plain.as_subclass(Packed), requires_grad=False)
    with pytest.raises(NotImplementedError):
        linear.weight.index_select(0, torch.tensor([1]))
    assert type(weight_of(linear)) is torch.Tensor and torch.equal(weight_of(linear), plain)


@pytest.mark.parametrize("name", ["eagle", "eagle_token_map", "medusa_token_map", "mlp_speculator"])
def test_heads_draft_for_a_target_whose_lm_head_weight_is_a_tensor_subclass(name):
    """The output stays plain generate's: the subclass computes what the plain weight does."""
    target = make_model("llama")
    config = _heads(target)[name]
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    expected = target.generate(ids, **kwargs)
    weight = target.lm_head.weight.detach().clone()
    target.lm_head.weight = torch.nn.Parameter(weight.as_subclass(Packed), requires_grad=False)
    out = hf_specdec.generate(target, ids, speculative=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.num_draft_tokens > 0


def _heads(target: torch.nn.Module) -> dict[str, SpeculativeConfig]:
    medusa_map = shared_medusa(target)
    medusa_map.set_token_map(torch.arange(0, VOCAB, 3))
    eagle_map = eagle_head(target, seed=1)
    eagle_map.set_token_map(torch.arange(0, VOCAB, 2))
    return {"eagle": SpeculativeConfig(method="eagle", heads=eagle_head(target)),
            "eagle_token_map": SpeculativeConfig(method="eagle", heads=eagle_map),
            "medusa": SpeculativeConfig(method="medusa", heads=heads_for(target)),
            "medusa_token_map": SpeculativeConfig(method="medusa", heads=medusa_map),
            "mlp_speculator": SpeculativeConfig(method="mlp_speculator", heads=random_speculator(target))}


@pytest.mark.parametrize("name", ["eagle", "eagle_token_map", "medusa", "medusa_token_map", "mlp_speculator"])
def test_heads_draft_for_a_dynamically_quantized_target(name):
    base = make_model("llama")
    config = _heads(base)[name]
    target = _quantized(copy.deepcopy(base))
    ids, mask = padded_batch([9, 6], seed=3, repeat_period=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".* is dynamically quantized")  # tests/test_capabilities.py
        out = hf_specdec.generate(target, ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  speculative=config, return_dict_in_generate=True)
    assert out.spec_stats.num_draft_tokens > 0
