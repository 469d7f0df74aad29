"""The prefill budget the planner picks for a decode-maximal closed batch (policy_search/prefill_budget.py):
whole prompts per pass, as many as fit, since each prompt pass streams the weights again."""
from __future__ import annotations

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, Workload, estimate
from policy_search.prefill_budget import budget_candidates, closed_batch_prefill_budget
from policy_search.units import GiB

MODEL = ModelSpec.from_name("opt-1.3b")
# weights streamed from the cpu tier: every prompt pass pays their copy up again
STREAMED = Policy(gpu_batch_size=32, w_gpu=0.0, w_cpu=1.0, scheduler="decode-maximal", prefill_budget=128)
CLOSED = Workload(prompt_len=128, gen_len=16, num_requests=32)


def test_candidates_are_doubling_whole_prompts_up_to_every_prompt():
    assert budget_candidates(512, 72) == [512 * n for n in (1, 2, 4, 8, 16, 32, 64, 72)]
    assert budget_candidates(100, 1) == [100]
    assert budget_candidates(7, 8) == [7, 14, 28, 56]


def test_with_room_every_prompt_is_prefilled_in_one_pass():
    hardware = HardwareSpec.preset("t4").with_memory(gpu=64 * GiB)
    assert closed_batch_prefill_budget(STREAMED, MODEL, hardware, CLOSED) == 32 * 128


def test_the_largest_budget_whose_passes_fit_is_chosen():
    """A GPU tier sized between two candidates' largest passes: the smaller one is picked, and it beats
    the policy's own one-prompt budget in the estimate."""
    roomy = HardwareSpec.preset("t4").with_memory(gpu=64 * GiB)
    peaks = {b: estimate(STREAMED.replace(prefill_budget=b), MODEL, roomy, CLOSED).peak_memory["gpu"]
             for b in budget_candidates(128, 32)}
    between = (peaks[8 * 128] + peaks[16 * 128]) / 2 / roomy.memory_usable_fraction
    hardware = roomy.with_memory(gpu=between)
    chosen = closed_batch_prefill_budget(STREAMED, MODEL, hardware, CLOSED)
    assert chosen == 8 * 128
    rate = {b: estimate(STREAMED.replace(prefill_budget=b), MODEL, hardware, CLOSED).throughput for b in (128, chosen)}
    assert rate[chosen] > rate[128]


@pytest.mark.parametrize(("policy", "workload"), [
    (STREAMED.replace(scheduler="block"), CLOSED),  # the block schedule prefills whole blocks anyway
    (STREAMED, Workload(prompt_len=128, gen_len=16)),  # an open stream: decodes ride along prompt chunks
    (STREAMED, Workload(prompt_len=128, gen_len=16, num_requests=33)),  # more requests than run at once
])
def test_not_a_closed_decode_maximal_batch_keeps_the_policys_budget(policy, workload):
    hardware = HardwareSpec.preset("t4").with_memory(gpu=64 * GiB)
    assert closed_batch_prefill_budget(policy, MODEL, hardware, workload) == 128


def test_the_search_gives_a_closed_batch_the_fastest_budget_that_fits():
    """A closed batch searched for under decode-maximal on a GPU too small for the weights: the budget
    is no longer the steady-state one (a prompt of its running set per pass), but the estimate's
    fastest that fits, and the estimate is faster for it."""
    from policy_search import search
    from policy_search.passes import steady_prefill_budget

    hardware = HardwareSpec.preset("t4").with_memory(gpu=2 * GiB)
    policy, est = search(MODEL, hardware, CLOSED, scheduler="decode-maximal")
    steady = policy.replace(prefill_budget=steady_prefill_budget(policy, CLOSED))
    assert est.fits and policy.prefill_budget > steady.prefill_budget
    assert est.throughput > estimate(steady, MODEL, hardware, CLOSED).throughput
