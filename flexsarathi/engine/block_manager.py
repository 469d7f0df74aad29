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

Forks (the `n` completions of one prompt, vLLM's approach): a fork's table starts with its
parent's complete prompt blocks, shared by reference count (a block is free again only when its
last holder frees it; only the parent's prefill writes them, before its forks join, and
positions before the prompt's end are never written again), and goes on with blocks of its own, the first a copy of the prompt's last,
partial block (copied by the engine when the parent's prefill ends).

Each admitted sequence also holds one row of the compressed pools' full-precision residual
buffer (the block being filled), so rows bound the running set too.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from flexsarathi.engine.sequence import Sequence
from policy_search.policy import TIERS


class BlockManager:
    def __init__(self, block_size: int, blocks_per_tier: dict[str, int], num_residual: int):
        """num_residual: rows of the compressed pools' full-precision buffer, one per sequence
        that may run at once (each has at most one block being filled)."""
        self.block_size = block_size
        self.resize(blocks_per_tier, num_residual)

    def resize(self, blocks_per_tier: dict[str, int], num_residual: int) -> None:
        """Lay out `blocks_per_tier` blocks and `num_residual` rows anew (the engine does when a
        batch of requests arrives at an idle cache); only while no sequence holds any."""
        if hasattr(self, "refs") and not self.idle:
            raise RuntimeError("the KV cache is resized while sequences hold blocks")
        self._lay_out(blocks_per_tier, num_residual)

    def release_all(self) -> None:
        """Every block and row is free again (the sequences holding them were dropped)."""
        self._lay_out(self.blocks_per_tier, self.num_residual)

    def _lay_out(self, blocks_per_tier: dict[str, int], num_residual: int) -> None:
        unknown = set(blocks_per_tier) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown KV tiers {sorted(unknown)}; tiers are {TIERS}")
        self.blocks_per_tier = {t: n for t, n in blocks_per_tier.items() if n}
        self.base: dict[str, int] = {}
        self.free: dict[str, deque[int]] = {}
        start = 0
        for tier in TIERS:
            count = blocks_per_tier.get(tier, 0)
            self.base[tier], self.free[tier] = start, deque(range(start, start + count))
            start += count
        self.num_blocks = start
        self.refs = [0] * start  # holders of each block (forks share their parent's prompt blocks)
        self.free_residual: deque[int] = deque(range(num_residual))
        self.num_residual = num_residual

    @property
    def idle(self) -> bool:
        """No sequence holds a block or a residual row."""
        return not any(self.refs) and len(self.free_residual) == self.num_residual

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

    def has_room(self, num_blocks: int, num_rows: int = 1) -> bool:
        """Whether `num_blocks` blocks and `num_rows` residual rows are free."""
        return num_rows <= len(self.free_residual) and num_blocks <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Admit `seq` with blocks for `num_tokens` (default: its whole life), fastest tier first."""
        tokens = seq.max_len if num_tokens is None else num_tokens
        if not self.can_allocate(seq, tokens):
            raise RuntimeError(f"no room for {self.blocks_for(tokens)} KV blocks of sequence {seq.seq_id}")
        seq.block_table = []
        self._extend(seq.block_table, self.blocks_for(tokens), TIERS)
        seq.residual_id = self.free_residual.popleft()

    def fork(self, parent: Sequence, child: Sequence, num_shared: int, num_tokens: int) -> None:
        """Admit `child` with the first `num_shared` blocks of `parent`'s table (shared) and blocks
        of its own up to `num_tokens` tokens (taken where its table may grow)."""
        if not self.has_room(self.blocks_for(num_tokens) - num_shared):
            raise RuntimeError(f"no room to fork sequence {child.seq_id} from {parent.seq_id}")
        child.block_table = parent.block_table[:num_shared]
        for block in child.block_table:
            self.refs[block] += 1
        self._extend(child.block_table, self.blocks_for(num_tokens), self._growth_tiers(child))
        child.residual_id = self.free_residual.popleft()

    def local_slots(self, block: int, count: int) -> tuple[str, torch.Tensor]:
        """The tier of `block` and the pool slots of its first `count` positions."""
        tier = self.tier_of(block)
        start = (block - self.base[tier]) * self.block_size
        return tier, torch.arange(start, start + count)

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
                self.refs[table[-1]] = 1

    def free_blocks(self, seq: Sequence) -> None:
        """`seq` gives back its blocks (a shared one is free once no other table holds it) and
        its residual row."""
        for block in seq.block_table:
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken (sequence {seq.seq_id})")
            if self.refs[block] == 0:
                self.free[self.tier_of(block)].append(block)
        seq.block_table = []
        self.free_residual.append(seq.residual_id)
        seq.residual_id = -1
