"""The 4-bit weight dequantization kernel (quant/cpu_weight_dequant.py) against torch's route in
quant.groupwise.dequantize, bit for bit: every code layout, symmetric and asymmetric groups,
fp32 and bf16 out, rows split over threads, values whose bf16 rounding ties."""
from __future__ import annotations

import pytest
import torch

from quant import QTensor, QuantConfig, cpu_weight_dequant, dequantize, quantize

needs_kernel = pytest.mark.skipif(not cpu_weight_dequant.available(),
                                  reason=f"kernel not available: {cpu_weight_dequant.unavailable_reason()}")

LAYOUTS = {"line_halves": {}, "adjacent_pairs": {"adjacent_pairs": True}, "group_halves": {"group_halves": True}}


def _torch_route(q: QTensor, dtype: torch.dtype, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(cpu_weight_dequant, "covers", lambda *args: False)
        return dequantize(q, dtype)


@needs_kernel
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("group,shape", [(32, (37, 96)), (64, (64, 2048)), (128, (9, 384)), (2, (5, 6)), (16, (3, 48))])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_as_torchs_route(layout, group, shape, symmetric, dtype, threads, monkeypatch):
    gen = torch.Generator().manual_seed(group * 7 + shape[0])
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 1, shape[0])[:, None] + 0.3
    q = quantize(w, QuantConfig(bits=4, group_size=group, symmetric=symmetric, **LAYOUTS[layout]))
    assert cpu_weight_dequant.covers(q, dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = dequantize(q, dtype)
        into = dequantize(q, dtype, out=torch.full(shape, float("nan"), dtype=dtype))
    finally:
        torch.set_num_threads(previous)
    want = _torch_route(q, dtype, monkeypatch)
    assert got.dtype == dtype and torch.equal(got, want) and torch.equal(into, want)


@needs_kernel
def test_bf16_rounds_ties_to_even_as_torch_does(monkeypatch):
    """Codes and groups chosen so that code * scale + minimum lands exactly halfway between two bf16
    values, both with an even and an odd last bit below: the rounding rule decides."""
    config = QuantConfig(bits=4, group_size=16)
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 1)  # [4 groups, 16]
    # scale 2**-8 with minimum 1: 1 + c / 256 needs 8 fraction bits, bf16 keeps 7: odd c are ties
    q = QTensor(data=(codes[:, :8] | (codes[:, 8:] << 4)).reshape(-1), scale=torch.full((4,), 2.0 ** -8).half(),
                minimum=torch.tensor([1.0, -1.0, 3.0, 0.5]).half(), shape=(4, 16), dtype=torch.float32, config=config)
    got = dequantize(q, torch.bfloat16)
    want = _torch_route(q, torch.bfloat16, monkeypatch)
    exact = dequantize(q, torch.float32)
    assert torch.equal(got, want) and not torch.equal(got.float(), exact)  # some values did round


def test_covers_only_what_it_computes():
    q = quantize(torch.randn(8, 64), QuantConfig(bits=4, group_size=32))
    assert cpu_weight_dequant.covers(q, torch.bfloat16) == cpu_weight_dequant.available()
    assert not cpu_weight_dequant.covers(q, torch.float16)
    assert not cpu_weight_dequant.covers(quantize(torch.randn(8, 64), QuantConfig(bits=8, group_size=32)), torch.float32)
    assert not cpu_weight_dequant.covers(quantize(torch.randn(2, 8, 64), QuantConfig(bits=4, group_size=32)),
                                         torch.float32)  # 3-D: torch's route
    assert not cpu_weight_dequant.covers(quantize(torch.randn(64, 8), QuantConfig(bits=4, group_size=32, group_dim=0)),
                                         torch.float32)
    assert not cpu_weight_dequant.covers(quantize(torch.randn(8, 40), QuantConfig(bits=4, group_size=32)),
                                         torch.float32)  # padded lines
