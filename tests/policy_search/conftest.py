"""Shared planner fixtures: the t4 preset, FlexGen's published workload and policies, a CPU host
profile and dummy OPT-1.3B."""
from __future__ import annotations

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, Workload
from policy_search.flexgen_placement import flexgen_weight_fields
from policy_search.units import GB, GiB, TFLOPS

ALL_GPU = dict(w_gpu=1.0, w_cpu=0.0, w_disk=0.0, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
               act_gpu=1.0, act_cpu=0.0, act_disk=0.0)



# FlexGen (ICML'23) Table 2 and benchmark/flexgen/bench_suite.py, prompt 512 / output 32, on a T4:
# (model, published tokens/s, the policy FlexGen ran: --percent 20 80 0 100 0 100 and 0 50 0 0 0 100).
FLEXGEN_PUBLISHED = {
    "opt-30b": (7.32, Policy(gpu_batch_size=48, num_gpu_batches=3, **flexgen_weight_fields("opt-30b", 20, 80),
                             kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                             cpu_attention=True, scheduler="block")),
    "opt-175b": (0.69, Policy(gpu_batch_size=32, num_gpu_batches=8, **flexgen_weight_fields("opt-175b", 0, 50),
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


def host_profile(dequant_rate: float, **extra) -> HardwareSpec:
    """A 2-core host as `flexsarathi profile` describes it (round figures)."""
    return HardwareSpec(
        name="host", gpu_memory=24 * GiB, cpu_memory=24 * GiB, disk_memory=64 * GiB,
        host_to_device=15 * GB, device_to_host=15 * GB, disk_to_host=3 * GB, host_to_disk=0.4 * GB,
        gpu_matmul_prefill_flops=0.4 * TFLOPS, gpu_matmul_decode_flops=0.2 * TFLOPS,
        gpu_memory_bandwidth=24 * GB, gpu_attention_prefill_flops=20e9, gpu_attention_decode_flops=1e9,
        cpu_matmul_flops=0.4 * TFLOPS, cpu_attention_flops=1e9, gpu_dequant_rate=dequant_rate,
        cpu_dequant_rate=dequant_rate, compute_on_host=True, **extra)


@pytest.fixture(scope="module")
def opt13() -> ModelSpec:
    return ModelSpec.from_name("dummy:opt-1.3b", bytes_per_value=2)
