"""4-bit codes stored as split halves of each group (QuantConfig.group_halves: the `qs` bytes of
GGUF's Q4_0 and Q4_1 blocks) read back exactly as the split-halves-of-a-line layout does, on every
path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quant import QuantConfig, dequantize, quantize
from quant.fused import dequant_linear_reference, quantized_linear


def test_group_halves_bytes_hold_codes_j_and_j_plus_half_a_group():
    x = torch.randn(6, 128)
    q = quantize(x, QuantConfig(bits=4, group_size=32, group_halves=True))
    line = quantize(x, QuantConfig(bits=4, group_size=32))
    codes = torch.cat([line.data.view(6, 64) & 0x0F, line.data.view(6, 64) >> 4], dim=1)  # [6, 128]: each value's code
    groups = codes.view(-1, 32)
    assert torch.equal(q.data.view(-1, 16), groups[:, :16] | (groups[:, 16:] << 4))
    assert torch.equal(q.scale, line.scale) and torch.equal(q.minimum, line.minimum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,minimum_fp32", [(32, False), (64, True), (128, False)])
def test_group_halves_dequantize_like_split_halves(dtype, group, minimum_fp32):
    x = torch.randn(40, 256)
    split = quantize(x, QuantConfig(bits=4, group_size=group, minimum_fp32=minimum_fp32))
    halves = quantize(x, QuantConfig(bits=4, group_size=group, minimum_fp32=minimum_fp32, group_halves=True))
    assert torch.equal(dequantize(split, dtype), dequantize(halves, dtype))
    inputs = torch.randn(3, 256, dtype=dtype)
    want = F.linear(inputs, dequantize(halves, dtype))
    assert torch.equal(quantized_linear(inputs, halves), want)
    got = dequant_linear_reference(inputs, halves.data, halves.scale, halves.minimum, None, halves.layout, 4,
                                   group_halves=True)
    assert torch.equal(got, want)


def test_group_halves_is_for_4_bits_without_adjacent_pairs():
    with pytest.raises(ValueError, match="group_halves"):
        QuantConfig(bits=8, group_halves=True)
    with pytest.raises(ValueError, match="group_halves"):
        QuantConfig(bits=4, group_halves=True, adjacent_pairs=True)
    assert QuantConfig(bits=4, group_halves=True).line_halves is False and QuantConfig().line_halves
