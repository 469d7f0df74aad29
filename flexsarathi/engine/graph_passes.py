"""Which passes replay a CUDA graph, and their inputs from the block tables: the engine's side of
offload/decode_graphs.py.

A policy allows graphs where policy_search.graphs.graphs_refused finds no reason against (the
planner prices such passes by the same rule). Then a
pass that is one micro-batch of decode tokens, each sampling, none asking for prompt logprobs,
replays the graph of its (batch, keys) bucket; any other pass (prompt chunks, several micro-batches)
runs eagerly as before. Each bucket's working set, which its graph keeps, is reserved on the gpu
tier as "decode graphs" at its first pass; a bucket that does not fit the budget runs eagerly.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.micro_batch_builder import wants_prompt_logprobs
from flexsarathi.engine.scheduler import SchedulerOutput, WorkItem
from offload.decode_graphs import DecodeGraphs, bucket_of
from offload.memory import MemoryBudgetError, MemoryTracker
from policy_search.working_set import PassTokens

GRAPH_POOL = "decode graphs"


class GraphPasses:
    def __init__(self, executor, blocks: BlockManager, memory: MemoryTracker, device: torch.device,
                 working_bytes: Callable[[PassTokens], int], worst_pass: Callable[[], int]):
        """working_bytes: the engine's price of a pass's working set (what a captured bucket keeps);
        worst_pass: the bytes of the largest pass of the requests running (eager passes must
        still fit beside the graphs)."""
        self.blocks, self.memory, self._working_bytes, self._worst_pass = blocks, memory, working_bytes, worst_pass
        self.graphs = DecodeGraphs(executor, device)
        self._reserved = 0  # bytes reserved for the captured buckets
        self._refused: set[tuple[int, int]] = set()  # buckets over the budget: eager

    def clear(self) -> None:
        """Drop every graph (a pool they address was replaced, or the engine closes)."""
        self.graphs.clear()
        self._refused.clear()
        if self._reserved:
            self.memory.release("gpu", self._reserved, GRAPH_POOL)
            self._reserved = 0

    def scratch_slot(self) -> int:
        """The first slot of the gpu pool's block past the block manager's: padding rows' slot."""
        return self.blocks.blocks_per_tier.get("gpu", 0) * self.blocks.block_size

    def forward(self, plan: SchedulerOutput) -> list[tuple[WorkItem, torch.Tensor]] | None:
        """Each item with its logits [1, vocab] (fp32, compute device: a copy, since the graph's output
        is overwritten by the next replay), or None where the pass runs eagerly."""
        if len(plan.micro_batches) != 1:
            return None
        items = plan.micro_batches[0]
        if not all(it.num_tokens == 1 and it.samples and not wants_prompt_logprobs(it) and not it.seq.forks
                   and not it.seq.lora_id for it in items):  # LoRA rows: the executor's eager pass
            return None
        key = bucket_of(len(items), max(it.end for it in items))
        if not self._admit(key):
            return None
        logits = self.graphs.run([it.seq.token_ids(it.start, it.end)[0] for it in items], [it.start for it in items],
                                 self._context_slots(items, key[1]), self.scratch_slot()).clone()
        return [(item, logits[i:i + 1]) for i, item in enumerate(items)]

    def _admit(self, key: tuple[int, int]) -> bool:
        """A bucket runs from a graph once its working set is reserved (at its first pass)."""
        if key in self.graphs:
            return True
        if key in self._refused:
            return False
        batch, keys = key
        tokens = PassTokens(total=batch, widest=batch, slice_rows=batch, context_slots=batch * keys,
                            attention_slots=batch * keys, attention_cells=batch * keys, logit_rows=batch)
        nbytes = self._working_bytes(tokens)
        try:
            self.memory.reserve("gpu", nbytes, GRAPH_POOL)
        except MemoryBudgetError:
            self._refused.add(key)
            return False
        try:  # the largest eager pass of the requests running still fits beside it
            with self.memory.reservation("gpu", self._worst_pass(), "largest pass (activations)"):
                pass
        except MemoryBudgetError:
            self.memory.release("gpu", nbytes, GRAPH_POOL)
            self._refused.add(key)
            return False
        self._reserved += nbytes
        return True

    def _context_slots(self, items: list[WorkItem], keys: int) -> torch.Tensor:
        """[rows, keys] gpu-pool slots of positions 0..keys-1 of each item's sequence (blocks past
        its table: the scratch block)."""
        bs, base = self.blocks.block_size, self.blocks.base["gpu"]
        per_row = -(-keys // bs)
        scratch_block = base + self.blocks.blocks_per_tier["gpu"]
        tables = torch.tensor([(it.seq.block_table[:per_row] + [scratch_block] * per_row)[:per_row] for it in items])
        slots = (tables - base)[:, :, None] * bs + torch.arange(bs)  # [rows, blocks, bs]
        return slots.view(len(items), per_row * bs)[:, :keys]
