"""Paged KV-cache pools (as in vLLM), one per tier: fixed-size token blocks, a block table per
sequence (kept by the scheduler's block manager; the pool only stores and gathers).

A pool holds, per layer, K and V for `num_slots` token slots. It lives in compute-device memory
(gpu tier), host memory (cpu tier, pinned on CUDA) or a memory-mapped file in the offload folder
(disk tier). With `compress=True` K and V are stored 4-bit, grouped along the head dimension,
compressed on store and dequantized on gather on the device that attends (so a CPU-tier cache
crosses PCIe compressed).
"""
from __future__ import annotations

import os
import tempfile

import torch

from quant import QTensor, QuantConfig, dequantize, quantize


def kv_quant_config(head_dim: int, bits: int = 4, group_size: int = 64) -> QuantConfig:
    """Groups along the head dimension, never wider than one head (a group never mixes heads)."""
    group = min(group_size, head_dim + head_dim % 2)
    return QuantConfig(bits=bits, group_size=group, group_dim=-1)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool,
            folder: str | None) -> torch.Tensor:
    if folder is None:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    # Disk tier: a file mapped into memory; unlinked at once so nothing outlives the process.
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    fd, path = tempfile.mkstemp(prefix="kv-", suffix=".bin", dir=folder)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    return flat[:nbytes].view(dtype).view(shape)


class KVPool:
    def __init__(self, tier: str, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, *, quant: QuantConfig | None = None,
                 pin_memory: bool = False, folder: str | None = None):
        """quant: None stores K/V in `dtype`; a QuantConfig (grouped along the head dimension,
        group_dim=-1; see kv_quant_config) stores them compressed."""
        self.tier, self.num_slots, self.dtype = tier, num_slots, dtype
        self.device = torch.device(device)
        self.kv_heads, self.head_dim = num_kv_heads, head_dim
        if quant is not None and quant.group_dim not in (-1, 2):
            raise ValueError(f"KV quantization must group along the head dimension (group_dim=-1), got {quant}")
        self.quant = quant
        if self.quant is None:
            shapes = {"": ((num_layers, num_slots, num_kv_heads, head_dim), dtype)}
        else:
            groups = num_kv_heads * -(-head_dim // self.quant.group_size)  # per slot
            shapes = {"data": ((num_layers, num_slots, groups * self.quant.bytes_per_group), torch.uint8),
                      "scale": ((num_layers, num_slots, groups), torch.float16),
                      "minimum": ((num_layers, num_slots, groups), torch.float16)}
        self.k = {n: _buffer(s, d, self.device, pin_memory, folder) for n, (s, d) in shapes.items()}
        self.v = {n: _buffer(s, d, self.device, pin_memory, folder) for n, (s, d) in shapes.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in list(self.k.values()) + list(self.v.values()))

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       quant: QuantConfig | None) -> int:
        if quant is None:
            return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        q = quant
        groups = num_kv_heads * -(-head_dim // q.group_size)
        return 2 * num_layers * groups * (q.bytes_per_group + 4)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a stored value reads back as (identity unless compressed)."""
        return x if self.quant is None else dequantize(quantize(x, self.quant), x.dtype)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T]; k, v: [T, kv_heads, head_dim] on any device."""
        slots = slots.to(self.device)
        for pool, x in ((self.k, k), (self.v, v)):
            if self.quant is None:
                pool[""][layer].index_copy_(0, slots, x.to(self.device, self.dtype))
                continue
            q = quantize(x, self.quant)  # on x's device: less to copy
            num = x.shape[0]
            for name, part in (("data", q.data), ("scale", q.scale), ("minimum", q.minimum)):
                pool[name][layer].index_copy_(0, slots, part.view(num, -1).to(self.device))

    def gather(self, layer: int, slots: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, L] -> fresh k, v: [B, L, kv_heads, head_dim] in the pool dtype on `device`."""
        slots = slots.to(self.device)
        batch, length = slots.shape
        out = []
        for pool in (self.k, self.v):
            if self.quant is None:
                out.append(pool[""][layer][slots].to(device, non_blocking=True))
                continue
            parts = {n: pool[n][layer][slots].reshape(-1).to(device, non_blocking=True) for n in pool}
            q = QTensor(data=parts["data"], scale=parts["scale"], minimum=parts["minimum"],
                        shape=(batch * length, self.kv_heads, self.head_dim), dtype=self.dtype,
                        config=self.quant)
            out.append(dequantize(q).view(batch, length, self.kv_heads, self.head_dim))
        return out[0], out[1]
