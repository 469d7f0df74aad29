"""The cost model's arithmetic, checked against hand derivations for simple placements."""
import math

import pytest

from policy_search import Policy, Workload, estimate
from policy_search.cost_model import RESOURCES
from policy_search.model_spec import ModelSpec
from policy_search.passes import steady_prefill_budget
from policy_search.units import GiB

ALL_GPU = dict(w_gpu=1.0, w_cpu=0.0, w_disk=0.0, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
               act_gpu=1.0, act_cpu=0.0, act_disk=0.0)


@pytest.fixture(scope="module")
def opt13b():
    return ModelSpec.from_name("opt-13b")


def io(est):
    return {r: sum(p.resources[r] * p.count for p in est.passes) for r in RESOURCES[:4]}


def test_all_on_gpu_moves_nothing_and_counts_every_byte(opt13b, t4):
    wl = Workload(prompt_len=128, gen_len=8)
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, scheduler="block", **ALL_GPU)
    est = estimate(policy, opt13b, t4, wl)
    assert all(v == 0 for v in io(est).values())
    kv = 8 * (128 + 8) * opt13b.num_layers * opt13b.kv_bytes_per_token(False)
    home = opt13b.weight_bytes(False) + kv
    # on top of the homes, only one micro-batch's intermediates (smaller than 1% here)
    assert home < est.peak_memory["gpu"] < home * 1.01
    assert est.peak_memory["cpu"] == est.peak_memory["disk"] == 0
    assert est.throughput == pytest.approx(est.generated_tokens / est.total_seconds)
    assert est.generated_tokens == 8 * 8


def test_each_prefetched_layer_costs_one_layer_buffer(opt13b, t4):
    """weight_prefetch=2 keeps one more streamed layer in a gpu-tier working buffer (and, for disk
    weights, one more host staging buffer); the engine reserves the same (offload/placement.py)."""
    wl = Workload(prompt_len=128, gen_len=8)
    policy = Policy(gpu_batch_size=4, **(ALL_GPU | dict(w_gpu=0.0, w_disk=1.0)))
    one, two = (estimate(policy.replace(weight_prefetch=d), opt13b, t4, wl) for d in (1, 2))
    layer = opt13b.layer_placed_bytes(False)  # norms and biases stay on the compute device
    assert two.peak_memory["gpu"] - one.peak_memory["gpu"] == pytest.approx(layer)
    assert two.peak_memory["cpu"] - one.peak_memory["cpu"] == pytest.approx(layer)
    off = estimate(policy.replace(weight_prefetch=2, overlap=False), opt13b, t4, wl)
    assert one.peak_memory["gpu"] - off.peak_memory["gpu"] == pytest.approx(layer)


def test_weight_stream_time_is_bytes_over_bandwidth(opt13b, t4):
    wl = Workload(prompt_len=128, gen_len=8)
    policy = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(w_gpu=0.25, w_cpu=0.5, w_disk=0.25)))
    for compressed in (False, True):
        est = estimate(policy.replace(compress_weight=compressed), opt13b, t4, wl)
        # the decoder layers stream; embeddings and the LM head stay on the compute device (as the engine keeps them)
        streamed = opt13b.num_layers * opt13b.layer_placed_bytes(compressed)
        decode = est.passes[-1]
        assert decode.resources["host->device"] == pytest.approx(0.75 * streamed / t4.host_to_device)
        assert decode.resources["disk->host"] == pytest.approx(0.25 * streamed / t4.disk_to_host)
        assert decode.resources["device->host"] == 0
        # disk data crosses both links before use: the load chain is their sum
        assert decode.seconds >= (decode.resources["host->device"] + decode.resources["disk->host"]) * (1 - 1e-12)


def test_disk_streams_a_checkpoints_blocks_without_the_minimums(opt13b, t4):
    """A GGUF Q4_0 store streams the file's blocks (2-byte scale + 16 code bytes per 32 values) while
    the memory tiers hold our minimum too: the disk term is priced at 18 of every 20 bytes held."""
    import dataclasses

    from policy_search.quant_format import WeightFormat

    wl = Workload(prompt_len=128, gen_len=8)
    policy = Policy(gpu_batch_size=4, scheduler="block", compress_weight=True,
                    **(ALL_GPU | dict(w_gpu=0.25, w_cpu=0.5, w_disk=0.25)))
    held, streamed = (dataclasses.replace(opt13b, weight_format=WeightFormat(4, 32, 2, minimum_streamed=m))
                      for m in (True, False))
    full, blocks = (estimate(policy, spec, t4, wl).passes[-1] for spec in (held, streamed))
    assert blocks.resources["disk->host"] == pytest.approx(full.resources["disk->host"] * 18 / 20)
    assert blocks.resources["host->device"] == pytest.approx(full.resources["host->device"])
    assert streamed.weight_bytes(True) == held.weight_bytes(True)


def test_cpu_attention_runs_where_the_cache_lives(opt13b, t4):
    wl = Workload(prompt_len=256, gen_len=16)
    placement = ALL_GPU | dict(kv_gpu=0.5, kv_cpu=0.25, kv_disk=0.25)
    base = Policy(gpu_batch_size=8, num_gpu_batches=2, scheduler="block", **placement)
    on = estimate(base.replace(cpu_attention=True), opt13b, t4, wl)
    off = estimate(base, opt13b, t4, wl)
    decodes_on = [p for p in on.passes if p.kind.startswith("decode")]
    decodes_off = [p for p in off.passes if p.kind.startswith("decode")]
    # decode step i (1..15) of each of the 16 sequences attends to 256 + i tokens in every layer
    kv_read = sum(16 * (256 + i) for i in range(1, 16)) * opt13b.num_layers
    flops = kv_read * 4 * opt13b.q_dim
    cpu_seconds = sum(p.resources["cpu"] * p.count for p in decodes_on)
    assert cpu_seconds == pytest.approx(0.5 * flops / t4.cpu_attention_flops)
    assert all(p.resources["cpu"] == 0 for p in off.passes)
    # without CPU attention the off-GPU half of the cache crosses PCIe instead (q and output rows
    # aside), gathered on the host into a pinned buffer first (a pass at the host's memory rate)
    moved = sum((off_p.resources["host->device"] - on_p.resources["host->device"]) * on_p.count
                for on_p, off_p in zip(decodes_on, decodes_off))
    kv_bytes = kv_read * opt13b.kv_bytes_per_token(False) * 0.5
    assert moved == pytest.approx(kv_bytes / t4.host_to_device + kv_bytes / t4.cpu_read_bandwidth, rel=0.01)


@pytest.mark.parametrize("memory_rate", [None, 40e9])
def test_the_host_gather_of_off_gpu_kv_is_priced_on_a_gpu_machine_only(opt13b, t4, memory_rate):
    """K/V bound for the GPU from the cpu tier is gathered on the host (a pass over its bytes at
    HardwareSpec.cpu_read_bandwidth: host_to_device where the memory rate is not known) before
    the copy up; on a host compute device that gather is the copy itself, priced once."""
    from tests.policy_search.conftest import host_profile

    wl = Workload(prompt_len=64, gen_len=4)
    gpu_machine = t4.replace(cpu_memory_bandwidth=memory_rate)
    policy = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0)))
    kv_read = sum(4 * (64 + i) for i in range(1, 4)) * opt13b.num_layers  # decode steps 1..3
    kv_bytes = kv_read * opt13b.kv_bytes_per_token(False)
    for hw, gathered_at in ((gpu_machine, memory_rate or t4.host_to_device), (host_profile(1e9), None)):
        kept = estimate(policy.replace(kv_gpu=1.0, kv_cpu=0.0), opt13b, hw, wl).passes
        off = estimate(policy, opt13b, hw, wl).passes
        moved = sum((o.resources["host->device"] - k.resources["host->device"]) * o.count
                    for o, k in zip(off, kept) if o.kind.startswith("decode"))
        copy = kv_bytes / hw.host_to_device
        assert moved == pytest.approx(copy + (kv_bytes / gathered_at if gathered_at else 0.0), rel=0.01)


def test_kv_cache_grows_with_context(opt13b, t4):
    wl = Workload(prompt_len=512, gen_len=256)
    policy = Policy(gpu_batch_size=16, scheduler="block", **(ALL_GPU | dict(kv_gpu=0.0, kv_cpu=1.0)))
    decodes = [p for p in estimate(policy, opt13b, t4, wl).passes if p.kind.startswith("decode")]
    assert len(decodes) == 4 and sum(p.count for p in decodes) == 255
    reads = [p.resources["host->device"] for p in decodes]
    assert reads == sorted(reads) and reads[-1] > reads[0] * 1.2
    assert [p.seconds for p in decodes] == sorted(p.seconds for p in decodes)


def test_without_overlap_a_pass_waits_for_every_resource(opt13b, t4):
    wl = Workload(prompt_len=256, gen_len=16)
    policy = Policy(gpu_batch_size=8, scheduler="block",
                    **(ALL_GPU | dict(w_gpu=0.5, w_cpu=0.5, kv_gpu=0.0, kv_cpu=1.0)))
    serial = estimate(policy.replace(overlap=False), opt13b, t4, wl)
    for p in serial.passes:
        assert p.seconds == pytest.approx(sum(p.resources.values()))
    assert serial.throughput < estimate(policy, opt13b, t4, wl).throughput


def test_decode_maximal_steady_state(opt13b, t4):
    wl = Workload(prompt_len=512, gen_len=32)
    policy = Policy(gpu_batch_size=16, num_gpu_batches=4, scheduler="decode-maximal", **ALL_GPU)
    # A request holds one of the 64 slots for 1 prefill pass + 31 decode passes: 64 / 32 finish per
    # pass, so 512 * 64 / 32 prompt tokens per pass keep every slot busy.
    budget = steady_prefill_budget(policy, wl)
    assert budget == 512 * 64 // 32
    est = estimate(policy.replace(prefill_budget=budget), opt13b, t4, wl)
    (mixed,) = est.passes
    assert mixed.decode_tokens == pytest.approx(64 * 31 / 32) and mixed.prompt_tokens == pytest.approx(budget)
    assert mixed.count == pytest.approx(32) and est.generated_tokens == 64 * 32  # 64 tokens per pass
    # half the budget admits one request per pass: 31 sequences decode, half the slots idle
    half = estimate(policy.replace(prefill_budget=budget // 2), opt13b, t4, wl).passes[0]
    assert half.decode_tokens == pytest.approx(31) and half.prompt_tokens == pytest.approx(512)
    # a budget below the prompt cuts it into chunks, each reading the KV of the chunks before it
    chunked = estimate(policy.replace(prefill_budget=128), opt13b, t4, wl)
    assert chunked.passes[0].prompt_tokens == pytest.approx(128)
    assert chunked.throughput < est.throughput


def test_finite_runs(opt13b, t4):
    policy = Policy(gpu_batch_size=10, num_gpu_batches=1, scheduler="block", **ALL_GPU)
    wl = Workload(prompt_len=128, gen_len=8, num_requests=25)
    est = estimate(policy, opt13b, t4, wl)
    assert est.passes[0].count == 3  # ceil(25 / 10) blocks, the last one padded
    assert est.generated_tokens == 25 * 8
    dm = policy.replace(scheduler="decode-maximal", prefill_budget=steady_prefill_budget(policy, wl))
    est = estimate(dm, opt13b, t4, wl)
    assert est.generated_tokens == 25 * 8
    # all prompts are processed: steady passes plus ramp/drain at half content
    prompt_total = sum(p.prompt_tokens * p.count for p in est.passes)
    assert prompt_total == pytest.approx(25 * 128)
    ramp = [p for p in est.passes if p.kind == "ramp/drain"][0]
    assert ramp.count == 2 * 7


def test_block_pads_to_the_longest_member(opt13b, t4):
    spread = Workload.from_pairs([(64, 4), (448, 28)])  # mean 256 / 16
    fixed = Workload(prompt_len=256, gen_len=16)
    policy = Policy(gpu_batch_size=8, scheduler="block", **ALL_GPU)
    padded, even = estimate(policy, opt13b, t4, spread), estimate(policy, opt13b, t4, fixed)
    s_pad, n_pad = spread.expected_block_max(8)
    assert padded.passes[0].prompt_tokens == pytest.approx(8 * s_pad)
    assert sum(p.count for p in padded.passes[1:]) == round(n_pad) - 1
    assert padded.generated_tokens == even.generated_tokens == 8 * 16
    assert padded.throughput < even.throughput


def test_compression_trades_io_for_dequantization(opt13b, t4):
    wl = Workload(prompt_len=256, gen_len=16)
    policy = Policy(gpu_batch_size=8, num_gpu_batches=3, scheduler="block",
                    **(ALL_GPU | dict(w_gpu=0.0, w_cpu=1.0, kv_gpu=0.0, kv_cpu=1.0)))
    plain, packed = (estimate(policy.replace(compress_weight=c, compress_kv=c), opt13b, t4, wl)
                     for c in (False, True))
    decode_plain, decode_packed = plain.passes[-1], packed.passes[-1]
    assert decode_packed.resources["host->device"] < 0.35 * decode_plain.resources["host->device"]
    dequant = 3 * opt13b.num_layers * opt13b.layer_matrix_params / t4.gpu_dequant_rate  # per micro-batch
    assert decode_packed.resources["gpu"] - decode_plain.resources["gpu"] > dequant
    assert packed.peak_memory["cpu"] < 0.4 * plain.peak_memory["cpu"]


def test_fits_reports_the_overflow(opt13b, t4):
    policy = Policy(gpu_batch_size=8, scheduler="block", **ALL_GPU)
    est = estimate(policy, opt13b, t4.with_memory(gpu=8 * GiB), Workload(prompt_len=64, gen_len=4))
    assert not est.fits
    assert est.over_budget["gpu"] == pytest.approx(est.peak_memory["gpu"] - 0.8 * 8 * GiB)


def test_bound_names_the_resource_holding_most_time(opt13b, t4):
    # all weights stream from the CPU every pass; 64 decode passes of 8 tokens each wait on PCIe
    policy = Policy(gpu_batch_size=8, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_cpu=1.0)))
    est = estimate(policy, opt13b, t4, Workload(prompt_len=64, gen_len=64))
    decodes = [p for p in est.passes if p.kind.startswith("decode")]
    for p in decodes:  # the load chain, then the engine's step around the pass (8 sequences)
        assert p.resources["step"] == pytest.approx(t4.step_overhead + 8 * t4.sequence_overhead)
        assert p.bound == "host->device" and p.resources["host->device"] > p.resources["gpu"]
        assert p.seconds == pytest.approx(p.resources["host->device"] + p.resources["step"])
    assert sum(p.total_seconds for p in decodes) > est.passes[0].total_seconds
    assert est.bound == "host->device"


def _scheduler_passes(num_requests, prompt, gen, budget, running):
    """(passes with prompt chunks, decode rows in all passes, passes) of the engine's real
    scheduler on a fixed-length workload: one generated token per sampled row."""
    import torch

    from flexsarathi.engine.block_manager import BlockManager
    from flexsarathi.engine.sampling import SamplingParams
    from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig
    from flexsarathi.engine.sequence import Sequence

    blocks = BlockManager(16, {"cpu": num_requests * math.ceil((prompt + gen) / 16)}, num_residual=num_requests)
    scheduler = Scheduler(SchedulerConfig(max_running=running, num_micro_batches=1, prefill_budget=budget), blocks)
    for i in range(num_requests):
        scheduler.add(Sequence(i, [1] * prompt, SamplingParams(max_tokens=gen, ignore_eos=True),
                               max_len=prompt + gen, stop_ids=frozenset(), generator=torch.Generator()))
    prefill_passes = decode_rows = passes = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        items = plan.items
        passes += 1
        prefill_passes += any(it.seq.is_prefilling for it in items)
        decode_rows += sum(not it.seq.is_prefilling for it in items)
        sampling = [it.seq for it in items if it.samples]
        scheduler.postprocess(plan, sampling, [3] * len(sampling))
    return prefill_passes, decode_rows, passes


@pytest.mark.parametrize(("requests", "prompt", "gen", "budget"),
                         [(30, 128, 32, 512), (7, 100, 5, 64), (16, 64, 16, 1024), (5, 40, 1, 30)])
def test_closed_batch_is_modelled_as_the_scheduler_runs_it(opt13b, t4, requests, prompt, gen, budget):
    """No more requests than running slots: the planner's passes are the scheduler's, pass for pass
    (prompt-chunk passes without decodes, then one decode pass per further token)."""
    policy = Policy(gpu_batch_size=32, num_gpu_batches=1, prefill_budget=budget, **ALL_GPU)
    est = estimate(policy, opt13b, t4, Workload(prompt_len=prompt, gen_len=gen, num_requests=requests))
    prefill_passes, decode_rows, passes = _scheduler_passes(requests, prompt, gen, budget, 32)
    assert sum(p.count for p in est.passes) == pytest.approx(passes)
    prefills = [p for p in est.passes if p.prompt_tokens > 0]
    assert sum(p.count for p in prefills) == prefill_passes
    assert all(p.decode_tokens == 0 for p in prefills)
    assert sum(p.decode_tokens * p.count for p in est.passes) == pytest.approx(decode_rows)
    assert sum(p.prompt_tokens * p.count for p in est.passes) == pytest.approx(requests * prompt)
    assert est.generated_tokens == requests * gen
