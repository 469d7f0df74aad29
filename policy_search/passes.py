"""What the passes of a run carry, for each scheduler: the pass shapes and how many of each.

Block (FlexGen's schedule): a block of B = gpu_batch_size x num_gpu_batches requests is prefilled
whole in one pass, then decoded in lockstep for n-1 passes, every member padded to the block's
longest prompt and output. Decode passes are grouped into a few segments so the KV cache the
estimate reads grows with the context instead of sitting at its mean.

Decode-maximal (SARATHI, flexsarathi/engine/scheduler.py): `max_running` = B counts every admitted sequence,
prefilling or decoding; each pass carries one decode token per decoding sequence plus prompt tokens up
to `prefill_budget`. By Little's law a request holds its slot for its prefill passes (1, or s / budget
when its prompt is cut into chunks) plus its n-1 decode passes, so with budget >= s at most
r = B / n requests finish per pass: each pass carries s * B / n prompt tokens (the budget the search
picks) and B (n-1) / n decode tokens, and generates B tokens. A smaller budget admits fewer
(r = budget / s). A finite run adds a ramp (the running set filling) and a drain (emptying): about
2 (n-1) passes at half the steady content.

A closed batch (no more requests than B, so all are admitted at once and the whole run is the
scheduler's tail) is modelled pass by pass instead: ceil(N s / budget) passes of prompt chunks
without decodes (every decode has slack behind the last prompt, so it sits them out), then the
decode passes of the longest output, every running sequence decoding, the contexts growing as in
the block schedule. That is the run the engine makes for `LLM.generate(prompts)` with
len(prompts) <= B.
"""
from __future__ import annotations

import math

from policy_search.pass_shape import PassShape, RunShape
from policy_search.policy import Policy
from policy_search.workload import Workload

DECODE_SEGMENTS = 4  # block decode passes are modelled in this many context segments


def steady_prefill_budget(policy: Policy, workload: Workload) -> int:
    """Prompt tokens per pass that keep `policy.max_running` slots busy (decode-maximal): s * B / n,
    and at least one whole mean prompt, so prompts are not cut into chunks for want of budget."""
    running = policy.max_running
    if workload.num_requests is not None:
        running = min(running, workload.num_requests)
    prompt = workload.mean_prompt_len
    return max(1, math.ceil(prompt * max(1.0, running / workload.mean_gen_len)))


def reserved_kv_tokens(policy: Policy, running: float, total_len: float) -> float:
    """KV slots the engine reserves for `running` lifetimes of `total_len` tokens: whole blocks each
    (LLMEngine._kv_total_blocks; a 4-bit pool's blocks are 64 tokens)."""
    block = policy.kv_block_size
    return running * math.ceil(total_len / block) * block


SIMULATE_UP_TO = 4096  # requests: a longer finite workload is modelled analytically


def replays(policy: Policy, workload: Workload) -> bool:
    """Whether the run is replayed pass by pass (simulate.py): a finite workload that fills more
    than the running set and whose lengths vary, stop early, or meet a bounded KV cache."""
    n = workload.num_requests
    if n is None or n > SIMULATE_UP_TO or (n <= policy.max_running and policy.scheduler != "block"):
        return False
    return not workload.is_fixed or workload.max_tokens is not None or policy.kv_cache_tokens is not None


def run_shape(policy: Policy, workload: Workload) -> RunShape:
    if replays(policy, workload):
        from policy_search.simulate import simulated_run

        return simulated_run(policy, workload)
    if policy.scheduler == "block":
        return _block(policy, workload)
    return _decode_maximal(policy, workload)


def _block(policy: Policy, workload: Workload) -> RunShape:
    running = policy.max_running
    if workload.num_requests is not None:
        running = min(running, workload.num_requests)
    k = policy.num_gpu_batches
    if workload.is_fixed:
        prompt, gen = (float(x) for x in workload.lengths[0])
    else:
        prompt, gen = workload.expected_block_max(running)
    # A partial last block costs as much as a full one: the block is padded, and weight I/O is per pass.
    blocks = 1 if workload.num_requests is None else math.ceil(workload.num_requests / running)
    requests = running if workload.num_requests is None else workload.num_requests
    passes = [PassShape(
        kind="prefill", count=blocks, decode_tokens=0.0, prompt_tokens=running * prompt,
        context=0.0, max_context=prompt, prior_kv_tokens=0.0,
        prompt_pairs=running * prompt * (prompt + 1) / 2, sampled=running,
        prompt_rows_per_sequence=prompt, micro_batches=k)]
    passes += _decode_segments(blocks, max(0, round(gen) - 1), running, prompt, k)
    return RunShape(passes=tuple(passes), generated_tokens=requests * workload.mean_gen_len,
                    requests=requests,
                    kv_tokens=reserved_kv_tokens(policy, running, workload.max_prompt_len + workload.max_gen_len),
                    running=running, steady_state=workload.num_requests is None)


def _decode_segments(count: float, steps: int, decoding: float, prompt: float,
                     micro_batches: int) -> list[PassShape]:
    """`steps` decode passes (repeated `count` times), `decoding` sequences each (each samples a
    token), step i attending to prompt + i tokens, in at most DECODE_SEGMENTS segments of growing
    context."""
    segments = min(DECODE_SEGMENTS, steps)
    passes = []
    for j in range(segments):
        first = 1 + steps * j // segments
        last = steps * (j + 1) // segments  # decode steps first..last attend to prompt + step tokens
        passes.append(PassShape(
            kind="decode" if segments == 1 else f"decode {j + 1}/{segments}",
            count=count * (last - first + 1), decode_tokens=decoding, prompt_tokens=0.0,
            context=prompt + (first + last) / 2, max_context=prompt + last, prior_kv_tokens=0.0,
            prompt_pairs=0.0, sampled=decoding, prompt_rows_per_sequence=0.0,
            micro_batches=micro_batches))
    return passes


def _closed_batch(policy: Policy, workload: Workload) -> RunShape:
    """Decode-maximal with every request admitted at once (see the module docstring)."""
    requests, k = workload.num_requests, policy.num_gpu_batches
    budget, prompt = policy.prefill_budget, workload.mean_prompt_len
    prompt_tokens = requests * prompt
    prefill_count = max(1, math.ceil(prompt_tokens / budget))
    per_pass = prompt_tokens / prefill_count
    chunks = max(1.0, prompt / budget)  # chunks of one prompt, each reading the ones before
    passes = [PassShape(
        kind="prefill", count=prefill_count, decode_tokens=0.0, prompt_tokens=per_pass,
        context=0.0, max_context=workload.max_prompt_len, prior_kv_tokens=per_pass * (chunks - 1) / 2,
        prompt_pairs=per_pass * workload.mean_prompt_causal_pairs, sampled=requests / prefill_count,
        prompt_rows_per_sequence=min(budget, workload.max_prompt_len), micro_batches=k)]
    # Decode passes last as long as the longest of the N outputs; meanwhile sequences with shorter
    # outputs finish, so on average N (mean n - 1) / (max n - 1) sequences decode in each.
    steps = max(0, round(workload.expected_block_max(requests)[1]) - 1)
    if steps > 0:
        decoding = requests * workload.mean_decode_steps / steps
        passes += _decode_segments(1, steps, decoding, prompt, k)
    return RunShape(passes=tuple(passes), generated_tokens=requests * workload.mean_gen_len,
                    requests=requests, kv_tokens=reserved_kv_tokens(policy, requests, workload.max_total_len),
                    running=requests,
                    steady_state=False)


def _decode_maximal(policy: Policy, workload: Workload) -> RunShape:
    if workload.num_requests is not None and workload.num_requests <= policy.max_running:
        return _closed_batch(policy, workload)
    running = policy.max_running
    if workload.num_requests is not None:
        running = min(running, workload.num_requests)
    k = policy.num_gpu_batches
    prompt = workload.mean_prompt_len
    steps = workload.mean_decode_steps
    budget = policy.prefill_budget
    prefill_passes = max(1.0, prompt / budget)  # a prompt longer than the budget is cut into chunks
    # Requests finishing per pass: limited by the budget, and by the slots (Little's law).
    finished_per_pass = min(budget / prompt, running / (prefill_passes + steps))
    decoding = finished_per_pass * steps
    prompt_per_pass = finished_per_pass * prompt
    # A prompt cut in m chunks reads the KV of the chunks before each: s (m-1) / 2 tokens in all.
    prior = prompt_per_pass * (prefill_passes - 1) / 2
    generated_per_pass = decoding + finished_per_pass  # the prefill pass samples the first token

    def shape(kind: str, count: float, scale: float) -> PassShape:
        return PassShape(
            kind=kind, count=count, decode_tokens=decoding * scale,
            prompt_tokens=prompt_per_pass * scale, context=workload.mean_decode_context,
            max_context=workload.max_total_len, prior_kv_tokens=prior * scale,
            prompt_pairs=prompt_per_pass * scale * workload.mean_prompt_causal_pairs,
            sampled=generated_per_pass * scale,
            prompt_rows_per_sequence=min(budget, workload.max_prompt_len), micro_batches=k)

    if workload.num_requests is None:
        # Reference run: the passes in which `running` requests complete, in steady state.
        passes = (shape("mixed", running / finished_per_pass, 1.0),)
        requests = running
    else:
        requests = workload.num_requests
        total = requests / finished_per_pass  # pass-equivalents of steady content
        fill = prefill_passes + steps - 1  # passes for the running set to fill (and to drain)
        passes = tuple(p for p in (shape("mixed", max(0.0, total - fill), 1.0),
                                   shape("ramp/drain", 2 * fill, 0.5)) if p.count > 0)
    return RunShape(passes=passes, generated_tokens=requests * workload.mean_gen_len, requests=requests,
                    kv_tokens=reserved_kv_tokens(policy, running, workload.max_total_len), running=running,
                    steady_state=workload.num_requests is None)
