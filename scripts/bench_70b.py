#!/usr/bin/env python
"""A model far larger than memory from disk on a CPU-only machine: llama-2-70b's shape (GQA 64/8
heads, 80 layers, hidden 8192, ffn 28672) by default, or any registered shape with `--model`
(mixture-of-experts ones included: mixtral-8x7b, qwen3-30b-a3b), with dummy 4-bit group-wise
weights streamed from a disk store with O_DIRECT, the policy (batch, placement, schedule) chosen by
the planner on a measured profile of this machine; prints tok/s against this machine's bound and,
for dense models, against what llama.cpp's mmap offload would read per token at batch 1 (prints;
asserts nothing).

    .venv/bin/python scripts/bench_70b.py --profile prof70b.json   # the headline: 80 layers, 32 x 32 -> 16
    .venv/bin/python scripts/bench_70b.py --layers 4               # the same layer shapes, 4 layers (~1.9 GB store)
    .venv/bin/python scripts/bench_70b.py --model mixtral-8x7b --profile profmix.json   # every expert from disk
    .venv/bin/python scripts/bench_70b.py --quick                  # smoke test: a tiny llama shape, ~1 minute

Mixture of experts: every expert's bytes are read each pass (the planner is held to whole-layer
reads and to computing experts where the pass runs, which is what the bound prices), a token's
FLOPs are its top-k experts' (and the router's); the matmul rates are measured on attention's
matrices and one expert's at the pass's token count, a rate no lower than the experts' fewer rows
each get, so the bound is if anything optimistic.

Set-up
* Model: `dummy:llama-2-70b` (or, with --layers N, the same config truncated to N layers, registered
  here as `llama-2-70b-<N>l`: its store is keyed apart). The layer matrices are drawn directly as
  4-bit g64 codes (4.5 bits per value; uniform codes, each group's step giving the std 0.02 of
  the other dummy models' normal draws: `dummy_weight_codes`, checkpoint.DummyWeights) and written
  to the disk store layer by layer (offload/placed_layers.py): generating and quantizing normal
  draws (--quantize-normal) costs ~48 CPU seconds per 70B layer here (43 of them quantizing),
  drawing codes 1.2 (measured on a busy 2-core EPYC). The store is written once and reused. Its key is the store format version, the source's
  fingerprint (model name, so the layer count; seed; codes drawn or quantized), the compute dtype
  and the 4-bit format (bits, group size, grouping dimension): a store of another format is never
  read as this one. The script prints how long writing took, where the time goes (one layer made
  alone) and the peak RSS while writing (VmHWM, reset before).
* Machine: no GPU, so the "gpu" tier is a budgeted working set in host memory (--gpu-mem-gib) and
  the cpu tier another budget (--cpu-mem-gib); the engine refuses a policy that does not fit them
  (KV cache of the chosen batch included) and the planner only proposes policies that fit.
* Policy: `policy_search.search` on a profile of this machine (`flexsarathi profile`'s code on the
  model's layer shapes in the run's dtype; --profile loads it or measures and saves it) for the closed workload
  (--num-requests prompts of --prompt-len tokens, --gen-len generated each), with 4-bit weights and
  at most --num-requests running, every layer's weights on disk (--cpu-weights lets it keep a part
  in memory); it picks the batch, the KV and activation placement, schedule and prefill budget.
* Measured: generate() end to end after a one-pass warm-up; the bytes this process read from the
  disk (/proc/self/io read_bytes; the store's page cache is dropped first and it is read with
  O_DIRECT, so the page cache never serves it); per pass the tokens, attended keys and logit rows.
* Bound per pass = max(disk bytes of the pass / disk rate, FLOPs / matmul rate (the run's dtype,
  `--dtype`, default this CPU's measured choice) at the pass's rows), summed over the passes (as scripts/bench_offload.py: rates measured in this process just
  before the run, best of a few rounds; the disk the fastest of three ways of reading the store).
  Dequantization and every overhead are outside the bound. Target: tok/s >= 0.8 of the bound's.
  Also printed: the bound at the 4-bit matmul rate, i.e. the compute term priced at the rate of
  the engine's own call on 4-bit weights (`int4pack_linear`: torch's int4 kernel up to 64 rows,
  dequantize + GEMM above), measured here on the layer's matrices. No CPU kernel here multiplies
  4-bit weights at the bf16 GEMM rate (the int4 kernel ran at about half of it at 32 rows), so
  where the decode passes are compute-bound (32 rows on 2 cores) this is the bound this machine
  can reach.
* llama.cpp: arithmetic, not a run (llama-cpp-python is not installed: building it on 2 shared
  cores and writing a 38 GB GGUF of dummy weights is not done here). At batch 1 its mmap offload
  reads every weight once per token once the model exceeds the RAM it may cache (the page cache
  evicts the start of a sequential scan larger than itself before the next token wants it again):
  tok/s = disk rate / bytes per token, bytes = weights x bits per weight / 8 (Q4_0 4.5, Q4_K_M ~4.8).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import harness  # puts the repository root on sys.path
import torch

from bound import Pass, Rates, Shapes, best_rates, cpu_per_gb, instrument, measure_disk_buffered, measure_matmul
from harness import (GB, GiB, cpu_seconds, disk_read_bytes, drop_cache_of, machine_busy_seconds,
                     release_free_memory, say)
from flexsarathi.engine.llm_engine import resolve_dtype  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from flexsarathi.machine.profiler import read_store_rate  # noqa: E402
from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.formats.checkpoint import DummyWeights  # noqa: E402
from flexsarathi.cli.engine_args import describe_policy  # noqa: E402
from quant.config import WEIGHT_QUANT  # noqa: E402
from flexsarathi.engine.planner_spec import planner_model_spec  # noqa: E402
from offload.disk_store import DiskStore  # noqa: E402
from policy_search import HardwareSpec, Workload, search  # noqa: E402
from policy_search.model_registry import known_config, register_variant  # noqa: E402
from quant import quantize  # noqa: E402
from quant.cpu_matmul import Int4Packed  # noqa: E402
from quant.int4pack import int4pack_linear  # noqa: E402

RATE_TOKENS = (1, 8, 32, 128, 512, 1024)  # up to the prefill budget the planner picks here
LLAMA_CPP_BITS = {"Q4_0": 4.5, "Q4_K_M": 4.8}  # bits per weight of llama.cpp's 4-bit formats
# --quick: llama-2-70b's proportions (GQA 8:1, ffn 3.5 x hidden) at a tiny size
TINY = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=1, intermediate_size=1792,
            num_hidden_layers=2)
TINY_MOE = dict(TINY, moe_intermediate_size=256, head_dim=64)  # --quick of an MoE model: its experts, small


def register_model(base: str, layers: int | None, quick: bool) -> str:
    """The registered model name to run: `base`, its config truncated to `layers`, or (quick) small."""
    config = known_config(base)
    moe = config.get("num_local_experts") or config.get("num_experts")
    return register_variant(base, layers, (TINY_MOE if moe else TINY) if quick else None)


def llama_cpp_bytes_per_token(shapes: Shapes) -> dict[str, float]:
    """Bytes llama.cpp's mmap offload reads per token at batch 1, per 4-bit format: every layer
    weight and the output matrix (the embedding lookup touches one row)."""
    weights = shapes.layers * shapes.layer_matrix_params + shapes.hidden * shapes.vocab
    return {fmt: weights * bits / 8 for fmt, bits in LLAMA_CPP_BITS.items()}


# ---- profile, policy, store ---------------------------------------------------------------------


def load_profile(args, spec) -> HardwareSpec:
    if args.profile and os.path.exists(args.profile):
        say(f"profile: {args.profile} (loaded)")
        return HardwareSpec.load(args.profile)
    from flexsarathi.machine.profiler import profile_machine

    say("profile: measuring this machine" + (f" (saved to {args.profile})" if args.profile else ""))
    profile = profile_machine(args.offload_dir, LLM, dtype=args.dtype, model=spec, prompt_len=args.prompt_len,
                              decode_context=args.prompt_len + args.gen_len, decode_seqs=args.num_requests,
                              log=lambda line: say("  " + line))
    if args.profile:
        profile.save(args.profile)
    return profile


def choose_policy(args, model: str, profile: HardwareSpec):
    """(hardware with this run's budgets, policy, the planner's estimate for this closed workload)."""
    hardware = profile.with_memory(gpu=args.gpu_mem_gib * GiB, cpu=args.cpu_mem_gib * GiB)
    spec = planner_model_spec(f"dummy:{model}", args.dtype)
    workload = Workload(prompt_len=args.prompt_len, gen_len=args.gen_len, num_requests=args.num_requests)
    placement = {} if args.cpu_weights else dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0)
    if spec.num_experts:  # every expert read each pass, computed where the pass runs: what the bound prices
        placement.update(routed_expert_reads=False, cpu_experts=False)
    policy, est = search(spec, hardware, workload, compress_weight=True, max_running=args.num_requests, **placement)
    say(f"planner: {describe_policy(policy)}, weight prefetch {policy.weight_prefetch}")
    say(f"  predicted {est.throughput:.3f} tok/s ({est.generated_tokens:.0f} tokens in {est.total_seconds:.0f} s, "
        f"bound by {est.bound}); peak memory " + ", ".join(
            f"{t} {est.peak_memory[t] / GiB:.2f} of {est.budgets[t] / GiB:.2f} GiB" for t in ("gpu", "cpu", "disk")))
    return hardware, policy, est


def vm_hwm_reset() -> None:
    """Reset this process's peak RSS (VmHWM), so the next reading is the peak from here."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def vm_hwm() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def time_one_layer(model: str, codes: bool, dtype: torch.dtype) -> str:
    """How long making one layer takes, as placing the store does it for every layer."""
    source = DummyWeights(model, codes=WEIGHT_QUANT if codes else None)
    start = time.perf_counter()
    weights = source.layer_weights(0, dtype)
    made = time.perf_counter() - start
    if codes:
        return f"one layer alone: codes drawn in {made:.1f} s"
    start = time.perf_counter()
    for tensor in weights.values():
        if tensor.dim() == 2:
            quantize(tensor, WEIGHT_QUANT)
    return f"one layer alone: generated in {made:.1f} s, quantized in {time.perf_counter() - start:.1f} s"


def build_engine(args, model: str, policy, hardware):
    """(engine, store bytes): the store written first where absent (timed, peak RSS), else reused."""
    release_free_memory()
    vm_hwm_reset()
    start = time.perf_counter()
    cpu0 = cpu_seconds()
    llm = LLM(f"dummy:{model}", enable_prefix_caching=False, dtype=args.dtype, policy=policy, hardware=hardware,
              offload_dir=args.offload_dir, direct_io=True, dummy_weight_codes=not args.quantize_normal)
    seconds, peak, cpu = time.perf_counter() - start, vm_hwm(), cpu_seconds() - cpu0
    store = llm.engine.weights.store
    size = sum(store.entry(n).nbytes for n in store.names())
    written = os.path.getmtime(store.manifest_path) >= time.time() - seconds - 1
    say(f"engine built in {seconds:.0f} s; store {store.path} ({size / GB:.2f} GB, "
        + (f"written now: {size / GB / seconds:.3f} GB/s" if written else "reused") + ")"
        + f"; peak RSS while building {peak / GiB:.2f} GiB")
    if written:
        say(f"  writing took {cpu:.0f} CPU seconds of this process; {time_one_layer(model, not args.quantize_normal, args.dtype)} "
            f"(x {llm.engine.config.num_layers} layers; the rest: writing, checksums, embeddings)")
    if not store.direct_io_active:
        say("  WARNING: the store fell back to buffered I/O: the page cache is NOT bypassed")
    return llm, size


# ---- the bound's rates ----------------------------------------------------------------------------


@torch.inference_mode()
def measure_rates(store: DiskStore, shapes: Shapes, dtype: torch.dtype) -> Rates:
    """Disk rate (the fastest of three ways of reading the store's files) and matmul rates in the run's dtype."""
    files = store.data_files()
    drop_cache_of(files)
    read_store_rate(store, range_reads=False)  # the first read of a run is slower: warm-up
    direct, _ = cpu_per_gb(read_store_rate, store, False)
    engine_path, _ = cpu_per_gb(read_store_rate, store, True)
    buffered, _ = cpu_per_gb(measure_disk_buffered, files)
    matmul = measure_matmul(shapes.matrices, dtype, rounds=3, row_counts=RATE_TOKENS)
    rates = Rates(direct, buffered, matmul, engine_path)
    say(f"  disk read {direct / GB:.2f} GB/s O_DIRECT, {engine_path / GB:.2f} as the engine reads, "
        f"{buffered / GB:.2f} buffered cold: the bound uses {rates.disk / GB:.2f} GB/s")
    say(f"  {str(dtype).removeprefix('torch.')} matmul (one layer): " + ", ".join(f"T={t}: {r / 1e12:.3f}" for t, r in rates.matmul.items())
        + " TFLOP/s")
    return rates


@torch.inference_mode()
def measure_matmul_4bit(shapes: Shapes, group_size: int, rounds: int = 3, seconds_per_round: float = 0.3
                        ) -> dict[int, float]:
    """FLOP/s of one layer's matmuls on 4-bit weights in the int4 kernel's layout, by the engine's
    own call (`int4pack_linear`: the kernel up to CPU_INT4_KERNEL_MAX_ROWS rows, dequantize +
    GEMM above), per row count: the fastest way this machine has to multiply these weights."""
    gen = torch.Generator().manual_seed(0)
    ws = [Int4Packed(torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=gen),
                     (torch.rand(o, i // group_size, 2, generator=gen) * 0.01).to(torch.bfloat16), (o, i),
                     group_size) for o, i in shapes.matrices]
    scratch = torch.empty(max(o * i for o, i in shapes.matrices), dtype=torch.bfloat16)
    xs = {t: [torch.randn(t, i, generator=gen).to(torch.bfloat16) for _, i in shapes.matrices] for t in RATE_TOKENS}

    def layer(t: int) -> None:
        for w, x in zip(ws, xs[t]):
            int4pack_linear(x, w, None, scratch[:w.shape[0] * w.shape[1]].view(w.shape))

    return best_rates(layer, 2.0 * shapes.measured_params, RATE_TOKENS, rounds, seconds_per_round)


# ---- the run ------------------------------------------------------------------------------------


@dataclass
class Run:
    generated: int
    seconds: float
    passes: list[Pass]
    disk_read: int
    peak_rss: float
    cores: float
    others: float

    @property
    def bound(self) -> float:
        return sum(max(p.io_s, p.compute_s) for p in self.passes)


def disk_bytes_per_pass(llm) -> int:
    """Bytes a pass reads from the store: every layer's disk-tier pieces."""
    plan = llm.engine.weights.plan
    return sum(p.bytes_on("disk") for p in plan.tensors) * plan.num_layers


def run(args, llm, shapes: Shapes, rates: Rates, vocab: int) -> Run:
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(4, vocab, (args.num_requests, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True)
    files = llm.engine.weights.store.data_files()
    drop_cache_of(files)
    say("warm-up: one pass")
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    passes: list[Pass] = []
    instrument(llm, shapes, rates, disk_bytes_per_pass(llm), passes)
    drop_cache_of(files)
    release_free_memory()
    vm_hwm_reset()
    read0, cpu0, busy0 = disk_read_bytes(), cpu_seconds(), machine_busy_seconds()
    say(f"generating: {args.num_requests} prompts x {args.prompt_len} tokens -> {args.gen_len} each")
    llm.generate(prompts, params, use_tqdm=True)
    stats = llm.last_stats
    cpu = cpu_seconds() - cpu0
    others = machine_busy_seconds() - busy0 - cpu
    return Run(stats["generated_tokens"], stats["seconds"], passes, disk_read_bytes() - read0, vm_hwm(),
               cpu / stats["seconds"], others / stats["seconds"])


def bound_4bit(result: Run, shapes: Shapes, rates_4bit: Rates) -> float:
    """The bound with the 4-bit weights' own matmul rate: per pass max(disk time, FLOPs / the
    rate at which this machine multiplies 4-bit weights at the pass's row count)."""
    return sum(max(p.io_s, shapes.pass_flops(p.tokens, p.attended, p.rows) / rates_4bit.rate(p.tokens))
               for p in result.passes)


def report(args, shapes: Shapes, rates: Rates, rates_4bit: Rates, result: Run, est, store_bytes: int) -> None:
    r = result
    tok_s, bound_tok_s = r.generated / r.seconds, r.generated / r.bound
    say(f"\n=== {args.model} shape, {shapes.layers} layers, 4-bit g64 weights ({store_bytes / GB:.2f} GB store), "
        f"{args.num_requests} x {args.prompt_len} -> {args.gen_len} ===")
    say(f"  measured: {tok_s:.3f} tok/s ({r.generated} tokens in {r.seconds:.1f} s, {len(r.passes)} passes); "
        f"disk read {r.disk_read / GB:.2f} GB ({r.disk_read / max(len(r.passes), 1) / GB:.2f} GB per pass); "
        f"peak RSS {r.peak_rss / GiB:.2f} GiB; cores used {r.cores:.2f}, others {r.others:.2f}")
    say(f"  bound: {r.bound:.1f} s = sum over passes of max(disk bytes / {rates.disk / GB:.2f} GB/s, FLOPs / "
        f"{str(args.dtype).removeprefix('torch.')} matmul rate) -> {bound_tok_s:.3f} tok/s; measured / bound time "
        f"{r.seconds / r.bound:.2f}, "
        f"tok/s / bound tok/s {tok_s / bound_tok_s:.2f} (target >= 0.8)")
    if rates_4bit is not None:
        b4 = bound_4bit(r, shapes, rates_4bit)
        say(f"  bound at the 4-bit matmul rate (FLOPs / the int4 kernel's or dequantize + GEMM's rate, the "
            f"faster, at the pass's rows): {b4:.1f} s -> {r.generated / b4:.3f} tok/s; tok/s / that "
            f"{tok_s * b4 / r.generated:.2f}")
    say(f"  planner predicted {est.throughput:.3f} tok/s: measured / predicted {tok_s / est.throughput:.2f}")
    for kind, ps in (("prefill-carrying", [p for p in r.passes if p.tokens > p.rows]),
                     ("decode-only", [p for p in r.passes if p.tokens <= p.rows])):
        if ps:
            n = len(ps)
            say(f"  {kind:<17} {n:>3} passes: mean {sum(p.tokens for p in ps) / n:6.0f} tokens, measured "
                f"{sum(p.seconds for p in ps) / n:7.2f} s, bound I/O {sum(p.io_s for p in ps) / n:6.2f} s / compute "
                f"{sum(p.compute_s for p in ps) / n:6.2f} s; waited for weights {sum(p.stall_s for p in ps) / n:6.2f} s")
    if shapes.stored_params:  # experts: llama.cpp reads only the routed ones; no arithmetic stands in for a run
        return
    say("  llama.cpp mmap offload at batch 1 (arithmetic: every weight read once per token once the model "
        "exceeds the RAM it may cache):")
    for fmt, per_token in llama_cpp_bytes_per_token(shapes).items():
        theirs = rates.disk / per_token
        say(f"    {fmt} ({LLAMA_CPP_BITS[fmt]} bits/weight): {per_token / GB:.2f} GB per token -> {theirs:.3f} tok/s "
            f"at {rates.disk / GB:.2f} GB/s; ours / that {tok_s / theirs:.1f}x")


def result_row(args, shapes: Shapes, rates: Rates, rates_4bit: Rates | None, r: Run, est, store_bytes: int
               ) -> tuple[dict, dict]:
    """(the printed figures as one row, the printed ratios) for the JSON result."""
    tok_s = r.generated / r.seconds
    b4 = bound_4bit(r, shapes, rates_4bit) if rates_4bit is not None else None
    row = {"model": args.model, "layers": shapes.layers, "store_gb": store_bytes / GB, "tokens": r.generated,
           "seconds": r.seconds, "passes": len(r.passes), "tok_s": tok_s, "disk_read_gb": r.disk_read / GB,
           "peak_rss_gib": r.peak_rss / GiB, "cores": r.cores, "others": r.others, "bound_s": r.bound,
           "bound_4bit_s": b4, "predicted_tok_s": est.throughput, "disk_gb_s": rates.disk / GB}
    ratios = {"tok_s_over_bound": tok_s * r.bound / r.generated, "measured_over_predicted": tok_s / est.throughput}
    if b4:
        ratios["tok_s_over_bound_4bit"] = tok_s * b4 / r.generated
    if not shapes.stored_params:
        ratios.update({f"ours_over_llama_cpp_{fmt}_arithmetic": tok_s * per_token / rates.disk
                       for fmt, per_token in llama_cpp_bytes_per_token(shapes).items()})
    return row, ratios


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-70b",
                   help="a registered shape (policy_search/model_registry.py), e.g. mixtral-8x7b, qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="truncate the model to N layers")
    p.add_argument("--dtype", default="auto", help="compute dtype (auto: this CPU's measured choice)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32,
                   help="prompts (all admitted at once; the planner runs at most this many)")
    p.add_argument("--gpu-mem-gib", type=float, default=6.0, help="the 'gpu' tier: a host working set (GiB)")
    p.add_argument("--cpu-mem-gib", type=float, default=8.0, help="the cpu tier (GiB)")
    p.add_argument("--profile", default=None, help="hardware profile JSON (loaded if it exists, else measured and saved)")
    p.add_argument("--cpu-weights", action="store_true",
                   help="let the planner keep part of the weights in memory (default: every layer streams from disk)")
    p.add_argument("--quantize-normal", action="store_true",
                   help="write the store by quantizing normal draws (the other dummy benchmarks' weights; "
                        "~40x slower to write than the default, codes drawn directly)")
    p.add_argument("--offload-dir", default="/tmp/fs_bench_70b")
    p.add_argument("--quick", action="store_true", help="smoke test: a tiny llama shape, 2 layers, 4 x 8 -> 3")
    harness.add_json_option(p, __file__)
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.gen_len, args.num_requests = 8, 3, 4
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    args.dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))
    say(f"bench_70b: {cpu_line(args.dtype)}")
    model = register_model(args.model, args.layers, args.quick)
    spec = planner_model_spec(f"dummy:{model}", args.dtype)
    shapes = Shapes.of(spec)
    say(f"model: {model} ({shapes.layers} layers, {shapes.layers * shapes.layer_matrix_params / 1e9:.2f} B "
        f"layer parameters, {spec.num_layers * spec.layer_weight_bytes(True) / GB:.2f} GB of them at 4-bit g64); workload {args.num_requests} x "
        f"{args.prompt_len} -> {args.gen_len}")
    profile = load_profile(args, spec)
    hardware, policy, est = choose_policy(args, model, profile)
    llm, store_bytes = build_engine(args, model, policy, hardware)
    try:
        say("measuring the bound's rates (disk: the store itself)")
        rates = measure_rates(llm.engine.weights.store, shapes, args.dtype)
        rates_4bit = None  # torch's int4 kernel is bf16-only: in another dtype 4-bit weights are dequantized
        if args.dtype == torch.bfloat16:
            matmul_4bit = measure_matmul_4bit(shapes, WEIGHT_QUANT.group_size)
            say("  4-bit matmul (one layer, the engine's call): "
                + ", ".join(f"T={t}: {f / 1e12:.3f}" for t, f in matmul_4bit.items()) + " TFLOP/s")
            rates_4bit = Rates(rates.disk_direct, rates.disk_buffered, matmul_4bit, rates.disk_engine_path)
        result = run(args, llm, shapes, rates, spec.vocab_size)
    finally:
        llm.close()
    report(args, shapes, rates, rates_4bit, result, est, store_bytes)
    row, ratios = result_row(args, shapes, rates, rates_4bit, result, est, store_bytes)
    harness.write_result(args, [row], ratios, dtype=args.dtype, extra={"rates": rates, "rates_4bit": rates_4bit,
                                                                       "policy": describe_policy(policy)})
    say(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
