"""Loading a GGUF's layers into the engine's weights, against reading the file once and against
dequantizing it to floats (what transformers' GGUF loading does, with gguf.quants.dequantize).

Writes a GGUF of llama-2-7b's layer shapes (random codes, `--layers` layers, `--type`), then in
fresh subprocesses (each its own peak RSS), from a cold page cache for the file (fadvise DONTNEED):
  read:  the file's bytes read once (the floor);
  ours:  GGUFCheckpoint.layer_weights for every layer (codes repacked as QTensors, q/k reordered);
  deq:   gguf.quants.dequantize of every layer tensor to fp32 (transformers' way).
Prints seconds, ratios, peak RSS and bytes held (QTensor bytes against the file's tensor bytes).

    python scripts/bench_gguf.py --type Q4_0 --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import harness  # puts the repository root on sys.path; imports no torch (see measure)
from workloads import FP16_FIELDS, HIDDEN, VOCAB, write_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def child(mode: str, path: str) -> dict:
    """One measurement in this process: seconds and bytes held."""
    start = time.perf_counter()
    held = 0
    if mode == "read":
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 24):
                held += len(chunk)
    elif mode == "ours":
        import torch

        from flexsarathi.formats.gguf_checkpoint import GGUFCheckpoint
        source = GGUFCheckpoint(path, report=lambda line: None)
        for i in range(source.config.num_layers):
            for w in source.layer_weights(i, torch.bfloat16).values():
                held += w.nbytes if hasattr(w, "config") else w.numel() * w.element_size()
    else:
        import gguf

        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            if t.name.startswith("blk."):
                held += gguf.quants.dequantize(t.data, t.tensor_type).nbytes
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "held": held, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(mode: str, path: str) -> dict:
    harness.drop_cache_of([path])
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, __file__, "--child", mode, path], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", default="Q4_0", choices=sorted(FP16_FIELDS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--write", nargs=3, help=argparse.SUPPRESS)
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    if args.write:
        write_model(args.write[0], args.write[1], int(args.write[2]))
        return
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
        path = os.path.join(folder, "model.gguf")
        # written by a child too: Linux keeps a process's peak RSS across fork + exec, so the
        # measuring children must come from a parent that never held the model
        subprocess.run([sys.executable, __file__, "--write", path, args.type, str(args.layers)], check=True)
        layer_bytes = os.path.getsize(path) - 2 * VOCAB * HIDDEN * 2  # less the fp16 embedding and head
        print(f"{args.type}, {args.layers} layers of llama-2-7b: {os.path.getsize(path) / 2**20:.0f} MiB "
              f"({layer_bytes / 2**20:.0f} MiB of layers)")
        results = {mode: measure(mode, path) for mode in ("read", "ours", "deq")}
    read = results["read"]["seconds"]
    for mode, r in results.items():
        print(f"{mode:5s} {r['seconds']:7.2f} s  {r['seconds'] / read:5.2f}x read  peak RSS {r['rss_mib']:7.0f} MiB  "
              f"held {r['held'] / 2**20:7.0f} MiB")
    ratios = {"ours_over_deq_seconds": results["ours"]["seconds"] / results["deq"]["seconds"],
              "ours_over_deq_held": results["ours"]["held"] / results["deq"]["held"],
              "ours_held_over_layer_bytes": results["ours"]["held"] / layer_bytes}
    print(f"ours / dequantize-to-fp32: time {ratios['ours_over_deq_seconds']:.2f}x, "
          f"bytes held {ratios['ours_over_deq_held']:.3f}x; ours held / layer bytes in "
          f"the file {ratios['ours_held_over_layer_bytes']:.3f}")
    harness.write_result(args, [{"mode": mode, **r, "over_read": r["seconds"] / read} for mode, r in results.items()],
                         ratios)


if __name__ == "__main__":
    main()
