"""Decode attention on the CPU: our fp32 matmul path against PyTorch's fused CPU flash kernel, the
one aten op here that also returns the log-sum-exp the exact merge of partial attentions needs
(`_scaled_dot_product_flash_attention_for_cpu`; the efficient-attention op with LSE is CUDA-only).
Both through flexsarathi.models.attention.attend (kernel="matmul" / "flash"), on K/V as the pools gather
them ([B, L, kv_heads, d]), min of repeats taking turns. Prints times and the ratio
(docs/BENCHMARKS.md, bench_attention_lse).

    python scripts/bench_attention_lse.py [--repeats 15] [--threads N] [--json PATH]
"""
from __future__ import annotations

import argparse

import harness  # puts the repository root on sys.path
import torch

from flexsarathi.models.attention import attend

CASES = [  # (name, sequences, query rows each, context, heads, kv_heads, head_dim)
    ("decode opt-1.3b 30 x 160", 30, 1, 160, 32, 32, 64),
    ("decode opt-1.3b 30 x 600", 30, 1, 600, 32, 32, 64),
    ("decode llama-7b 16 x 512", 16, 1, 512, 32, 32, 128),
    ("decode llama-70b gqa 8 x 512", 8, 1, 512, 64, 8, 128),
    ("prompt chunk 1 x 256 rows", 1, 256, 256, 32, 32, 64),
]


def _inputs(seqs, rows, context, heads, kv_heads, dim, dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seqs, rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(seqs, context, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(seqs, context, kv_heads, dim, generator=gen).to(dtype)
    q_pos = torch.arange(context - rows, context).expand(seqs, rows).contiguous()
    kv_len = torch.full((seqs,), context)
    return q, k, v, q_pos, kv_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(harness.machine()["line"])
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, *shape in CASES:
            q, k, v, q_pos, kv_len = _inputs(*shape, dtype)
            scale = shape[-1] ** -0.5
            outs = {}

            def call(kernel: str):
                def run() -> None:
                    outs[kernel] = attend(q, k, v, q_pos, kv_len, scale, kernel=kernel)
                return run

            # taking turns: load changes hit both alike
            times = harness.alternate({"matmul": call("matmul"), "flash": call("flash")}, args.repeats, warmup=False)
            best = {which: times.best(which) for which in ("matmul", "flash")}
            diff = (outs["matmul"][0].float() - outs["flash"][0].float()).abs().max().item()
            print(f"{str(dtype).removeprefix('torch.'):>8} {name:<30} matmul {best['matmul'] * 1e3:7.2f} ms  "
                  f"flash+lse {best['flash'] * 1e3:7.2f} ms  flash/matmul {best['flash'] / best['matmul']:5.2f}"
                  f"  (max |diff| {diff:.1e})")
            rows.append({"dtype": str(dtype).removeprefix("torch."), "case": name, "matmul_ms": best["matmul"] * 1e3,
                         "flash_ms": best["flash"] * 1e3, "flash_over_matmul": best["flash"] / best["matmul"],
                         "max_abs_diff": diff})
    harness.write_result(args, rows)


if __name__ == "__main__":
    main()
