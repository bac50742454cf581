"""A linear layer with int8 weights (one scale per output row) for the narrow calls of drafting on a CPU.

At batch 1 a drafter's forward reads all its weights to compute one or a few rows, so on a CPU it runs at the speed
of memory, and weights stored in one byte instead of two are read in about half the time. PyTorch's
`_weight_int8pack_mm` computes `x @ (qweight * scales[:, None]).T` with the int8 weights dequantized in registers;
measured on a 2-core x86-64 CPU, 1 thread, bfloat16 activations (`python benchmarks/int8_linear.py`), it runs
2.0x to 2.3x as fast as the bfloat16 matmul for one row, 1.1x to 1.3x for four, and slower from six rows on;
with float32 activations it has no vector path and runs many times slower than a float32 matmul, but with a
float32 layer's rows rounded to bfloat16 on the way in (and the result cast back) it beats the float32 matmul by
1.2x to 4.6x up to 16 rows (`benchmarks/results/int8_linear_cpu.txt`). Hence the rule here: calls on a CPU of at
most `MAX_INT8_ROWS` rows (`MAX_INT8_ROWS_FLOAT32` for a float32 layer) go to the int8 kernel with their
activations in bfloat16; any other call uses the layer's own floating-point weight, which the layer keeps.

The kernel loads 16 activations (32 bytes) and 16 weights at a time with aligned loads (in PyTorch's source) and
checks neither the inner size nor the alignment: inner sizes that are not multiples of 16 crashed the process here
(8, 13, 20, 24, 33 and 40 in a sweep run while writing this module; 16, 32, 48, 64 and 96 ran), and an aligned load
from an activation tensor that starts off a 32-byte boundary faults. `int8_kernel_applies` refuses the first (such a
layer always takes the floating-point path) and `int8_linear` copies an unaligned input into a fresh (aligned)
tensor.

The file reads as the kernel files here do: the torch reference, the kernel's launcher, the module.
"""

from __future__ import annotations

import torch
from torch import nn

# rows (tokens) at most per call that take the int8 kernel, with bfloat16 (or float16) and with float32 activations:
# measured on a CPU, see the module docstring
MAX_INT8_ROWS = 4
MAX_INT8_ROWS_FLOAT32 = 16
# the kernel's inner-dimension step (16 bfloat16 activations per vector load)
INNER_MULTIPLE = 16
ALIGNMENT = 64  # bytes; PyTorch's CPU allocator aligns every allocation to this


def quantize_int8(
    # [N, K] floating point
    weight: torch.Tensor,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, K] int8, [N] `scale_dtype`): symmetric per-row quantization, row n = qweight[n] * scales[n], with
    scales[n] = max |weight[n]| / 127 (rows of zeros get scale 1)."""
    weight = weight.detach().float()
    peak = weight.abs().amax(dim=1)
    scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    qweight = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales.to(scale_dtype)


def int8_linear_reference(
    # [..., K]
    x: torch.Tensor,
    # [N, K] int8
    qweight: torch.Tensor,
    # [N]
    scales: torch.Tensor,
    # [N] or None
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype: the same product with the weights dequantized in float32."""
    weight = qweight.float() * scales.float()[:, None]
    out = torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def int8_kernel_applies(
    # [..., K]
    x: torch.Tensor,
    inner: int,
) -> bool:
    """Whether a call with input `x` to a layer of inner size `inner` takes the int8 kernel (a host-side fact of
    shapes, dtype and device: no sync)."""
    rows = x.numel() // max(x.shape[-1], 1)
    most = MAX_INT8_ROWS_FLOAT32 if x.dtype == torch.float32 else MAX_INT8_ROWS
    return (x.device.type == "cpu" and x.is_floating_point() and 0 < rows <= most
            and inner % INNER_MULTIPLE == 0 and _KERNEL_AVAILABLE)


# this torch's int8 weight-only matmul, looked up once (per call it would cost a namespace lookup per layer)
_KERNEL_AVAILABLE = hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_kernel_available() -> bool:
    """Whether this torch has the int8 weight-only matmul (`torch.ops.aten._weight_int8pack_mm`)."""
    return _KERNEL_AVAILABLE


def int8_linear(
    # [..., K] floating point on a CPU, few rows (`int8_kernel_applies`)
    x: torch.Tensor,
    # [N, K] int8, contiguous
    qweight: torch.Tensor,
    # [N] bfloat16
    scales: torch.Tensor,
    # [N] or None
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype: the kernel's product, computed from x in bfloat16 (callers check
    `int8_kernel_applies` first)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if not rows.is_contiguous() or rows.data_ptr() % ALIGNMENT:
        rows = rows.clone(memory_format=torch.contiguous_format)
    out = torch.ops.aten._weight_int8pack_mm(rows, qweight, scales).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Int8Linear(nn.Module):
    """A linear layer that keeps its floating-point weight and an int8 copy: narrow calls on a CPU read the copy
    (`int8_kernel_applies`), every other call the floating-point weight. `weight` and `bias` stay the layer's
    own, so code that reads them (token maps, dtype and device queries) sees what it would see on the original."""

    def __init__(
        self,
        # [N, K]
        weight: torch.Tensor,
        # [N] or None
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        qweight, scales = quantize_int8(weight)
        self.register_buffer("qweight", qweight.to(weight.device), persistent=False)
        self.register_buffer("scales", scales.to(weight.device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(
        self,
        # [..., K]
        x: torch.Tensor,
    ) -> torch.Tensor:
        if int8_kernel_applies(x, self.in_features):
            return int8_linear(x, self.qweight, self.scales, self.bias)
        # in the weight's dtype, as a token map's lm_head computes (a bfloat16 head may project with float32 rows)
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 in narrow calls"
