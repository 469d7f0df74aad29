"""`flexsarathi bench`: FlexGen's throughput protocol. Random prompts of --prompt-len token ids
(dummy weights are fine: this measures speed, not text), a warm-up run (prompts of 32 tokens, two
generated tokens each: a prompt pass and a decode pass), then the measured run: every prompt
generates exactly --gen-len tokens (greedy, EOS ignored); throughput = generated tokens / (prefill +
decode time), the wall time of the run's passes. Prints a table and one JSON line (the last line of stdout).

With --hardware, the preset's or profile's memory capacities are the budgets the engine enforces
even on a larger device (an H100 running as a T4); the report names the device that ran.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from flexsarathi.cli.engine_args import add_model_args, build_llm, describe_policy, device_name
from flexsarathi.errors import FlexSarathiError
from flexsarathi.engine.sampling import SamplingParams

WARMUP_PROMPT_LEN = 32  # FlexGen warms up on 32-token prompts, one new token each
# Ours: two, so a decode pass runs too and the decode path's GPU kernels (Triton's: the 4-bit matmul at
# decode rows, attention over a 4-bit pool) are compiled before the clock starts (a second or more
# each on first use), as FlexGen's set-up before its warm-up call is outside its timing.
WARMUP_MAX_TOKENS = 2


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="FlexGen's throughput benchmark (table + one JSON line)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default: the policy's running sequences (gpu_batch_size x num_gpu_batches; without "
                   "--policy as many as memory holds, up to 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
    p.set_defaults(func=run_bench)
    return p


def run_bench(args) -> int:
    from policy_search import Workload

    for name in ("prompt_len", "gen_len", "num_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FlexSarathiError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    workload = Workload(prompt_len=args.prompt_len, gen_len=args.gen_len, num_requests=args.num_prompts)
    llm, policy = build_llm(args, workload)
    try:
        result = _measure(llm, policy, args)
    finally:
        llm.close()
    print(_table(result))
    print(json.dumps(result))
    return 0


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _measure(llm, policy, args) -> dict:
    engine = llm.engine
    context = engine.config.max_position_embeddings
    if args.prompt_len + args.gen_len > context:
        raise FlexSarathiError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} exceeds the "
                               f"model's context of {context}")
    # FlexGen's protocol: a batch of every running sequence (a default engine's: as many as fit)
    count = args.num_prompts or engine.fitted_running([args.prompt_len] * policy.max_running,
                                                      [args.prompt_len + args.gen_len] * policy.max_running)
    vocab, described = engine.config.vocab_size, describe_policy(policy, engine.engine_config.fit_running)
    print(f"bench: {count} prompts x {args.prompt_len} tokens -> {args.gen_len} each, {described} "
          "(--num-prompts N for another count)", file=sys.stderr, flush=True)
    if not args.no_warmup:
        llm.generate(_prompts(count, min(WARMUP_PROMPT_LEN, args.prompt_len), vocab, args.seed + 1),
                     SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.generate(_prompts(count, args.prompt_len, vocab, args.seed),
                 SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True), use_tqdm=False)
    s = llm.last_stats
    return {"model": args.model, "device": device_name(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."), "hardware": args.hardware,
            "policy": described, "num_prompts": count, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "prompt_tokens": s["prompt_tokens"], "generated_tokens": s["generated_tokens"],
            "passes": s["passes"], "seconds": s["seconds"], "throughput_tok_s": s["tokens_per_s"],
            "total_tok_s": (s["prompt_tokens"] + s["generated_tokens"]) / s["seconds"],
            "peak_bytes": {tier: entry["peak"] for tier, entry in s["memory"].items()},
            "capacity_bytes": {tier: entry["capacity"] for tier, entry in s["memory"].items()}}


def _table(r: dict) -> str:
    from offload.memory import human_bytes

    rows = [("model", r["model"]), ("device", r["device"]), ("dtype", r["dtype"]),
            ("hardware budgets", r["hardware"] or "none (whole device)"), ("policy", r["policy"]),
            ("workload", f"{r['num_prompts']} prompts x {r['prompt_len']} tokens -> {r['gen_len']} tokens"),
            ("passes", r["passes"]), ("time (prefill + decode)", f"{r['seconds']:.3f} s"),
            ("throughput", f"{r['throughput_tok_s']:.3f} generated tok/s"),
            ("prompt + generated", f"{r['total_tok_s']:.3f} tok/s")]
    rows += [(f"peak {tier}", human_bytes(peak) + (f" of {human_bytes(r['capacity_bytes'][tier])}"
                                                     if r["capacity_bytes"][tier] is not None else ""))
             for tier, peak in r["peak_bytes"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
