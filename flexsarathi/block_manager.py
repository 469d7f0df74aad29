"""KV-cache block bookkeeping: which blocks of which tier's pool a sequence owns. No tensors.

A sequence is admitted only when the blocks for its whole life (prompt + max_tokens, capped by the
context) are free, and they are reserved at once: a running sequence never has to be preempted.
Sequences are spread over tiers so that each tier's share of admitted sequences follows the
policy's KV fractions (kv_gpu, kv_cpu, kv_disk).
"""
from __future__ import annotations

import math

from flexsarathi.sequence import Sequence


class BlockManager:
    def __init__(self, block_size: int, blocks_per_tier: dict[str, int],
                 tier_fractions: dict[str, float]):
        self.block_size = block_size
        self.free: dict[str, list[int]] = {t: list(range(n - 1, -1, -1)) for t, n in blocks_per_tier.items()}
        self.fractions = {t: tier_fractions.get(t, 0.0) for t in blocks_per_tier}
        self.admitted = {t: 0 for t in blocks_per_tier}

    def blocks_needed(self, seq: Sequence) -> int:
        return math.ceil(seq.max_len / self.block_size)

    def _tier_for(self, needed: int) -> str | None:
        total = sum(self.admitted.values()) + 1
        # The tier furthest below its share that still has room.
        candidates = [t for t, free in self.free.items() if len(free) >= needed and self.fractions[t] > 0]
        if not candidates:
            return None
        return max(candidates, key=lambda t: (self.fractions[t] * total - self.admitted[t], self.fractions[t]))

    def can_allocate(self, seq: Sequence) -> bool:
        return self._tier_for(self.blocks_needed(seq)) is not None

    def allocate(self, seq: Sequence) -> None:
        needed = self.blocks_needed(seq)
        tier = self._tier_for(needed)
        if tier is None:
            raise RuntimeError(f"no tier has {needed} free KV blocks for sequence {seq.seq_id}")
        seq.kv_tier = tier
        seq.block_table = [self.free[tier].pop() for _ in range(needed)]
        self.admitted[tier] += 1

    def free_blocks(self, seq: Sequence) -> None:
        self.free[seq.kv_tier].extend(reversed(seq.block_table))
        self.admitted[seq.kv_tier] -= 1
        seq.block_table = []
