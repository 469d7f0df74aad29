"""The CPU compute dtype where the user sets none (`dtype=None` or `"auto"`): chosen by measuring
the matmul rates of the candidate dtypes on this machine, once, and cached per machine.

CPUs differ widely in half-precision matmuls: with AVX-512 BF16 (or AMX) bf16 is much faster than
fp32, on an AVX2-only CPU much slower (emulated in software; rates: docs/BENCHMARKS.md, "CPU dtype
choice"). So the candidates (fp32, bf16, and fp16 only where the CPU has fp16 arithmetic:
AVX512-FP16 or AMX-FP16) are timed on one representative layer's four matmuls (the profiler's
timer) on one thread at a decode-like and a prefill-like row count, best of two interleaved rounds
(a few seconds). `choose_dtype` keeps fp32, the more accurate, unless a half type is at least
HALF_SPEEDUP times as fast at both row counts; the rule: docs/DESIGN.md.
Delete the cache file to measure again (e.g. after measuring on a machine busy with other work).

The cache is a small JSON file (`$FLEXSARATHI_CACHE_DIR` or ~/.cache/flexsarathi, `cpu_dtype.json`)
with one entry per machine key: CPU model, cores, relevant flags, torch's CPU capability and the ISA
overrides in the environment, torch version and thread count. An entry for another key is not
used; a file that cannot be read or parsed, or an entry that does not hold a candidate, is
measured again and rewritten.
"""
from __future__ import annotations

import logging
import time

import torch

from flexsarathi.machine.cache_file import cache_path, keep_others, read_entries, write_entries
from flexsarathi.machine.cpu_info import cpu_description

HALF_SPEEDUP = 1.3  # a half dtype must be this many times faster than fp32 at both row counts
DECODE_ROWS, PREFILL_ROWS = 16, 128  # a decode micro-batch; a prefill chunk
CACHE_FILE = "cpu_dtype.json"
CACHE_VERSION = 1
MAX_CACHE_ENTRIES = 16  # other machines' entries kept beside this one's (a shared home folder)
FP16_FLAGS = ("avx512_fp16", "amx_fp16")  # fp16 arithmetic in hardware (else fp16 is converted)
log = logging.getLogger(__name__)

Rates = dict  # torch.dtype -> (decode FLOP/s, prefill FLOP/s)


def is_auto(dtype) -> bool:
    """Whether `dtype` asks for the default rule (None or "auto", as vLLM spells it)."""
    return dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto")


def candidate_dtypes(flags) -> tuple[torch.dtype, ...]:
    """fp32 and bf16 always (bf16 may be slow: the measurement decides); fp16 only with native
    fp16 arithmetic (without it torch converts every element, never a win)."""
    fp16 = (torch.float16,) if any(f in flags for f in FP16_FLAGS) else ()
    return (torch.float32, torch.bfloat16) + fp16


def choose_dtype(rates: Rates) -> torch.dtype:
    """The fastest half dtype whose rates are >= HALF_SPEEDUP x fp32's at both row counts (ranked
    by its smaller speed-up); fp32 otherwise. rates: dtype -> (decode FLOP/s, prefill FLOP/s)."""
    fp32 = rates[torch.float32]
    speedups = {dt: min(r[0] / fp32[0], r[1] / fp32[1]) for dt, r in rates.items() if dt != torch.float32}
    clear = {dt: s for dt, s in speedups.items() if s >= HALF_SPEEDUP}
    return max(clear, key=clear.get) if clear else torch.float32


def probe_layer():
    """The layer the rates are measured on: OPT-350M's (hidden 1024, MLP 4096; 12.6M parameters),
    small enough that a slow dtype's prefill-like call stays ~0.15 s, large enough to leave the caches."""
    from flexsarathi.machine.layer_timing import LayerShapes

    h, f = 1024, 4096
    return LayerShapes(((3 * h, h), (h, h), (f, h), (h, f)), heads=16, kv_heads=16, head_dim=64)


def measure_rates(candidates, rounds: int = 2) -> Rates:
    """dtype -> (decode FLOP/s, prefill FLOP/s) of the probe layer's matmuls on one CPU thread: the
    best of `rounds` interleaved medians of 3 calls, so a neighbour's burst of load lands on one
    figure of one round, not on one dtype. One thread: the choice is about the CPU's kernels, and a
    multi-thread team on a busy machine waits for its slowest thread (measured at load 12 on 2
    cores: fp32 and bf16 16-row rates within 1.5x of each other with 2 threads, 5-10x apart with 1)."""
    from flexsarathi.machine.layer_timing import layer_matmul_seconds

    shapes, cpu = probe_layer(), torch.device("cpu")
    seconds: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(rounds):
            for rows in (DECODE_ROWS, PREFILL_ROWS):
                for dt in candidates:
                    s = layer_matmul_seconds(cpu, dt, shapes, rows, repeats=3)
                    seconds[dt, rows] = min(seconds.get((dt, rows), s), s)
    finally:
        torch.set_num_threads(threads)
    flops_per_row = 2 * shapes.params
    return {dt: tuple(flops_per_row * rows / seconds[dt, rows] for rows in (DECODE_ROWS, PREFILL_ROWS))
            for dt in candidates}


def machine_key() -> dict:
    """What the choice depends on: the CPU as torch uses it, torch's version and its threads."""
    return {"version": CACHE_VERSION, **cpu_description(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def cpu_compute_dtype() -> torch.dtype:
    """This machine's CPU compute dtype: the cached choice for its key, else measured and cached."""
    path, key = cache_path(CACHE_FILE), machine_key()
    entries = read_entries(path)
    cached = _lookup(entries, key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    candidates = candidate_dtypes(key["flags"])
    rates = measure_rates(candidates)
    chosen = choose_dtype(rates)
    entry = {"key": key, "dtype": _name(chosen), "measured_s": round(time.perf_counter() - start, 2),
             "rates_flops": {_name(dt): list(rs) for dt, rs in rates.items()},  # (decode, prefill) rows
             "rule": f"half dtype only if >= {HALF_SPEEDUP}x fp32 at {DECODE_ROWS} and {PREFILL_ROWS} rows"}
    log.info("CPU compute dtype %s, measured in %.1f s: %s TFLOP/s (cached in %s)", entry["dtype"],
             entry["measured_s"], {n: [round(r / 1e12, 3) for r in rs] for n, rs in entry["rates_flops"].items()},
             path)
    write_entries(path, keep_others(entries, key, MAX_CACHE_ENTRIES) + [entry], "CPU dtype")
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lookup(entries: list[dict], key: dict) -> torch.dtype | None:
    """The dtype cached for `key`, if its entry names one of this machine's candidates."""
    for entry in entries:
        if entry.get("key") == key:
            names = {_name(dt): dt for dt in candidate_dtypes(key["flags"])}
            return names.get(entry.get("dtype"))
    return None
