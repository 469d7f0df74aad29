"""A KV pool's gather onto the CPU, as decode attention beside a host cache runs it every layer of
every step: the paths side by side on one pool, min of interleaved repeats, with ratios.

- plain fp32 pool: index_select into a fresh tensor (the old path) / into a recycled buffer (now);
- 4-bit pool (KVCompression, the default format): torch's route (index the codes, unpack, affine,
  permute; fresh tensors: the old path) / the C kernel into recycled buffers (quant/cpu_kv_dequant.py).

    PYTHONPATH=$PWD python scripts/bench_kv_gather.py [--model llama-2-7b] [--seqs 32] [--context 144]
"""
from __future__ import annotations

import argparse
import contextlib

import harness  # puts the repository root on sys.path
import torch

from flexsarathi.machine.cpu_info import cpu_line
from offload import host_buffer
from offload.kv_cache import KVCompression, KVPool
from policy_search.model_spec import ModelSpec
from quant import cpu_kv_dequant


@contextlib.contextmanager
def _old_path():
    """The path before: no recycled buffers (every gather allocates) and no C kernel."""
    saved = host_buffer._STORAGE_USE_COUNT, cpu_kv_dequant.covers
    host_buffer._STORAGE_USE_COUNT, cpu_kv_dequant.covers = None, (lambda *args: False)
    try:
        yield
    finally:
        host_buffer._STORAGE_USE_COUNT, cpu_kv_dequant.covers = saved


def _filled_pool(spec: ModelSpec, seqs: int, slots_per_seq: int, compression) -> KVPool:
    block = compression.block_size if compression else 16
    pool = KVPool("cpu", 1, seqs * slots_per_seq, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu",
                  block_size=block, compression=compression, num_residual=seqs)
    gen = torch.Generator().manual_seed(0)
    tables = [pool.k, pool.v] if compression is None else [*pool.k_codes.values(), *pool.v_codes.values()]
    for t in tables:
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
        else:
            t.copy_(torch.rand(t.shape, generator=gen) * 0.1)
    return pool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b", help="a registry shape (KV heads, head size)")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=144, help="tokens gathered per sequence")
    parser.add_argument("--repeats", type=int, default=7)
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    spec = ModelSpec.from_name(args.model, bytes_per_value=4)
    print(f"bench_kv_gather: {cpu_line(torch.float32)}; kernel: {cpu_kv_dequant.unavailable_reason() or 'built'}")
    print(f"{args.model}: {args.seqs} sequences x {args.context} tokens, {spec.num_kv_heads} KV heads x "
          f"{spec.head_dim}, one layer; ms per gather (min of {args.repeats})")
    rows = []
    for name, compression in (("fp32", None), ("4-bit", KVCompression())):
        block = compression.block_size if compression else 16
        per_seq = -(-(args.context + 1) // block) * block
        pool = _filled_pool(spec, args.seqs, per_seq, compression)
        slots = torch.arange(args.seqs)[:, None] * per_seq + torch.arange(args.context)[None, :]
        complete = torch.full((args.seqs,), args.context // block * block)

        def gather():
            return pool.gather(0, slots, torch.device("cpu"), torch.arange(args.seqs), complete)

        def old_path():
            with _old_path():
                gather()

        # taking turns: load changes hit both alike
        times = harness.alternate({"old": old_path, "new": gather}, args.repeats, warmup=False)
        best = {path: times.best(path) for path in ("old", "new")}
        print(f"  {name:>5} pool: old {best['old'] * 1e3:7.1f} ms   new {best['new'] * 1e3:7.1f} ms   "
              f"old / new {best['old'] / best['new']:5.2f}x")
        rows.append({"pool": name, "old_ms": best["old"] * 1e3, "new_ms": best["new"] * 1e3,
                     "old_over_new": best["old"] / best["new"]})
    harness.write_result(args, rows, dtype=torch.float32)


if __name__ == "__main__":
    main()
