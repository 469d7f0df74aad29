"""4-bit linears on the CPU against the uncompressed matmul they replace, and where 4-bit pays.

    .venv/bin/python scripts/bench_quant_cpu.py --quick           # one shape, few rows, 1 thread
    .venv/bin/python scripts/bench_quant_cpu.py --threads 1 2     # opt-1.3b shapes, 1-512 rows
    .venv/bin/python scripts/bench_quant_cpu.py --layer --threads 2 --rows 30 480   # one opt-1.3b layer
    .venv/bin/python scripts/bench_quant_cpu.py --layer --shapes llama-2-7b --dtype float32 --threads 2

Per (shape, rows, dtype, threads), after a warm-up, the paths taking turns call by call in one
process; the fastest of --repeats calls per path (the least disturbed on a shared machine):
  plain   F.linear on the uncompressed weight (what reading the uncompressed weight feeds)
  rowmaj  quantized_linear on our row-major 4-bit weight: dequantize into a reused buffer +
          F.linear (the engine's CPU path for fp32, and for bf16 where the kernel layout is not ours)
  packed  quantized_linear on the weight at rest in the int4 kernel's layout (bf16; the engine's
          path since it is stored so): the kernel up to CPU_INT4_KERNEL_MAX_ROWS rows, else
          dequantize_int4pack + F.linear (quant/int4pack.py)
  kernel  torch's int4 kernel at any row count;  pk-deq  dequantize_int4pack + F.linear at any
  int8    our int8 x 4-bit kernel on the row-major weight, x as one int8 plane (quant/cpu_int8_matmul.py)
  int8x2  the same with two planes (~16 bits): the engine's default up to INT8X2_MAX_ROWS rows
and the pass-time model for a weight streamed from disk at --disk-gbps: pass = max(io, compute),
io = stored bytes / rate; "4bit/plain" > 1 means 4-bit is faster for that linear.
--layer: the four linears of one opt-1.3b layer (qkv fused, o, fc1, fc2) summed, x 24 layers: the
compute of a pass's linears, and the same pass-time model over the layer's bytes.
"""
from __future__ import annotations

import argparse
import time

import harness  # puts the repository root on sys.path (run from a checkout without installing)
import torch
import torch.nn.functional as F

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from quant import QuantConfig, quantize, quantized_linear  # noqa: E402
from quant.cpu_matmul import layout_matches_torch, linear_4bit, pack_for_cpu_kernel  # noqa: E402
from quant import cpu_int8_matmul  # noqa: E402
from quant.int4pack import dequantize_int4pack  # noqa: E402
from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS  # noqa: E402

OPT_1_3B_SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))  # [out, in]: attention, fc1, fc2
# One layer's linears, [out, in], and the model's layer count (--layer)
LAYERS = {"opt-1.3b": (((6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)), 24),
          "llama-2-7b": (((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)), 32)}
ROWS = (1, 8, 32, 128, 512)


def linears(shape, dtype):
    """(uncompressed weight, row-major 4-bit, kernel-layout 4-bit or None) of one random weight."""
    weight = (torch.randn(shape) * 0.02).to(dtype)
    q = quantize(weight, QuantConfig(bits=4, group_size=64))
    return weight, q, (pack_for_cpu_kernel(q) if dtype == torch.bfloat16 else None)


CLOCK = time.perf_counter  # --cpu-time: time.thread_time (see main)


def timed_paths(x, weight, q, packed, repeats) -> dict[str, float]:
    """Fastest seconds of each path on `x`, the paths taking turns call by call (a shared machine's
    load then hits them alike)."""
    scratch = torch.empty(weight.shape, dtype=x.dtype)
    paths = {"plain": lambda: F.linear(x, weight), "rowmaj": lambda: quantized_linear(x, q)}
    if packed is not None:
        paths |= {"packed": lambda: quantized_linear(x, packed), "kernel": lambda: linear_4bit(x, packed),
                  "pk-deq": lambda: F.linear(x, dequantize_int4pack(packed, out=scratch))}
    if cpu_int8_matmul.available() and cpu_int8_matmul.covers(x, q):
        paths |= {"int8": lambda: cpu_int8_matmul.int8_linear(x, q),
                  "int8x2": lambda: cpu_int8_matmul.int8_linear(x, q, planes=2)}
    # a warm-up call each: buffers allocated, caches and the thread pool started
    times = harness.alternate(paths, repeats, clock=CLOCK)
    return {k: times.best(k) for k in paths}


def summary(label, t, io_plain, io_4bit, rows) -> tuple[str, dict]:
    """One line: times, ratios to plain, and the streamed pass-time model; and its figures as a row."""
    # what the engine runs on a weight streamed in its format (cpu_matmul="auto")
    best_4bit = t.get("packed", t["int8x2"] if "int8x2" in t and rows <= cpu_int8_matmul.INT8X2_MAX_ROWS
                      else t["rowmaj"])
    gain = max(io_plain, t["plain"]) / max(io_4bit, best_4bit)
    times = " ".join(f"{k}={v * 1e3:7.2f}" for k, v in t.items())
    ratios = " ".join(f"{k}/plain={v / t['plain']:5.2f}" for k, v in t.items() if k != "plain")
    line = (f"{label} ms: {times} | {ratios} | io plain={io_plain * 1e3:6.2f} 4bit={io_4bit * 1e3:5.2f} | "
            f"streamed 4bit/plain pass speed={gain:4.2f}x")
    return line, {"case": label, "ms": {k: v * 1e3 for k, v in t.items()}, "io_plain_ms": io_plain * 1e3,
                  "io_4bit_ms": io_4bit * 1e3, "streamed_4bit_over_plain_pass_speed": gain}


def bench_shape(shape, rows, dtype, repeats, disk_bps) -> list[tuple[str, dict]]:
    out_features, in_features = shape
    weight, q, packed = linears(shape, dtype)
    io_plain, io_4bit = weight.numel() * weight.element_size() / disk_bps, q.nbytes / disk_bps
    lines = []
    for m in rows:
        t = timed_paths(torch.randn(m, in_features).to(dtype), weight, q, packed, repeats)
        lines.append(summary(f"{out_features}x{in_features} {str(dtype)[6:]:8} rows={m:4d}", t, io_plain, io_4bit, m))
    return lines


def bench_layer(rows, dtype, repeats, disk_bps, model="opt-1.3b") -> list[tuple[str, dict]]:
    """One layer's linears (opt: qkv fused, o, fc1, fc2; llama: qkv, o, gate/up fused, down) summed
    and scaled to the model's layers."""
    shapes, layers = LAYERS[model]
    weights = [linears(s, dtype) for s in shapes]
    io_plain = layers * sum(w.numel() * w.element_size() for w, _, _ in weights) / disk_bps
    io_4bit = layers * sum(q.nbytes for _, q, _ in weights) / disk_bps
    lines = []
    for m in rows:
        total: dict[str, float] = {}
        for (w, q, packed), shape in zip(weights, shapes):
            for k, v in timed_paths(torch.randn(m, shape[1]).to(dtype), w, q, packed, repeats).items():
                total[k] = total.get(k, 0.0) + layers * v
        lines.append(summary(f"{model} pass ({layers} layers) {str(dtype)[6:]} rows={m:4d}", total, io_plain, io_4bit, m))
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one 2048x2048 shape, rows 1/32/512, 1 thread")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--disk-gbps", type=float, default=1.75, help="disk read rate for the pass-time model")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--layer", action="store_true", help="a whole layer's linears, x the model's layers")
    p.add_argument("--shapes", choices=sorted(LAYERS), default="opt-1.3b",
                   help="the model whose matrices (or, with --layer, whose layer) are measured")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this thread's CPU time (1 thread only: torch then computes on the calling "
                        "thread): on a loaded machine it leaves out the time other processes hold the core")
    harness.add_json_option(p, __file__)
    args = p.parse_args(argv)
    if args.cpu_time:
        if args.threads != [1]:
            p.error("--cpu-time needs --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    shapes, rows, threads = OPT_1_3B_SHAPES, args.rows, args.threads
    if args.shapes != "opt-1.3b":
        shapes = LAYERS[args.shapes][0]
    if args.quick:
        shapes, rows, threads = ((2048, 2048),), (1, 32, 512), [1]
    print(cpu_line(' and '.join(args.dtype)))
    print(f"int4 layout ours == torch's converter here: {layout_matches_torch()}; kernel up to "
          f"{CPU_INT4_KERNEL_MAX_ROWS} rows; int8 kernel: {cpu_int8_matmul.unavailable_reason() or 'built'} "
          f"(int8x2 up to {cpu_int8_matmul.INT8X2_MAX_ROWS} rows); disk {args.disk_gbps} GB/s")
    table = []
    for n in threads:
        torch.set_num_threads(n)
        print(f"-- {n} thread(s)")
        for dtype in (getattr(torch, d) for d in args.dtype):
            if args.layer:
                for line, row in bench_layer(rows, dtype, args.repeats, args.disk_gbps * 1e9, args.shapes):
                    print(line, flush=True)
                    table.append({"threads": n, **row})
                continue
            for shape in shapes:
                for line, row in bench_shape(shape, rows, dtype, args.repeats, args.disk_gbps * 1e9):
                    print(line, flush=True)
                    table.append({"threads": n, **row})
    harness.write_result(args, table, dtype=" and ".join(args.dtype))


if __name__ == "__main__":
    main()
