"""A finite workload's passes, pass by pass, as the engine's schedulers form them (pure planning:
no tensors, no import of the runtime).

The analytic model (passes.py) describes a run by its steady state and a ramp and drain at half
content. With long-tailed lengths the drain is set by the longest outputs, a block schedule is set
by the longest member of each block, and KV admission (lifetime reservation or on demand with
preemption) bounds the running set by the cache rather than by the slots. So for a finite list of
requests this module replays the scheduler's rules (flexsarathi/engine/scheduler.py, block_manager.py):

- block: admit up to `max_running` requests whose whole lives (prompt + max_tokens) fit the cache,
  prefill them whole in one pass, decode in lockstep until all have stopped, next block;
- decode-maximal: every decoding sequence decodes each pass, prompt chunks fill the budget;
  admission by lifetime reservation, or on demand (the prompt fits, with a 1% watermark; a decode
  that finds no block preempts the most recently admitted sequence, which later recomputes its
  prompt and outputs so far as a prefill).

Requests are taken in order from `workload.lengths` (cycled to `num_requests`); a request's
generated length is its gen_len (where it stops), its max_tokens `workload.max_tokens` (None:
its own gen_len, as with ignore_eos).
The tail deferral of decodes and the KV cache's tier split are not modelled. Passes of similar
content are grouped into PassShapes (by kind and token counts within a factor sqrt 2), which is
what the cost model prices.
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from policy_search.pass_shape import PassShape, RunShape
from policy_search.policy import Policy
from policy_search.workload import Workload

WATERMARK = 0.01  # the scheduler's default kv_watermark


def kv_capacity_blocks(policy: Policy, workload: Workload) -> int:
    """Blocks of KV cache the engine gives this run (LLMEngine._kv_blocks)."""
    bs = policy.kv_block_size
    if policy.kv_cache_tokens is not None:
        return policy.kv_cache_tokens // bs
    running = min(policy.max_running, workload.num_requests)
    longest = max(s + _reserved(workload, n) for s, n in workload.lengths)
    return running * math.ceil(longest / bs)


def _reserved(workload: Workload, gen: int) -> int:
    """A request's max_tokens: the workload's, or (lengths known) its own output length."""
    return gen if workload.max_tokens is None else workload.max_tokens


@dataclass(eq=False)  # identity, not value: two requests of equal lengths are still two
class _Req:
    prompt: int
    gen: int  # tokens it generates before stopping
    life: int  # tokens a lifetime reservation holds
    computed: int = 0
    generated: int = 0
    prefill: int = 0  # tokens to compute before the next sample (prompt, or recompute)
    blocks: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


@dataclass
class _Pass:
    decodes: int = 0
    context: int = 0  # KV tokens the decodes attend to, summed
    max_context: int = 0
    prompt: int = 0
    prior: int = 0  # cached tokens the chunks attend to, summed
    pairs: float = 0.0  # causal (query, key) pairs of the chunks
    sampled: int = 0
    widest_chunk: int = 0

    def add_chunk(self, start: int, end: int, samples: bool) -> None:
        n = end - start
        self.prompt += n
        self.prior += start * n  # each query reads the `start` cached keys...
        self.pairs += n * start + n * (n + 1) / 2  # ...and the chunk's own, causally
        self.sampled += samples
        self.widest_chunk = max(self.widest_chunk, n)
        self.max_context = max(self.max_context, end)


class _Simulator:
    def __init__(self, policy: Policy, workload: Workload):
        self.policy, self.bs = policy, policy.kv_block_size
        self.free = kv_capacity_blocks(policy, workload)
        self.watermark = math.ceil(WATERMARK * self.free)
        self.on_demand = policy.kv_admission == "on-demand" and policy.scheduler != "block"
        lengths = workload.lengths
        self.waiting = deque(_Req(s, n, s + _reserved(workload, n))
                             for s, n in (lengths[i % len(lengths)] for i in range(workload.num_requests)))
        for req in self.waiting:
            req.prefill = req.prompt
        self.running: list[_Req] = []
        self.passes: list[_Pass] = []
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def admit(self) -> _Req | None:
        if not self.waiting or len(self.running) >= self.policy.max_running:
            return None
        req = self.waiting[0]
        need = self.blocks_for(req.prefill if self.on_demand else req.life)
        watermark = self.watermark if self.on_demand and self.running else 0
        if need + watermark > self.free and not (need <= self.free and self.rest_fits()):
            return None
        self.waiting.popleft()
        req.blocks, self.free = need, self.free - need
        self.running.append(req)
        return req

    def rest_fits(self) -> bool:
        owed = sum(self.blocks_for(r.life) - r.blocks for r in self.running)
        return (len(self.running) + len(self.waiting) <= self.policy.max_running
                and owed + sum(self.blocks_for(r.life) for r in self.waiting) <= self.free)

    def release(self, req: _Req) -> None:
        self.running.remove(req)
        self.free += req.blocks
        req.blocks = 0

    def preempt(self, victim: _Req) -> None:
        self.release(victim)
        victim.prefill, victim.computed = victim.tokens, 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def grow(self, decoding: list[_Req]) -> list[_Req]:
        kept = []
        for req in decoding:
            while req in self.running and self.blocks_for(req.tokens) > req.blocks + self.free:
                self.preempt(self.running[-1])
            if req in self.running:
                extra = self.blocks_for(req.tokens) - req.blocks
                req.blocks, self.free = req.blocks + extra, self.free - extra
                kept.append(req)
        return kept

    def step(self, items: list[tuple[_Req, int, int]]) -> None:
        """Record a pass of (request, start, end) items and advance them."""
        record = _Pass()
        for req, start, end in items:
            if end - start == 1 and start >= req.prefill:
                record.decodes += 1
                record.context += end
                record.max_context = max(record.max_context, end)
                record.sampled += 1
            else:
                record.add_chunk(start, end, end == req.tokens)
        self.passes.append(record)
        for req, start, end in items:
            req.computed = end
            if end == req.tokens:
                req.generated += 1
                if req.generated >= req.gen:
                    self.release(req)

    def decode_maximal_pass(self) -> None:
        decoding = [r for r in self.running if r.computed >= r.prefill]
        if self.on_demand:
            decoding = self.grow(decoding)
        items = [(r, r.computed, r.tokens) for r in decoding]
        budget = self.policy.prefill_budget
        prefilling = [r for r in self.running if r.computed < r.prefill]
        while budget > 0:
            req = prefilling.pop(0) if prefilling else self.admit()
            if req is None:
                break
            chunk = min(budget, req.prefill - req.computed)
            items.append((req, req.computed, req.computed + chunk))
            budget -= chunk
        self.step(items)

    def block_pass(self) -> None:
        if not self.running:
            while self.admit() is not None:
                pass
        self.step([(r, r.computed, r.tokens) for r in self.running])

    def run(self) -> None:
        one_pass = self.block_pass if self.policy.scheduler == "block" else self.decode_maximal_pass
        while self.waiting or self.running:
            one_pass()


def _bucket(p: _Pass) -> tuple:
    def level(x: int) -> int:
        return -1 if x == 0 else int(2 * math.log2(x))
    return level(p.decodes), level(p.prompt)


def _shape(group: list[_Pass], micro_batches: int) -> PassShape:
    count = len(group)
    decodes = sum(p.decodes for p in group)
    prompt = sum(p.prompt for p in group)
    kind = "mixed" if decodes and prompt else ("decode" if decodes else "prefill")
    return PassShape(
        kind=kind, count=count, decode_tokens=decodes / count, prompt_tokens=prompt / count,
        context=sum(p.context for p in group) / decodes if decodes else 0.0,
        max_context=max(p.max_context for p in group), prior_kv_tokens=sum(p.prior for p in group) / count,
        prompt_pairs=sum(p.pairs for p in group) / count, sampled=sum(p.sampled for p in group) / count,
        prompt_rows_per_sequence=max(p.widest_chunk for p in group), micro_batches=micro_batches)


def simulated_run(policy: Policy, workload: Workload) -> RunShape:
    """The run's passes, grouped into shapes (see the module docstring)."""
    sim = _Simulator(policy, workload)
    sim.run()
    groups: dict[tuple, list[_Pass]] = defaultdict(list)
    for p in sim.passes:
        groups[_bucket(p)].append(p)
    shapes = tuple(_shape(g, policy.num_gpu_batches) for _, g in sorted(groups.items()))
    lengths = workload.lengths
    generated = sum(lengths[i % len(lengths)][1] for i in range(workload.num_requests))
    return RunShape(passes=shapes, generated_tokens=float(generated), requests=float(workload.num_requests),
                    kv_tokens=float(kv_capacity_blocks(policy, workload) * policy.kv_block_size),
                    running=min(policy.max_running, workload.num_requests), steady_state=False)


def simulated_pass_count(policy: Policy, workload: Workload) -> tuple[int, int]:
    """(passes, preemptions) of the replayed run."""
    sim = _Simulator(policy, workload)
    sim.run()
    return len(sim.passes), sim.preemptions
