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

KV admission (`kv_admission`, decode-maximal only; block always reserves, as FlexGen does):
- "on-demand" (default): a request is admitted when the blocks of what it prefills (its prompt)
  fit with `kv_watermark` of the blocks left over; tables grow a block at a time as sequences
  decode. When a decode finds no block, the most recently admitted running sequence is preempted:
  its blocks are freed and it goes back to the head of the queue, to recompute its prompt and
  outputs so far as a prefill when readmitted (its outputs stay outputs; its sampling generator
  keeps its state). The oldest running sequence is never preempted while another runs, so it
  always progresses (no starvation), and every request fits the cache alone (no deadlock). Early
  stops (EOS) never held the blocks of their unused max_tokens, so more sequences run at once.
- "reserve": a request is admitted only when the blocks of its whole life (prompt + max_tokens)
  are free, taken at once; it is never preempted. Where lengths are known (ignore_eos) and the
  cache holds every running lifetime, it is the same schedule without preemption risk.

Forks (the `n` completions of one prompt, `add_group`): the prompt is prefilled once, by the
group's first sequence (the parent). The group is admitted as one: the slots of all its members
and the blocks of the parent plus each fork's own blocks (beyond the parent's complete prompt
blocks, which they share) are taken at once, so a fork never waits for room. When the parent's
prefill ends, the forks join the running set in that same pass and sample their first tokens
from the parent's last prompt logits (each with its own generator); from then on each is an
ordinary sequence (a preempted fork recomputes from its own tokens). A parent preempted before
its prefill ends gives back its forks' blocks too, and the group is readmitted as one.

On a GPU, `token_multiple` (128) rounds a pass's token count down to a multiple of the matmul
tile by shortening its last prompt chunk, where the chunk is longer than the cut (SARATHI).

A pass is split into `num_micro_batches` micro-batches; weights are loaded once per pass.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # gpu_batch_size * num_gpu_batches
    num_micro_batches: int
    prefill_budget: int  # prompt tokens per pass (decode-maximal)
    mode: str = "decode-maximal"  # or "block"
    defer_decodes_with_slack: bool = True  # decode-maximal: see the module docstring
    kv_admission: str = "on-demand"  # or "reserve" (lifetime); block always reserves
    kv_watermark: float = 0.01  # on-demand: fraction of the blocks an admission leaves free
    token_multiple: int = 1  # round pass token counts down to this (128 on a GPU)

    @property
    def on_demand(self) -> bool:
        return self.kv_admission == "on-demand" and self.mode != "block"


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
    def items(self) -> list[WorkItem]:
        return [item for mb in self.micro_batches for item in mb]

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
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens sent through passes as prefill (prompts, recomputes)
        self.num_cached_tokens = 0  # tokens admissions found in the prefix cache instead

    def set_max_running(self, max_running: int) -> None:
        """Another ceiling on the sequences running at once, set between batches (an engine that
        fits its running set to memory does so for each batch: EngineConfig.fit_running)."""
        if self.has_unfinished():
            raise RuntimeError("set_max_running while requests run")
        self.config = replace(self.config, max_running=max_running)

    @property
    def _watermark(self) -> int:
        """On demand: blocks an admission leaves free (the cache may be resized between batches)."""
        return math.ceil(self.config.kv_watermark * self.blocks.num_blocks) if self.config.on_demand else 0

    def add(self, seq: Sequence) -> None:
        self.add_group([seq])

    def add_group(self, seqs: list[Sequence]) -> None:
        """The completions of one prompt (SamplingParams.n): the first prefills it and the others
        fork from it (see the module docstring). A group larger than the running set, or than
        the cache can admit at once, is split into groups that fit, each prefilling once."""
        for seq in seqs:
            if self.blocks.blocks_needed(seq) > self.blocks.num_blocks:
                raise RuntimeError(f"sequence {seq.seq_id} needs {self.blocks.blocks_needed(seq)} KV blocks "
                                   f"({seq.max_len} tokens) but the cache has {self.blocks.num_blocks}; enlarge it")
        while seqs:
            size = 1
            while (size < min(len(seqs), self.config.max_running)
                   and self._group_blocks(seqs[0], seqs[1:size + 1]) <= self.blocks.num_blocks):
                size += 1
            seqs[0].forks = list(seqs[1:size])
            self.waiting.append(seqs[0])
            seqs = seqs[size:]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        items = self._block_items() if self.config.mode == "block" else self._decode_maximal_items()
        plan = SchedulerOutput(self._split(items))
        self.num_prefill_tokens += plan.num_prefill_tokens
        return plan

    def postprocess(self, plan: SchedulerOutput, seqs: list[Sequence],
                    token_ids: list[int | None]) -> list[Sequence]:
        """After `plan`'s pass: its items' tokens are computed, and each of `seqs` (the items
        that sample, and the forks of those whose prompt prefill ended: they sample from their
        parent's logits) takes its sampled token, None where its context is full (it finishes
        by length). Finished sequences leave and free their blocks; returns them."""
        for item in plan.items:
            item.seq.num_computed += item.num_tokens
            self.blocks.register(item.seq)  # prefix caching: its blocks computed by now
        for seq in seqs:
            if seq.forks:
                self._fork(seq)
        for seq, token in zip(seqs, token_ids):
            if seq.error is not None:  # its logits were not finite: no token, the request fails
                seq.status = SequenceStatus.FINISHED_FAILED
            elif seq.status.finished:  # an embedding request, pooled by the engine: nothing to sample
                continue
            elif seq.context_full:  # a prompt as long as the model's context: nothing to sample
                seq.status = SequenceStatus.FINISHED_LENGTH
            else:
                seq.append(token)
        finished = [seq for seq in seqs if seq.status.finished]
        for seq in finished:
            self.running.remove(seq)
            self.blocks.free_blocks(seq)
        return finished

    def abort_all(self) -> list[Sequence]:
        """Drops every unfinished sequence (those of an interrupted call) and frees every block;
        returns them. With none unfinished, the cached prefixes stay."""
        dropped = self.running + list(self.waiting)
        if not dropped:
            return []
        for seq in dropped + [f for s in dropped for f in s.forks]:
            seq.block_table, seq.residual_id = [], -1
        self.running, self.waiting = [], deque()
        self.blocks.release_all()
        return dropped

    def _fork(self, parent: Sequence) -> None:
        """`parent`'s prompt prefill has ended (this pass samples its first token): its forks
        join the running set with the prompt computed. Their tables already hold its complete
        prompt blocks and a block of their own for the partial last one, whose KV the engine
        copies from the parent's."""
        forks, parent.forks = parent.forks, []
        for seq in forks:
            seq.status = SequenceStatus.RUNNING
            seq.num_computed = parent.num_prompt_tokens
            self.running.append(seq)

    # ---- admission and preemption ----------------------------------------------------------
    def _admit(self, shares_pending_blocks: bool = False) -> Sequence | None:
        """Admits the head of the queue with its forks (their slots and blocks) if they fit.
        shares_pending_blocks (decode-maximal): not while a running sequence still prefills the
        next block of its prompt that the prefix cache lacks (the same leading tokens: a shared
        system prompt); a pass later it takes that block from the cache (BlockManager.
        prefills_a_block_of) instead of every request admitted together computing it again."""
        if not self.waiting:
            return None
        seq = self.waiting[0]
        if (shares_pending_blocks and seq.params.prompt_logprobs is None
                and self.blocks.prefills_a_block_of(seq, [s for s in self.running if s.is_prefilling])):
            return None
        size = 1 + len(seq.forks)
        if self._slots_taken() + size > self.config.max_running:
            return None
        # prefix caching: the blocks that hold its leading tokens already (prompt logprobs need
        # every prompt position computed, as in vLLM)
        group = self._group_blocks(seq, seq.forks)
        cached = self.blocks.cached_prefix(seq, group) if seq.params.prompt_logprobs is None else []
        forks_own = group - self.blocks.blocks_for(self._admission_tokens(seq))
        if not self._fits(forks_own + self.blocks.blocks_to_take(self._admission_tokens(seq), cached), size):
            if not self.running:
                raise RuntimeError("the KV cache cannot hold a single request; enlarge it")
            return None
        self.waiting.popleft()
        self.blocks.allocate(seq, self._admission_tokens(seq), cached)
        seq.num_computed = len(cached) * self.blocks.block_size  # their K/V is in the cache already
        self.num_cached_tokens += seq.num_computed
        if not seq.num_preemptions:
            seq.num_cached_tokens = seq.num_computed
        for fork in seq.forks:
            self.blocks.fork(seq, fork, self._num_shared(seq), self._admission_tokens(fork))
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _admission_tokens(self, seq: Sequence) -> int:
        """Tokens whose blocks admission takes: what it prefills (on demand) or its whole life."""
        return seq.num_prefill_tokens if self.config.on_demand else seq.max_len

    def _num_shared(self, parent: Sequence) -> int:
        """Blocks a fork shares with its parent: the prompt's complete ones."""
        return parent.num_prompt_tokens // self.blocks.block_size

    def _group_blocks(self, parent: Sequence, forks: list[Sequence], lifetime: bool = False) -> int:
        """Blocks to admit `parent` with `forks` (for their whole lives when `lifetime`): the
        parent's, and each fork's beyond the prompt blocks it shares."""
        tokens = (lambda s: s.max_len) if lifetime else self._admission_tokens
        own = sum(self.blocks.blocks_for(tokens(f)) - self._num_shared(parent) for f in forks)
        return self.blocks.blocks_for(tokens(parent)) + own

    def _slots_taken(self) -> int:
        """Running sequences and the forks waiting in them for their parent's prefill."""
        return len(self.running) + sum(len(s.forks) for s in self.running)

    def _fits(self, num_blocks: int, num_rows: int) -> bool:
        """Room to admit a group needing `num_blocks` blocks and `num_rows` residual rows. On
        demand, a watermark of blocks is left for the running sequences to grow into, unless
        every lifetime fits anyway."""
        if not self.blocks.has_room(num_blocks, num_rows):
            return False
        return (not self._watermark or not self.running
                or self.blocks.has_room(num_blocks + self._watermark, num_rows) or self._rest_admissible())

    def _preempt(self, victim: Sequence) -> None:
        """Free the victim's blocks; it waits at the head of the queue to be recomputed."""
        self.running.remove(victim)
        self.blocks.free_blocks(victim)
        for fork in victim.forks:  # not forked yet: their blocks are taken again with the parent
            self.blocks.free_blocks(fork)
        victim.preempt()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _grow_or_preempt(self, decoding: list[Sequence]) -> list[Sequence]:
        """The decoding sequences (admission order) once each has a KV slot for its next token:
        while one lacks a block, the most recently admitted running sequence is preempted (it
        may be that sequence itself)."""
        kept, block_size = [], self.blocks.block_size
        for seq in decoding:
            if len(seq.block_table) * block_size >= seq.num_tokens:  # its table holds the next token already
                kept.append(seq)  # (most steps: a block is taken once per block_size tokens)
                continue
            while seq.status is SequenceStatus.RUNNING and not self.blocks.can_grow(seq, seq.num_tokens):
                # Alone and still short: its table ends in a tier whose blocks (and the slower
                # ones') are spent while faster ones are free. Readmitted alone, fastest tier
                # first, it fits (Scheduler.add checked that every request fits the cache alone).
                self._preempt(self.running[-1])
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.grow(seq, seq.num_tokens)
                kept.append(seq)
        return kept

    # ---- policies ------------------------------------------------------------------------
    def _decode_maximal_items(self) -> list[WorkItem]:
        decoding = [s for s in self.running if not s.is_prefilling]
        if self.config.defer_decodes_with_slack:
            last_pass = self._tail_last_pass()
            if last_pass is not None:  # passes left to the last prefilling sequence's end
                # A decode sampled now ends after passes_left(s) passes, deferred one pass later.
                decoding = [s for s in decoding if _passes_left(s) + 1 > last_pass]
        if self.config.on_demand:
            decoding = self._grow_or_preempt(decoding)
        items = [WorkItem(s, s.num_computed, s.num_tokens) for s in decoding]
        budget = self._pass_prefill_budget(len(items))
        prefilling = [s for s in self.running if s.is_prefilling]
        while budget > 0:
            seq = prefilling.pop(0) if prefilling else self._admit(shares_pending_blocks=True)
            if seq is None:
                break
            chunk = min(budget, seq.num_prefill_tokens - seq.num_computed)
            items.append(WorkItem(seq, seq.num_computed, seq.num_computed + chunk))
            budget -= chunk
        return items

    def _pass_prefill_budget(self, num_decodes: int) -> int:
        """The prefill budget, less what rounds the pass down to a multiple of token_multiple
        (when the budget is larger than that cut)."""
        budget, multiple = self.config.prefill_budget, self.config.token_multiple
        cut = (num_decodes + budget) % multiple
        return budget - cut if cut < budget else budget

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
        for seq in owing:  # a parent's forks sample with it and have its lengths: no term of their own
            queued += seq.num_prefill_tokens - seq.num_computed
            prefilled_in = -(-queued // budget)  # the pass sampling its first token
            last = max(last, prefilled_in + seq.max_len - seq.num_prefill_tokens - 1)
        return last

    def _rest_admissible(self) -> bool:
        """Whether every waiting request can be admitted now, together, and every sequence then
        run to its max_tokens without a preemption (no one waits for room)."""
        if len(self.running) + len(self.waiting) > self.config.max_running:  # O(1): groups take >= 1 slot
            return False
        rows = sum(1 + len(s.forks) for s in self.waiting)
        if self._slots_taken() + rows > self.config.max_running:
            return False
        owed = 0
        if self.config.on_demand:  # blocks the running sequences (and their forks) may still take
            holders = self.running + [f for s in self.running for f in s.forks]
            owed = sum(self.blocks.blocks_needed(s) - len(s.block_table) for s in holders)
        need = sum(self._group_blocks(s, s.forks, lifetime=True) for s in self.waiting)
        return self.blocks.has_room(owed + need, rows)

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
