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

Prefix caching (`prefix_caching`, engine/prefix_cache.py): a sequence's complete blocks are
registered by the tokens they hold once computed (`register`); an admission starts its table with
the blocks that already hold its leading tokens (`cached_prefix`), shared by reference count like
a fork's. Free blocks wait in each tier's free list in the order they are handed out again: those
holding nothing first, then registered ones least recently freed first (a table's tail before its
head), so a prefix stays findable as long as the cache can keep it. A table stays in tier order:
a cached run stops where a block lies in a faster tier than the one before it, and where the
rest of the sequence's life could not fit the tiers it may then grow into (so that, alone, every
request still fits: the scheduler's no-deadlock rule).
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque

import torch

from flexsarathi.engine.prefix_cache import PrefixCache, block_digests
from flexsarathi.engine.sequence import Sequence
from policy_search.policy import TIERS


class BlockManager:
    def __init__(self, block_size: int, blocks_per_tier: dict[str, int], num_residual: int,
                 prefix_caching: bool = False):
        """num_residual: rows of the compressed pools' full-precision buffer, one per sequence
        that may run at once (each has at most one block being filled)."""
        self.block_size = block_size
        self.cache = PrefixCache() if prefix_caching else None
        self.resize(blocks_per_tier, num_residual)

    def resize(self, blocks_per_tier: dict[str, int], num_residual: int, kept: tuple[str, ...] = ()) -> None:
        """Lay out `blocks_per_tier` blocks and `num_residual` rows anew (the engine does when a
        batch of requests arrives at an idle cache); only while no sequence holds any. `kept`: the
        tiers whose pools kept their tensors; their cached prefixes stay where the new layout still
        has their blocks (a block is its tier's slots, so it keeps its tokens' K/V)."""
        if hasattr(self, "refs") and not self.idle:
            raise RuntimeError("the KV cache is resized while sequences hold blocks")
        carried = self._cached_in(kept) if hasattr(self, "refs") else []
        self._lay_out(blocks_per_tier, num_residual)
        for digest, tier, local in carried:  # in the order they were to be handed out
            if local < self.blocks_per_tier.get(tier, 0):
                block = self.base[tier] + local
                self.cache.register(block, digest)
                self.free[tier].move_to_end(block)

    def _cached_in(self, tiers) -> list[tuple[bytes, str, int]]:
        """(digest, tier, index in the tier) of the cached blocks of `tiers`, in free-list order."""
        if self.cache is None:
            return []
        return [(self.cache.digest_of[b], t, b - self.base[t]) for t in tiers if t in self.free
                for b in self.free[t] if self.cache.holds(b)]

    def release_all(self) -> None:
        """Every block and row is free again (the sequences holding them were dropped) and no
        prefix is cached (a pass they were in may have been cut short)."""
        self._lay_out(self.blocks_per_tier, self.num_residual)

    def _lay_out(self, blocks_per_tier: dict[str, int], num_residual: int) -> None:
        unknown = set(blocks_per_tier) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown KV tiers {sorted(unknown)}; tiers are {TIERS}")
        self.blocks_per_tier = {t: n for t, n in blocks_per_tier.items() if n}
        self.base: dict[str, int] = {}
        self.free: dict[str, OrderedDict[int, None]] = {}  # per tier, in the order handed out
        start = 0
        for tier in TIERS:
            count = blocks_per_tier.get(tier, 0)
            self.base[tier], self.free[tier] = start, OrderedDict.fromkeys(range(start, start + count))
            start += count
        if self.cache is not None:
            self.cache.clear()
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

    def allocate(self, seq: Sequence, num_tokens: int | None = None, cached: list[int] = ()) -> None:
        """Admit `seq` with blocks for `num_tokens` (default: its whole life): `cached` first
        (cached_prefix's, shared), then free ones, fastest tier first."""
        tokens = seq.max_len if num_tokens is None else num_tokens
        if not (self.free_residual and self.has_room(self.blocks_to_take(tokens, cached))):
            raise RuntimeError(f"no room for {self.blocks_for(tokens)} KV blocks of sequence {seq.seq_id}")
        for block in cached:
            self._hold(block)
        seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)
        self._extend(seq.block_table, self.blocks_for(tokens), self._growth_tiers(seq))
        seq.residual_id = self.free_residual.popleft()

    def blocks_to_take(self, num_tokens: int, cached: list[int] = ()) -> int:
        """Free blocks an admission with blocks for `num_tokens` takes when it starts with `cached`:
        the rest of its table, and those of `cached` no table holds now."""
        return self.blocks_for(num_tokens) - len(cached) + sum(1 for b in cached if not self.refs[b])

    def _hold(self, block: int) -> None:
        if not self.refs[block]:
            del self.free[self.tier_of(block)][block]
        self.refs[block] += 1

    # ---- prefix caching ----------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The registered blocks that hold `seq`'s leading tokens (see the module docstring), for
        an admission of `num_blocks` blocks in all (its table's and its forks' own): at most those
        before its last prefill token, which a pass must compute for its logits, and no more than
        leave the rest room in the tiers its table may then grow into, now and when alone."""
        if self.cache is None:
            return []
        _, blocks = self._registered_run(seq)
        for k in range(1, len(blocks)):  # tier order: a faster tier after a slower one ends the run
            if TIERS.index(self.tier_of(blocks[k])) < TIERS.index(self.tier_of(blocks[k - 1])):
                blocks = blocks[:k]
                break
        while blocks and not (self._room_after(blocks) >= num_blocks - len(blocks)
                              and self._room_after(blocks, alone=True) >= self.blocks_for(seq.max_len) - len(blocks)):
            blocks.pop()
        return blocks

    def _registered_run(self, seq: Sequence) -> tuple[int, list[int]]:
        """(its blocks a prefill may take from the cache: those before its last prefill token, which a
        pass must compute for its logits; the registered blocks of its leading tokens among them)."""
        usable = (seq.num_prefill_tokens - 1) // self.block_size
        return usable, self.cache.chain(block_digests(seq, usable, self.block_size))

    def _room_after(self, cached: list[int], alone: bool = False) -> int:
        """Blocks a table starting with `cached` may grow into (the tiers from its last block's
        on), free now, or once no other sequence holds any (`alone`), less the cached ones there."""
        tiers = TIERS[TIERS.index(self.tier_of(cached[-1])):]
        if alone:
            room = sum(self.blocks_per_tier.get(t, 0) for t in tiers)
            return room - sum(1 for b in cached if self.tier_of(b) in tiers)
        room = sum(len(self.free[t]) for t in tiers)
        return room - sum(1 for b in cached if not self.refs[b] and self.tier_of(b) in tiers)

    def prefills_a_block_of(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether the block that follows `seq`'s cached prefix (cached_prefix without its tier
        checks) is one a sequence of `prefilling` is still computing: the same digest, not yet
        registered (blocks are registered when the pass computing them ends). Admitted after that
        pass, `seq` takes it from the cache instead of computing it again."""
        if self.cache is None or not prefilling:
            return False
        usable, run = self._registered_run(seq)
        hits = len(run)
        if hits >= usable:
            return False
        wanted = block_digests(seq, hits + 1, self.block_size)[hits]
        return any((hits + 1) * self.block_size <= other.num_prefill_tokens
                   and block_digests(other, hits + 1, self.block_size)[hits] == wanted for other in prefilling)

    def register(self, seq: Sequence) -> None:
        """Name `seq`'s blocks whose tokens are all computed now by the tokens they hold."""
        done = min(seq.num_computed // self.block_size, len(seq.block_table))
        if self.cache is None or done <= seq.num_registered_blocks:
            return
        digests = block_digests(seq, done, self.block_size)
        for k in range(seq.num_registered_blocks, done):
            self.cache.register(seq.block_table[k], digests[k])
        seq.num_registered_blocks = done

    def fork(self, parent: Sequence, child: Sequence, num_shared: int, num_tokens: int) -> None:
        """Admit `child` with the first `num_shared` blocks of `parent`'s table (shared) and blocks
        of its own up to `num_tokens` tokens (taken where its table may grow)."""
        if not self.has_room(self.blocks_for(num_tokens) - num_shared):
            raise RuntimeError(f"no room to fork sequence {child.seq_id} from {parent.seq_id}")
        child.block_table = parent.block_table[:num_shared]
        for block in child.block_table:
            self.refs[block] += 1
        child.block_digests = parent.block_digests[:num_shared]  # shared blocks, shared tokens
        child.num_registered_blocks = min(parent.num_registered_blocks, num_shared)
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
                block = self.free[tier].popitem(last=False)[0]
                if self.cache is not None:
                    self.cache.forget(block)  # it will hold other tokens
                table.append(block)
                self.refs[block] = 1
        if len(table) < length:  # the callers check room first: a table short of its tokens' slots
            raise RuntimeError(f"KV blocks ran out in tiers {tiers}: a table of {len(table)} blocks, "
                               f"{length} needed")  # would drop their K/V

    def free_blocks(self, seq: Sequence) -> None:
        """`seq` gives back its blocks (a shared one is free once no other table holds it) and
        its residual row. Tail first: with prefix caching, a table's head is handed out last."""
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken (sequence {seq.seq_id})")
            if self.refs[block] == 0:
                free = self.free[self.tier_of(block)]
                free[block] = None
                if self.cache is not None and not self.cache.holds(block):
                    free.move_to_end(block, last=False)  # holds nothing: handed out first
        seq.block_table = []
        self.free_residual.append(seq.residual_id)
        seq.residual_id = -1
