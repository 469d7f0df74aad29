"""A 4-bit weight at rest in the CPU int4 kernel's layout (quant/int4pack.py) against dequantize + matmul.

- `dequantize_int4pack` must be bit for bit what the kernel multiplies by, `(c - 8) * s + z` in fp32
  from the codes and the bf16 `s`, `z` (written here from our own split-half codes, not from the
  kernel's layout), rounded to the output dtype.
- The wired linear (`quantized_linear` on an `Int4Packed`), at decode rows (the kernel) and at
  prefill rows (dequantize_int4pack + F.linear), must lie within the bound derived in
  quant/cpu_matmul.py of `dequantize(q, bfloat16)` + F.linear; the prefill path adds one bf16
  rounding of each kernel weight (u |w_kernel|, with |w_kernel| <= |w| + the weight bound).
- The stored form (`components`) round-trips through `Int4Packed.from_flat` and any 64-row block
  range of it is the packing of those rows alone (what a row piece on a tier holds).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS
from quant import QuantConfig, dequantize, quantize, quantized_linear
from quant.cpu_matmul import BLOCK_ROWS, Int4Packed, layout_matches_torch, linear_4bit, pack_for_cpu_kernel, \
    weight_error_bound
from quant.int4pack import dequantize_int4pack
from quant.layout import GroupLayout
from quant.packing import unpack_4bit
from quant.qtensor import QTensor
from tests.quant.test_cpu_matmul import U_BF16, _check_within_bound, _weight, in_features_gamma

pytestmark = pytest.mark.skipif(not layout_matches_torch(),
                                reason="torch's CPU int4 layout differs from ours on this CPU (not AVX-512)")


def _kernel_weights(q: QTensor, packed: Int4Packed) -> torch.Tensor:
    """fp32 `[out, in]`: (c - 8) * s + z from our own codes and the bf16 s, z."""
    out_features, in_features = q.shape
    codes = unpack_4bit(q.data.view(out_features, -1)).float()
    s = packed.scales_zeros[..., 0].float().repeat_interleave(q.config.group_size, dim=1)
    z = packed.scales_zeros[..., 1].float().repeat_interleave(q.config.group_size, dim=1)
    return (codes - 8) * s + z


@pytest.mark.parametrize("out_features,in_features,group_size", [(64, 64, 64), (192, 320, 64), (128, 2048, 32),
                                                                 (64 * 40, 128, 128)])
def test_dequantize_int4pack_is_the_kernels_weight_rounded(out_features, in_features, group_size):
    q = _weight(out_features, in_features, seed=11, group_size=group_size)
    packed = pack_for_cpu_kernel(q)
    exact = _kernel_weights(q, packed)
    assert torch.equal(dequantize_int4pack(packed, torch.float32), exact)
    out = torch.empty(out_features, in_features, dtype=torch.bfloat16)
    got = dequantize_int4pack(packed, out=out)
    assert got is out and torch.equal(got.view(torch.int16), exact.bfloat16().view(torch.int16))


def test_the_kernel_multiplies_by_those_weights():
    """At one row the kernel's product is an fp32 dot product of x with the fp32 kernel weights."""
    q = _weight(128, 256, seed=12)
    packed = pack_for_cpu_kernel(q)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(13)).bfloat16()
    y = linear_4bit(x, packed).double()
    w = _kernel_weights(q, packed).double()
    reference = x.double() @ w.T
    bound = in_features_gamma(256) * (x.double().abs() @ w.abs().T) + U_BF16 * reference.abs() * (1 + 1e-6)
    assert ((y - reference).abs() <= bound).all()


def _check_prefill_within_bound(x, q, y):
    """The derived bound, widened by the prefill path's one bf16 rounding of each kernel weight."""
    widened = weight_error_bound(q) + U_BF16 * (dequantize(q, torch.float32).abs() + weight_error_bound(q))
    w = dequantize(q, torch.bfloat16).double()
    reference = x.double() @ w.T
    ax = x.double().abs()
    bound = (ax @ widened.double().T + in_features_gamma(q.shape[1]) * (ax @ (w.abs() + widened.double()).T)
             + U_BF16 * (1 + 2 * U_BF16) * y.double().abs())
    assert ((y.double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 7, CPU_INT4_KERNEL_MAX_ROWS, CPU_INT4_KERNEL_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_wired_linear_within_derived_bound_at_decode_and_prefill_rows(rows, with_bias):
    q = _weight(192, 320, seed=14)
    packed = pack_for_cpu_kernel(q)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 320, generator=g).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16() if with_bias else None
    y = quantized_linear(x, packed, bias)
    assert y.shape == (rows, 192) and y.dtype == torch.bfloat16
    if rows <= CPU_INT4_KERNEL_MAX_ROWS:
        assert torch.equal(y, linear_4bit(x, packed, bias))  # the kernel path
        _check_within_bound(x, q, bias, y)
    else:  # bit for bit the dequantized kernel weights through F.linear
        kernel_bf16 = _kernel_weights(q, packed).bfloat16()
        assert torch.equal(y, F.linear(x, kernel_bf16, bias))
        if bias is None:  # with a bias: the same F.linear, so the equality above carries the bound
            _check_prefill_within_bound(x, q, y)


def test_prefill_bound_catches_a_wrong_weight():
    q, other = _weight(128, 256, seed=15), _weight(128, 256, seed=16)
    x = torch.randn(100, 256, generator=torch.Generator().manual_seed(17)).bfloat16()
    y = quantized_linear(x, pack_for_cpu_kernel(other))
    with pytest.raises(AssertionError):
        _check_prefill_within_bound(x, q, y)


def test_stored_components_round_trip_and_block_ranges_are_self_contained():
    q = _weight(256, 192, seed=18)
    packed = pack_for_cpu_kernel(q)
    flat = packed.components()
    assert [c.dtype for c in flat] == [torch.uint8, torch.bfloat16] and all(c.dim() == 1 for c in flat)
    again = Int4Packed.from_flat(*(c.clone() for c in flat), packed.shape, packed.group_size)
    assert torch.equal(again.packed, packed.packed) and torch.equal(again.scales_zeros, packed.scales_zeros)
    start, stop = BLOCK_ROWS, 3 * BLOCK_ROWS  # a row piece of two blocks, as a tier holds it
    rows_only = _rows(q, start, stop)
    alone = pack_for_cpu_kernel(rows_only).components()
    for whole, part in zip(flat, alone):
        per_row = whole.numel() // q.shape[0]
        assert torch.equal(whole[start * per_row:stop * per_row], part)


def _rows(q: QTensor, start: int, stop: int) -> QTensor:
    """Rows [start, stop) of a weight grouped along its rows' input dimension."""
    groups_per_row = q.shape[1] // q.config.group_size
    bytes_per_row = groups_per_row * q.config.bytes_per_group
    shape = (stop - start, q.shape[1])
    assert GroupLayout.of(shape, q.config).num_groups == (stop - start) * groups_per_row
    return QTensor(data=q.data[start * bytes_per_row:stop * bytes_per_row],
                   scale=q.scale[start * groups_per_row:stop * groups_per_row],
                   minimum=q.minimum[start * groups_per_row:stop * groups_per_row], shape=shape, dtype=q.dtype,
                   config=q.config)


def test_dequantize_int4pack_refuses_a_wrong_buffer():
    packed = pack_for_cpu_kernel(quantize(torch.randn(64, 128), QuantConfig(bits=4, group_size=64)))
    with pytest.raises(ValueError, match="64, 128"):
        dequantize_int4pack(packed, out=torch.empty(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float16"):
        dequantize_int4pack(packed, out=torch.empty(64, 128, dtype=torch.float16))


@pytest.mark.parametrize("kernel_layout", [True, False])
def test_the_reused_buffer_serves_calls_inside_and_outside_inference_mode(kernel_layout):
    """The engine runs under inference mode; a later direct call with a weight of the same shape
    reuses the buffer the engine's call made (a shape no other test uses, so this call makes it)."""
    q = _weight(320, 192, seed=19)
    weight = pack_for_cpu_kernel(q) if kernel_layout else q
    x = torch.randn(CPU_INT4_KERNEL_MAX_ROWS + 1, 192, generator=torch.Generator().manual_seed(20)).bfloat16()
    with torch.inference_mode():
        inside = quantized_linear(x, weight)
    assert torch.equal(quantized_linear(x, weight), inside)
