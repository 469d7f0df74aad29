"""Shared planner fixtures: the t4 preset, FlexGen's published workload and policies."""
from __future__ import annotations

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, Workload

# FlexGen (ICML'23) Table 2 and benchmark/flexgen/bench_suite.py, prompt 512 / output 32, on a T4:
# (model, published tokens/s, the policy FlexGen ran).
FLEXGEN_PUBLISHED = {
    "opt-30b": (7.32, Policy(gpu_batch_size=48, num_gpu_batches=3, w_gpu=0.2, w_cpu=0.8, w_disk=0.0,
                             kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                             cpu_attention=True, scheduler="block")),
    "opt-175b": (0.69, Policy(gpu_batch_size=32, num_gpu_batches=8, w_gpu=0.0, w_cpu=0.5, w_disk=0.5,
                              kv_gpu=0.0, kv_cpu=0.0, kv_disk=1.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                              cpu_attention=True, scheduler="block", pin_weight=False)),
}


@pytest.fixture(scope="session")
def t4() -> HardwareSpec:
    return HardwareSpec.preset("t4")


@pytest.fixture(scope="session")
def flexgen_workload() -> Workload:
    return Workload(prompt_len=512, gen_len=32)


@pytest.fixture(scope="session")
def flexgen_published():
    return {name: (published, policy, ModelSpec.from_name(name))
            for name, (published, policy) in FLEXGEN_PUBLISHED.items()}
