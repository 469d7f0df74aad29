"""Decode attention where the KV cache lives on the CPU (`--cpu-cache-compute` in FlexGen, cpu_attention
here): FlexGen's own CPU route and ours, one layer of one decode step, side by side on this machine.

The case it stands for: FlexGen's `opt-30b/cpu-weights` policy (scripts/bench_flexgen_gpu.py), 48 sequences
of a 512-token prompt, fp16 KV on the CPU. Each decode step, for every layer, only q crosses to the CPU
and the output back; the CPU reads the whole cache. What runs on the CPU per layer:

- FlexGen 0.1.8 (`TorchDevice.mha_gen` with the cache on the CPU): the new row written into the cache,
  the cache's first s rows laid out [b * heads, d, s] and [b * heads, s, d] (copies), widened to fp32,
  then its own `_attention_value` (bmm, mask, softmax, bmm), the output narrowed to fp16;
- ours (`KVPool.attend_decode` on a plain cpu-tier pool, as the executor's IN_POOL route calls it, then
  `KVPool.store` of the new rows): each sequence's slots read in place by quant/csrc/kv_attention.c.

The same K, V and q go to both; the outputs are compared (max |difference|). Min of interleaved repeats.

    .venv/bin/pip install flexgen==0.1.8 --no-deps     # FlexGen's code, for the baseline
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cpu_attention.py [--model opt-30b] [--seqs 48] [--context 512]
"""
from __future__ import annotations

import argparse
import sys
import time

import harness  # puts the repository root on sys.path
import torch

from flexsarathi.machine.cpu_info import cpu_line
from offload.kv_cache import KVPool
from offload.micro_batch import AttentionGroup, KVPart
from policy_search.model_spec import ModelSpec
from quant import cpu_kv_attention

BLOCK = 16  # the plain pool's block (LLMEngine's PLAIN_KV_BLOCK)


def flexgen_device():
    """FlexGen's CPU device (its TorchDevice), or exit saying how to install it."""
    try:
        from flexgen import pytorch_backend
    except ImportError:
        sys.exit("bench_cpu_attention: the baseline is FlexGen's own code: .venv/bin/pip install flexgen==0.1.8 "
                 "--no-deps")
    pytorch_backend.fix_recursive_import()  # what flexgen.flex_opt does as it is imported
    return pytorch_backend.TorchDevice("cpu")


class FlexGenLayer:
    """One layer's cache in FlexGen's layout, (s, b * heads, d), and mha_gen's CPU steps over it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, device):
        batch, length, heads, dim = k.shape  # the prompt's keys, then room for the new row
        self.k_cache = torch.empty(length + 1, batch * heads, dim, dtype=k.dtype)
        self.v_cache = torch.empty_like(self.k_cache)
        self.k_cache[:length] = k.permute(1, 0, 2, 3).reshape(length, batch * heads, dim)
        self.v_cache[:length] = v.permute(1, 0, 2, 3).reshape(length, batch * heads, dim)
        self.mask = torch.ones(batch, length + 1, dtype=torch.bool)
        self.device, self.heads, self.dim = device, heads, dim

    def step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, heads, d] (unscaled), k_new, v_new [B, heads, d] -> out [B, heads, d] fp16."""
        batch, heads, dim = q.shape
        src_s = self.k_cache.shape[0]
        q = (q * scale).reshape(batch * heads, 1, dim)  # FlexGen scales q in its projection
        k, v = self.k_cache[:src_s], self.v_cache[:src_s]
        k[src_s - 1:src_s] = k_new.reshape(1, batch * heads, dim)
        v[src_s - 1:src_s] = v_new.reshape(1, batch * heads, dim)
        k = k.permute(1, 2, 0).reshape(batch * heads, dim, src_s)
        v = v.permute(1, 0, 2).reshape(batch * heads, src_s, dim)
        q, k, v = q.float(), k.float(), v.float()
        value = self.device._attention_value(q, k, v, self.mask, batch, src_s, 1, heads, dim)
        return value.half().view(batch, heads, dim)


class OurLayer:
    """One layer of a plain cpu-tier KVPool holding the same keys, and the decode micro-batch's group."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        batch, length, kv_heads, dim = k.shape
        per_seq = -(-(length + 1) // BLOCK) * BLOCK
        self.pool = KVPool("cpu", 1, batch * per_seq, kv_heads, dim, k.dtype, "cpu", block_size=BLOCK)
        starts = torch.arange(batch) * per_seq
        slots = starts[:, None] + torch.arange(length + 1)  # [B, L + 1]: the prompt, then the new row
        self.pool.store(0, slots[:, :length].reshape(-1), k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim))
        self.write_slots = slots[:, length].contiguous()
        column = lambda value: torch.full((batch,), value, dtype=torch.long)  # noqa: E731
        rows = torch.arange(batch)
        self.part = KVPart("cpu", slots, kv_start=column(0), kv_len=column(length + 1), patch_src=rows,
                           patch_seq=rows, patch_pos=column(length), residual_ids=rows, complete_len=column(0))
        self.group = AttentionGroup(token_rows=rows, num_queries=1, q_pos=column(length)[:, None], parts=[self.part],
                                    row_start=0)

    def step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float) -> torch.Tensor:
        out, _ = self.pool.attend_decode(0, self.group, self.part, q[:, None], k_new, v_new, scale, None)
        self.pool.store(0, self.write_slots, k_new, v_new)
        return out[:, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="opt-30b", help="a registry shape (heads, head size)")
    parser.add_argument("--seqs", type=int, default=48, help="sequences of the decode micro-batch")
    parser.add_argument("--context", type=int, default=512, help="keys cached before the new one")
    parser.add_argument("--repeats", type=int, default=5)
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    spec = ModelSpec.from_name(args.model, bytes_per_value=2)
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if heads != kv_heads:
        sys.exit(f"bench_cpu_attention: FlexGen runs OPT only (no grouped-query heads); {args.model} has "
                 f"{heads} query heads over {kv_heads} KV heads")
    reason = cpu_kv_attention.unavailable_reason()
    if reason:
        sys.exit(f"bench_cpu_attention: our kernel is not built here ({reason})")
    flexgen = flexgen_device()
    print(f"bench_cpu_attention: {cpu_line(torch.float16)}")
    cache_bytes = 2 * args.seqs * (args.context + 1) * kv_heads * dim * 2
    print(f"{args.model}: {args.seqs} sequences x {args.context + 1} keys, {heads} heads x {dim}, fp16 KV "
          f"({cache_bytes / 2**20:.0f} MiB per layer); one layer of one decode step; min of {args.repeats}")
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(args.seqs, args.context, kv_heads, dim, generator=gen).half() for _ in range(2))
    q, k_new, v_new = (torch.randn(args.seqs, heads, dim, generator=gen).half() for _ in range(3))
    scale = dim ** -0.5
    theirs, ours = FlexGenLayer(k, v, flexgen), OurLayer(k, v)
    del k, v
    outputs = {}
    steps = {name: (lambda name=name, layer=layer: outputs.__setitem__(name, layer.step(q, k_new, v_new, scale)))
             for name, layer in (("FlexGen", theirs), ("ours", ours))}
    runs = harness.alternate(steps, args.repeats)  # rotated order: a busy neighbour slows both alike
    best = {name: min(seconds) for name, seconds in runs.seconds.items()}
    diff = (outputs["ours"].float() - outputs["FlexGen"].float()).abs().max().item()
    rows = [{"route": "FlexGen", "ms": best["FlexGen"] * 1e3}, {"route": "ours", "ms": best["ours"] * 1e3}]
    for line in harness.ratio_table(rows, "route", "ms", "FlexGen"):
        print(line)
    speedup = best["FlexGen"] / best["ours"]
    print(f"ours / FlexGen speed: {speedup:.2f}x; the outputs differ by at most {diff:.2e} (fp16)")
    harness.write_result(args, rows, {"ours_speedup": speedup}, torch.float16,
                         extra={"max_abs_diff": diff, "cache_bytes_per_layer": cache_bytes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
