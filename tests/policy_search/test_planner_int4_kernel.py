"""4-bit weights on a CPU host with a measured int4 kernel rate (`HardwareSpec.cpu_int4_matmul_flops`):
decode-only micro-batches of at most CPU_INT4_KERNEL_MAX_ROWS rows multiply with the kernel (its
FLOPs at its rate, no dequantization); other passes dequantize + matmul as before. Profiles without
the figure (older JSONs, presets) keep that pricing everywhere."""
import json

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, SpecError, Workload, estimate
from policy_search.cost_model import uses_cpu_int4_kernel
from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS, GPU_INT4_KERNEL_MAX_ROWS
from policy_search.units import TFLOPS

from tests.policy_search.conftest import ALL_GPU, host_profile

INT4 = 0.15 * TFLOPS


@pytest.fixture(scope="module")
def host() -> HardwareSpec:
    """A 2-core host as `flexsarathi profile` describes it (round figures), no int4 figure."""
    return host_profile(dequant_rate=2e9)


def _dequant_matmul(model: ModelSpec, hw: HardwareSpec, rows: float, micro_batches: int) -> float:
    """One layer's 4-bit matmuls priced as dequantization + the host's affine dense matmul."""
    params = model.layer_matrix_params
    return (micro_batches * params * model.bytes_per_value / hw.gpu_memory_bandwidth
            + 2 * params * rows / hw.gpu_matmul_prefill_flops + micro_batches * params / hw.gpu_dequant_rate)


def _pairs(policy, model, hw, wl):
    """(pass without the int4 figure, the same pass with it), for every modelled pass."""
    plain = estimate(policy, model, hw, wl)
    kernel = estimate(policy, model, hw.replace(cpu_int4_matmul_flops=INT4), wl)
    assert [p.kind for p in plain.passes] == [p.kind for p in kernel.passes]
    return list(zip(plain.passes, kernel.passes))


@pytest.mark.parametrize("batch,micro_batches", [(16, 1), (CPU_INT4_KERNEL_MAX_ROWS, 1),
                                                 (2 * CPU_INT4_KERNEL_MAX_ROWS, 2)])
def test_few_decode_rows_use_the_kernel_without_dequantization(opt13, host, batch, micro_batches):
    wl = Workload(prompt_len=64, gen_len=4)
    policy = Policy(gpu_batch_size=batch // micro_batches, num_gpu_batches=micro_batches, scheduler="block",
                    compress_weight=True, **ALL_GPU)
    decodes = [(a, b) for a, b in _pairs(policy, opt13, host, wl) if a.prompt_tokens == 0]
    assert decodes
    for plain, kernel in decodes:
        rows = plain.decode_tokens
        saved = _dequant_matmul(opt13, host, rows, micro_batches) - 2 * opt13.layer_matrix_params * rows / INT4
        assert plain.resources["gpu"] - kernel.resources["gpu"] == pytest.approx(opt13.num_layers * saved)
        for resource in ("disk->host", "host->device", "cpu"):
            assert kernel.resources[resource] == plain.resources[resource]


def test_more_rows_or_prompt_tokens_dequantize_as_before(opt13, host):
    wl = Workload(prompt_len=64, gen_len=4)
    wide = Policy(gpu_batch_size=CPU_INT4_KERNEL_MAX_ROWS + 1, scheduler="block", compress_weight=True, **ALL_GPU)
    for plain, kernel in _pairs(wide, opt13, host, wl):  # prefill and decode: too many rows
        assert kernel.resources == plain.resources
    mixed = Policy(gpu_batch_size=8, scheduler="decode-maximal", compress_weight=True, **ALL_GPU)
    pairs = _pairs(mixed, opt13, host, Workload(prompt_len=64, gen_len=8, num_requests=64))
    carrying = [(a, b) for a, b in pairs if a.prompt_tokens > 0]
    assert carrying
    for plain, kernel in carrying:  # prompt tokens in the pass: dequantize + matmul
        assert kernel.resources == plain.resources


def test_kernel_needs_4bit_weights_a_host_and_a_figure(opt13, host):
    wl = Workload(prompt_len=64, gen_len=4)
    dense = Policy(gpu_batch_size=16, scheduler="block", **ALL_GPU)
    for plain, kernel in _pairs(dense, opt13, host, wl):
        assert kernel.resources == plain.resources
    gpu = host.replace(compute_on_host=False)
    compressed = dense.replace(compress_weight=True)
    for plain, kernel in _pairs(compressed, opt13, gpu, wl):
        assert kernel.resources == plain.resources
    from policy_search.pass_shape import PassShape

    shape = PassShape(kind="decode", count=1, decode_tokens=16, prompt_tokens=0, context=65, max_context=65,
                      prior_kv_tokens=0, prompt_pairs=0, sampled=16, prompt_rows_per_sequence=0, micro_batches=1)
    assert uses_cpu_int4_kernel(shape, compressed, host.replace(cpu_int4_matmul_flops=INT4))
    assert not uses_cpu_int4_kernel(shape, compressed, host)
    assert not uses_cpu_int4_kernel(shape, dense, host.replace(cpu_int4_matmul_flops=INT4))


def test_profiles_without_the_figure_still_load(tmp_path, host):
    path = tmp_path / "old.json"
    data = host.to_dict()
    del data["cpu_int4_matmul_flops"]  # written before the field existed
    path.write_text(json.dumps(data))
    assert HardwareSpec.load(path).cpu_int4_matmul_flops is None
    assert HardwareSpec.load(path) == host
    measured = host.replace(cpu_int4_matmul_flops=INT4)
    measured.save(path)
    assert json.loads(path.read_text())["cpu_int4_matmul_flops"] == INT4
    assert HardwareSpec.load(path) == measured
    host.save(path)  # no kernel here: null in the JSON, None again
    assert json.loads(path.read_text())["cpu_int4_matmul_flops"] is None
    assert HardwareSpec.load(path) == host
    assert HardwareSpec.preset("t4").cpu_int4_matmul_flops is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(SpecError, match="cpu_int4_matmul_flops"):
            host.replace(cpu_int4_matmul_flops=bad)


GPU_INT4 = 120 * TFLOPS


def _gpu_dequant_matmul(model: ModelSpec, hw: HardwareSpec, rows: float, micro_batches: int) -> float:
    """One layer's 4-bit matmuls on a GPU priced as dequantization + the dense matmul (decode rows)."""
    params = model.layer_matrix_params
    per_micro_batch = max(2 * params * rows / micro_batches / hw.gpu_matmul_prefill_flops,
                          2 * params * rows / micro_batches / hw.gpu_matmul_decode_flops,
                          params * model.bytes_per_value / hw.gpu_memory_bandwidth)
    return micro_batches * (per_micro_batch + params / hw.gpu_dequant_rate)


@pytest.mark.parametrize("batch,micro_batches", [(16, 1), (GPU_INT4_KERNEL_MAX_ROWS, 1), (96, 2)])
def test_on_a_gpu_up_to_256_rows_multiply_with_the_triton_kernel(opt13, batch, micro_batches):
    """A GPU profile with the fused kernel's rate: decode micro-batches of at most
    GPU_INT4_KERNEL_MAX_ROWS rows cost the kernel's FLOPs or its codes' bytes, no dequantization;
    the prefill of every prompt at once (more rows) dequantizes as before."""
    gpu = HardwareSpec.preset("a100-80g")
    wl = Workload(prompt_len=64, gen_len=4)
    policy = Policy(gpu_batch_size=batch // micro_batches, num_gpu_batches=micro_batches, scheduler="block",
                    compress_weight=True, **ALL_GPU)
    plain = estimate(policy, opt13, gpu, wl)
    kernel = estimate(policy, opt13, gpu.replace(gpu_int4_matmul_flops=GPU_INT4), wl)
    params = opt13.layer_matrix_params
    for a, b in zip(plain.passes, kernel.passes):
        if a.prompt_tokens:  # 64-token prompts, `batch` of them: over the kernel's rows
            assert a.resources == b.resources
            continue
        rows = a.decode_tokens
        fused = max(2 * params * rows / GPU_INT4,
                    micro_batches * params * opt13.weight_format.bytes_per_value / gpu.gpu_memory_bandwidth)
        saved = _gpu_dequant_matmul(opt13, gpu, rows, micro_batches) - fused
        assert a.resources["gpu"] - b.resources["gpu"] == pytest.approx(opt13.num_layers * saved)


def test_a_gpu_above_the_kernels_rows_or_without_its_figure_dequantizes(opt13):
    gpu = HardwareSpec.preset("a100-80g")
    wl = Workload(prompt_len=64, gen_len=4)
    wide = Policy(gpu_batch_size=GPU_INT4_KERNEL_MAX_ROWS + 1, scheduler="block", compress_weight=True, **ALL_GPU)
    assert (estimate(wide, opt13, gpu, wl).passes
            == estimate(wide, opt13, gpu.replace(gpu_int4_matmul_flops=GPU_INT4), wl).passes)
    host = gpu.replace(compute_on_host=True, gpu_int4_matmul_flops=GPU_INT4)  # the CPU's own kernel figure rules
    narrow = wide.replace(gpu_batch_size=16)
    without = host.replace(gpu_int4_matmul_flops=None)
    assert estimate(narrow, opt13, host, wl).passes == estimate(narrow, opt13, without, wl).passes


def test_a_4bit_pool_a_gpu_kernel_attends_in_place_is_not_dequantized_for_decodes(opt13):
    """ModelSpec.decode_in_pool naming the gpu tier for 4-bit KV (the Triton decode kernel): decode
    attention reads the codes, so the decode passes save the dequantization of every context token
    (with bandwidth ample, the FLOPs bound the attention either way); prompt passes are unchanged."""
    import dataclasses

    gpu = HardwareSpec.preset("a100-80g").replace(gpu_memory_bandwidth=1e16)
    in_pool = dataclasses.replace(opt13, decode_in_pool=((), ("gpu",)))
    wl = Workload(prompt_len=64, gen_len=8)
    policy = Policy(gpu_batch_size=16, scheduler="block", compress_kv=True, **ALL_GPU)
    gathered, kernel = estimate(policy, opt13, gpu, wl), estimate(policy, in_pool, gpu, wl)
    contexts = _decode_contexts(policy, opt13, gpu, wl)
    for a, b in zip(gathered.passes, kernel.passes):
        if a.prompt_tokens:
            assert a.resources["gpu"] == pytest.approx(b.resources["gpu"])
            continue
        dequantized = a.decode_tokens * contexts[a.kind] * opt13.kv_values_per_token / gpu.gpu_dequant_rate
        assert a.resources["gpu"] - b.resources["gpu"] == pytest.approx(opt13.num_layers * dequantized)


def _decode_contexts(policy, model, hw, wl):
    """Each modelled decode pass's context, by its kind."""
    from policy_search.estimate import pass_costs

    _, costs = pass_costs(policy, model, hw, wl)
    return {c.shape.kind: c.shape.context for c in costs if c.shape.prompt_tokens == 0}
