#!/usr/bin/env python
"""How close the int8 x 4-bit CPU kernel (quant/csrc/q4_int8_gemm.c) runs to what this core can do.

On the AVX2 path every 32 multiply-adds of the kernel are one `vpmaddubsw` (unsigned codes x signed
int8 x, pairs summed to int16) and one `vpaddw` (into the running int16 sums): its ceiling is the
rate at which the core retires those two together. The VNNI paths' `vpdpbusd` does both, 32
multiply-adds on ymm (AVX-VNNI) or 64 on zmm (AVX-512 VNNI): their ceiling is its rate times its
width. A small C program (built here with `cc -O2 -mavx2`, plus the VNNI flags this CPU has) measures:
- the clock, from a chain of dependent adds (one per cycle on every x86 core of the last decade);
- `vpmaddubsw` alone, `vpmaddubsw` + `vpaddw` pairs and `vpdpbusd` on ymm and zmm, eight independent
  chains each, from registers;
then the kernel itself (`int8_linear`, one plane: `--cpu-matmul int8`) on each instruction path this
CPU has (every one gives the same bits), on llama-2-7b's four layer matrices at decode (16, 32) and
prompt (512) rows, 1 thread and all, the paths taking turns pass by pass, best of `--repeats`:
multiply-adds per cycle and per cent of the path's ceiling, and each path's rate against AVX2's.
Prints the CPU line (its family and model name the core generation) and the path the engine runs
here. Asserts nothing; machines here are noisy, so compare best-of figures taken in one run.

    .venv/bin/python scripts/bench_int8_ceiling.py            # ~1 minute

`--against OLD.c` also times another version of the kernel's source (built the same way), each
timed pass alternating between the two, so that the noise of a shared machine falls on both alike:

    git show HEAD~1:quant/csrc/q4_int8_gemm.c > /tmp/old.c
    .venv/bin/python scripts/bench_int8_ceiling.py --against /tmp/old.c

`--layout group --group-size 32` times GGUF Q4_0's codes; `--panels` also times the default path on
the weights stored in the kernel's panels (quant/panels.py), as the engine holds them under
cpu_matmul=int8, against the row-major weights' per-call packing.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import harness  # puts the repository root on sys.path
import torch

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from quant import QuantConfig, quantize  # noqa: E402
from quant import cpu_int8_matmul  # noqa: E402
from quant.cpu_kernels import ISA_PATHS, Kernel, c_compiler, cpu_flags, missing_cpu_flags  # noqa: E402
from quant.panels import to_panels  # noqa: E402

LAYOUTS = {"line": {}, "pairs": {"adjacent_pairs": True}, "group": {"group_halves": True}}
# llama-2-7b's fused layer matrices (N, K): qkv, o, gate_up, down
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define MAD(acc) __asm__ volatile("vpmaddubsw %1, %0, %0" : "+x"(acc) : "x"(b))
#define PAIR(acc, tmp) __asm__ volatile("vpmaddubsw %2, %3, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(tmp) : "x"(b), "x"(c))
/* AVX-VNNI is the VEX form; AVX-512 VNNI + VL alone (Zen 4) has only the EVEX one */
#ifdef DP256_EVEX
#define DP256(acc) __asm__ volatile("%{evex%} vpdpbusd %1, %2, %0" : "+x"(acc) : "x"(b), "x"(c))
#else
#define DP256(acc) __asm__ volatile("%{vex%} vpdpbusd %1, %2, %0" : "+x"(acc) : "x"(b), "x"(c))
#endif
#define DP512(acc) __asm__ volatile("vpdpbusd %1, %2, %0" : "+v"(acc) : "v"(wb), "v"(wc))
#define EIGHT(OP) OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); OP(a6); OP(a7)
#define EIGHTW(OP) OP(w0); OP(w1); OP(w2); OP(w3); OP(w4); OP(w5); OP(w6); OP(w7)
int main(void) {
    const long n = 200000000L, m = 50000000L;
    double best_add = 1e9, best_mad = 1e9, best_pair = 1e9, best_dp256 = 1e9, best_dp512 = 1e9;
    __m256i a0 = _mm256_set1_epi8(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, t;
    const __m256i b = _mm256_set1_epi8(3), c = _mm256_set1_epi8(5);
#ifdef DP512_TOO
    __m512i w0 = _mm512_set1_epi8(1), w1 = w0, w2 = w0, w3 = w0, w4 = w0, w5 = w0, w6 = w0, w7 = w0;
    const __m512i wb = _mm512_set1_epi8(3), wc = _mm512_set1_epi8(5);
#endif
    for (int round = 0; round < 5; round++) {
        long x = 0;
        double s = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
        double d = now() - s; if (d < best_add) best_add = d;
        s = now();
        for (long i = 0; i < m; i++) { EIGHT(MAD); }
        d = now() - s; if (d < best_mad) best_mad = d;
        s = now();
        for (long i = 0; i < m; i++) {
            PAIR(a0, t); PAIR(a1, t); PAIR(a2, t); PAIR(a3, t); PAIR(a4, t); PAIR(a5, t); PAIR(a6, t); PAIR(a7, t);
        }
        d = now() - s; if (d < best_pair) best_pair = d;
#ifdef DP256_TOO
        s = now();
        for (long i = 0; i < m; i++) { EIGHT(DP256); }
        d = now() - s; if (d < best_dp256) best_dp256 = d;
#endif
#ifdef DP512_TOO
        s = now();
        for (long i = 0; i < m; i++) { EIGHTW(DP512); }
        d = now() - s; if (d < best_dp512) best_dp512 = d;
#endif
    }
    const double ghz = 4.0 * n / best_add / 1e9, per = 8.0 * m / 1e9 / ghz;
    printf("%.4f %.4f %.4f %.4f %.4f\n", ghz, per / best_mad, per / best_pair, per / best_dp256, per / best_dp512);
#ifdef DP512_TOO
    if (_mm512_reduce_add_epi32(w0) == 12345) return 1;
#endif
    return _mm256_extract_epi16(a0, 0) == 12345;
}
"""


@dataclass(frozen=True)
class Ceiling:
    """Measured on one core: the clock and the instructions' rates (per cycle; 0: not on this CPU)."""
    ghz: float
    maddubs: float  # vpmaddubsw alone
    pair: float  # vpmaddubsw + vpaddw: AVX2's 32 multiply-adds into a running int16 sum
    dpbusd256: float  # vpdpbusd on ymm: 32 multiply-adds into int32 (AVX-VNNI, or AVX-512 VNNI + VL)
    dpbusd512: float  # vpdpbusd on zmm: 64 (AVX-512 VNNI)

    def multiply_adds_per_cycle(self, isa: str) -> float:
        """The ceiling of the kernel's integer work on path `isa`: its instruction's rate x width."""
        return {"avx2": 32 * self.pair, "avx_vnni": 32 * self.dpbusd256, "avx512_vnni": 64 * self.dpbusd512}[isa]


def probe() -> Ceiling | str:
    """The core's clock and multiply-add instructions' rates (the VNNI ones where its flags have
    them), or why not."""
    compiler = c_compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or $CC)"
    flags = cpu_flags() or frozenset()
    extra = []
    if "avx_vnni" in flags:
        extra += ["-DDP256_TOO"]
    elif {"avx512_vnni", "avx512vl"} <= flags:
        extra += ["-DDP256_TOO", "-DDP256_EVEX"]
    if {"avx512_vnni", "avx512f", "avx512bw"} <= flags:
        extra += ["-DDP512_TOO", "-mavx512f", "-mavx512bw"]
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "probe.c", Path(folder) / "probe"
        source.write_text(PROBE)
        built = subprocess.run([compiler, "-O2", "-mavx2", *extra, "-o", str(binary), str(source)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return f"the probe did not build: {built.stderr.strip()[:200]}"
        ran = subprocess.run([str(binary)], capture_output=True, text=True)
        values = [float(v) for v in ran.stdout.split()]
        if ran.returncode != 0 or len(values) != 5:
            return f"the probe failed (exit {ran.returncode}; printed {ran.stdout.strip()[:80]!r})"
    return Ceiling(*[v if math.isfinite(v) and v > 1e-6 else 0.0 for v in values])


def kernel_rates(rows: int, threads: int, repeats: int, weights: dict, inputs, kernels: dict) -> dict[str, float]:
    """{name: multiply-adds per second of one pass over the four matrices, best of `repeats`}, the
    kernels (name -> cpu_kernels.Kernel) taking turns pass by pass, each on weights[name]."""
    previous, current = torch.get_num_threads(), cpu_int8_matmul.KERNEL
    torch.set_num_threads(threads)

    def one_pass(kernel, matrices):
        def run() -> None:
            cpu_int8_matmul.KERNEL = kernel  # what int8_linear calls
            for w, x in zip(matrices, inputs[rows]):
                cpu_int8_matmul.int8_linear(x, w)
        return run

    try:
        times = harness.alternate({name: one_pass(kernel, weights[name]) for name, kernel in kernels.items()}, repeats,
                                  warmup=False)
    finally:
        cpu_int8_matmul.KERNEL = current
        torch.set_num_threads(previous)
    return {name: rows * sum(n * k for n, k in SHAPES) / times.best(name) for name in kernels}


def the_kernels(args) -> dict[str, Kernel] | str:
    """{name: kernel} to time alternately: each instruction path this CPU has (or --isa's), and
    --against's source; or why not."""
    names = args.isa or [name for name, path in ISA_PATHS.items() if not missing_cpu_flags(path)]
    kernels = {name: cpu_int8_matmul.kernel_for(name) for name in names}
    if args.against:
        kernels["against"] = Kernel("int8_linear (--against)", Path(args.against), cpu_int8_matmul.KERNEL.signatures,
                                    isa_paths=True)
    for name, kernel in kernels.items():
        if not kernel.available():
            return f"{name}: {kernel.unavailable_reason()}"
    return kernels


def print_ceiling(c: Ceiling) -> None:
    print(f"clock ~{c.ghz:.2f} GHz (dependent adds), per cycle and core: vpmaddubsw alone {c.maddubs:.2f} "
          f"({32 * c.maddubs:.0f} multiply-adds), with its vpaddw {c.pair:.2f} ({32 * c.pair:.0f}); vpdpbusd ymm "
          f"{c.dpbusd256:.2f} ({32 * c.dpbusd256:.0f}), zmm {c.dpbusd512:.2f} ({64 * c.dpbusd512:.0f}; 0: not on this CPU)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per row count and thread count")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 512], help="rows of x (decode: the sequences; "
                   "prompt: 512)")
    p.add_argument("--isa", nargs="+", choices=list(ISA_PATHS), default=None,
                   help="instruction paths to time (default: every one this CPU has)")
    p.add_argument("--against", default=None, metavar="OLD.c", help="another version of quant/csrc/q4_int8_gemm.c "
                   "to time alternately with this one (built for the default path)")
    p.add_argument("--layout", choices=tuple(LAYOUTS), default="line", help="the codes' layout: ours (line), GPTQ's "
                   "adjacent pairs, GGUF Q4_0's group halves (with --group-size 32: a Q4_0 file's)")
    p.add_argument("--panels", action="store_true", help="also time the default path on the weights stored in the "
                   "kernel's panels (quant/panels.py: what the engine holds under cpu_matmul=int8)")
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    print(cpu_line(torch.float32))
    print(f"the engine's path here: {cpu_int8_matmul.KERNEL.isa_name() or cpu_int8_matmul.unavailable_reason()}")
    kernels, ceiling = the_kernels(args), probe()
    if isinstance(kernels, str) or isinstance(ceiling, str):
        why = kernels if isinstance(kernels, str) else ceiling
        print(f"not measured: {why}")
        harness.write_result(args, [], note=f"not measured: {why}")
        return 1
    print_ceiling(ceiling)
    gen = torch.Generator().manual_seed(0)
    config = QuantConfig(bits=4, group_size=args.group_size, **LAYOUTS[args.layout])
    matrices = [quantize(torch.randn(n, k, generator=gen) * 0.02, config) for n, k in SHAPES]
    weights = {name: matrices for name in kernels}
    if args.panels:  # the default path again, on copies stored in panels
        name = f"{cpu_int8_matmul.KERNEL.isa_name()} panels"
        kernels[name], weights[name] = cpu_int8_matmul.KERNEL, [to_panels(q.clone()) for q in matrices]
    inputs = {rows: [torch.randn(rows, k, generator=gen) for _, k in SHAPES] for rows in args.rows}
    print(f"\n{'path':>12} {'rows':>5} {'threads':>8} {'G mult-adds/s':>14} {'per cycle and core':>19} "
          f"{'of its ceiling':>15} {'vs avx2':>8}")
    table = []
    for rows in args.rows:
        for threads in sorted({1, os.cpu_count() or 1}):
            rates = kernel_rates(rows, threads, args.repeats, weights, inputs, kernels)
            for name, rate in rates.items():
                per_cycle = rate / (ceiling.ghz * 1e9) / threads
                top = ceiling.multiply_adds_per_cycle(kernels[name].isa_name())
                against = f"{rate / rates['avx2']:.2f}x" if "avx2" in rates else ""
                print(f"{name:>12} {rows:>5} {threads:>8} {rate / 1e9:>14.1f} {per_cycle:>19.1f} "
                      f"{per_cycle / top if top else float('nan'):>14.0%} {against:>8}")
                table.append({"path": name, "rows": rows, "threads": threads, "g_mult_adds_s": rate / 1e9,
                              "per_cycle_and_core": per_cycle, "of_ceiling": per_cycle / top if top else None,
                              "vs_avx2": rate / rates["avx2"] if "avx2" in rates else None})
    harness.write_result(args, table, dtype=torch.float32, extra={"ceiling": ceiling})
    return 0


if __name__ == "__main__":
    sys.exit(main())
