"""A default engine (LLM(policy=None)) runs as many sequences at once as its compute device's memory
holds (flexsarathi/engine/running_fit.py): every request where memory allows, else the most whose KV
cache and largest pass fit the budget, with the tokens of an explicit policy of that size."""
from __future__ import annotations

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.llm_engine import EngineConfig
from flexsarathi.engine.running_fit import DEFAULT_MAX_RUNNING, default_policy, largest_fitting
from flexsarathi.errors import FlexSarathiError
from policy_search import HardwareSpec, Policy
from tests.policy_search.conftest import host_profile

PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(6 + i % 5)] for i in range(40)]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(stories_dir, policy=None, hardware=None):
    """(outputs, last_stats, peak gpu-tier bytes) of PROMPTS on stories260K in fp32 on the CPU."""
    with LLM(stories_dir, dtype="float32", device="cpu", policy=policy, hardware=hardware) as llm:
        budget = llm.engine.memory.budget
        if policy is None and hardware is None:  # free RAM for the compute tier, and for both RAM tiers together
            assert budget.gpu == budget.host and budget.cpu is None
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.token_ids for o in outputs], llm.last_stats, llm.engine.memory.peak("gpu")


def test_a_default_engine_runs_every_request_at_once_where_memory_allows(stories_dir):
    tokens, stats, _ = run(stories_dir)
    assert stats["running"] == len(PROMPTS)
    # every prompt (<= 10 tokens each, 400 in all) fits one pass's 512-token prefill budget: one
    # pass prefills all and samples each one's first token, then one decode pass per further token
    assert stats["passes"] == PARAMS.max_tokens
    assert tokens == run(stories_dir, Policy(gpu_batch_size=len(PROMPTS)))[0]


def test_a_budget_caps_the_running_set_at_the_most_that_fit(stories_dir):
    """An explicit policy of k running, unbudgeted, peaks at weights + KV(k) + its largest pass:
    a default engine given exactly that much runs k (k + 1 needs more), with the same tokens."""
    k = 13
    tokens_k, _, peak_k = run(stories_dir, Policy(gpu_batch_size=k))
    peak_next = run(stories_dir, Policy(gpu_batch_size=k + 1))[2]
    assert peak_next > peak_k
    t4 = HardwareSpec.preset("t4").replace(memory_usable_fraction=1.0)
    tokens, stats, peak = run(stories_dir, hardware=t4.with_memory(gpu=peak_k))
    assert stats["running"] == k and peak <= peak_k and tokens == tokens_k
    assert run(stories_dir, hardware=t4.with_memory(gpu=peak_k - 1))[1]["running"] == k - 1


def test_fitting_the_running_set_needs_everything_on_the_device():
    with pytest.raises(FlexSarathiError, match="fit_running .* needs a policy .* w_gpu=0.5"):
        EngineConfig("dummy:opt-125m", policy=default_policy().replace(w_gpu=0.5, w_cpu=0.5), fit_running=True)


def test_largest_fitting_is_the_largest_count_within_the_room():
    need = [0, 10, 25, 40, 55, 70]  # need[r]: growing with r
    assert [largest_fitting(5, need.__getitem__, room) for room in (9, 10, 24, 25, 54, 70, 1000)] == [1, 1, 1, 2, 3, 5, 5]
    assert largest_fitting(1, need.__getitem__, 0) == 1
    assert default_policy().max_running == DEFAULT_MAX_RUNNING


def test_ray_actors_of_a_job_without_a_policy_fit_their_own_running_sets():
    pytest.importorskip("ray.data", reason="flexsarathi.ray needs Ray Data (make test installs the ray extra)")
    from flexsarathi.ray.spec import EngineSpec

    spec = EngineSpec.of("dummy:opt-125m", None)
    assert spec.options == {"fit_running": True} and Policy.from_dict(spec.policy) == default_policy()
    assert EngineSpec.of("dummy:opt-125m", Policy()).options == {}  # an explicit policy runs as it says


def test_weights_beyond_a_default_engines_memory_fail_before_loading_and_say_what_to_do(stories_dir):
    from offload.memory import MemoryBudgetError

    small = HardwareSpec.preset("t4").replace(memory_usable_fraction=1.0).with_memory(gpu=100 << 10)
    with pytest.raises(FlexSarathiError, match=r"does not fit on the cpu without offloading: .* held to its budget "
                       r"\(gpu memory budget exceeded reserving 'weights \(gpu tier\)'.*--policy auto \(searched for this machine"):
        LLM(stories_dir, dtype="float32", device="cpu", hardware=small)
    with pytest.raises(MemoryBudgetError):  # an explicit policy's shortfall stays the arithmetic alone
        LLM(stories_dir, dtype="float32", device="cpu", hardware=small, policy=Policy())


def test_a_cpu_profiles_budget_caps_the_engines_two_ram_tiers_together(stories_dir):
    host = host_profile(dequant_rate=5e9, host_memory=24 << 30)
    with LLM(stories_dir, dtype="float32", device="cpu", hardware=host) as llm:
        budget = llm.engine.memory.budget
        assert budget.host == int(host.cpu_budget) and budget.gpu == int(host.gpu_budget)
    with LLM(stories_dir, dtype="float32", device="cpu", hardware=host.replace(compute_on_host=False)) as llm:
        assert llm.engine.memory.budget.host is None
