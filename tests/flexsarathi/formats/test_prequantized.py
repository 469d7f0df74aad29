"""concat_rows (q/k/v fused by rows): parts read into their rows of one buffer are that buffer,
others are concatenated; either way the fused weight is the parts one after another."""
from __future__ import annotations

import torch

from flexsarathi.formats.prequantized import concat_rows
from quant import QuantConfig, dequantize, quantize


def _parts(buffers: dict | None = None):
    config = QuantConfig(bits=4, group_size=32, adjacent_pairs=True)
    parts = [quantize(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)), config) for rows in (3, 5, 2)]
    if buffers is None:
        return parts
    out = []
    for name in ("data", "scale"):  # each part's codes and scales moved into its rows of one buffer
        whole = torch.cat([getattr(p, name) for p in parts])
        buffers[name] = whole
        out.append(whole.split([getattr(p, name).numel() for p in parts]))
    return [type(p)(data=d, scale=s, minimum=p.minimum, shape=p.shape, dtype=p.dtype, config=p.config)
            for p, d, s in zip(parts, *out)]


def test_parts_end_to_end_in_one_buffer_are_fused_without_a_copy():
    buffers = {}
    fused = concat_rows(_parts(buffers))
    assert fused.data.data_ptr() == buffers["data"].data_ptr() and fused.data.numel() == buffers["data"].numel()
    assert fused.scale.data_ptr() == buffers["scale"].data_ptr()
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in _parts()]))


def test_parts_apart_are_concatenated():
    parts = _parts()
    fused = concat_rows(parts)
    assert all(fused.data.data_ptr() != p.data.data_ptr() for p in parts)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))
