#!/usr/bin/env python
"""How close the int8 x 4-bit CPU kernel (quant/csrc/q4_int8_gemm.c) runs to what this core can do.

Every 32 multiply-adds of the kernel are one `vpmaddubsw` (unsigned codes x signed int8 x, pairs
summed to int16) and one `vpaddw` (into the running int16 sums); AVX2 has no instruction that does
both (AVX-VNNI's `vpdpbusd` does, on CPUs this one may not be). So the ceiling is the rate at which
the core retires those two together. A small C program (built here with `cc -O2 -mavx2`) measures:
- the clock, from a chain of dependent adds (one per cycle on every x86 core of the last decade);
- `vpmaddubsw` alone and `vpmaddubsw` + `vpaddw` pairs, eight independent chains each, from registers;
then the kernel itself (`int8_linear`, one plane: `--cpu-matmul int8`) on llama-2-7b's four layer
matrices at decode (32) and prefill (512) rows, on 1 thread and on all, best of `--repeats`:
multiply-adds per cycle and per cent of the pairs' ceiling. Prints the CPU line (its family and
model name the core generation). Asserts nothing; machines here are noisy, so compare best-of
figures taken in one run.

    .venv/bin/python scripts/bench_int8_ceiling.py            # ~1 minute

`--against OLD.c` also times another version of the kernel's source (built the same way), each
timed pass alternating between the two, so that the noise of a shared machine falls on both alike:

    git show HEAD~1:quant/csrc/q4_int8_gemm.c > /tmp/old.c
    .venv/bin/python scripts/bench_int8_ceiling.py --against /tmp/old.c
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from quant import QuantConfig, quantize  # noqa: E402
from quant import cpu_int8_matmul  # noqa: E402
from quant.cpu_kernels import Kernel, c_compiler  # noqa: E402

# llama-2-7b's fused layer matrices (N, K): qkv, o, gate_up, down
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define MAD(acc) __asm__ volatile("vpmaddubsw %1, %0, %0" : "+x"(acc) : "x"(b))
#define PAIR(acc, tmp) __asm__ volatile("vpmaddubsw %2, %3, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(tmp) : "x"(b), "x"(c))
int main(void) {
    const long n = 200000000L, m = 50000000L;
    double best_add = 1e9, best_mad = 1e9, best_pair = 1e9;
    __m256i a0 = _mm256_set1_epi8(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, t;
    const __m256i b = _mm256_set1_epi8(3), c = _mm256_set1_epi8(5);
    for (int round = 0; round < 5; round++) {
        long x = 0;
        double s = now();
        for (long i = 0; i < n; i++)
            __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
        double d = now() - s; if (d < best_add) best_add = d;
        s = now();
        for (long i = 0; i < m; i++) { MAD(a0); MAD(a1); MAD(a2); MAD(a3); MAD(a4); MAD(a5); MAD(a6); MAD(a7); }
        d = now() - s; if (d < best_mad) best_mad = d;
        s = now();
        for (long i = 0; i < m; i++) {
            PAIR(a0, t); PAIR(a1, t); PAIR(a2, t); PAIR(a3, t); PAIR(a4, t); PAIR(a5, t); PAIR(a6, t); PAIR(a7, t);
        }
        d = now() - s; if (d < best_pair) best_pair = d;
    }
    const double ghz = 4.0 * n / best_add / 1e9;
    printf("%.4f %.4f %.4f\n", ghz, 8.0 * m / best_mad / 1e9 / ghz, 8.0 * m / best_pair / 1e9 / ghz);
    return _mm256_extract_epi16(a0, 0) == 12345;
}
"""


def probe() -> tuple[float, float, float] | str:
    """(GHz, vpmaddubsw per cycle, vpmaddubsw + vpaddw pairs per cycle), or why not."""
    compiler = c_compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or $CC)"
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder) / "probe.c", Path(folder) / "probe"
        source.write_text(PROBE)
        built = subprocess.run([compiler, "-O2", "-mavx2", "-o", str(binary), str(source)], capture_output=True,
                               text=True)
        if built.returncode != 0:
            return f"the probe did not build: {built.stderr.strip()[:200]}"
        ran = subprocess.run([str(binary)], capture_output=True, text=True)
        ghz, mad, pair = (float(v) for v in ran.stdout.split())
    return ghz, mad, pair


def kernel_rates(rows: int, threads: int, repeats: int, weights, inputs, kernels: dict) -> dict[str, float]:
    """{name: multiply-adds per second of one pass over the four matrices, best of `repeats`}, the
    kernels (name -> cpu_kernels.Kernel) taking turns pass by pass."""
    previous, current = torch.get_num_threads(), cpu_int8_matmul.KERNEL
    torch.set_num_threads(threads)
    best = dict.fromkeys(kernels, float("inf"))
    try:
        for _ in range(repeats):
            for name, kernel in kernels.items():
                cpu_int8_matmul.KERNEL = kernel  # what int8_linear calls
                start = time.perf_counter()
                for w, x in zip(weights, inputs[rows]):
                    cpu_int8_matmul.int8_linear(x, w)
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        cpu_int8_matmul.KERNEL = current
        torch.set_num_threads(previous)
    return {name: rows * sum(n * k for n, k in SHAPES) / seconds for name, seconds in best.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per row count and thread count")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--against", default=None, metavar="OLD.c", help="another version of quant/csrc/q4_int8_gemm.c "
                   "to time alternately with this one")
    args = p.parse_args()
    print(cpu_line(torch.float32))
    if not cpu_int8_matmul.available():
        print(f"the int8 kernel is not available here: {cpu_int8_matmul.unavailable_reason()}")
        return 1
    measured = probe()
    if isinstance(measured, str):
        print(f"no ceiling: {measured}")
        return 1
    ghz, mad, pair = measured
    ceiling = 32 * pair  # multiply-adds per cycle and core
    print(f"clock ~{ghz:.2f} GHz (dependent adds); vpmaddubsw alone {mad:.2f}/cycle ({32 * mad:.0f} multiply-adds); "
          f"with its vpaddw {pair:.2f}/cycle: ceiling {ceiling:.1f} multiply-adds per cycle and core")
    gen = torch.Generator().manual_seed(0)
    weights = [quantize(torch.randn(n, k, generator=gen) * 0.02, QuantConfig(bits=4, group_size=args.group_size))
               for n, k in SHAPES]
    inputs = {rows: [torch.randn(rows, k, generator=gen) for _, k in SHAPES] for rows in (32, 512)}
    kernels = {"kernel": cpu_int8_matmul.KERNEL}
    if args.against:
        old = Kernel("int8_linear (--against)", Path(args.against), cpu_int8_matmul.KERNEL.signatures)
        if not old.available():
            print(f"--against {args.against}: {old.unavailable_reason()}")
            return 1
        kernels["against"] = old
    cores = os.cpu_count() or 1
    print(f"\n{'kernel':>8} {'rows':>5} {'threads':>8} {'G mult-adds/s':>14} {'per cycle and core':>19} "
          f"{'of the ceiling':>15}")
    for rows in (32, 512):
        for threads in sorted({1, cores}):
            rates = kernel_rates(rows, threads, args.repeats, weights, inputs, kernels)
            for name, rate in rates.items():
                per_cycle = rate / (ghz * 1e9) / threads
                print(f"{name:>8} {rows:>5} {threads:>8} {rate / 1e9:>14.1f} {per_cycle:>19.1f} "
                      f"{per_cycle / ceiling:>14.0%}")
            if len(rates) == 2:
                print(f"{'':>8} {'':>5} {'':>8} kernel / against: {rates['kernel'] / rates['against']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
