"""Turns the scheduler's work items into the executor's MicroBatch (tokens + attention metadata)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.scheduler import WorkItem
from offload.micro_batch import AttentionGroup, KVPart, KVWrite, MicroBatch
from policy_search.policy import TIERS


@dataclass(frozen=True)
class LogitSpan:
    """Where an item's logits are in the micro-batch's output: rows [offset, offset + count)."""

    item: WorkItem
    offset: int
    count: int


def wants_prompt_logprobs(item: WorkItem) -> bool:
    seq = item.seq
    return seq.params.prompt_logprobs is not None and item.start < seq.num_prompt_tokens


@dataclass
class _TierRun:
    tier: str
    start: int  # first position stored in this tier
    visible: int  # positions of this run inside the item's context [0, end)
    slots: torch.Tensor  # [visible] local slots in the tier's pool (a view of the slot map's)


class SlotMap:
    """Every position a sequence's block table covers as (tier, local slot), worked out once per
    table: a decode step reuses it (one new block every block_size steps), where the view of each
    item cost ~25 tensor operations over its whole context every step (2.8 ms of host time per
    step at 32 sequences, as long as the pass itself). Valid while `table` is the sequence's table
    at this length: the BlockManager only appends to a table in place or replaces it."""

    def __init__(self, table: list[int], blocks: BlockManager):
        bs = blocks.block_size
        self.table, self.num_blocks = table, len(table)
        tiers = [blocks.tier_of(b) for b in table]
        local_blocks = [b - blocks.base[t] for b, t in zip(table, tiers)]
        self.local = (torch.tensor(local_blocks, dtype=torch.long)[:, None] * bs
                      + torch.arange(bs)).flatten()  # [blocks * bs]
        self.local_list = self.local.tolist()  # the same as ints: a write's few slots without a tensor op
        # (tier, first position, positions) in TIERS order: a table takes its blocks tier by tier
        self.tier_runs: list[tuple[str, int, int]] = []
        for tier in TIERS:
            where = [i for i, t in enumerate(tiers) if t == tier]
            if where:
                if where[-1] - where[0] + 1 != len(where):
                    raise RuntimeError(f"block table {table} holds tier {tier!r} in two runs")
                self.tier_runs.append((tier, where[0] * bs, len(where) * bs))

    @staticmethod
    def of(seq, blocks: BlockManager) -> "SlotMap":
        cached = seq.slot_map
        if cached is None or cached.table is not seq.block_table or cached.num_blocks != len(seq.block_table):
            cached = seq.slot_map = SlotMap(seq.block_table, blocks)
        return cached

    def runs(self, end: int) -> list[_TierRun]:
        """The tiers holding positions [0, end), each with its positions' local slots."""
        return [_TierRun(tier, start, min(count, end - start), self.local[start:min(start + count, end)])
                for tier, start, count in self.tier_runs if start < end]


class IndexPack:
    """A micro-batch's int64 indices gathered as Python ints (add, add_ranges), then made ONE host
    tensor (done) whose views are the index fields of the micro-batch, its groups, parts and writes
    (MicroBatch.packed): torch.tensor on a list costs ~4 us even for a few ints and ~7x np.array's
    per int (built so, a 72 x 512 prompt pass takes 18.7 ms of host time where ~15 torch.tensor
    calls took 28.5; a decode of 2 sequences 66 us, was 105: Zen 4), and on a GPU the fields go up
    in one copy."""

    def __init__(self):
        self._values: list[int] = []
        self.flat: torch.Tensor | None = None

    def add(self, values) -> tuple[int, int]:
        """(start, count) of `values` (an iterable of ints) in the pack."""
        start = len(self._values)
        self._values += values
        return start, len(self._values) - start

    def add_ranges(self, ranges) -> tuple[int, int]:
        """add of range(a, b) for each (a, b), one after the other."""
        start = len(self._values)
        for a, b in ranges:
            self._values += range(a, b)
        return start, len(self._values) - start

    def done(self) -> torch.Tensor:
        self.flat = torch.from_numpy(np.array(self._values, dtype=np.int64))
        return self.flat

    def view(self, span: tuple[int, int], *shape: int) -> torch.Tensor:
        """The added values at `span` (a view of the pack), in `shape` if given."""
        values = self.flat[span[0]:span[0] + span[1]]
        return values.view(shape) if shape else values


def build_micro_batch(items: list[WorkItem], blocks: BlockManager,
                      group_prompts_upto: int = 0) -> tuple[MicroBatch, list[LogitSpan]]:
    """The micro-batch of `items`, its attention groups: decodes grouped, whole prompts of up to
    group_prompts_upto tokens grouped (where the executor attends such a group in one causal call:
    LLMEngine._prompts_grouped_upto), later prompt chunks alone. Its indices are views of one
    tensor (IndexPack); each group, part and write is made once the pack is done."""
    pack = IndexPack()
    token_ids, positions, logit_rows, spans, groups = [], [], [], [], []
    prompts: dict[tuple, list] = {}  # whole prompts by length and tier layout (_prompt_group_key)
    writes: dict[str, tuple[list, list, list]] = {t: ([], [], []) for t in TIERS}  # rows, slots, ids
    decodes: dict[tuple, list[tuple[WorkItem, int, list[_TierRun]]]] = {}
    row = 0
    for item in items:
        seq, n = item.seq, item.num_tokens
        slot_map = SlotMap.of(seq, blocks)
        runs = slot_map.runs(item.end)
        token_ids += seq.token_ids(item.start, item.end)
        positions += range(item.start, item.end)
        if wants_prompt_logprobs(item):
            spans.append(LogitSpan(item, len(logit_rows), n))
            logit_rows += range(row, row + n)
        elif item.samples:
            spans.append(LogitSpan(item, len(logit_rows), 1))
            logit_rows.append(row + n - 1)
        for run in runs:  # the new positions [start, end) that lie in each tier
            lo, hi = max(item.start, run.start), min(item.end, run.start + run.visible)
            if lo < hi:
                rows, slots, ids = writes[run.tier]
                rows += range(row + lo - item.start, row + hi - item.start)
                slots += slot_map.local_list[lo:hi]  # positions lo..hi-1: the map covers every position
                ids += [seq.residual_id] * (hi - lo)
        if n == 1:
            decodes.setdefault(_decode_group_key(item, runs), []).append((item, row, runs))
        elif item.start == 0 and n <= group_prompts_upto:
            prompts.setdefault(_prompt_group_key(item, runs), []).append((item, row, runs))
        else:
            groups.append(_group([(item, row, runs)], n, blocks.block_size, pack))
        row += n
    groups += [_group(members, members[0][0].num_tokens, blocks.block_size, pack) for members in prompts.values()]
    groups += [_group(members, 1, blocks.block_size, pack) for members in decodes.values()]
    kv_writes = [_write(t, rows, pack.add(rows), pack.add(slots), pack.add(ids))
                 for t, (rows, slots, ids) in writes.items() if rows]
    fields = [pack.add(values) for values in (token_ids, positions, logit_rows)]
    packed = pack.done()
    token_ids, positions, logit_rows = (pack.view(span) for span in fields)
    batch = MicroBatch(token_ids=token_ids, positions=positions, groups=[make(pack) for make in groups],
                       kv_writes=[make(pack) for make in kv_writes], logit_rows=logit_rows, packed=packed,
                       lora_rows=_adapter_rows(items))
    return batch, spans


def _adapter_rows(items: list[WorkItem]) -> dict[int, torch.Tensor | None]:
    """{LoRA adapter id: the rows of its sequences' tokens (None: every row)} (MicroBatch.lora_rows)."""
    rows, row = {}, 0
    for item in items:
        if item.seq.lora_id:
            rows.setdefault(item.seq.lora_id, []).extend(range(row, row + item.num_tokens))
        row += item.num_tokens
    return {adapter: None if len(r) == row else torch.tensor(r, dtype=torch.long) for adapter, r in rows.items()}


def _write(tier: str, rows: list[int], *spans: tuple[int, int]):
    """The KVWrite of `rows` (rows, slots, residual ids at `spans`) once the pack is done. rows ascend
    (items in order, each item's rows in order), so they are consecutive exactly when they span as
    many rows as they count."""
    row_start = rows[0] if rows[-1] - rows[0] + 1 == len(rows) else None
    return lambda pack: KVWrite(tier, *(pack.view(span) for span in spans), row_start=row_start)


def _decode_group_key(item: WorkItem, runs: list[_TierRun]) -> tuple:
    """Decodes attend as one padded batch per key: the tiers their contexts touch, and the context
    length rounded up to a power of two, so a long context does not pad every short one to its
    length (padded keys are gathered and scored like real ones; a group pads at most 2x)."""
    return tuple(r.tier for r in runs), (item.end - 1).bit_length()


def _prompt_group_key(item: WorkItem, runs: list[_TierRun]) -> tuple:
    """Whole prompts (or first chunks) of one length whose positions lie in the same tiers alike
    attend as one batch: each sees only its own new rows, so one causal call serves them all
    (offload/executor.py one_causal_call) where a prompt each took a dozen launches."""
    return item.num_tokens, tuple((r.tier, r.start, r.visible) for r in runs)


def _group(members: list[tuple[WorkItem, int, list[_TierRun]]], n: int, block_size: int, pack: IndexPack):
    """Sequences that each bring n query rows, with one KV part per tier their contexts touch: the
    AttentionGroup once the pack is done."""
    rows = [row for _, row, _ in members]
    items = [item for item, _, _ in members]
    token_rows = pack.add_ranges((row, row + n) for row in rows)  # [B * n]
    q_pos = pack.add_ranges((item.start, item.start + n) for item in items)  # [B, n]
    residual_ids = pack.add([item.seq.residual_id for item in items])
    parts = []
    for tier in TIERS:
        runs = [next((r for r in item_runs if r.tier == tier), None) for _, _, item_runs in members]
        if any(r is not None for r in runs):
            parts.append(_part(tier, items, runs, n, block_size, residual_ids, pack))
    contiguous = all(b - a == n for a, b in zip(rows, rows[1:]))
    return lambda pack: AttentionGroup(token_rows=pack.view(token_rows), num_queries=n,
                                       q_pos=pack.view(q_pos, len(items), n), parts=[make(pack) for make in parts],
                                       row_start=rows[0] if contiguous else None)


def _part(tier: str, items: list[WorkItem], runs: list[_TierRun | None], n: int, block_size: int,
          residual_ids: tuple[int, int], pack: IndexPack):
    """The group's keys in one tier (each member's run there; None: it has no keys there): the KVPart
    once the pack is done."""
    empty = torch.empty(0, dtype=torch.long)
    # [B, L] slots, padded with slot 0 (masked): one call, not a write per member (its own tensor:
    # a pool index, read on the host and uploaded by the executor where its pool is on a GPU)
    kv_slots = pad_sequence([empty if r is None else r.slots for r in runs], batch_first=True)
    kv_start, kv_len, complete_len = [], [], []
    src, seq_index, pos_index = [], [], []
    for b, (item, run) in enumerate(zip(items, runs)):
        if run is None:  # no keys in this tier: a row of zeros, masked
            kv_start.append(0)
            kv_len.append(0)
            complete_len.append(0)
            continue
        kv_start.append(run.start)
        kv_len.append(run.visible)
        # Blocks complete before this pass (item.start tokens are cached): read from codes.
        complete_len.append(min(max(item.start // block_size * block_size - run.start, 0), run.visible))
        lo, hi = max(item.start, run.start), min(item.end, run.start + run.visible)
        src += range(b * n + lo - item.start, b * n + hi - item.start)
        seq_index += [b] * max(hi - lo, 0)
        pos_index += range(lo - run.start, hi - run.start)
    new_rows = None
    starts = {run.start - item.start for item, run in zip(items, runs) if run is not None}
    if None not in runs and len(starts) == 1 and min(starts) >= 0 and len({r.visible for r in runs}) == 1:
        lo = starts.pop()  # every key of this part is new, in each sequence's rows lo..
        new_rows = (lo, lo + runs[0].visible)
    spans = [pack.add(values) for values in (kv_start, kv_len, src, seq_index, pos_index)]
    complete = pack.add(complete_len)
    return lambda pack: KVPart(tier, kv_slots, *(pack.view(span) for span in spans), pack.view(residual_ids),
                               pack.view(complete), new_rows)
