"""The target's lm_head and embedding weights as heads read them, whatever module holds them."""

from __future__ import annotations

import torch
from torch import nn


def _read(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    if callable(value):  # torch.ao's dynamic quantization gives its weight and bias by methods (packed int8)
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
    torch.ao's dynamic quantization or by torchao (a tensor subclass), that weight dequantized."""
    return _read(module, "weight")


def bias_of(module: nn.Module) -> torch.Tensor | None:
    """A linear layer's bias [out] (dequantized likewise), or None."""
    return _read(module, "bias")
