"""The CPU 4-bit paths against dequantize + matmul.

- `dequantize(q, bfloat16)` (which now writes bf16 directly on the CPU) must be bit for bit
  `dequantize(q, float32)` rounded to bf16: the arithmetic it replaced.
- `to_int4pack` must equal torch's own converter byte for byte (the layout is machine-specific).
- `linear_4bit` (torch's int4 kernel) must lie within the error bound derived in quant/cpu_matmul.py
  of the exact product with `dequantize`'s bf16 weights: the weight difference the bf16 scale and
  zero allow, fp32 accumulation (K * 2**-24 relative to sum |x||w|) and one rounding to bf16.
"""
from __future__ import annotations

import pytest
import torch

from quant import QuantConfig, dequantize, quantize
from quant.cpu_matmul import (kernel_covers, kernel_order_scales, layout_matches_torch, linear_4bit, pack_for_cpu_kernel, to_int4pack,
                              weight_error_bound)
from quant.packing import unpack_4bit

needs_kernel = pytest.mark.skipif(not layout_matches_torch(), reason="torch's CPU int4 layout differs on this CPU")
U_BF16 = 2.0**-8
U_FP32 = 2.0**-24


def _weight(out_features: int, in_features: int, seed: int, group_size: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05 + 0.01
    return quantize(w.bfloat16(), QuantConfig(bits=4, group_size=group_size))


@pytest.mark.parametrize("shape,group_dim", [((192, 320), -1), ((7, 100), -1), ((130, 33), 0), ((1, 64), -1)])
def test_bf16_dequantize_is_fp32_dequantize_rounded(shape, group_dim):
    g = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(*shape, generator=g) * 3, QuantConfig(bits=4, group_size=64, group_dim=group_dim))
    expected = dequantize(q, torch.float32).bfloat16()
    out = torch.empty(shape, dtype=torch.bfloat16)
    for got in (dequantize(q, torch.bfloat16), dequantize(q, torch.bfloat16, out=out)):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (192, 320), (128, 2048)])
def test_packing_equals_torch_converter(out_features, in_features):
    q = _weight(out_features, in_features, seed=2)
    codes = unpack_4bit(q.data.view(out_features, -1)).to(torch.int32)  # [out, in], split halves undone
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert torch.equal(to_int4pack(q)[0], expected)


def _check_within_bound(x, q, bias, y):
    w = dequantize(q, torch.bfloat16).double()  # what dequantize + matmul multiplies by
    reference = x.double() @ w.T + (0 if bias is None else bias.double())
    wb = weight_error_bound(q).double()
    ax = x.double().abs()
    weight_part = ax @ wb.T
    accumulation = in_features_gamma(q.shape[1]) * (ax @ (w.abs() + wb).T)
    rounding = U_BF16 * (1 + 2 * U_BF16) * y.double().abs()
    bound = weight_part + accumulation + rounding + (0 if bias is None else U_BF16 * bias.double().abs())
    error = (y.double() - reference).abs()
    assert (error <= bound).all(), f"max excess {(error - bound).max().item():.3g}"
    return error, bound


def in_features_gamma(k: int) -> float:
    return (k + 1) * U_FP32 / (1 - (k + 1) * U_FP32)  # fp32 accumulation of k products plus the bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_4bit_within_derived_bound(rows, with_bias):
    q = _weight(192, 320, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 320, generator=g).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16() if with_bias else None
    y = linear_4bit(x, pack_for_cpu_kernel(q), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 192)
    _check_within_bound(x, q, bias, y)


@needs_kernel
def test_linear_4bit_keeps_leading_dims_and_bound_is_tight_enough_to_catch_a_wrong_weight():
    q, other = _weight(128, 256, seed=5), _weight(128, 256, seed=6)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = linear_4bit(x, pack_for_cpu_kernel(q))
    assert y.shape == (2, 3, 128)
    flat = y.view(-1, 128)
    _check_within_bound(x.view(-1, 256), q, None, flat)
    with pytest.raises(AssertionError):  # the bound is not so loose that another weight passes
        _check_within_bound(x.view(-1, 256), other, None, flat)


def test_pack_refuses_what_the_kernel_does_not_cover():
    assert pack_for_cpu_kernel(_weight(100, 128, seed=8)) is None  # rows not whole 64-row blocks
    eight_bit = quantize(torch.randn(64, 128), QuantConfig(bits=8, group_size=64))
    assert not kernel_covers(eight_bit)
    per_column = quantize(torch.randn(64, 128), QuantConfig(bits=4, group_size=64, group_dim=0))
    assert not kernel_covers(per_column)


@needs_kernel
def test_linear_4bit_refuses_fp32_and_wrong_width():
    packed = pack_for_cpu_kernel(_weight(64, 128, seed=9))
    with pytest.raises(ValueError, match="bf16"):
        linear_4bit(torch.randn(2, 128), packed)
    with pytest.raises(ValueError, match="128"):
        linear_4bit(torch.randn(2, 64).bfloat16(), packed)


@pytest.mark.parametrize("offset", [0, 2, 1])  # elements into a flat buffer; 1: no int32 view there
def test_kernel_order_scales_is_the_transpose_bit_for_bit(offset):
    """The int32 pair transpose equals the plain `[in / group, out, 2]` transpose for every bit
    pattern (random int16 bits, NaN and infinity patterns included), from a flat buffer at even
    and odd offsets, as a working buffer's component view is."""
    out_features, groups = 128, 12
    bits = torch.randint(-2**15, 2**15, (offset + out_features * groups * 2,), dtype=torch.int16,
                         generator=torch.Generator().manual_seed(offset))
    scales_zeros = bits.view(torch.bfloat16)[offset:].view(out_features, groups, 2)
    got = kernel_order_scales(scales_zeros)
    assert got.shape == (groups, out_features, 2) and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), scales_zeros.transpose(0, 1).contiguous().view(torch.int16))
