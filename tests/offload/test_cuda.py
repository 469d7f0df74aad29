"""What only a GPU can show (issue 28; docs/GPU.md lists these with what each shows). Every test is
marked `gpu` and skips without CUDA; the CPU-side halves of the same rules are in
tests/offload/test_device_discipline.py and tests/flexsarathi/test_gpu_rules.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.llm_engine import resolve_dtype
from offload.executor import PassExecutor
from offload.host_buffer import align_up
from policy_search import Policy
from quant import QuantConfig, dequantize, quantize, quantized_linear
from quant.fused import TRITON_MAX_ROWS
from tests.offload.test_launch_count import MOST, decode_launches
from tests.offload.test_policy_matrix import BASE, CASES, COMPRESSED_CASES, _prompts
from tests.prompt_logits import prompt_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _llm(folder, policy: Policy, tmp_path, device: str = "cuda", dtype: str = "float32") -> LLM:
    return LLM(folder, dtype=dtype, device=device, policy=policy, offload_dir=str(tmp_path / "offload"),
               kv_block_size=8)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


# ---- no host sync inside the layer loop -------------------------------------------------------
SYNC_FREE = {  # placements whose layer loop must not wait for the GPU (cpu_attention must: it needs q)
    "all_on_device": dict(),
    "streamed_weights_kv_and_activations_on_the_host": dict(w_gpu=0.2, w_cpu=0.4, w_disk=0.4, kv_gpu=0.5,
                                                            kv_cpu=0.5, act_gpu=0.5, act_cpu=0.5, num_gpu_batches=2),
    "compressed_kv_split": dict(kv_gpu=0.5, kv_cpu=0.5, compress_kv=True, num_gpu_batches=2),
}


@pytest.mark.parametrize("case", list(SYNC_FREE))
def test_the_layer_loop_makes_no_host_sync(tiny_checkpoint, tmp_path, monkeypatch, case):
    """set_sync_debug_mode("error") around every layer of every pass (loads, compute, stores and the
    prefetches running meanwhile, on every thread): a stream synchronize, a blocking copy, .item(),
    nonzero() or a boolean mask on a CUDA tensor raises. The tokens are those of a run without it."""
    folder = tiny_checkpoint("llama_deep")[0]
    policy = Policy(**{**BASE, **SYNC_FREE[case]})
    prompts = _prompts(128)
    expected = _tokens(_llm(folder, policy, tmp_path / "plain"), prompts)
    original = PassExecutor._run_layer

    def checked(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(PassExecutor, "_run_layer", checked)
    assert _tokens(_llm(folder, policy, tmp_path / "checked"), prompts) == expected


# ---- every placement with CUDA compute gives the all-on-device tokens ---------------------------
@pytest.fixture(scope="module")
def cuda_references(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def get(model: str, compressed: bool):
        if (model, compressed) not in cache:
            folder = tiny_checkpoint(model)[0]
            prompts = _prompts(128)
            llm = _llm(folder, Policy(**BASE, compress_weight=compressed, compress_kv=compressed),
                       tmp_path_factory.mktemp("ref"))
            cache[(model, compressed)] = folder, prompts, _tokens(llm, prompts), prompt_logits(llm, prompts[:3])
        return cache[(model, compressed)]

    return get


def _check_placement(cuda_references, model, compressed, case, tmp_path):
    folder, prompts, ref_tokens, ref_logits = cuda_references(model, compressed)
    llm = _llm(folder, Policy(**{**BASE, **CASES[case], "compress_weight": compressed,
                                 "compress_kv": compressed}), tmp_path)
    assert _tokens(llm, prompts) == ref_tokens
    for got, ref in zip(prompt_logits(llm, prompts[:3]), ref_logits):
        torch.testing.assert_close(got, ref, atol=1e-3 if compressed else 1e-4, rtol=0)


@pytest.mark.parametrize("model", ["opt_deep", "llama_deep"])
@pytest.mark.parametrize("case", list(CASES))  # cpu attention among them (kv_*_cpu_attention, everything_off_gpu)
def test_every_placement_on_cuda_gives_the_all_on_device_tokens(cuda_references, model, case, tmp_path):
    _check_placement(cuda_references, model, False, case, tmp_path)


@pytest.mark.parametrize("model", ["opt_deep", "llama_deep"])
@pytest.mark.parametrize("case", COMPRESSED_CASES)
def test_every_compressed_placement_on_cuda_gives_the_all_on_device_tokens(cuda_references, model, case, tmp_path):
    _check_placement(cuda_references, model, True, case, tmp_path)


# ---- the Triton kernel at large models' layer shapes ------------------------------------------
LAYER_SHAPES = {  # [out_features, in_features] as the engine fuses them
    "opt-30b": {"qkv": (3 * 7168, 7168), "out": (7168, 7168), "fc1": (28672, 7168), "fc2": (7168, 28672)},
    "llama-2-70b": {"qkv": (8192 + 2 * 1024, 8192), "o": (8192, 8192), "gate_up": (2 * 28672, 8192),
                    "down": (8192, 28672)},
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("model", list(LAYER_SHAPES))
@pytest.mark.parametrize("rows", [1, 16, 64, TRITON_MAX_ROWS])
def test_triton_kernel_at_large_layer_shapes_matches_dequantize_then_matmul(model, rows):
    """fp16, 4-bit group 64 (the weight format): the kernel (and quantized_linear, which picks it
    at these rows on sm_80+) against dequantize + fp32 matmul."""
    from quant import triton_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (out_features, in_features) in LAYER_SHAPES[model].items():
        weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).half()
        q = quantize(weight, QuantConfig(bits=4, group_size=64, group_dim=-1))
        del weight
        x = torch.randn(rows, in_features, device="cuda", generator=gen).half()
        expected = F.linear(x.float(), dequantize(q, torch.float32))
        assert triton_kernels.supports(x, q), name
        torch.testing.assert_close(triton_kernels.dequant_linear(x, q, None).float(), expected, rtol=1e-2, atol=5e-2)
        torch.testing.assert_close(quantized_linear(x, q).float(), expected, rtol=1e-2, atol=5e-2)


# ---- pinned host memory is what the tracker counts --------------------------------------------
def test_pinned_host_bytes_are_what_the_tracker_counts(tiny_checkpoint, tmp_path):
    """cpu-tier weights, the KV pool and the disk weights' staging are page-locked (is_pinned) at
    exactly their bytes (cudaHostRegister, no power-of-two rounding), and those bytes are the
    tracker's cpu-tier reservations for them."""
    folder = tiny_checkpoint("llama_deep")[0]
    policy = Policy(**BASE, w_gpu=0.2, w_cpu=0.4, w_disk=0.4, kv_gpu=0.0, kv_cpu=1.0, act_gpu=0.5, act_cpu=0.5)
    llm = _llm(folder, policy, tmp_path)
    _tokens(llm, _prompts(128))
    engine = llm.engine
    weights, placed = engine.weights, engine.weights.placed
    cpu_pieces = [t for layer in range(weights.num_layers) for plan in weights.plan.tensors
                  for i, piece in enumerate(plan.pieces) if piece.tier == "cpu"
                  for t in placed.pieces[layer][(plan.name, i)]]
    staging = [t for slot in weights._staging for kind in slot for buffers in kind.values() for t in buffers]
    arenas = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in staging}  # one per slot
    pool = engine.kv_pools["cpu"]
    assert all(t.is_pinned() for t in cpu_pieces + staging + [pool.k, pool.v])
    by_what = engine.memory.in_use_by_what("cpu")
    assert sum(t.nbytes for t in cpu_pieces) == by_what["weights (cpu tier)"]
    assert len(arenas) == weights.plan.num_slots
    assert sum(arenas.values()) == by_what["weight staging (pinned)"]
    # only each weight's disk rows are staged (the last 40% of a layer's bytes here), not the whole layer
    def slot_bytes(rows_of) -> int:  # a slot as tiered_weights lays it out: each component 4096-aligned
        return sum(align_up(cm.nbytes(end - first)) for plan in weights.plan.layer(0).streamed
                   for first, end in [rows_of(plan)] if end > first for cm in plan.components)

    def disk_rows(plan):
        disk = [piece for piece in plan.pieces if piece.tier == "disk"]
        return (disk[0].row_start, disk[-1].row_end) if disk else (0, 0)

    staged = slot_bytes(disk_rows)
    assert by_what["weight staging (pinned)"] == weights.plan.num_slots * staged
    assert staged < slot_bytes(lambda plan: (0, plan.shape[0]))
    assert pool.nbytes == by_what["KV cache"]
    assert engine.activations.pinned_bytes > 0


# ---- the engine's device, not the current one -------------------------------------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_cuda1_leaves_cuda0_untouched(tiny_checkpoint, tmp_path):
    """Worker threads and the pass run on the engine's device: nothing is allocated on cuda:0
    (the current device of every thread by default), and the tokens are cuda:0's."""
    folder = tiny_checkpoint("llama_deep")[0]
    policy = Policy(**BASE, w_gpu=0.5, w_cpu=0.5, kv_gpu=0.5, kv_cpu=0.5, num_gpu_batches=2)
    prompts = _prompts(128)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.max_memory_allocated(0)
    on_one = _tokens(_llm(folder, policy, tmp_path / "one", device="cuda:1"), prompts)
    assert torch.cuda.max_memory_allocated(0) == before
    assert on_one == _tokens(_llm(folder, policy, tmp_path / "zero", device="cuda:0"), prompts)


def test_auto_dtype_on_this_gpu_has_tensor_cores_for_it():
    bf16_ok = torch.cuda.get_device_capability() >= (8, 0)
    assert resolve_dtype(None, torch.bfloat16, torch.device("cuda")) == (torch.bfloat16 if bf16_ok else torch.float16)


@pytest.mark.parametrize("drop", [False, True])
def test_an_engine_closed_or_dropped_leaves_no_copy_in_flight(tiny_checkpoint, tmp_path, drop):
    """The last layer of a pass prefetches the next pass's first layers on the weights' side
    stream, so copies can still be queued when a run returns. An engine closed, or dropped without
    close(), waits for them before its working buffers and pinned memory go back to the allocators:
    a copy landing in memory handed to the next engine changed one of its tokens (seen once in the
    suite on an H100, 16 workers sharing it: test_the_layer_loop_makes_no_host_sync)."""
    import gc

    folder = tiny_checkpoint("llama_deep")[0]
    policy = Policy(**{**BASE, **SYNC_FREE["streamed_weights_kv_and_activations_on_the_host"]})
    llm = _llm(folder, policy, tmp_path)
    _tokens(llm, _prompts(128))
    stream = llm.engine.weights._stream
    assert stream is not None
    for _, load in llm.engine.weights._pending.values():  # queued on the host: copies in flight, if any
        if load is not None:
            load.result()
    if drop:
        del llm
        gc.collect()
    else:
        llm.close()
    assert stream.query()  # nothing of that engine is still running on its stream


def test_a_held_back_io_stream_does_not_change_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    """The I/O stream held back (a GPU-side sleep before every activation load) while the compute
    stream runs ahead, with the activations split across gpu and cpu and two micro-batches: the
    tokens are the all-on-device ones. A load reads rows parked from the compute stream (the
    pass's embeddings) and frees them once its copies are queued; before ActivationStore.take told
    the allocator (record_stream), their memory went to the compute stream's next tensor while the
    load had not read it yet (one token in three runs changed under 12 processes on an H100)."""
    import time

    from offload.activations import ActivationStore

    folder = tiny_checkpoint("llama_deep")[0]
    policy = Policy(**{**BASE, **SYNC_FREE["streamed_weights_kv_and_activations_on_the_host"]})
    prompts = _prompts(128)
    expected = _tokens(_llm(folder, Policy(**BASE), tmp_path / "reference"), prompts)
    take, compute = ActivationStore.take, PassExecutor._compute

    def held_back_take(self, key):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time on the loading stream before its copies
        return take(self, key)

    def late_compute(self, *args):
        time.sleep(0.002)  # the I/O thread's take of the next micro-batch is queued meanwhile
        return compute(self, *args)

    monkeypatch.setattr(ActivationStore, "take", held_back_take)
    monkeypatch.setattr(PassExecutor, "_compute", late_compute)
    assert _tokens(_llm(folder, policy, tmp_path / "held_back"), prompts) == expected


# ---- CUDA graphs for resident decode passes ---------------------------------------------------
@pytest.mark.parametrize("model", ["opt_deep", "llama_deep"])
@pytest.mark.parametrize("scheduler", ["block", "decode-maximal"])
def test_decode_graphs_on_cuda_give_the_eager_tokens(tiny_checkpoint, tmp_path, model, scheduler):
    """Captured and replayed decode passes (padding rows onto the scratch slot, contexts crossing key
    buckets, LLaMA's RoPE tables rebuilt inside the graph) give the eager passes' tokens and
    logprobs; two generates on one engine reuse and then replace the graphs (a larger pool)."""
    folder = tiny_checkpoint(model)[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    batches = [_prompts(128)[:3], _prompts(128)]  # 3 sequences pad to 4; then 5 to 8 on a larger pool
    runs = {}
    for graphs in (False, True):
        policy = Policy(gpu_batch_size=8, overlap=False, scheduler=scheduler, prefill_budget=8)
        with LLM(folder, dtype="float32", device="cuda", policy=policy, cuda_graphs=graphs,
                 offload_dir=str(tmp_path / "offload")) as llm:
            outs = [llm.generate(b, params, use_tqdm=False) for b in batches]
            runs[graphs] = ([[o.token_ids for o in out] for out in outs],
                            [[step[t].logprob for o in out for t, step in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)]
                             for out in outs])
            assert (llm.engine.stats["graph_passes"] > 0) == graphs
    assert runs[True][0] == runs[False][0]
    for got, ref in zip(runs[True][1], runs[False][1]):
        assert got == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("kind", sorted(MOST))
def test_eager_decode_layer_steps_on_cuda_launch_what_they_launch_on_the_cpu(tiny_checkpoint, kind):
    """The launch count the CPU pins (tests/offload/test_launch_count.py) holds on CUDA: the lean
    path is taken there too ("cuda" and "cuda:0" are one device)."""
    folder = tiny_checkpoint(kind)[0]
    launches, steps = decode_launches(folder, device="cuda")
    assert launches <= MOST[kind], steps[0]
    assert steps[0] == decode_launches(folder, device="cpu")[1][0]


def test_a_host_pool_stores_the_gpus_codes_of_v_without_quantizing_again(monkeypatch):
    """A compressed pool on the cpu tier, fed by a GPU pass: V's codes (what the pass's attention read
    back) come down with K in one event wait, and the host quantizes only K's completed blocks; the
    pool then holds what a store of the same codes from the host gives."""
    from offload import kv_cache
    from offload.kv_cache import KVCompression, KVPool

    torch.manual_seed(0)
    k, v = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64)  # one whole block of 16 tokens
    slots, rows = torch.arange(16), torch.zeros(16, dtype=torch.long)

    def pool():
        return KVPool("cpu", 1, 32, 2, 64, torch.float32, "cpu", block_size=16,
                      compression=KVCompression(block_size=16), num_residual=1)  # K grouped by the pool's block

    host = pool()
    host.store(0, slots, k[0], v[0], rows, v_codes=host.quantize_v(v[0])[0])
    fed = pool()
    codes = fed.quantize_v(v[0].cuda())[0]
    quantized, real = [], kv_cache.quantize
    monkeypatch.setattr(kv_cache, "quantize", lambda x, config, **kw: quantized.append(config) or real(x, config, **kw))
    fed.store(0, slots, k[0].cuda(), v[0].cuda(), rows, v_codes=codes)
    assert quantized == [fed.k_config]  # K's completed block only
    for name in ("data", "scale", "minimum"):
        assert torch.equal(fed.v_codes[name], host.v_codes[name]) and torch.equal(fed.k_codes[name], host.k_codes[name])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_v_quantize_kernel_gives_torchs_bits_on_cuda(dtype):
    """quant/triton_quantize.py compiled (IEEE division, no fma) against torch's quantize on this GPU
    and on the CPU: codes, scales and minimums bit for bit, over nine decades, strided rows of a fused
    projection, constant groups; a non-finite group sets the flag without a sync."""
    from quant import triton_quantize

    gen = torch.Generator().manual_seed(1)
    for tokens, heads, dim, group in [(1, 1, 8, 8), (72, 32, 128, 64), (9, 8, 64, 64), (5, 4, 80, 16), (40, 2, 32, 8)]:
        fused = torch.randn(tokens, 3 * heads * dim, generator=gen) * torch.logspace(-6, 3, tokens)[:, None]
        x = fused.to(dtype)[:, heads * dim:2 * heads * dim].view(tokens, heads, dim)
        x[0, 0, :group] = 0.37
        config = QuantConfig(bits=4, group_size=group)
        got = triton_quantize.quantize_lines(x.cuda(), config)
        for want in (quantize(x.cuda(), config), quantize(x, config)):
            for name in ("data", "scale", "minimum"):
                assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), (tokens, heads, dim, name)
    flag = torch.zeros((), dtype=torch.bool, device="cuda")
    bad = torch.randn(3, 2, 16, device="cuda", dtype=dtype)
    bad[1, 1, 4] = float("nan")
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_quantize.quantize_lines(bad, QuantConfig(bits=4, group_size=16), nonfinite=flag)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bool(flag)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("model", ["opt_deep", "llama_deep"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_compressed_decodes_read_in_the_pool_give_the_gather_routes_tokens(tiny_checkpoint, tmp_path, monkeypatch,
                                                                           model, dtype):
    """A gpu-tier compressed pool's decode rows attended by quant/triton_kv_attention.py (one launch,
    the codes read in place) against the gather route (dequantized context, SDPA) on the same GPU:
    the same greedy tokens, logprobs within the rounding of the two summation orders."""
    from offload.kv_cache import KVPool, gathered_decodes

    folder = tiny_checkpoint(model)[0]
    policy = Policy(**{**BASE, "compress_kv": True, "num_gpu_batches": 2})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompts = _prompts(128)

    def run():
        outs = [o.outputs[0] for o in _llm(folder, policy, tmp_path, dtype=dtype).generate(prompts, params,
                                                                                           use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    calls, kernel = [], KVPool.attend_decode_codes
    monkeypatch.setattr(KVPool, "attend_decode_codes", lambda self, *a, **kw: calls.append(1) or kernel(self, *a, **kw))
    tokens, logprobs = run()
    assert calls
    read_in_pool = len(calls)
    with gathered_decodes():  # the route a GPU without Triton takes
        gathered, gathered_logprobs = run()
    assert len(calls) == read_in_pool  # none read in the pool
    assert tokens == gathered
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    assert max(abs(a - b) for x, y in zip(logprobs, gathered_logprobs) for a, b in zip(x, y)) < tolerance


def test_a_default_engine_on_cuda_fits_its_running_set_and_replays_graphs(stories_dir):
    """LLM(policy=None) on a GPU (flexsarathi/engine/running_fit.py): every request runs at once
    within 90% of the free GPU memory, the tokens are an explicit policy's of that size, and its
    decode passes still replay CUDA graphs beside the fitted KV cache (their pools are reserved
    in the same budget: a bucket that does not fit runs eagerly)."""
    prompts = [[(7 * i + j) % 500 + 2 for j in range(6 + i % 5)] for i in range(24)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(stories_dir, dtype="float32", device="cuda") as llm:
        fitted = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        free = torch.cuda.mem_get_info()[0]
        assert llm.last_stats["running"] == len(prompts) and llm.engine.stats["graph_passes"] > 0
        assert llm.engine.memory.budget.gpu <= 0.9 * (free + llm.engine.memory.in_use("gpu") + (1 << 30))
    with LLM(stories_dir, dtype="float32", device="cuda", policy=Policy(gpu_batch_size=len(prompts))) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fitted


# ---- small CUDA rules --------------------------------------------------------------------------
def test_an_engine_on_bare_cuda_computes_on_an_indexed_device(tiny_checkpoint, tmp_path):
    """LLM(device="cuda"): the engine's device is "cuda:<current>", equal to its tensors' devices,
    so the executor's and pools' device checks hold (a bare "cuda" never equals "cuda:0": a store
    re-uploaded slots already uploaded, every layer-step)."""
    from offload.kv_cache import KVPool

    folder = tiny_checkpoint("opt_deep")[0]
    llm = _llm(folder, Policy(**BASE), tmp_path)
    assert llm.engine.device == torch.device("cuda", torch.cuda.current_device())
    moved = []
    store_pair = KVPool.store_pair

    def counting_store_pair(self, layer, slots, pair):
        moved.append(slots.device != self.device)
        return store_pair(self, layer, slots, pair)

    KVPool.store_pair = counting_store_pair
    try:
        _tokens(llm, _prompts(128))
    finally:
        KVPool.store_pair = store_pair
    assert moved and not any(moved)


def test_a_graph_buckets_input_upload_reads_the_rows_it_was_given():
    """_Bucket.fill rewrites its pinned host buffer while the last step's copy up may still be
    queued (held back here by a GPU-side sleep): the copy must read the rows of its own fill."""
    from offload.decode_graphs import _Bucket

    bucket = _Bucket(2, 16, torch.device("cuda"))
    slots = torch.arange(32).view(2, 16)
    torch.cuda._sleep(50_000_000)  # the stream busy for a while: the first copy waits behind it
    bucket.fill([5, 6], [3, 4], slots, scratch_slot=99)
    first = bucket.inputs.clone()  # queued after the first copy, before the second
    bucket.fill([7, 8], [9, 10], slots + 100, scratch_slot=99)
    torch.cuda.synchronize()
    assert bucket.view(first, "token_ids").tolist() == [5, 6]
    assert bucket.view(first, "positions").tolist() == [3, 4]


@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_cumulative_sums_never_rise_at_a_zero(rows):
    """The sampler's inverse CDF on CUDA: one row (CUB's scan) and several, 90% of each row's
    tokens at probability 0 after 50272 tokens of random mass: the sums it searches are
    non-decreasing and equal to their predecessor's at every zero, so no barred token can be drawn;
    the search gives the host's float64 inverse CDF for 500 u per row except where u x total falls
    within 1e-6 of a boundary."""
    from flexsarathi.engine.sampling import cumulative_sums, inverse_cdf

    gen = torch.Generator().manual_seed(rows)
    probs = torch.rand(rows, 50272, generator=gen)
    probs[torch.rand(rows, 50272, generator=gen) < 0.9] = 0
    probs /= probs.sum(-1, keepdim=True)
    sums = cumulative_sums(probs.cuda()).cpu()
    zero = probs == 0
    assert (sums[:, 1:] >= sums[:, :-1]).all()
    assert (sums[:, 1:][zero[:, 1:]] == sums[:, :-1][zero[:, 1:]]).all()
    exact = probs.double().cumsum(-1)
    for u in torch.rand(500, 1, generator=gen):
        tokens = inverse_cdf(probs.cuda(), u.expand(rows))
        for r, token in enumerate(tokens):
            assert not zero[r, token]
            target = u.item() * exact[r, -1].item()
            expected = int(torch.searchsorted(exact[r], torch.tensor([target], dtype=torch.float64), right=True))
            near = (exact[r] - target).abs().min().item() < 1e-6
            assert token == expected or near


# ---- prefix caching and LoRA adapters on a GPU --------------------------------------------------
def test_prefix_caching_on_cuda_gives_the_uncached_tokens_with_graphs(tiny_checkpoint, tmp_path):
    """Prompts sharing 40 leading tokens, one request at a time then all together: cached blocks
    in the gpu pool (and split to the host) feed eager prompt chunks and graph-replayed decodes;
    the tokens and logprobs are those of the engine without the cache."""
    folder = tiny_checkpoint("llama_deep")[0]
    shared = (_prompts(128)[3] * 2)[:40]
    prompts = [shared + p[:6] for p in _prompts(128)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for caching in (False, True):
        for split in (dict(), dict(kv_gpu=0.5, kv_cpu=0.5)):
            policy = Policy(gpu_batch_size=len(prompts), prefill_budget=48, **split)
            with LLM(folder, dtype="float32", device="cuda", policy=policy, kv_block_size=8,
                     enable_prefix_caching=caching, offload_dir=str(tmp_path / "offload")) as llm:
                outs = llm.generate(prompts, params, use_tqdm=False)
                hits = llm.last_stats["prefix_cache_hit_tokens"]
            assert (hits > 0) == caching
            runs[caching, bool(split)] = [o.token_ids for o in outs]
    assert runs[True, False] == runs[False, False] and runs[True, True] == runs[False, True]


def test_a_lora_adapter_merged_on_cuda_gives_the_cpus_tokens(tiny_checkpoint, tmp_path):
    from tests.flexsarathi.formats.test_lora_adapter import TARGETS, save_adapter

    folder = tiny_checkpoint("llama_gqa_untied")[0]
    save_adapter(folder, tmp_path / "adapter", TARGETS["llama_gqa_untied"])
    prompts = _prompts(128)
    tokens = {}
    for device in ("cpu", "cuda"):
        with LLM(folder, dtype="float32", device=device, lora=str(tmp_path / "adapter"),
                 policy=Policy(w_gpu=0.5, w_cpu=0.5), offload_dir=str(tmp_path / device)) as llm:
            tokens[device] = _tokens(llm, prompts)
    assert tokens["cuda"] == tokens["cpu"]
