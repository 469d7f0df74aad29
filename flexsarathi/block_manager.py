"""KV-cache block bookkeeping: which blocks of which tier's pool a sequence owns. No tensors.

Blocks have global ids: tier t owns ids [base[t], base[t] + blocks[t]). Pools are sized by the
policy's KV fractions, so each tier holds its share of the cache by bytes (to a block). A sequence
is admitted only when the blocks for its whole life (prompt + max_tokens, capped by the context)
are free, and takes them at once, fastest tier first: a running sequence is never preempted, and
the blocks of each tier cover one contiguous range of its positions (a sequence that does not fit
in the rest of one tier continues in the next; attention merges the parts exactly).
"""
from __future__ import annotations

import math
from collections import deque

from flexsarathi.sequence import Sequence

TIERS = ("gpu", "cpu", "disk")


class BlockManager:
    def __init__(self, block_size: int, blocks_per_tier: dict[str, int], num_residual: int):
        """num_residual: rows of the compressed pools' full-precision buffer, one per sequence
        that may run at once (each has at most one block being filled)."""
        unknown = set(blocks_per_tier) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown KV tiers {sorted(unknown)}; tiers are {TIERS}")
        self.block_size = block_size
        self.base: dict[str, int] = {}
        self.free: dict[str, deque[int]] = {}
        start = 0
        for tier in TIERS:
            count = blocks_per_tier.get(tier, 0)
            self.base[tier], self.free[tier] = start, deque(range(start, start + count))
            start += count
        self.num_blocks = start
        self.free_residual: deque[int] = deque(range(num_residual))

    def tier_of(self, block: int) -> str:
        for tier in reversed(TIERS):
            if block >= self.base[tier]:
                return tier
        raise ValueError(f"block {block} is negative")

    def blocks_needed(self, seq: Sequence) -> int:
        return math.ceil(seq.max_len / self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.can_allocate_all([seq])

    def can_allocate_all(self, seqs: list[Sequence]) -> bool:
        """Whether all of `seqs` could be admitted now, together."""
        return (len(seqs) <= len(self.free_residual)
                and sum(len(f) for f in self.free.values()) >= sum(self.blocks_needed(s) for s in seqs))

    def allocate(self, seq: Sequence) -> None:
        needed = self.blocks_needed(seq)
        if not self.can_allocate(seq):
            raise RuntimeError(f"no room for {needed} KV blocks of sequence {seq.seq_id}")
        table = []
        for tier in TIERS:
            while len(table) < needed and self.free[tier]:
                table.append(self.free[tier].popleft())
        seq.block_table = table
        seq.residual_id = self.free_residual.popleft()

    def free_blocks(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.free[self.tier_of(block)].append(block)
        seq.block_table = []
        self.free_residual.append(seq.residual_id)
        seq.residual_id = -1
