"""4-bit codes stored as adjacent pairs (QuantConfig.adjacent_pairs: the byte layout of GPTQ's and
compressed-tensors' int32 words) read back exactly as the split-half layout does, on every path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quant import QuantConfig, dequantize, quantize
from quant.fused import dequant_linear_reference, quantized_linear
from quant.packing import pack_4bit_pairs, unpack_4bit_pairs_into


def test_pairs_pack_and_unpack_are_inverse_and_match_int32_words():
    codes = torch.randint(0, 16, (5, 24), dtype=torch.uint8)
    packed = pack_4bit_pairs(codes)
    out = torch.empty_like(codes)
    unpack_4bit_pairs_into(packed, out)
    assert torch.equal(out, codes)
    # An int32 word holding value j at bits 4j (little-endian) has exactly these bytes.
    words = sum((codes[:, j::8].to(torch.int64) << (4 * j)) for j in range(8)).to(torch.uint32).view(torch.int32)
    assert torch.equal(words.contiguous().view(torch.uint8), packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("minimum_fp32", [False, True])
def test_pairs_dequantize_like_split_halves(dtype, minimum_fp32):
    x = torch.randn(64, 256)
    split = quantize(x, QuantConfig(bits=4, group_size=32, minimum_fp32=minimum_fp32))
    pairs = quantize(x, QuantConfig(bits=4, group_size=32, minimum_fp32=minimum_fp32, adjacent_pairs=True))
    assert pairs.minimum.dtype == (torch.float32 if minimum_fp32 else torch.float16)
    assert torch.equal(dequantize(split, dtype), dequantize(pairs, dtype))
    inputs = torch.randn(3, 256, dtype=dtype)
    want = F.linear(inputs, dequantize(pairs, dtype))
    assert torch.equal(quantized_linear(inputs, pairs), want)
    got = dequant_linear_reference(inputs, pairs.data, pairs.scale, pairs.minimum, None, pairs.layout, 4, True)
    assert torch.equal(got, want)


def test_adjacent_pairs_is_for_4_bits_only():
    with pytest.raises(ValueError, match="adjacent_pairs"):
        QuantConfig(bits=8, adjacent_pairs=True)
