#!/usr/bin/env python
"""What automatic prefix caching saves on a batch job whose prompts share their start (a system
prompt, few-shot examples): the same job run by the engine without it (`enable_prefix_caching=
False`, every prompt prefilled whole, what a user had before) and with it, side by side in one
process, rounds alternated (A B, B A, ...), end-to-end seconds and their ratio (prints; asserts
nothing but that both runs give the same tokens).

    .venv/bin/python scripts/bench_prefix.py                       # dummy opt-125m, 32 x (1024 shared + 64) -> 32
    .venv/bin/python scripts/bench_prefix.py --model dummy:llama-2-7b --layers 2 --shared 2048

Each request is `--shared` token ids common to all, then `--unique` of its own (random ids: the
KV cache holds ids, not text, so a dummy model's weights do what a checkpoint's would), greedy,
ignore_eos, `--max-tokens` each. The cache is emptied before every run (BlockManager.release_all),
so each run's first request computes the shared blocks and the later ones find them: what one job
saves, not what an earlier run left. Reported per engine: seconds (best of the rounds), prompt
tokens the passes computed, tokens found in the cache, and passes.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile

import harness  # puts the repository root on sys.path
from flexsarathi import LLM, SamplingParams
from flexsarathi.machine.cpu_info import cpu_line
from policy_search import Policy
from policy_search.model_registry import register_variant

ENGINES = ("no caching", "prefix caching")


def prompts_of(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    shared = [rng.randrange(4, vocab) for _ in range(args.shared)]
    return [shared + [rng.randrange(4, vocab) for _ in range(args.unique)] for _ in range(args.requests)]


def build(args, caching: bool, offload_dir: str) -> LLM:
    model = args.model
    if args.layers is not None:
        model = f"dummy:{register_variant(model.removeprefix('dummy:'), args.layers)}"
    policy = Policy(gpu_batch_size=args.batch, prefill_budget=args.prefill_budget)
    return LLM(model, dtype=args.dtype, policy=policy, enable_prefix_caching=caching, offload_dir=offload_dir)


def job(llm: LLM, prompts: list, params: SamplingParams, runs: list) -> None:
    llm.engine.blocks.release_all()  # nothing cached from an earlier run
    outs = llm.generate(prompts, params, use_tqdm=False)
    runs.append({"tokens": [o.token_ids for o in outs], **llm.last_stats})


def report(args, llm: LLM, side, runs: dict) -> dict:
    engine = llm.engine
    rows = []
    for name in ENGINES:
        last = runs[name][-1]
        rows.append({"engine": name, "seconds": min(side.seconds[name]), "prompt_tokens": last["prompt_tokens"],
                     "prefill_tokens_computed": last["prefill_tokens_computed"],
                     "cache_hit_tokens": last["prefix_cache_hit_tokens"], "passes": last["passes"],
                     "generated_tokens": last["generated_tokens"]})
    # bf16 CPU matmuls differ in the last bits with the pass's shape (rows, chunking): on random
    # weights a near-tie can flip a greedy token, so the count of equal requests is printed
    def agree(a: list, b: list) -> int:
        return sum(x == y for x, y in zip(a, b))

    base = runs[ENGINES[0]][0]["tokens"]
    same = agree(runs[ENGINES[1]][0]["tokens"], base)  # requests with the same tokens in both engines
    repeat = {name: min(agree(r["tokens"], runs[name][0]["tokens"]) for r in runs[name]) for name in ENGINES}
    print(f"model {args.model}{f' ({args.layers} layers)' if args.layers else ''}, device {engine.device}, dtype "
          f"{str(engine.dtype).removeprefix('torch.')}; {args.requests} requests x ({args.shared} shared + "
          f"{args.unique} own tokens) -> {args.max_tokens}, batch {args.batch}, prefill budget {args.prefill_budget}; "
          f"best of {args.rounds} rounds (alternated)")
    print(f"{'engine':15} {'seconds':>8} {'prompt tok':>10} {'computed':>9} {'cached':>8} {'passes':>7}")
    for r in rows:
        print(f"{r['engine']:15} {r['seconds']:8.2f} {r['prompt_tokens']:10d} {r['prefill_tokens_computed']:9d} "
              f"{r['cache_hit_tokens']:8d} {r['passes']:7d}")
    pairs = [a / b for a, b in zip(side.seconds[ENGINES[0]], side.seconds[ENGINES[1]])]
    speedup = rows[0]["seconds"] / rows[1]["seconds"]
    print(f"prefix caching / no caching, end to end: {speedup:.2f}x faster (best against best; per round "
          f"{', '.join(f'{p:.2f}' for p in pairs)}, median {statistics.median(pairs):.2f})")
    print(f"requests with the same tokens in both engines: {same} of {len(base)}; run to run, each engine: "
          + ", ".join(f"{name} {n} of {len(base)}" for name, n in repeat.items()))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {cpu_line()}; commit "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    return {"rows": rows, "speedup": speedup, "median_round_speedup": statistics.median(pairs), "same_tokens": same,
            "same_run_to_run": repeat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:opt-125m")
    ap.add_argument("--layers", type=int, default=None, help="dummy:<shape> only: run N of its layers")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--shared", type=int, default=1024, help="token ids every prompt starts with")
    ap.add_argument("--unique", type=int, default=64, help="token ids of each prompt's own after them")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="gpu_batch_size (running sequences)")
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--dtype", default=None, help="default: the engine's auto (measured per machine on a CPU)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    if args.layers is not None and not args.model.startswith("dummy:"):
        raise SystemExit("--layers is for dummy:<shape> models")
    with tempfile.TemporaryDirectory(prefix="bench_prefix_") as offload_dir:
        llms = {name: build(args, name == ENGINES[1], offload_dir) for name in ENGINES}
        prompts = prompts_of(args, llms[ENGINES[0]].engine.config.vocab_size)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        runs = {name: [] for name in ENGINES}
        side = harness.alternate({name: (lambda n=name: job(llms[n], prompts, params, runs[n])) for name in ENGINES},
                                 rounds=args.rounds)
        summary = report(args, llms[ENGINES[1]], side, runs)
        for llm in llms.values():
            llm.close()
    harness.write_result(args, summary["rows"], {"prefix_caching_speedup": summary["speedup"]},
                         extra={"median_round_speedup": summary["median_round_speedup"],
                                "same_tokens": summary["same_tokens"],
                                "same_run_to_run": summary["same_run_to_run"]})


if __name__ == "__main__":
    main()
