#!/usr/bin/env python
"""top_p / top_k filtering, ours beside a sort of every row (what vLLM's sampler does in
`apply_top_k_top_p`: sort, cumulative sum, mask, scatter back), on batches of logits shaped like a
model's: every row peaked (a nucleus of a few tokens), one row in the batch flat or in between
(a high temperature, an uncertain position), every row flat. Prints the medians and their ratio
(sorting / ours) and how many rows' kept tokens differ (a flat row's nucleus of ~40,000 tokens
may end one token apart: fp32 sums in two orders; tests/flexsarathi/engine/test_sampling.py checks
ours against a float64 sort); asserts nothing.

    .venv/bin/python scripts/bench_sampling.py                       # 64 rows, vocab 50272 and 128256
    .venv/bin/python scripts/bench_sampling.py --rows 16 --vocab 32000 --top-p 0.95 --top-k 50

Ours cuts each row from its 1024 most likely tokens (a top-k selection) and only the rows those
cannot decide from more, so one flat row no longer sends the whole batch to a sort.
"""
from __future__ import annotations

import argparse

import torch

import harness  # puts the repository root on sys.path
from flexsarathi.engine.sampling import SamplingParams, filtered_logits
from flexsarathi.machine.cpu_info import cpu_line


def sorted_cut(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The textbook route: sort every row, keep its top_k, then the smallest prefix reaching top_p."""
    scaled = logits / temperature
    values, order = scaled.sort(dim=-1, descending=True)  # [R, vocab]
    if top_k > 0:
        values[:, top_k:] = float("-inf")
    probs = values.softmax(-1)
    before = probs.cumsum(-1) - probs
    values = values.masked_fill((before >= top_p) & (torch.arange(values.shape[1]) > 0), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, values)


def batches(rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Peaked rows (logits of spread 8: a nucleus of a few tokens), and the same with one row of
    spread 2 (in between: a nucleus of thousands) or 1/3 (flat), and every row flat."""
    g = torch.Generator().manual_seed(seed)
    peaked = torch.randn(rows, vocab, generator=g) * 8
    medium, flat_row = peaked.clone(), peaked.clone()
    medium[rows // 2] = torch.randn(vocab, generator=g) * 2
    flat_row[rows // 2] = torch.randn(vocab, generator=g) / 3
    return {"every row peaked": peaked, "one row in between": medium, "one row flat": flat_row,
            "every row flat": torch.randn(rows, vocab, generator=g) / 3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, nargs="+", default=[50272, 128256])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    print(f"{cpu_line()}; {torch.get_num_threads()} threads; {args.rows} rows, top_p {args.top_p}, "
          f"top_k {args.top_k}, temperature {args.temperature}")
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)] * args.rows
    print(f"{'vocab':>7} {'batch':<20} {'sorted ms':>10} {'ours ms':>9} {'sorted / ours':>14}  "
          "rows whose kept tokens differ (most tokens in a row)")
    rows, ratios = [], {}
    for vocab in args.vocab:
        for name, logits in batches(args.rows, vocab, seed=0).items():
            differ = (torch.isfinite(filtered_logits(logits, params)) != torch.isfinite(
                sorted_cut(logits, args.temperature, args.top_k, args.top_p))).sum(-1)  # [rows]
            sort_ms = 1e3 * harness.median_seconds(lambda: sorted_cut(logits, args.temperature, args.top_k, args.top_p),
                                                  args.repeats, warmup=1)
            ours_ms = 1e3 * harness.median_seconds(lambda: filtered_logits(logits, params), args.repeats, warmup=1)
            print(f"{vocab:>7} {name:<20} {sort_ms:>10.1f} {ours_ms:>9.1f} {sort_ms / ours_ms:>13.2f}x  "
                  f"{int((differ > 0).sum())} ({int(differ.max())})")
            rows.append({"vocab": vocab, "batch": name, "sorted_ms": sort_ms, "ours_ms": ours_ms,
                         "rows_differing": int((differ > 0).sum()), "most_tokens_differing": int(differ.max())})
            ratios[f"{vocab} {name}: sorted / ours"] = sort_ms / ours_ms
    harness.write_result(args, rows, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
