"""Paged KV-cache pools (as in vLLM): fixed-size token blocks, a block table per sequence.

A pool holds, per layer, K and V for `num_blocks * block_size` token slots. A sequence's slot for
position p is `block_table[p // block_size] * block_size + p % block_size`, so variable lengths
waste at most one partly-filled block per sequence. Which blocks a sequence owns is decided by the
scheduler's block manager; the pool only stores and gathers.
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 pin_memory: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        num_slots = num_blocks * block_size
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T]; k, v: [T, kv_heads, head_dim] (any device: copied to the pool's)."""
        slots = slots.to(self.device)
        self.k[layer].index_copy_(0, slots, k.to(self.device, self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.device, self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, L] -> k, v: [B, L, kv_heads, head_dim] on the pool's device."""
        slots = slots.to(self.device)
        return self.k[layer][slots], self.v[layer][slots]
