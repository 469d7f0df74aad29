"""Turns the scheduler's work items into the executor's MicroBatch (tokens + attention metadata)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    slots: torch.Tensor  # [visible] local slots in the tier's pool


class _SeqView:
    """One item's positions mapped to (tier, local slot)."""

    def __init__(self, item: WorkItem, blocks: BlockManager):
        bs = blocks.block_size
        table = item.seq.block_table
        pos = torch.arange(item.end)
        block_ids = torch.tensor(table, dtype=torch.long)[pos // bs]
        tier_index = torch.tensor([TIERS.index(blocks.tier_of(b)) for b in table], dtype=torch.long)[pos // bs]
        base = torch.tensor([blocks.base[t] for t in TIERS], dtype=torch.long)
        self.tier_index = tier_index  # [end]
        self.local = (block_ids - base[tier_index]) * bs + pos % bs  # [end]
        self.runs: list[_TierRun] = []
        for i, tier in enumerate(TIERS):
            where = (tier_index == i).nonzero().flatten()
            if where.numel():  # contiguous by construction (blocks are taken tier by tier)
                first = int(where[0])
                self.runs.append(_TierRun(tier, first, where.numel(), self.local[where]))


def build_micro_batch(items: list[WorkItem], blocks: BlockManager,
                      group_prompts_upto: int = 0) -> tuple[MicroBatch, list[LogitSpan]]:
    """The micro-batch of `items`, its attention groups: decodes grouped, whole prompts of up to
    group_prompts_upto tokens grouped (where the executor attends such a group in one causal call:
    LLMEngine._prompts_grouped_upto), later prompt chunks alone."""
    token_ids, positions, logit_rows, spans, groups = [], [], [], [], []
    prompts: dict[tuple, list] = {}  # whole prompts by length and tier layout (_prompt_group_key)
    writes: dict[str, tuple[list, list, list]] = {t: ([], [], []) for t in TIERS}
    decodes: dict[tuple, list[tuple[WorkItem, int, _SeqView]]] = {}
    row = 0
    for item in items:
        seq, n = item.seq, item.num_tokens
        view = _SeqView(item, blocks)
        token_ids += seq.token_ids(item.start, item.end)
        positions += range(item.start, item.end)
        if wants_prompt_logprobs(item):
            spans.append(LogitSpan(item, len(logit_rows), n))
            logit_rows += range(row, row + n)
        elif item.samples:
            spans.append(LogitSpan(item, len(logit_rows), 1))
            logit_rows.append(row + n - 1)
        new_tiers = view.tier_index[item.start:item.end]
        for i, tier in enumerate(TIERS):
            mask = new_tiers == i
            if mask.any():
                writes[tier][0].append(torch.arange(row, row + n)[mask])
                writes[tier][1].append(view.local[item.start:item.end][mask])
                writes[tier][2].append(torch.full((int(mask.sum()),), seq.residual_id, dtype=torch.long))
        if n == 1:
            decodes.setdefault(_decode_group_key(item, view), []).append((item, row, view))
        elif item.start == 0 and n <= group_prompts_upto:
            prompts.setdefault(_prompt_group_key(item, view), []).append((item, row, view))
        else:
            groups.append(_group([(item, row, view)], n, blocks.block_size))
        row += n
    groups += [_group(members, members[0][0].num_tokens, blocks.block_size) for members in prompts.values()]
    groups += [_group(members, 1, blocks.block_size) for members in decodes.values()]
    kv_writes = [_write(t, torch.cat(r), torch.cat(s), torch.cat(ids)) for t, (r, s, ids) in writes.items() if r]
    batch = MicroBatch(token_ids=torch.tensor(token_ids), positions=torch.tensor(positions),
                       groups=groups, kv_writes=kv_writes,
                       logit_rows=torch.tensor(logit_rows, dtype=torch.long))
    return batch, spans


def _write(tier: str, rows: torch.Tensor, slots: torch.Tensor, residual_ids: torch.Tensor) -> KVWrite:
    """rows ascend (items in order, each item's rows in order), so they are consecutive exactly
    when they span as many rows as they count."""
    consecutive = int(rows[-1]) - int(rows[0]) + 1 == rows.numel()
    return KVWrite(tier, rows, slots, residual_ids, row_start=int(rows[0]) if consecutive else None)


def _decode_group_key(item: WorkItem, view: _SeqView) -> tuple:
    """Decodes attend as one padded batch per key: the tiers their contexts touch, and the context
    length rounded up to a power of two, so a long context does not pad every short one to its
    length (padded keys are gathered and scored like real ones; a group pads at most 2x)."""
    return tuple(r.tier for r in view.runs), (item.end - 1).bit_length()


def _prompt_group_key(item: WorkItem, view: _SeqView) -> tuple:
    """Whole prompts (or first chunks) of one length whose positions lie in the same tiers alike
    attend as one batch: each sees only its own new rows, so one causal call serves them all
    (offload/executor.py one_causal_call) where a prompt each took a dozen launches."""
    return item.num_tokens, tuple((r.tier, r.start, r.visible) for r in view.runs)


def _group(members: list[tuple[WorkItem, int, _SeqView]], n: int, block_size: int) -> AttentionGroup:
    """Sequences that each bring n query rows, with one KV part per tier their contexts touch."""
    batch = len(members)
    token_rows = torch.cat([torch.arange(row, row + n) for _, row, _ in members])
    q_pos = torch.stack([torch.arange(item.start, item.end) for item, _, _ in members])  # [B, n]
    parts = []
    for tier in TIERS:
        runs = [next((r for r in view.runs if r.tier == tier), None) for _, _, view in members]
        if all(r is None for r in runs):
            continue
        length = max(r.visible for r in runs if r is not None)
        kv_slots = torch.zeros(batch, length, dtype=torch.long)  # padding -> slot 0, masked
        kv_start = torch.zeros(batch, dtype=torch.long)
        kv_len = torch.zeros(batch, dtype=torch.long)
        complete_len = torch.zeros(batch, dtype=torch.long)
        residual_ids = torch.tensor([item.seq.residual_id for item, _, _ in members], dtype=torch.long)
        src, seq_index, pos_index = [], [], []
        for b, ((item, _, _), run) in enumerate(zip(members, runs)):
            if run is None:
                continue
            kv_slots[b, :run.visible] = run.slots
            kv_start[b], kv_len[b] = run.start, run.visible
            # Blocks complete before this pass (item.start tokens are cached): read from codes.
            complete_len[b] = min(max(item.start // block_size * block_size - run.start, 0), run.visible)
            for p in range(max(item.start, run.start), min(item.end, run.start + run.visible)):
                src.append(b * n + p - item.start)
                seq_index.append(b)
                pos_index.append(p - run.start)
        new_rows = None
        starts = {run.start - item.start for (item, _, _), run in zip(members, runs) if run is not None}
        if None not in runs and len(starts) == 1 and min(starts) >= 0 and len({r.visible for r in runs}) == 1:
            lo = starts.pop()  # every key of this part is new, in each sequence's rows lo..
            new_rows = (lo, lo + runs[0].visible)
        parts.append(KVPart(tier, kv_slots, kv_start, kv_len, torch.tensor(src, dtype=torch.long),
                            torch.tensor(seq_index, dtype=torch.long), torch.tensor(pos_index, dtype=torch.long),
                            residual_ids, complete_len, new_rows))
    rows = [row for _, row, _ in members]
    contiguous = all(b - a == n for a, b in zip(rows, rows[1:]))
    return AttentionGroup(token_rows=token_rows, num_queries=n, q_pos=q_pos, parts=parts,
                          row_start=rows[0] if contiguous else None)
