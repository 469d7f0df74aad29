"""The planner's pass-by-pass replay (policy_search/simulate.py) against the real Scheduler and
BlockManager on the same requests: the same passes, decode rows, prompt tokens and preemptions."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.sampling import SamplingParams
from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig
from flexsarathi.engine.sequence import Sequence
from policy_search import Policy, Workload
from policy_search.errors import SpecError
from policy_search.passes import replays, run_shape
from policy_search.search import kv_admission
from policy_search.simulate import kv_capacity_blocks, simulated_pass_count


def token_at(seq_id: int, position: int) -> int:
    """The simulated model's sample after `position`: period 50 in the position, so the token at
    an output index below 50 first occurs there."""
    return 100 + (seq_id * 31 + position * 7) % 50


def real_run(policy: Policy, workload: Workload) -> tuple[int, int, int, int]:
    """(passes, decode rows, prompt tokens, preemptions) of the real scheduler (no tail deferral,
    which the replay does not model)."""
    blocks = BlockManager(policy.kv_block_size, {"cpu": kv_capacity_blocks(policy, workload)},
                          num_residual=min(policy.max_running, workload.num_requests))
    scheduler = Scheduler(SchedulerConfig(max_running=policy.max_running, num_micro_batches=1,
                                          prefill_budget=policy.prefill_budget, mode=policy.scheduler,
                                          kv_admission=policy.kv_admission, defer_decodes_with_slack=False),
                          blocks)
    for i, (s, n) in enumerate(workload.lengths[:workload.num_requests]):
        max_tokens = workload.max_tokens or n
        stop = frozenset({token_at(i, s + n - 1)}) if n < max_tokens else frozenset()
        scheduler.add(Sequence(i, [1] * s, SamplingParams(max_tokens=max_tokens), max_len=s + max_tokens,
                               stop_ids=stop, generator=torch.Generator()))
    passes = decodes = prompt = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        passes += 1
        for it in plan.items:
            if it.seq.is_prefilling:
                prompt += it.num_tokens
            else:
                decodes += 1
        sampling = [it.seq for it in plan.items if it.samples]
        scheduler.postprocess(plan, sampling, [token_at(s.seq_id, s.num_tokens) for s in sampling])
    return passes, decodes, prompt, scheduler.num_preemptions


def replayed(policy: Policy, workload: Workload) -> tuple[int, int, int, int]:
    shape = run_shape(policy, workload)
    passes, preemptions = simulated_pass_count(policy, workload)
    assert round(shape.total_passes) == passes
    rows = round(sum(p.count * p.decode_tokens for p in shape.passes))
    prompt = round(sum(p.count * p.prompt_tokens for p in shape.passes))
    return passes, rows, prompt, preemptions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=3, max_size=14),
       st.integers(1, 4), st.integers(8, 64), st.sampled_from(["block", "decode-maximal"]),
       st.sampled_from(["on-demand", "reserve"]), st.sampled_from([None, 48]), st.integers(0, 12))
def test_replay_matches_the_scheduler(pairs, running, budget, scheduler, admission, max_tokens, spare):
    workload = Workload(pairs=tuple(pairs), num_requests=len(pairs), max_tokens=max_tokens)
    longest = max(s + (max_tokens or n) for s, n in pairs)
    policy = Policy(gpu_batch_size=running, prefill_budget=budget, scheduler=scheduler, kv_admission=admission,
                    kv_cache_tokens=16 * (-(-longest // 16) + spare))
    if not replays(policy, workload):
        return
    assert replayed(policy, workload) == real_run(policy, workload)


def test_on_demand_runs_more_at_once_when_requests_stop_early():
    pairs = tuple((32, 8 + (i % 5)) for i in range(40))
    workload = Workload(pairs=pairs, num_requests=40, max_tokens=256)
    policy = Policy(gpu_batch_size=32, prefill_budget=128, kv_cache_tokens=4 * 288)
    reserve = simulated_pass_count(policy.replace(kv_admission="reserve"), workload)
    demand = simulated_pass_count(policy, workload)
    assert demand[0] < reserve[0] / 2  # ~4 lifetimes fit, but ~25 prompts + outputs
    assert kv_admission(workload) == "on-demand"
    assert kv_admission(Workload(pairs=pairs, num_requests=40)) == "reserve"


def test_max_tokens_below_an_output_is_refused():
    with pytest.raises(SpecError, match="max_tokens=8 is below the longest output"):
        Workload(pairs=((4, 9),), max_tokens=8)


def test_policy_validates_the_kv_admission_fields():
    from policy_search.policy import PolicyError

    with pytest.raises(PolicyError, match="kv_admission must be one of"):
        Policy(kv_admission="lazy")
    with pytest.raises(PolicyError, match="kv_cache_tokens must be a positive integer"):
        Policy(kv_cache_tokens=0)
    assert Policy.from_dict(Policy(kv_cache_tokens=4096).to_dict()).kv_cache_tokens == 4096


def test_requests_of_equal_lengths_stay_distinct():
    """Two requests with the same lengths (and so, in lockstep, the same state) are two requests:
    the replay once compared them by value and released or preempted the wrong one (found by the
    property above: a chunk with end < start, then a math domain error)."""
    pairs = ((29, 12), (1, 36), (1, 1), (1, 36), (6, 33), (6, 33))
    workload = Workload(pairs=pairs, num_requests=len(pairs), max_tokens=48)
    policy = Policy(gpu_batch_size=4, prefill_budget=20, scheduler="decode-maximal", kv_admission="on-demand",
                    kv_cache_tokens=80)
    assert replays(policy, workload)
    assert replayed(policy, workload) == real_run(policy, workload)
