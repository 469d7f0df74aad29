import torch

from quant import QuantConfig, quantize


def test_4bit_g64_weight_is_under_029_of_fp16():
    weight = torch.randn(4096, 4096, dtype=torch.float16)
    q = quantize(weight, QuantConfig(bits=4, group_size=64))
    fp16_bytes = weight.numel() * 2
    # 0.5 B per value of codes + (2 B scale + 2 B minimum) per 64 values = 0.5625 B per value.
    assert q.nbytes == weight.numel() * 0.5 + weight.numel() // 64 * 4
    assert q.nbytes / fp16_bytes == 0.28125 <= 0.29


def test_8bit_and_padded_groups():
    q = quantize(torch.randn(10, 100), QuantConfig(bits=8, group_size=64))  # 100 -> 2 groups of 64
    assert q.nbytes == 10 * 2 * (64 + 4)
