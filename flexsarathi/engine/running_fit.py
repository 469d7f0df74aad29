"""How many sequences an engine built without a policy runs at once: as many as the compute
device's memory holds, up to DEFAULT_MAX_RUNNING (vLLM's default max_num_seqs).

A throughput engine's default should not leave the device idle: a fixed small running set (the
Policy dataclass's gpu_batch_size of 8) ran dummy opt-125m at 276 generated tok/s on 2 Zen 5
cores where 64 running gave 611 (docs/BENCHMARKS.md, "Smaller measurements"). Each batch of
requests is sized when it is added (LLMEngine.fitted_running): the largest running count whose
KV cache (every running lifetime of the batch's longest request, as without kv_cache_tokens: no
preemption) and largest pass fit the compute tier's budget, or without one FIT_FRACTION of what
the device can still allocate (offload/free_memory.py: cgroup limits included).
"""
from __future__ import annotations

from typing import Callable

from policy_search.policy import Policy

DEFAULT_MAX_RUNNING = 256
# Of the free memory: the rest is headroom for what the engine does not price (allocator slack,
# CUDA graphs' pools, the sampler's rows, other processes growing).
FIT_FRACTION = 0.9


def default_policy(**changes) -> Policy:
    """Everything on the compute device, up to DEFAULT_MAX_RUNNING running (the engine fits the
    running set to memory where EngineConfig.fit_running is set, as LLM(policy=None) does)."""
    return Policy(gpu_batch_size=DEFAULT_MAX_RUNNING, **changes)


def policy_or_default(policy: Policy | None, options: dict) -> Policy:
    """The policy an LLM gets: the one given, or without one default_policy() with fit_running set
    in `options` (EngineConfig fields) unless they say otherwise."""
    if policy is not None:
        return policy
    options.setdefault("fit_running", True)
    return default_policy()


def largest_fitting(ceiling: int, need: Callable[[int], int], room: int) -> int:
    """The largest r in [1, ceiling] with need(r) <= room, need growing with r; 1 where not even
    one fits (the batch then runs, or fails, as it would with one running)."""
    low, high = 1, ceiling
    while low < high:
        middle = (low + high + 1) // 2
        if need(middle) <= room:
            low = middle
        else:
            high = middle - 1
    return low
