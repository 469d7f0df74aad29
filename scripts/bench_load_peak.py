#!/usr/bin/env python
"""The peak memory of loading a model, against what the engine then holds (prints; asserts nothing):

    .venv/bin/python scripts/bench_load_peak.py model.gguf                   # every layer in RAM
    .venv/bin/python scripts/bench_load_peak.py model.gguf --disk 0.65       # 35% of each layer in RAM, the rest on disk
    .venv/bin/python scripts/bench_load_peak.py path/to/checkpoint --dtype bfloat16

This process's resident set (VmRSS, VmHWM: anonymous and file-backed pages) is read after the
imports (the GGUF modules and the int8 kernel's library too) and once the engine is built; their difference is the load's peak, printed beside the engine's
tracker: what it holds once loaded (gpu and cpu tiers) and the load's own reservation ("loading
(layers in flight)", shown as its peak once released), and the resident set left once the load is
over. The disk store goes to a fresh folder (--offload-dir, removed first), so a disk policy writes it.
tests/flexsarathi/engine/test_load_peak.py checks the same on small checkpoints.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time

import harness  # noqa: E402 - puts the repository root on sys.path

import flexsarathi.formats.gguf_checkpoint  # noqa: E402,F401 - imported by a load of a GGUF: not the load's memory
import flexsarathi.formats.gguf_tokenizer  # noqa: E402,F401
from flexsarathi import LLM  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from policy_search import Policy  # noqa: E402
from quant import cpu_int8_matmul  # noqa: E402

GB = 1e9


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a .gguf file, a checkpoint folder or dummy:<name>")
    p.add_argument("--disk", type=float, default=0.0, help="share of each layer's (4-bit) weights on disk")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cpu-matmul", default="int8", choices=("auto", "int8x2", "int8", "dequantize"))
    p.add_argument("--offload-dir", default="/tmp/fs_bench_load_peak")
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    if not 0.0 <= args.disk <= 1.0:
        p.error(f"--disk must be a share between 0 and 1, got {args.disk}")
    shutil.rmtree(args.offload_dir, ignore_errors=True)
    policy = Policy(w_gpu=1 - args.disk, w_cpu=0.0, w_disk=args.disk, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
                    compress_weight=True) if args.disk else None
    cpu_int8_matmul.KERNEL.isa_name()  # the kernel's library loaded before, not counted in the load
    base = status("VmRSS")
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, policy=policy, cpu_matmul=args.cpu_matmul, offload_dir=args.offload_dir)
    seconds = time.perf_counter() - start
    peak, now = status("VmHWM") - base, status("VmRSS") - base
    report = llm.engine.memory.report()
    held = report["gpu"]["in_use"] + report["cpu"]["in_use"]
    loading = sum(n for tier in ("gpu", "cpu") for what, n in report[tier].get("peak_by_what", {}).items()
                  if what not in report[tier]["by_what"])
    print(f"bench_load_peak: {args.model}, disk share {args.disk:g}; {cpu_line(llm.engine.dtype)}")
    print(llm.engine.memory.format_report())
    print(f"loaded in {seconds:.1f} s; held {held / GB:.3f} GB, load reservation {loading / GB:.3f} GB; "
          f"RSS over the imports: peak {peak / GB:.3f} GB ({(peak - held) / GB:+.3f} over held), "
          f"after the load {now / GB:.3f} GB ({(now - held) / GB:+.3f} over held)")
    harness.write_result(args, [{"model": args.model, "disk_share": args.disk, "load_s": seconds, "held_bytes": held,
                                 "load_reservation_bytes": loading, "peak_over_imports_bytes": peak,
                                 "after_load_bytes": now}],
                         {"peak_over_held": peak / held if held else None}, dtype=llm.engine.dtype)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
