"""What goes into each pass. The scheduler decides; it never touches tensors.

- decode-maximal (default, SARATHI): every running sequence contributes its decode token, and
  prompt chunks fill the pass up to `prefill_budget` prompt tokens; a finished sequence frees its
  KV blocks and a waiting request starts prefilling in the next pass.
  In the tail of a workload (every request left is running or can be admitted at once, so no one
  waits for a finish to free room), a decode that has slack sits out the passes that carry
  prompt chunks (`defer_decodes_with_slack`): the last prompt to prefill still needs its own
  decode passes after its prefill, so a sequence that would finish before that, even one pass
  later, does not lengthen the batch, while its row (and the decode attention over its context)
  leaves a prefill pass, which on a CPU or an offloaded GPU is compute-bound. In an I/O-bound
  pass the row was free anyway, so leaving it out costs nothing either. A sequence that would
  finish last is never deferred, and nothing is deferred while requests wait for room (there a
  decode that finishes sooner frees a slot sooner).
- block (FlexGen, the baseline): admit `max_running` requests, prefill them whole in one pass,
  decode them in lockstep until all have finished, then take the next block.

A pass is split into `num_micro_batches` micro-batches; weights are loaded once per pass.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flexsarathi.block_manager import BlockManager
from flexsarathi.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # gpu_batch_size * num_gpu_batches
    num_micro_batches: int
    prefill_budget: int  # prompt tokens per pass (decode-maximal)
    mode: str = "decode-maximal"  # or "block"
    defer_decodes_with_slack: bool = True  # decode-maximal: see the module docstring


@dataclass(frozen=True)
class WorkItem:
    """Compute tokens [start, end) of `seq`; sample the next token when end reaches its length."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    micro_batches: list[list[WorkItem]]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for mb in self.micro_batches for item in mb)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(item.num_tokens for mb in self.micro_batches for item in mb if item.seq.is_prefilling)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        items = self._block_items() if self.config.mode == "block" else self._decode_maximal_items()
        return SchedulerOutput(self._split(items))

    def finish(self, seq: Sequence) -> None:
        """Called once `seq` has finished: its KV blocks go back to the pool."""
        self.running.remove(seq)
        self.blocks.free_blocks(seq)

    # ---- policies ------------------------------------------------------------------------
    def _admit(self) -> Sequence | None:
        if not self.waiting or len(self.running) >= self.config.max_running:
            return None
        if not self.blocks.can_allocate(self.waiting[0]):
            if not self.running:
                raise RuntimeError("the KV cache cannot hold a single request; enlarge it")
            return None
        seq = self.waiting.popleft()
        self.blocks.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _decode_maximal_items(self) -> list[WorkItem]:
        decoding = [s for s in self.running if not s.is_prefilling]
        if self.config.defer_decodes_with_slack:
            last_pass = self._tail_last_pass()
            if last_pass is not None:  # passes left to the last prefilling sequence's end
                # A decode sampled now ends after passes_left(s) passes, deferred one pass later.
                decoding = [s for s in decoding if _passes_left(s) + 1 > last_pass]
        items = [WorkItem(s, s.num_computed, s.num_tokens) for s in decoding]
        budget = self.config.prefill_budget
        prefilling = [s for s in self.running if s.is_prefilling]
        while budget > 0:
            seq = prefilling.pop(0) if prefilling else self._admit()
            if seq is None:
                break
            chunk = min(budget, seq.num_prompt_tokens - seq.num_computed)
            items.append(WorkItem(seq, seq.num_computed, seq.num_computed + chunk))
            budget -= chunk
        return items

    def _tail_last_pass(self) -> int | None:
        """In the tail of the workload with prompt tokens left to prefill: the pass (this one is 1)
        in which the last sequence still to prefill will sample its last token, were every pass
        from now on to carry a full prefill budget in admission order. None outside the tail or
        with nothing to prefill."""
        if not self._rest_admissible():  # first: it is O(1) while a long queue waits for room
            return None
        owing = [s for s in self.running if s.is_prefilling] + list(self.waiting)
        if not owing:
            return None
        budget, queued, last = self.config.prefill_budget, 0, 0
        for seq in owing:
            queued += seq.num_prompt_tokens - seq.num_computed
            prefilled_in = -(-queued // budget)  # the pass sampling its first token
            last = max(last, prefilled_in + seq.max_len - seq.num_prompt_tokens - 1)
        return last

    def _rest_admissible(self) -> bool:
        """Whether every waiting request can be admitted now, together (no one waits for room)."""
        return (len(self.running) + len(self.waiting) <= self.config.max_running
                and self.blocks.can_allocate_all(list(self.waiting)))

    def _block_items(self) -> list[WorkItem]:
        if not self.running:
            while self._admit() is not None:
                pass
        # Whole prompts in the block's first pass, then one decode token each.
        return [WorkItem(s, s.num_computed, s.num_tokens) for s in self.running]

    def _split(self, items: list[WorkItem]) -> list[list[WorkItem]]:
        """Micro-batches balanced by token count (largest items first, each to the lightest)."""
        count = min(self.config.num_micro_batches, len(items))
        if count <= 1:
            return [items] if items else []
        batches: list[list[WorkItem]] = [[] for _ in range(count)]
        loads = [0] * count
        for item in sorted(items, key=lambda it: -it.num_tokens):
            k = loads.index(min(loads))
            batches[k].append(item)
            loads[k] += item.num_tokens
        return batches


def _passes_left(seq: Sequence) -> int:
    """Decode passes a decoding sequence needs at most: one per token still to sample."""
    return seq.max_len - seq.num_tokens
