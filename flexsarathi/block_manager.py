"""KV-cache block bookkeeping: which blocks of which tier's pool a sequence owns. No tensors.

Blocks have global ids: tier t owns ids [base[t], base[t] + blocks[t]). Pools are sized by the
policy (its KV capacity split by its KV fractions), so each tier holds its share of the cache by
bytes (to a block). A sequence's block table is laid fastest tier first, and the blocks of each
tier cover one contiguous range of its positions (a sequence that does not fit in the rest of one
tier continues in the next; attention merges the parts exactly). Two ways to fill it:

- lifetime reservation (`allocate(seq, seq.max_len)`): every block the sequence can ever need
  (prompt + max_tokens, capped by the context), taken at admission; it never grows.
- on demand (`allocate(seq, tokens)` then `grow(seq, tokens)`): the blocks its tokens need now; a
  table grows only into the tier of its last block or slower ones, so the tiers stay in order.

Each admitted sequence also holds one row of the compressed pools' full-precision residual
buffer (the block being filled), so rows bound the running set too.
"""
from __future__ import annotations

import math
from collections import deque

from flexsarathi.sequence import Sequence
from policy_search.policy import TIERS


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

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self.free.values())

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks of the sequence's whole life (lifetime reservation)."""
        return self.blocks_for(seq.max_len)

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None, watermark: int = 0) -> bool:
        """Whether `seq` could be admitted now with blocks for `num_tokens` (default: its whole
        life), leaving `watermark` blocks free."""
        tokens = seq.max_len if num_tokens is None else num_tokens
        return bool(self.free_residual) and self.num_free >= self.blocks_for(tokens) + watermark

    def can_allocate_all(self, seqs: list[Sequence], reserved: int = 0) -> bool:
        """Whether all of `seqs` could be admitted now, together, each for its whole life, with
        `reserved` blocks kept for others."""
        return (len(seqs) <= len(self.free_residual)
                and self.num_free >= reserved + sum(self.blocks_needed(s) for s in seqs))

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Admit `seq` with blocks for `num_tokens` (default: its whole life), fastest tier first."""
        tokens = seq.max_len if num_tokens is None else num_tokens
        if not self.can_allocate(seq, tokens):
            raise RuntimeError(f"no room for {self.blocks_for(tokens)} KV blocks of sequence {seq.seq_id}")
        seq.block_table = []
        self._extend(seq.block_table, self.blocks_for(tokens), TIERS)
        seq.residual_id = self.free_residual.popleft()

    def _growth_tiers(self, seq: Sequence) -> tuple[str, ...]:
        """Tiers a table may grow into: its last block's tier and the slower ones."""
        if not seq.block_table:
            return TIERS
        return TIERS[TIERS.index(self.tier_of(seq.block_table[-1])):]

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        return missing <= sum(len(self.free[t]) for t in self._growth_tiers(seq))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s table to hold `num_tokens` tokens (no-op when it already does)."""
        if not self.can_grow(seq, num_tokens):
            raise RuntimeError(f"no room to grow sequence {seq.seq_id} to {num_tokens} tokens")
        self._extend(seq.block_table, self.blocks_for(num_tokens), self._growth_tiers(seq))

    def _extend(self, table: list[int], length: int, tiers: tuple[str, ...]) -> None:
        for tier in tiers:
            while len(table) < length and self.free[tier]:
                table.append(self.free[tier].popleft())

    def free_blocks(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.free[self.tier_of(block)].append(block)
        seq.block_table = []
        self.free_residual.append(seq.residual_id)
        seq.residual_id = -1
