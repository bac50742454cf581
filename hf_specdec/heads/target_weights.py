"""The target's lm_head and embedding as heads read them, whatever module holds them: plain layers, layers quantized
by torch.ao's dynamic quantization (weight and bias given by methods, packed int8), weights held as tensor subclasses
(torchao's). `layer_spec` and `weight_version` read no weight data (drafting calls them every step); `weight_of`
and `bias_of` give the tensors, dequantized where they are held quantized (for slicing, once per call)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class LayerSpec(NamedTuple):
    shape: torch.Size  # of the weight: [out, in] (an embedding's [V, H])
    dtype: torch.dtype  # what the layer takes its input in
    device: torch.device


def layer_spec(module: nn.Module) -> LayerSpec:
    """A linear or embedding layer's weight shape, input dtype and device, without dequantizing anything: a tensor
    subclass reports its logical shape and dtype; torch.ao's dynamically quantized layers take float32 on the CPU."""
    weight = module.weight
    if callable(weight):
        return LayerSpec(torch.Size((module.out_features, module.in_features)), torch.float32, torch.device("cpu"))
    return LayerSpec(weight.shape, weight.dtype, weight.device)


def weight_version(module: nn.Module) -> tuple:
    """A key that changes when the layer's weight changes (in place or replaced), read without dequantizing."""
    weight = module.weight
    if callable(weight):  # torch.ao: the packed parameters are replaced when the weight is set
        return (id(getattr(module, "_packed_params", module)),)
    if type(weight) in (torch.Tensor, nn.Parameter):
        return (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    return (id(weight), weight._version, weight.dtype, weight.device)  # a subclass may have no data pointer


def _read(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    if callable(value):  # torch.ao's dynamic quantization
        value = value()
    if value is None:
        return None
    if value.is_quantized:
        return value.dequantize()
    if type(value) not in (torch.Tensor, nn.Parameter) and callable(getattr(value, "dequantize", None)):
        return value.dequantize()  # a tensor subclass holding quantized data (torchao's), which slicing may not know
    return value


def weight_of(module: nn.Module) -> torch.Tensor:
    """A linear or embedding layer's weight [out, in] as a float tensor: its `weight`, or, for a layer quantized by
    torch.ao's dynamic quantization or by torchao (a tensor subclass), that weight dequantized (a copy)."""
    return _read(module, "weight")


def bias_of(module: nn.Module) -> torch.Tensor | None:
    """A linear layer's bias [out] (dequantized likewise), or None."""
    return _read(module, "bias")
