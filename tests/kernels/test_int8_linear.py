"""The int8 weight-only linear layer: the kernel against its torch reference on odd shapes, and when it is used."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.kernels.int8_linear import (
    MAX_INT8_ROWS,
    MAX_INT8_ROWS_FLOAT32,
    Int8Linear,
    int8_kernel_applies,
    int8_kernel_available,
    int8_linear,
    int8_linear_reference,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="this torch has no _weight_int8pack_mm")


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    torch.manual_seed(0)
    weight = torch.randn(7, 48) * torch.logspace(-3, 1, 7)[:, None]
    weight[3] = 0.0
    qweight, scales = quantize_int8(weight, scale_dtype=torch.float32)
    assert qweight.dtype == torch.int8 and qweight.shape == (7, 48) and scales.shape == (7,)
    assert int(qweight.abs().max()) == 127
    assert scales[3] == 1.0 and not qweight[3].any()
    error = (qweight.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("inner", [16, 48, 576])
@pytest.mark.parametrize("outer", [1, 3, 7, 33])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 2), (1, 4)])
def test_kernel_matches_the_reference(inner, outer, lead):
    torch.manual_seed(inner * outer)
    qweight, scales = quantize_int8(torch.randn(outer, inner))
    bias = torch.randn(outer)
    x = torch.randn(*lead, inner, dtype=torch.bfloat16)
    assert int8_kernel_applies(x, inner)
    got = int8_linear(x, qweight, scales, bias)
    expected = int8_linear_reference(x, qweight, scales, bias)
    assert got.shape == (*lead, outer) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


def test_float32_input_is_computed_in_bfloat16_and_returned_in_float32():
    torch.manual_seed(1)
    qweight, scales = quantize_int8(torch.randn(9, 32))
    x = torch.randn(2, 32)
    got = int8_linear(x, qweight, scales)
    assert got.dtype == torch.float32
    expected = int8_linear_reference(x.to(torch.bfloat16), qweight, scales).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


def test_an_unaligned_input_is_copied_before_the_kernel_reads_it():
    """The kernel's aligned loads would fault on a view that starts inside a 64-byte block."""
    torch.manual_seed(2)
    qweight, scales = quantize_int8(torch.randn(5, 32))
    storage = torch.randn(3 * 32 + 1, dtype=torch.bfloat16)
    x = storage[1:].view(3, 32)  # 2 bytes past an aligned start
    assert x.data_ptr() % 64
    torch.testing.assert_close(int8_linear(x, qweight, scales), int8_linear(x.clone(), qweight, scales))


def test_the_kernel_applies_to_narrow_cpu_calls_of_a_supported_inner_size_only():
    narrow = torch.zeros(MAX_INT8_ROWS, 32, dtype=torch.bfloat16)
    assert int8_kernel_applies(narrow, 32)
    assert int8_kernel_applies(narrow.float(), 32)
    assert not int8_kernel_applies(torch.zeros(MAX_INT8_ROWS + 1, 32, dtype=torch.bfloat16), 32)
    assert int8_kernel_applies(torch.zeros(MAX_INT8_ROWS_FLOAT32, 32), 32)  # a float32 matmul is slower still
    assert not int8_kernel_applies(torch.zeros(MAX_INT8_ROWS_FLOAT32 + 1, 32), 32)
    assert not int8_kernel_applies(torch.zeros(2, 24, dtype=torch.bfloat16), 24)  # not a multiple of 16
    assert not int8_kernel_applies(torch.zeros(0, 32, dtype=torch.bfloat16), 32)
    assert not int8_kernel_applies(torch.zeros(1, 32, dtype=torch.long), 32)


def test_int8_linear_reads_the_copy_in_narrow_calls_and_its_own_weight_otherwise():
    torch.manual_seed(3)
    linear = torch.nn.Linear(32, 11).to(torch.bfloat16)
    layer = Int8Linear.from_linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert {name for name, _ in layer.named_buffers()} == {"qweight", "scales"}
    narrow = torch.randn(1, 3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(narrow), int8_linear(narrow, layer.qweight, layer.scales, linear.bias))
    wide = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(wide), linear(wide))
    odd = torch.nn.Linear(24, 5)  # an inner size the kernel cannot take: always the float weight
    assert torch.equal(Int8Linear.from_linear(odd)(torch.ones(1, 24)), odd(torch.ones(1, 24)))


def test_the_copy_changes_a_layer_by_its_rounding_only():
    """A drafter's output moves by the weights' rounding: relative error of a 576-wide row about 1%."""
    torch.manual_seed(4)
    linear = torch.nn.Linear(576, 256, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    exact = linear(x).float()
    error = (Int8Linear.from_linear(linear)(x).float() - exact).norm() / exact.norm()
    assert 0 < float(error) < 0.02
