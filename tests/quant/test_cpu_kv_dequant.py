"""The KV gather + dequantize kernel (quant/cpu_kv_dequant.py) against quant.groupwise.dequantize:
the same bits for every value, on the layouts a compressed KV pool stores (keys grouped per channel
over a block's tokens; values grouped along each head, with padded heads and groups that straddle
the two nibble halves of a line), for any block table or slot order and any split over threads."""
from __future__ import annotations

import pytest
import torch

from quant import QuantConfig, dequantize, quantize
from quant import cpu_kv_dequant as kv

needs_kernel = pytest.mark.skipif(not kv.available(), reason=f"KV kernel not available: {kv.unavailable_reason()}")


def _codes(q) -> dict[str, torch.Tensor]:
    rows = q.shape[0]  # one row per block (keys) or slot (values), as the pool's tables hold them
    return {"data": q.data.view(rows, -1), "scale": q.scale.view(rows, -1), "minimum": q.minimum.view(rows, -1)}


@needs_kernel
@pytest.mark.parametrize("kv_heads,head_dim,block_size,length", [(2, 8, 4, 11), (3, 12, 16, 37), (1, 64, 8, 8),
                                                                  (4, 128, 64, 144), (2, 6, 2, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_keys_equal_dequantize_for_any_block_table(kv_heads, head_dim, block_size, length, threads):
    gen = torch.Generator().manual_seed(head_dim + length)
    num_blocks, batch = 9, 3
    # [blocks, kv_heads, head_dim, bs]: channels of very different ranges, as real keys have
    keys = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen) * torch.linspace(
        0.05, 20, head_dim)[:, None]
    q = quantize(keys, QuantConfig(bits=4, group_size=block_size))
    reference = dequantize(q, torch.float32).permute(0, 3, 1, 2)  # [blocks, bs, kv_heads, head_dim]
    per_seq = -(-length // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:per_seq] for _ in range(batch)])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kv.keys(_codes(q), tables, length, kv_heads, head_dim, block_size)
    finally:
        torch.set_num_threads(previous)
    positions = torch.arange(length)
    expected = reference[tables[:, positions // block_size], positions % block_size]  # [B, L, kvh, d]
    assert got.shape == (batch, length, kv_heads, head_dim) and got.dtype == torch.float32
    assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("kv_heads,head_dim,group", [(2, 12, 12), (1, 5, 6), (3, 64, 64), (2, 100, 64),
                                                     (2, 128, 64), (1, 96, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_values_equal_dequantize_for_any_slot_order(kv_heads, head_dim, group, threads):
    gen = torch.Generator().manual_seed(head_dim * 7 + group)
    num_slots, batch, length = 40, 5, 13
    values = torch.randn(num_slots, kv_heads, head_dim, generator=gen) * 3 + 1
    config = QuantConfig(bits=4, group_size=group)
    q = quantize(values, config)
    reference = dequantize(q, torch.float32)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:length] for _ in range(batch)])
    out = torch.full((batch, length, kv_heads, head_dim), float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kv.values(_codes(q), slots, kv_heads, head_dim, config, out=out)
    finally:
        torch.set_num_threads(previous)
    assert got is out
    assert torch.equal(got, reference[slots])


@needs_kernel
def test_a_wrong_output_buffer_is_one_clear_error():
    q = quantize(torch.randn(4, 2, 8), QuantConfig(bits=4, group_size=8))
    with pytest.raises(ValueError, match="out must be a contiguous fp32 CPU tensor of shape"):
        kv.values(_codes(q), torch.tensor([[0, 1]]), 2, 8, q.config, out=torch.empty(1, 2, 2, 8).transpose(1, 2))
    with pytest.raises(ValueError, match="out must be"):
        kv.values(_codes(q), torch.tensor([[0, 1]]), 2, 8, q.config, out=torch.empty(1, 2, 2, 8, dtype=torch.bfloat16))


def test_covers_only_what_the_kernel_computes():
    four = QuantConfig(bits=4, group_size=64)
    cpu = torch.device("cpu")
    assert kv.covers(four, torch.float32, cpu) == kv.available()
    for config, dtype, device in [(four, torch.bfloat16, cpu), (QuantConfig(bits=8, group_size=64), torch.float32, cpu),
                                  (QuantConfig(bits=4, group_size=64, symmetric=True), torch.float32, cpu),
                                  (QuantConfig(bits=4, group_size=64, minimum_fp32=True), torch.float32, cpu),
                                  (QuantConfig(bits=4, group_size=64, adjacent_pairs=True), torch.float32, cpu),
                                  (four, torch.float32, torch.device("meta"))]:
        assert not kv.covers(config, dtype, device)
