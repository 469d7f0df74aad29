"""`flexsarathi profile`: measure this machine into a HardwareSpec JSON that `--hardware` accepts.

Everything is measured on the compute device the engine would use (CUDA when present, else the
CPU, whose "gpu tier" is then host memory), in the engine's dtype and on the shapes of one decoder
layer (`model=`: a policy_search.ModelSpec; default: OPT-1.3B's, hidden 2048, MLP 8192, 32 heads):
copy bandwidths between tiers, disk read (O_DIRECT, page cache bypassed) and write (fsync'd), the
layer's four matmuls at several row counts, attention rates, dequantization rates, the int4 kernel
on the layer's 4-bit weights (torch's on the CPU, bf16 only; the fused Triton kernel on an sm_80+
GPU: what the planner prices passes of few rows at), and the engine's own fixed cost per layer of a
pass (run on a small dummy model). Each figure is the median of a few repeats after a warm-up, with
fewer repeats for slow calls, so the whole run takes under a minute on a 2-core machine (timings:
docs/BENCHMARKS.md). On a GPU the rates are the device's own time (calls captured in a CUDA graph
and replayed, layer_timing.device_seconds) on calls large enough to fill it: the launches a pass
makes are the engine's per-layer cost, measured apart, not part of a rate.

Without CUDA the profile says `compute_on_host` (the planner then adds cpu-tier copies to the compute
time) and the matmul figures are those of the cost model's host form, time = weight bytes /
bandwidth + FLOPs / rate: a CPU GEMM's time is affine in its rows (it streams the weights once per
call, then does the FMAs, and two cores overlap the two poorly), so the intercept and slope of the
measured times give `gpu_memory_bandwidth` and `gpu_matmul_prefill_flops`.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

from flexsarathi.machine.layer_timing import (LayerShapes, device_seconds, layer_matmul_seconds, layer_matmuls,
                                             median_seconds, sync_device)
from flexsarathi.models.attention import attend
from flexsarathi.models.layers import linear
from offload.disk_store import DiskStore
from offload.free_memory import meminfo_bytes
from offload.host_buffer import aligned_empty
from policy_search.hardware import HardwareSpec
from policy_search.model_spec import ModelSpec
from quant import QTensor, QuantConfig, cpu_kv_attention, dequantize, quantize


def _copy_bandwidth(src_device, dst_device, nbytes: int, pin: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device, pin_memory=pin and src_device.type == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device, pin_memory=pin and dst_device.type == "cpu")
    src.fill_(1)

    def run():
        dst.copy_(src, non_blocking=True)
        sync_device(torch.device("cuda") if "cuda" in (src_device.type, dst_device.type) else torch.device("cpu"))

    return nbytes / median_seconds(run)


def _matmul_figures(device, dtype, shapes: LayerShapes, on_host: bool) -> tuple[float, float, float]:
    """(prefill FLOP/s, decode FLOP/s, weight-streaming bytes/s) of the layer's matmuls."""
    flops_per_row = 2 * shapes.params
    weight_bytes = shapes.params * dtype.itemsize
    if not on_host:  # the GPU's own time (device_seconds): the launches are layer_overhead's
        decode = flops_per_row * 16 / device_seconds(layer_matmuls(device, dtype, shapes, 16, sync=False), device)[0]
        prefill = flops_per_row * 512 / device_seconds(layer_matmuls(device, dtype, shapes, 512, sync=False),
                                                       device)[0]
        return prefill, decode, 0.0
    rows = (8, 16, 32, 64, 128, 256, 512, 1024)  # decode micro-batches up to whole-block prefills
    seconds, start = [], time.perf_counter()
    for t in rows:  # bounded: at least 6 points, then stop once a call or the whole grows long
        seconds.append(layer_matmul_seconds(device, dtype, shapes, t))
        if len(seconds) >= 6 and (seconds[-1] > 0.5 or time.perf_counter() - start > 8):
            break
    rows = rows[:len(seconds)]
    decode = flops_per_row * 16 / seconds[rows.index(16)]
    # Line seconds = a + b * rows fitted in relative error (every row count matters alike): a streams
    # the weights, b is the FMA time per row. On a 2-core EPYC (bf16) it fits 8..1024 rows within 6%.
    # A point a busy neighbour spoiled (> 25% off the line) is dropped once and the line refitted.
    points = list(zip(rows, seconds))
    intercept, slope = _relative_line_fit(points)
    worst = max(points, key=lambda p: abs((intercept + slope * p[0]) / p[1] - 1))
    if abs((intercept + slope * worst[0]) / worst[1] - 1) > 0.25:
        intercept, slope = _relative_line_fit([p for p in points if p != worst])
    slope = max(slope, 1e-12)
    intercept = max(intercept, seconds[0] * 0.05)
    return flops_per_row / slope, decode, weight_bytes / intercept


def _relative_line_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) minimising sum(((a + b * x) / y - 1)^2): least squares weighted by 1 / y^2."""
    w = [1 / y ** 2 for _, y in points]
    s0 = sum(w)
    s1 = sum(wi * x for wi, (x, _) in zip(w, points))
    s2 = sum(wi * x * x for wi, (x, _) in zip(w, points))
    t0 = sum(wi * y for wi, (_, y) in zip(w, points))
    t1 = sum(wi * x * y for wi, (x, y) in zip(w, points))
    det = s0 * s2 - s1 * s1
    return (s2 * t0 - s1 * t1) / det, (s0 * t1 - s1 * t0) / det


def _attention_rate(device, dtype, queries: int, context: int, seqs: int, heads: int = 32,
                    head_dim: int = 128, kv_heads: int | None = None, between=None) -> float:
    """Causal-pair FLOP/s of attention as the executor runs it: each sequence's K and V gathered
    from a paged pool by slot (KVPool.gather), then `attend` (prompts: the flash kernel; decodes: fp32
    matmuls, whose time on a CPU is mostly the fp32 copies of K and V, masks and softmax); decodes on
    the CPU read the pool in place where its kernel covers it (KVPool.attends_in_pool). `between`
    (untimed) runs before each call: in a pass, attention sits between a layer's matmuls, which evict
    its data from the CPU's caches (back-to-back calls run twice as fast on a 2-core EPYC)."""
    kv_heads = kv_heads or heads
    q = torch.randn(seqs, queries, heads, head_dim, dtype=dtype, device=device)
    # Like the engine's pool (K and V of a slot side by side), one cache per layer, each read once
    # per pass: the call reads a layer that is not in the CPU caches (a hot 5 MB context would
    # flatter the rate 2x on a CPU).
    layers = max(2, -(-(256 << 20) // (2 * seqs * context * kv_heads * head_dim * dtype.itemsize)))
    pool = torch.randn(layers, seqs * context, 2, kv_heads, head_dim, dtype=dtype, device=device)
    # Sequences own runs of slots, in reverse order of admission as a busy pool leaves them.
    slots = torch.arange(seqs * context, device=device).view(seqs, context).flip(0)
    q_pos = torch.arange(context - queries, context, device=device).expand(seqs, queries)
    kv_len = torch.full((seqs,), context, device=device)
    in_place = device.type == "cpu" and queries == 1 and cpu_kv_attention.covers_plain(dtype, head_dim)
    no_new = (torch.zeros(seqs, kv_heads, head_dim), torch.zeros(seqs, kv_heads, head_dim),
              torch.full((seqs,), -1))
    layer = iter(range(1 << 62))

    def call():
        j = next(layer) % layers
        if in_place:
            cpu_kv_attention.plain_decode_attention(pool[j], slots, q[:, 0], (torch.zeros_like(kv_len), kv_len),
                                                    no_new, head_dim ** -0.5)
        else:
            k, v = pool[j].index_select(0, slots.reshape(-1)).view(seqs, context, 2, kv_heads, head_dim).unbind(2)
            attend(q, k, v, q_pos, kv_len, head_dim ** -0.5)  # gathered as KVPool.gather_pairs does

    if device.type == "cuda":  # the GPU's own time: no CPU caches to evict, the launches are layer_overhead's
        seconds = device_seconds(call, device)[0]
    else:
        seconds = _host_median(call, between, device)
    # FLOPs as the cost model counts them: the causal (query, key) pairs, 4 * heads * head_dim each
    # (query i at position context - queries + i sees that many keys plus itself).
    pairs = seqs * (queries * (context - queries) + queries * (queries + 1) // 2)
    return 4 * pairs * heads * head_dim / seconds


def _host_median(call, between, device) -> float:
    """Median host seconds of `call`, `between` (untimed) run before each (see _attention_rate)."""
    def run():
        if between is not None:
            between()
            sync_device(device)
        start = time.perf_counter()
        call()
        sync_device(device)
        return time.perf_counter() - start

    for _ in range(3):  # warm-up: the allocator settles (first calls page-fault their temporaries)
        run()
    times = []
    while len(times) < 11 and (len(times) < 3 or sum(times) < 1.0):  # bounded on slow machines
        times.append(run())
    return statistics.median(times)


def _dequant_rate(device, dtype, values: int | None = None) -> float:
    """Values per second dequantized into a preallocated buffer: 4M on a CPU, 64M (a 7B layer's
    largest matrix and more) on a GPU, where a small call is mostly its launches."""
    values = values or (1 << 26 if device.type == "cuda" else 1 << 22)
    q = quantize(torch.randn(values // 4096, 4096, dtype=dtype, device=device), QuantConfig())
    out = torch.empty(q.shape, dtype=dtype, device=device)
    return values / device_seconds(lambda: dequantize(q, out=out), device)[0]


INT4_KERNEL_ROWS = 16  # the decode row count the int4 kernel's rate is measured at


def _int4_kernel_rate(device, dtype, shapes: LayerShapes, rows: int = INT4_KERNEL_ROWS) -> float | None:
    """FLOP/s of the CPU kernel that multiplies the engine's 4-bit weights without dequantizing them,
    over the layer's matrices at `rows` rows: torch's int4 kernel (quant/cpu_matmul.py `linear_4bit`,
    bf16 where its layout is ours) or else the int8 kernel with two planes (quant/cpu_int8_matmul.py,
    what `cpu_matmul="auto"` runs at decode row counts); None where neither covers this machine,
    dtype and shapes. Neither's speed depends on the codes, so the weights are random bytes
    (quantizing and re-laying out a 70B layer would take longer than the measurement)."""
    from quant import cpu_int8_matmul
    from quant.config import WEIGHT_QUANT
    from quant.cpu_matmul import Int4Packed, linear_4bit, pack_for_cpu_kernel

    if device.type != "cpu":
        return None
    group = WEIGHT_QUANT.group_size
    inputs = [torch.randn(rows, i, dtype=dtype) for _, i in shapes.matrices]
    probe = quantize(torch.randn(64, 2 * group, dtype=dtype), WEIGHT_QUANT)
    if dtype == torch.bfloat16 and pack_for_cpu_kernel(probe) is not None \
            and not any(o % 64 or i % group for o, i in shapes.matrices):
        weights = [Int4Packed(torch.randint(0, 256, (o, i // 2), dtype=torch.uint8),
                              (torch.rand(o, i // group, 2) * 0.01).to(torch.bfloat16), (o, i), group)
                   for o, i in shapes.matrices]
        multiply = linear_4bit
    elif cpu_int8_matmul.available() and not any(i % 64 or i % group for _, i in shapes.matrices):
        weights = [_random_codes(o, i, dtype) for o, i in shapes.matrices]

        def multiply(x, w):
            return cpu_int8_matmul.int8_linear(x, w, planes=2)
    else:
        return None

    def run():
        for x, w in zip(inputs, weights):
            multiply(x, w)

    return 2 * shapes.params * rows / median_seconds(run, repeats=5)


GPU_INT4_KERNEL_ROWS = 64  # the decode row count the GPU's fused kernel is measured at


def _gpu_int4_kernel_rate(device, dtype, shapes: LayerShapes, rows: int = GPU_INT4_KERNEL_ROWS) -> float | None:
    """FLOP/s of the fused Triton kernel (quant/triton_kernels.py, what a CUDA engine multiplies
    4-bit weights with at up to GPU_INT4_KERNEL_MAX_ROWS rows) over the layer's matrices at `rows`
    rows, the GPU's own time (device_seconds); None off CUDA, below sm_80 (quant/fused.py use_triton)
    or where the kernel does not take these shapes. Random codes: its speed does not depend on them."""
    from quant import fused

    if device.type != "cuda" or not fused.use_triton(rows, torch.cuda.get_device_capability(device)):
        return None
    from quant import triton_kernels

    weights = [_random_codes(o, i, dtype).to(device) for o, i in shapes.matrices]
    inputs = [torch.randn(rows, i, dtype=dtype, device=device) for _, i in shapes.matrices]
    if not all(triton_kernels.supports(x, w) for x, w in zip(inputs, weights)):
        return None

    def run():
        for x, w in zip(inputs, weights):
            triton_kernels.dequant_linear(x, w, None)

    return 2 * shapes.params * rows / device_seconds(run, device)[0]


def _random_codes(out_features: int, in_features: int, dtype) -> QTensor:
    """A weight in the engine's 4-bit format with random codes, scales and minimums."""
    from quant.config import WEIGHT_QUANT

    groups = out_features * in_features // WEIGHT_QUANT.group_size
    return QTensor(data=torch.randint(0, 256, (out_features * in_features // 2,), dtype=torch.uint8),
                   scale=(torch.rand(groups) * 0.01).half(), minimum=(-torch.rand(groups) * 0.08).half(),
                   shape=(out_features, in_features), dtype=dtype, config=WEIGHT_QUANT)


def read_store_rate(store: DiskStore, range_reads: bool = True) -> float:
    """Bytes/s reading every tensor of `store` with O_DIRECT into two alternating 4096-aligned
    buffers, the next read in flight while one completes: with `range_reads` as the engine streams
    disk weights (read_range_async: chunks land straight in its aligned working buffers,
    offload/tiered_weights.py), else as whole tensors (read_async). The profile and
    scripts/bench_offload.py both measure with it."""
    names = store.names()
    biggest = max(store.entry(n).nbytes for n in names)
    buffers = [aligned_empty((biggest,), torch.uint8) for _ in range(2)]
    total, start = 0, time.perf_counter()
    pending = None
    for i, name in enumerate(names):
        e = store.entry(name)
        out = buffers[i % 2][:e.nbytes].view(e.dtype)
        fut = store.read_range_async(name, 0, out) if range_reads else store.read_async(name, out.view(e.shape))
        if pending is not None:
            pending.result()
        pending = fut
        total += e.nbytes
    pending.result()
    return total / (time.perf_counter() - start)


def _while_computing(fn, shapes: LayerShapes, dtype):
    """fn() on a thread while this thread runs the layer's matmuls (64 rows, torch's threads: the
    engine's) until it returns, as a pass's compute runs beside the weight loader; fn's result."""
    weights = [torch.randn(shape, dtype=dtype) for shape in shapes.matrices]
    inputs = [torch.randn(64, shape[1], dtype=dtype) for shape in shapes.matrices]
    result = []
    reader = threading.Thread(target=lambda: result.append(fn()))
    reader.start()
    while reader.is_alive():
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)
    reader.join()
    return result[0]


def _scratch_store(folder: str, nbytes: int, shapes: LayerShapes, dtype) -> tuple[DiskStore, float]:
    """A store of at least `nbytes` of the layer's matrices (two layers at least), and its write
    rate in bytes/s (fsync'd)."""
    store = DiskStore(folder, "profile", direct_io=True)
    layer_bytes = shapes.params * dtype.itemsize
    layers = disk_test_bytes(nbytes, shapes, dtype) // layer_bytes
    data = [torch.randint(0, 255, (o * i * dtype.itemsize,), dtype=torch.uint8) for o, i in shapes.matrices]
    start = time.perf_counter()
    writer = store.begin_write(total_bytes=layers * layer_bytes)
    for layer in range(layers):
        for i, tensor in enumerate(data):
            writer.add(f"{layer}.{i}", tensor)
    writer.commit()
    write = layers * layer_bytes / (time.perf_counter() - start)
    store.drop_page_cache()
    return store, write


def disk_test_bytes(nbytes: int, shapes: LayerShapes, dtype) -> int:
    """What the disk test writes when asked for `nbytes`: whole layers of matrices, two at least."""
    layer_bytes = shapes.params * dtype.itemsize
    return max(2, -(-nbytes // layer_bytes)) * layer_bytes


def _check_disk_room(folder: str, nbytes: int, asked: int, layer: str) -> None:
    """FlexSarathiError before any measuring when the disk test cannot fit in `folder` (the store would
    find it out only after the other measurements, in an offload store's words)."""
    from flexsarathi.errors import FlexSarathiError
    from offload.memory import human_bytes

    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise FlexSarathiError(f"the disk test writes {human_bytes(nbytes)} in {folder} ({human_bytes(asked)} asked "
                               f"for, whole layers of {layer}, two at least), and it has {human_bytes(free)} free: "
                               "ask for a smaller test or measure a folder on a disk with room")


def _disk_bandwidth(folder: str, nbytes: int, shapes: LayerShapes, dtype, busy_cores: bool,
                    seconds: float = 2.0) -> tuple[float, float, float]:
    """(read bytes/s, write bytes/s fsync'd, CPU seconds per byte read) of a scratch store of the
    layer's matrices in `folder`, read as the engine streams disk weights (read_store_rate). With
    `busy_cores` (compute on the host) the reads run while the cores do the layer's matmuls, as in
    a pass: reader threads then compete with the matmuls for the cores. The read figure is the
    median of reads repeated for `seconds` (at least five, after a warm-up read that checks the
    crc32s): one short read beside a matmul loop spread 1.5-2.8 GB/s between runs on a busy 2-core
    EPYC, this median 2.8-3.05 (docs/DESIGN.md, "Tried"). The CPU figure is the process's CPU time
    over one read with the cores otherwise idle (only the reader threads work)."""
    work = tempfile.mkdtemp(prefix="profile-", dir=folder)
    try:
        store, write = _scratch_store(work, nbytes, shapes, dtype)
        read_store_rate(store)  # warm-up: each tensor's first read checks its crc32
        cpu = time.process_time()
        read_store_rate(store)
        read_cpu = (time.process_time() - cpu) / sum(store.entry(n).nbytes for n in store.names())
        rates, start = [], time.perf_counter()
        while len(rates) < 5 or (time.perf_counter() - start < seconds and len(rates) < 100):
            rates.append(_while_computing(lambda: read_store_rate(store), shapes, dtype) if busy_cores
                         else read_store_rate(store))
        store.close()
        return statistics.median(rates), write, read_cpu
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _decode_step_times(llm, sequences: int, tokens: int) -> tuple[float, float]:
    """(pass, between) median seconds of the decode steps of a run of `sequences` 8-token prompts,
    after a warm-up run (with CUDA graphs: their capture): a pass from the engine's forward call to
    its logits on the host (eager and replayed passes both end there); between, from one decode
    pass's logits to the next pass's forward call (sampling, outputs, scheduling, building the
    micro-batches)."""
    from flexsarathi.engine.sampling import SamplingParams

    engine = llm.engine
    inner, marks = engine.forward, []

    def timed(plan):
        start = time.perf_counter()
        out = inner(plan)
        marks.append((start, time.perf_counter()))
        return out

    engine.forward = timed
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [[10] * 8] * sequences
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (and, with graphs, the capture)
    marks.clear()
    llm.generate(prompts, params, use_tqdm=False)
    engine.forward = inner
    decodes = marks[1:]  # the first pass computes the prompts
    between = [b[0] - a[1] for a, b in zip(decodes, decodes[1:])]
    return statistics.median(end - start for start, end in decodes), statistics.median(between)


def _layer_overhead(llm_class, device, dtype, model: str = "dummy:opt-125m", tokens: int = 12,
                    graphs: bool = False) -> float:
    """Seconds a pass costs per layer and micro-batch beyond its math: the executor's bookkeeping,
    thread hand-offs, per-call costs of small ops (kernel launches on a GPU). Measured by running
    the engine itself on a small model (everything on the compute device, one decode token per
    pass, where the math is a small part) and subtracting the time of its layers' and LM head's
    matmuls measured alone. graphs: with decode passes replayed from CUDA graphs (the engine's
    default on CUDA for such a policy), else eager passes. llm_class: profile_machine's."""
    from policy_search.policy import Policy

    with llm_class(model, dtype=dtype, device=device, policy=Policy(gpu_batch_size=1), cuda_graphs=graphs) as llm:
        pass_seconds, _ = _decode_step_times(llm, 1, tokens)
        config, g = llm.engine.config, llm.engine.weights.global_weights()
    shapes = LayerShapes.of(ModelSpec.from_name(model))
    head = g.get("lm_head.weight", g["embed_tokens.weight"])
    x = torch.randn(1, head.shape[1], dtype=dtype, device=device)
    head_seconds = median_seconds(lambda: (linear(x, head), sync_device(device)), repeats=7)  # a QTensor too
    layer_seconds = layer_matmul_seconds(device, dtype, shapes, 1)
    return max(0.0, (pass_seconds - head_seconds) / config.num_layers - layer_seconds)


def _step_overhead(llm_class, device, dtype, model: str = "dummy:opt-125m", sequences: int = 16,
                   tokens: int = 12) -> tuple[float, float]:
    """(fixed, per sequence) host seconds of an engine step outside its pass
    (HardwareSpec.step_overhead, sequence_overhead): the time between decode passes at 1 and at
    `sequences` sequences (the engine's default graphs setting), a line through the two.
    Sampling is part of it: its per-sequence cost grows with the vocabulary (opt-125m's 50272)
    where the compute device is the CPU. llm_class: profile_machine's."""
    from policy_search.policy import Policy

    between = {}
    for n in (1, sequences):
        with llm_class(model, dtype=dtype, device=device, policy=Policy(gpu_batch_size=n)) as llm:
            between[n] = _decode_step_times(llm, n, tokens)[1]
    per_sequence = max(0.0, (between[sequences] - between[1]) / (sequences - 1))
    return max(0.0, between[1] - per_sequence), per_sequence


def _host_memory() -> int:
    return meminfo_bytes("MemTotal")


def profile_machine(offload_dir: str, llm_class, dtype: torch.dtype | None = None, disk_bytes: int = 512 << 20,
                    log=print, model: ModelSpec | None = None, prompt_len: int = 128,
                    decode_context: int = 256, decode_seqs: int = 16,
                    device: torch.device | None = None) -> HardwareSpec:
    """Measure this machine, logging each step before it runs. llm_class: flexsarathi.llm.LLM, whose
    engine's own costs are timed (passed in: LLM(policy="auto") measures this machine through here).
    dtype: the engine's compute dtype (default: what the engine computes in, fp16 on CUDA and on the CPU
    the dtype measured fastest there, flexsarathi/machine/dtype_choice.py); model: whose layer shapes
    the matmuls and attention use (default OPT-1.3B's). Attention rates are measured on a whole prompt
    of `prompt_len` tokens and on `decode_seqs` sequences decoding against `decode_context` cached
    tokens: on a CPU the rate per pair depends on the shape (per-call costs weigh on short prompts), so
    a benchmark passes its workload's. device: the engine's compute device (default the GPU where there
    is one); "cpu" profiles the host as the compute tier even on a machine with a GPU, which is then
    left alone."""
    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype

    device = resolve_device(device)
    cuda = device.type == "cuda"
    dtype = dtype or resolve_dtype(None, torch.float16, device)  # what LLM(dtype=None) computes in
    shapes = LayerShapes.of(model)
    os.makedirs(offload_dir, exist_ok=True)
    test_bytes = disk_test_bytes(disk_bytes, shapes, dtype)
    _check_disk_room(offload_dir, test_bytes, disk_bytes, model.name if model else "opt-1.3b")
    log(f"profiling: compute device {device} ({dtype}), offload folder {offload_dir}, layer of "
        f"{model.name if model else 'opt-1.3b'} ({shapes.params / 1e6:.1f}M matrix parameters)")
    figures = {**_measure_transfers(device, dtype, shapes, offload_dir, test_bytes, log),
               **_measure_matmuls(device, dtype, shapes, log),
               **_measure_attention(device, dtype, shapes, prompt_len, decode_context, decode_seqs, log),
               **_measure_dequant_and_overhead(llm_class, device, dtype, shapes, log)}
    gpu_memory = _free_device_memory(device) if cuda else _host_memory()
    return HardwareSpec(
        name=f"profile-{os.uname().nodename}", gpu_memory=gpu_memory, cpu_memory=_host_memory(),
        disk_memory=shutil.disk_usage(offload_dir).free, compute_on_host=not cuda, **figures,
        host_memory=None if cuda else _host_memory(),  # no GPU: the gpu and cpu tiers share the RAM
        notes=f"measured by flexsarathi profile on {device} with {dtype}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, layer of {model.name if model else 'opt-1.3b'}, attention "
              f"on a {prompt_len}-token prompt and {decode_seqs} x {decode_context} decode tokens"
              + ("" if cuda else "; no CUDA: the gpu tier is host memory, compute on the host"))


def _free_device_memory(device) -> int:
    """What this process can still allocate on the GPU, not the card's total: the CUDA context and
    other processes' memory are not ours to plan. The planner fills `memory_usable_fraction` of it;
    the rest is the headroom for cuBLAS workspaces, Triton scratch and fragmentation."""
    free, _ = torch.cuda.mem_get_info(device)  # read after this process's context exists
    return int(free)


def _measure_transfers(device, dtype, shapes, offload_dir: str, disk_bytes: int, log) -> dict:
    cuda, cpu = device.type == "cuda", torch.device("cpu")
    log("  measuring copies between tiers (256 MiB each way) ...")
    h2d = _copy_bandwidth(cpu, device, 256 << 20, pin=cuda)
    d2h = _copy_bandwidth(device, cpu, 256 << 20, pin=cuda)
    log(f"  copies: host->device {h2d / 1e9:.2f} GB/s, device->host {d2h / 1e9:.2f} GB/s")
    log(f"  measuring the disk: writing and reading {disk_bytes / 2**20:.0f} MiB in {offload_dir} ...")
    disk_read, disk_write, read_cpu = _disk_bandwidth(offload_dir, disk_bytes, shapes, dtype, busy_cores=not cuda)
    log(f"  disk: read {disk_read / 1e9:.2f} GB/s (O_DIRECT as the engine reads"
        + ("" if cuda else ", while the cores compute") + f"; {read_cpu * 1e9:.3f} CPU s/GB), "
        f"write {disk_write / 1e9:.2f} GB/s")
    return dict(host_to_device=h2d, device_to_host=d2h, disk_to_host=disk_read, host_to_disk=disk_write,
                disk_read_cpu=read_cpu)


def _measure_matmuls(device, dtype, shapes, log) -> dict:
    cuda = device.type == "cuda"
    log(f"  measuring the layer's matmuls ({dtype}) at 8 .. 1024 rows ...")
    prefill, decode, weight_stream = _matmul_figures(device, dtype, shapes, on_host=not cuda)
    if cuda:
        mem_bw = _copy_bandwidth(device, device, 256 << 20, pin=False) * 2  # read + write
        cpu_matmul = _matmul_figures(torch.device("cpu"), torch.float32, shapes, on_host=True)[0]
    else:
        mem_bw, cpu_matmul = weight_stream, prefill
    log(f"  matmul: {prefill / 1e12:.3f} TFLOP/s (prefill), {decode / 1e12:.3f} (16 rows), weights "
        f"stream at {mem_bw / 1e9:.1f} GB/s" + ("" if cuda else " (host form: time = bytes / bw + FLOPs / rate)"))
    return dict(gpu_matmul_prefill_flops=prefill, gpu_matmul_decode_flops=decode,
                gpu_memory_bandwidth=mem_bw, cpu_matmul_flops=cpu_matmul)


GPU_PROMPTS = 8  # prompts of one prefill attention call timed on a GPU


def _measure_attention(device, dtype, shapes, prompt_len: int, decode_context: int, decode_seqs: int,
                       log) -> dict:
    cuda = device.type == "cuda"
    heads = dict(heads=shapes.heads, head_dim=shapes.head_dim, kv_heads=shapes.kv_heads)
    if not cuda:  # on the host, attention follows the layer's matmuls (see _attention_rate)
        heads["between"] = layer_matmuls(device, dtype, shapes, 64)
    # A whole prompt (the engine computes the full square and masks it: twice the causal pairs), and
    # a batch of sequences decoding one token each. On a GPU, calls large enough to fill it (a rate,
    # not a launch: a 128-token prompt is a few microseconds of an H200): several 512-token prompts,
    # 64 sequences of 512 keys at least.
    prompts, prompt, context, seqs = 1, prompt_len, decode_context, decode_seqs
    if cuda:
        prompts, prompt, context, seqs = (GPU_PROMPTS, max(prompt_len, 512), max(decode_context, 512),
                                          max(decode_seqs, 64))
    log("  measuring attention (whole prompts, then a decode batch) ...")
    attn_prefill = _attention_rate(device, dtype, prompt, prompt, prompts, **heads)
    attn_decode = _attention_rate(device, dtype, 1, context, seqs, **heads)
    # a GPU engine's host pool holds its compute dtype, read in place where the kernel covers it
    host_dtype = dtype if cpu_kv_attention.covers_plain(dtype, shapes.head_dim) else torch.float32
    cpu_attn = (attn_decode if not cuda else
                _attention_rate(torch.device("cpu"), host_dtype, 1, decode_context, decode_seqs, **heads))
    log(f"  attention: prefill {attn_prefill / 1e9:.2f} ({prompts} x {prompt}-token prompt), decode "
        f"{attn_decode / 1e9:.3f} ({seqs} x {context} tokens), CPU decode {cpu_attn / 1e9:.3f} "
        f"({decode_seqs} x {decode_context}) GFLOP/s (causal pairs)")
    return dict(gpu_attention_prefill_flops=attn_prefill, gpu_attention_decode_flops=attn_decode,
                cpu_attention_flops=cpu_attn)


def _measure_dequant_and_overhead(llm_class, device, dtype, shapes, log) -> dict:
    log("  measuring 4-bit dequantization and the CPU int4 kernel ...")
    dequant = _dequant_rate(device, dtype)
    cpu_dequant = dequant if device.type != "cuda" else _dequant_rate(torch.device("cpu"), torch.bfloat16)
    int4 = _int4_kernel_rate(device, dtype, shapes)
    gpu_int4 = _gpu_int4_kernel_rate(device, dtype, shapes)
    log(f"  dequantize: {dequant / 1e9:.2f} G values/s; int4 kernel: "
        + (f"{int4 / 1e12:.3f} TFLOP/s ({INT4_KERNEL_ROWS} rows)" if int4 else
           f"Triton {gpu_int4 / 1e12:.3f} TFLOP/s ({GPU_INT4_KERNEL_ROWS} rows)" if gpu_int4 else
           "not used here (bf16 on the CPU only, or the Triton kernel on an sm_80+ GPU)"))
    log("  measuring the engine's own cost per layer (dummy:opt-125m, one decode token per pass) ...")
    overhead = _layer_overhead(llm_class, device, dtype)
    graph_overhead = _layer_overhead(llm_class, device, dtype, graphs=True) if device.type == "cuda" else None
    step, per_sequence = _step_overhead(llm_class, device, dtype)
    log(f"  engine overhead: {overhead * 1e3:.3f} ms per layer and micro-batch of a pass (beyond the math)"
        + (f"; {graph_overhead * 1e3:.3f} ms per layer of a decode pass replayed from a CUDA graph"
           if graph_overhead is not None else "")
        + f"; outside a pass {step * 1e3:.3f} ms per step + {per_sequence * 1e6:.1f} us per sequence")
    return dict(gpu_dequant_rate=dequant, cpu_dequant_rate=cpu_dequant, layer_overhead=overhead,
                graph_layer_overhead=graph_overhead, step_overhead=step, sequence_overhead=per_sequence,
                cpu_int4_matmul_flops=int4, gpu_int4_matmul_flops=gpu_int4)
