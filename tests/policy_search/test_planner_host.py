"""The cost model on a machine without a GPU (`HardwareSpec.compute_on_host`): the compute device is the
host CPU, cpu-tier copies are memcpys on the computing cores, disk reads land in working buffers, and a
matmul's time is affine in its rows. Also: embeddings and the LM head never stream (engine behaviour)."""
import json

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, SpecError, Workload, estimate, search
from policy_search.units import GB

from tests.policy_search.conftest import ALL_GPU, host_profile


@pytest.fixture(scope="module")
def host() -> HardwareSpec:
    """A 2-core host as `flexsarathi profile` describes it (round figures)."""
    return host_profile(dequant_rate=5e9)


def _decode(est):
    return [p for p in est.passes if p.kind.startswith("decode")]


def test_disk_weights_cost_a_read_and_no_copy(opt13, host):
    """The drive's read overlaps the cores and lands in the aligned working buffer itself
    (offload/placement.py); only the cpu tier's half is copied, by the cores."""
    wl = Workload(prompt_len=64, gen_len=8)
    policy = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5)))
    layers = opt13.num_layers * opt13.layer_placed_bytes(False)
    decode = _decode(estimate(policy, opt13, host, wl))[0]
    r = decode.resources
    assert r["host->device"] == pytest.approx(0.5 * layers / host.host_to_device)
    assert r["disk->host"] == pytest.approx(0.5 * layers / host.disk_to_host)
    assert decode.seconds == pytest.approx(max(r["disk->host"], r["gpu"] + r["host->device"]))


def test_disk_reads_take_cpu_from_the_computing_cores(opt13, host):
    """The store's reader threads spend `disk_read_cpu` seconds per byte read on the cores that
    compute: on the host, w_disk x layer bytes x that figure joins host->device (the cores' work of
    filling the working buffers), so it adds to the compute chain; on a GPU machine it does not."""
    wl = Workload(prompt_len=64, gen_len=8)
    policy = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_cpu=0.25, w_disk=0.75)))
    layers = opt13.num_layers * opt13.layer_placed_bytes(False)
    cpu_per_byte = 0.04 / GB  # 0.04 CPU s/GB
    reads = host.replace(disk_read_cpu=cpu_per_byte)
    plain, charged = (_decode(estimate(policy, opt13, h, wl))[0] for h in (host, reads))
    assert charged.resources["host->device"] == pytest.approx(
        0.25 * layers / host.host_to_device + 0.75 * layers * cpu_per_byte)
    assert charged.resources["host->device"] - plain.resources["host->device"] == pytest.approx(
        0.75 * layers * cpu_per_byte)
    r = charged.resources
    assert charged.seconds == pytest.approx(max(r["disk->host"], r["gpu"] + r["host->device"]))
    on_gpu = [_decode(estimate(policy, opt13, h.replace(compute_on_host=False), wl))[0] for h in (host, reads)]
    assert on_gpu[0].resources == on_gpu[1].resources
    # profiles carry it (saved and loaded); older ones and the presets have none
    assert HardwareSpec.from_dict(reads.to_dict()).disk_read_cpu == cpu_per_byte
    assert HardwareSpec.from_dict({k: v for k, v in reads.to_dict().items()
                                   if k != "disk_read_cpu_seconds_per_byte"}).disk_read_cpu == 0
    with pytest.raises(SpecError, match="disk_read_cpu"):
        host.replace(disk_read_cpu=-1.0)


def test_host_copies_add_to_compute(opt13, host):
    wl = Workload(prompt_len=64, gen_len=8)
    policy = Policy(gpu_batch_size=16, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_cpu=1.0)))
    for p in estimate(policy, opt13, host, wl).passes:
        r = p.resources
        assert p.seconds == pytest.approx(r["gpu"] + r["cpu"] + r["host->device"] + r["device->host"])
        assert p.bound == "gpu"
    # a GPU copies over PCIe while it computes: the pass is the longest chain, not the sum
    for p in estimate(policy, opt13, host.replace(compute_on_host=False), wl).passes:
        assert p.seconds == pytest.approx(max(p.resources["gpu"], p.resources["host->device"]))


def test_disk_reads_overlap_host_compute(opt13, host):
    wl = Workload(prompt_len=64, gen_len=8)
    slow_disk = host.replace(disk_to_host=0.1 * GB)
    policy = Policy(gpu_batch_size=16, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_disk=1.0)))
    for p in _decode(estimate(policy, opt13, slow_disk, wl)):
        assert p.bound == "disk->host" and p.seconds == pytest.approx(p.resources["disk->host"])
    # with a fast drive the same passes wait on the cores: compute plus the copies
    for p in _decode(estimate(policy, opt13, host.replace(disk_to_host=100 * GB), wl)):
        assert p.bound == "gpu"
        assert p.seconds == pytest.approx(p.resources["gpu"] + p.resources["host->device"])


def test_host_matmul_is_affine_in_rows(opt13, host):
    """Each micro-batch streams the layer's weights once; every row adds its FLOPs at one rate."""
    wl = Workload(prompt_len=64, gen_len=2)
    base = Policy(gpu_batch_size=16, num_gpu_batches=1, scheduler="block", **ALL_GPU)
    attention_free = host.replace(gpu_attention_decode_flops=1e30, gpu_attention_prefill_flops=1e30)
    one = _decode(estimate(base, opt13, attention_free, wl))[0]
    two = _decode(estimate(base.replace(gpu_batch_size=8, num_gpu_batches=2), opt13, attention_free, wl))[0]
    stream = opt13.layer_matrix_params * 2 / host.gpu_memory_bandwidth
    head_stream = opt13.lm_head_params * 2 / host.gpu_memory_bandwidth
    # same 16 rows; the second micro-batch adds one more read of every layer's weights and of the head
    assert two.resources["gpu"] - one.resources["gpu"] == pytest.approx(opt13.num_layers * stream + head_stream)
    flops = 2 * 16 * (opt13.num_layers * opt13.layer_matrix_params + opt13.lm_head_params)
    # decode attention at an unbounded rate still reads its cache: 16 sequences x 65 tokens per layer
    cache_read = opt13.num_layers * 16 * 65 * opt13.kv_bytes_per_token(False) / host.gpu_memory_bandwidth
    assert one.resources["gpu"] == pytest.approx(opt13.num_layers * stream + head_stream + cache_read
                                                 + flops / host.gpu_matmul_prefill_flops)


def test_embeddings_and_head_stay_on_the_compute_device(opt13, host):
    wl = Workload(prompt_len=64, gen_len=8)
    streamed = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(w_gpu=0.0, w_cpu=1.0)))
    est = estimate(streamed, opt13, host, wl)
    layers = opt13.num_layers * opt13.layer_placed_bytes(False)
    # only the decoder layers move, however the weights are placed
    assert est.passes[0].resources["host->device"] == pytest.approx(layers / host.host_to_device)
    # the gpu tier holds the embeddings and head; the cpu tier the layers
    assert est.peak_memory["gpu"] > opt13.embedding_bytes
    resident = estimate(streamed.replace(w_gpu=1.0, w_cpu=0.0), opt13, host, wl)
    assert resident.peak_memory["gpu"] - est.peak_memory["gpu"] < layers
    assert est.peak_memory["cpu"] == pytest.approx(layers)


def test_compute_on_host_in_json(tmp_path, host):
    path = tmp_path / "host.json"
    host.save(path)
    assert json.loads(path.read_text())["compute_on_host"] is True
    assert HardwareSpec.load(path) == host
    # profiles written before the field existed load as GPU machines
    data = host.to_dict()
    del data["compute_on_host"]
    path.write_text(json.dumps(data))
    assert HardwareSpec.load(path).compute_on_host is False
    path.write_text(json.dumps({**data, "compute_on_host": 1}))
    with pytest.raises(SpecError, match="compute_on_host"):
        HardwareSpec.load(path)


def test_layer_overhead_is_paid_per_layer_and_micro_batch(opt13, host):
    wl = Workload(prompt_len=64, gen_len=8)
    policy = Policy(gpu_batch_size=8, num_gpu_batches=2, scheduler="block", **ALL_GPU)
    plain = estimate(policy, opt13, host, wl)
    slow = estimate(policy, opt13, host.replace(layer_overhead=2e-3), wl)
    for a, b in zip(plain.passes, slow.passes):
        assert b.resources["gpu"] - a.resources["gpu"] == pytest.approx(opt13.num_layers * 2 * 2e-3)
    assert slow.throughput < plain.throughput
    # profiles carry it (the presets a measured one); older profiles have none
    assert HardwareSpec.from_dict({k: v for k, v in host.to_dict().items()
                                   if k != "layer_overhead_seconds"}).layer_overhead == 0
    with pytest.raises(SpecError, match="layer_overhead"):
        host.replace(layer_overhead=-1.0)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("on_host", [True, False])
def test_the_step_around_a_pass_adds_to_every_chain(opt13, host, overlap, on_host):
    """The engine's host step around a pass (scheduling, micro-batches, sampling) is serial with
    it: each pass lasts step_overhead + sequence_overhead x its sequences longer, whichever chain
    binds. A block run of 8: its prompt pass and each decode pass carry 8 sequences."""
    wl = Workload(prompt_len=64, gen_len=8)
    hw = host if on_host else HardwareSpec.preset("a100-80g")
    hw = hw.replace(step_overhead=0.0, sequence_overhead=0.0)
    policy = Policy(gpu_batch_size=8, scheduler="block", overlap=overlap,
                    **(ALL_GPU | dict(w_gpu=0.5, w_cpu=0.5)))
    plain = estimate(policy, opt13, hw, wl)
    slow = estimate(policy, opt13, hw.replace(step_overhead=3e-3, sequence_overhead=2e-4), wl)
    assert [p.prompt_tokens for p in plain.passes][:1] == [8 * 64] and plain.passes[1].decode_tokens == 8
    for a, b in zip(plain.passes, slow.passes):
        assert b.resources["step"] == pytest.approx(3e-3 + 8 * 2e-4) and a.resources["step"] == 0
        assert b.seconds - a.seconds == pytest.approx(3e-3 + 8 * 2e-4)
    added = sum(p.count for p in plain.passes) * (3e-3 + 8 * 2e-4)
    assert slow.total_seconds - plain.total_seconds == pytest.approx(added)
    # profiles carry it (the presets a measured one); older profiles have none
    older = {k: v for k, v in hw.to_dict().items() if k not in ("step_overhead_seconds", "sequence_overhead_seconds")}
    assert HardwareSpec.from_dict(older).step_overhead == HardwareSpec.from_dict(older).sequence_overhead == 0
    with pytest.raises(SpecError, match="sequence_overhead"):
        hw.replace(sequence_overhead=-1e-6)


@pytest.mark.parametrize("placement, graphed", [
    (dict(), True),  # everything on the GPU: decode passes replay a graph
    (dict(kv_gpu=0.5, kv_cpu=0.5), False),  # KV off the GPU: eager (policy_search.graphs)
    (dict(compress_kv=True), False),  # 4-bit KV: eager
])
def test_a_decode_pass_replayed_from_a_graph_pays_the_graphs_overhead(opt13, placement, graphed):
    """estimate() prices a policy's decode passes at graph_layer_overhead where the engine replays
    them (one micro-batch, nothing moving, plain KV); prompt passes and other policies keep
    layer_overhead. Per decode pass the gpu time differs by layers x (eager - graph)."""
    wl = Workload(prompt_len=64, gen_len=8)
    gpu = HardwareSpec.preset("a100-80g").replace(layer_overhead=2e-3, graph_layer_overhead=None)
    policy = Policy(gpu_batch_size=8, num_gpu_batches=1, scheduler="block", **{**ALL_GPU, **placement})
    eager = estimate(policy, opt13, gpu, wl)
    replayed = estimate(policy, opt13, gpu.replace(graph_layer_overhead=5e-4), wl)
    for a, b in zip(eager.passes, replayed.passes):
        saved = opt13.num_layers * (2e-3 - 5e-4) if graphed and a.prompt_tokens == 0 else 0.0
        assert a.resources["gpu"] - b.resources["gpu"] == pytest.approx(saved)
    assert (replayed.throughput > eager.throughput) == graphed
    assert any(p.prompt_tokens == 0 for p in eager.passes)
    older = {k: v for k, v in gpu.replace(graph_layer_overhead=5e-4).to_dict().items()
             if k != "graph_layer_overhead_seconds"}
    assert HardwareSpec.from_dict(older).graph_layer_overhead is None  # optional: a profile without it


def test_the_gpu_and_cpu_tiers_share_the_hosts_ram(host):
    """Without a GPU both tiers are the host's RAM (a profile's host_memory): a placement is held to
    both tiers together within its usable fraction (host_budget), not to each budget apart (which
    would plan up to twice the RAM); a GPU machine's separate memories keep separate budgets."""
    host = host.replace(host_memory=host.cpu_memory)  # as `flexsarathi profile` writes it: the RAM
    assert host.host_budget == host.cpu_budget and "GPU + CPU one 24.00 GiB RAM" in host.describe()
    opt13b = ModelSpec.from_name("dummy:opt-13b", bytes_per_value=2)
    wl = Workload(prompt_len=128, gen_len=32)
    weights = opt13b.num_layers * opt13b.layer_placed_bytes(False)
    # 55% of the layers on the gpu tier, 40% on the cpu tier: each within its 19.2 GiB, together not
    policy = Policy(gpu_batch_size=4, scheduler="block", **(ALL_GPU | dict(w_gpu=0.55, w_cpu=0.4, w_disk=0.05)))
    assert 0.55 * weights < host.gpu_budget and 0.4 * weights < host.cpu_budget < 0.95 * weights
    est = estimate(policy, opt13b, host, wl)
    assert not est.fits and set(est.over_budget) == {"gpu+cpu"}
    assert est.over_budget["gpu+cpu"] == pytest.approx(est.peak_host - host.host_budget)
    assert est.peak_host == max(p.memory["gpu"] + p.memory["cpu"] for p in est.passes) >= 0.95 * weights
    assert estimate(policy, opt13b, host.replace(compute_on_host=False), wl).fits
    searched = search(opt13b, host, wl)[0]
    best = estimate(searched, opt13b, host, wl)
    assert best.fits and best.peak_host <= host.host_budget and searched.w_disk > 0
    assert host.total_budget() == host.cpu_budget + host.disk_budget

