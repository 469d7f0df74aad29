"""4-bit linears on the CPU against the uncompressed matmul they replace, and where 4-bit pays.

    .venv/bin/python scripts/bench_quant_cpu.py --quick           # one shape, few rows, 1 thread
    .venv/bin/python scripts/bench_quant_cpu.py --threads 1 2     # opt-1.3b shapes, 1-512 rows

Per (shape, rows, dtype, threads), medians after a warm-up, interleaved in one process:
  plain   F.linear on the uncompressed weight (what reading the uncompressed weight feeds)
  today   quantized_linear: dequantize into a reused buffer + F.linear (the engine's CPU path)
  int4    torch's int4 kernel on a weight packed once (bf16 only; quant/cpu_matmul.py)
  int4+pk the same plus packing our codes into its layout on every call (a streamed weight)
and the pass-time model for a weight streamed from disk at --disk-gbps: pass = max(io, compute),
io = stored bytes / rate; "4bit/plain" > 1 means 4-bit is faster for that linear.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flexsarathi.machine_info import cpu_line  # noqa: E402
from quant import QuantConfig, quantize, quantized_linear  # noqa: E402
from quant.cpu_matmul import layout_matches_torch, linear_4bit, pack_for_cpu_kernel  # noqa: E402
from bench_quant import median_seconds  # noqa: E402  (scripts/ is on sys.path when run as a script)

OPT_1_3B_SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))  # [out, in]: attention, fc1, fc2
ROWS = (1, 8, 32, 128, 512)


def bench_shape(shape, rows, dtype, repeats, disk_bps) -> list[str]:
    out_features, in_features = shape
    weight = (torch.randn(shape) * 0.02).to(dtype)
    q = quantize(weight, QuantConfig(bits=4, group_size=64))
    packed = pack_for_cpu_kernel(q) if dtype == torch.bfloat16 else None
    io_plain, io_4bit = weight.numel() * weight.element_size() / disk_bps, q.nbytes / disk_bps
    lines = []
    for m in rows:
        x = torch.randn(m, in_features).to(dtype)
        t = {"plain": median_seconds(lambda: F.linear(x, weight), repeats, warmup=1),
             "today": median_seconds(lambda: quantized_linear(x, q), repeats, warmup=1)}
        if packed is not None:
            t["int4"] = median_seconds(lambda: linear_4bit(x, packed), repeats, warmup=1)
            t["int4+pk"] = median_seconds(lambda: linear_4bit(x, pack_for_cpu_kernel(q)), repeats, warmup=1)
        best_4bit = min(v for k, v in t.items() if k in ("today", "int4+pk"))  # a streamed weight
        gain = max(io_plain, t["plain"]) / max(io_4bit, best_4bit)
        times = " ".join(f"{k}={v * 1e3:7.2f}" for k, v in t.items())
        lines.append(f"{out_features}x{in_features} {str(dtype)[6:]:8} rows={m:4d} ms: {times} | "
                     f"today/plain={t['today'] / t['plain']:5.2f} | io plain={io_plain * 1e3:6.2f} "
                     f"4bit={io_4bit * 1e3:5.2f} | streamed 4bit/plain pass speed={gain:4.2f}x")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one 2048x2048 shape, rows 1/32/512, 1 thread")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--disk-gbps", type=float, default=1.75, help="disk read rate for the pass-time model")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    shapes, rows, threads = OPT_1_3B_SHAPES, ROWS, args.threads
    if args.quick:
        shapes, rows, threads = ((2048, 2048),), (1, 32, 512), [1]
    print(cpu_line(' and '.join(args.dtype)))
    print(f"int4 layout ours == torch's converter here: {layout_matches_torch()}; disk {args.disk_gbps} GB/s")
    for n in threads:
        torch.set_num_threads(n)
        print(f"-- {n} thread(s)")
        for dtype in (getattr(torch, d) for d in args.dtype):
            for shape in shapes:
                for line in bench_shape(shape, rows, dtype, args.repeats, args.disk_gbps * 1e9):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
