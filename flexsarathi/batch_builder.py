"""Turns the scheduler's work items into the executor's MicroBatch (tokens + attention metadata)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexsarathi.scheduler import WorkItem
from offload.batch import AttentionGroup, MicroBatch


@dataclass(frozen=True)
class LogitSpan:
    """Where an item's logits are in the micro-batch's output: rows [offset, offset + count)."""

    item: WorkItem
    offset: int
    count: int


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size  # [end - start]


def wants_prompt_logprobs(item: WorkItem) -> bool:
    seq = item.seq
    return (seq.params.prompt_logprobs or seq.keep_prompt_logits) and item.start < seq.num_prompt_tokens


def build_micro_batch(items: list[WorkItem], block_size: int) -> tuple[MicroBatch, list[LogitSpan]]:
    token_ids, positions, logit_rows, spans, groups = [], [], [], [], []
    decodes: dict[str, list[tuple[WorkItem, int]]] = {}  # tier -> (item, row)
    row = 0
    for item in items:
        seq, n = item.seq, item.num_tokens
        token_ids += seq.token_ids(item.start, item.end)
        positions += range(item.start, item.end)
        if wants_prompt_logprobs(item):
            spans.append(LogitSpan(item, len(logit_rows), n))
            logit_rows += range(row, row + n)
        elif item.samples:
            spans.append(LogitSpan(item, len(logit_rows), 1))
            logit_rows.append(row + n - 1)
        if n == 1:
            decodes.setdefault(seq.kv_tier, []).append((item, row))
        else:
            groups.append(AttentionGroup(
                token_rows=torch.arange(row, row + n), num_queries=n,
                store_slots=_slots(seq.block_table, item.start, item.end, block_size),
                kv_slots=_slots(seq.block_table, 0, item.end, block_size)[None],
                kv_len=torch.tensor([item.end]), q_pos=torch.arange(item.start, item.end)[None],
                kv_tier=seq.kv_tier))
        row += n
    for tier, members in decodes.items():
        longest = max(item.end for item, _ in members)
        kv_slots = torch.zeros(len(members), longest, dtype=torch.long)  # padding -> slot 0, masked
        for b, (item, _) in enumerate(members):
            kv_slots[b, :item.end] = _slots(item.seq.block_table, 0, item.end, block_size)
        groups.append(AttentionGroup(
            token_rows=torch.tensor([r for _, r in members]), num_queries=1,
            store_slots=kv_slots[torch.arange(len(members)), [item.start for item, _ in members]],
            kv_slots=kv_slots, kv_len=torch.tensor([item.end for item, _ in members]),
            q_pos=torch.tensor([[item.start] for item, _ in members]), kv_tier=tier))
    batch = MicroBatch(token_ids=torch.tensor(token_ids), positions=torch.tensor(positions),
                       groups=groups, logit_rows=torch.tensor(logit_rows, dtype=torch.long))
    return batch, spans
