#!/usr/bin/env python
"""The cost of structured outputs: the same job (same prompts, same batch, same policy) run without
and with a JSON schema on one engine, tok/s side by side (prints; asserts nothing).

    .venv/bin/python scripts/bench_structured.py                         # stories260K (../shared/models)
    .venv/bin/python scripts/bench_structured.py --model dummy:opt-125m --tokenizer-from ../shared/models/stories260K

Where the time goes: the weights cost per pass, the grammar per token. Each step fills one
bitmask row per constrained sequence on the host (xgrammar's matcher), applies the masks on the
logits' device in one call, and advances each matcher by its sampled token; the first request of
a schema compiles it (once per engine). On a model as small as stories260K a pass is ~1 ms, so the
per-token grammar work is a large share; on a 7B-shaped model a pass is far longer and the same
per-token work is a small one. Unconstrained runs use ignore_eos and constrained ones stop at the
grammar's end, so tok/s (generated tokens over seconds) is compared, not totals.

A dummy model has no tokenizer: --tokenizer-from lends a checkpoint folder's tokenizer to the
grammar compiler (the vocabulary padded to the model's; the masks are the model's width).
"""
from __future__ import annotations

import argparse
import json
import time

import harness  # puts the repository root on sys.path
import flexsarathi.engine.llm_engine as llm_engine
import flexsarathi.engine.sampling as sampling
from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.sampling import StructuredOutputsParams
from flexsarathi.engine.structured_output import GrammarCompiler
from flexsarathi.formats.tokenizer import Tokenizer
from policy_search import Policy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad", "angry"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 10},
                                                  "size": {"enum": ["big", "small"]}},
                 "required": ["town", "size"]},
    },
    "required": ["name", "mood", "friends", "home"],
}


GRAMMAR_SECONDS = [0.0]  # time inside the grammar's per-step work (mask fill + apply, matcher advance)


def timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - start
    return wrapper


sampling.apply_grammar_masks = timed(sampling.apply_grammar_masks)
llm_engine.advance_matchers = timed(llm_engine.advance_matchers)


def run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="../shared/models/stories260K")
    ap.add_argument("--tokenizer-from", default=None, help="a folder whose tokenizer.json the grammar uses")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="gpu_batch_size (running sequences)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, policy=Policy(gpu_batch_size=args.batch, prefill_budget=64))
    engine = llm.engine
    if args.tokenizer_from:
        import os

        lent = Tokenizer.from_folder(args.tokenizer_from)
        engine.grammars = GrammarCompiler(lent, engine.config.vocab_size, [lent.eos_token_id])
        prompts = [lent.encode(f"Once upon a time, number {i}") for i in range(args.requests)]
        print(f"tokenizer lent from {os.path.basename(os.path.normpath(args.tokenizer_from))}")
    else:
        prompts = [f"Once upon a time, number {i}" for i in range(args.requests)]
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    schema = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    run(llm, prompts[:2], plain)  # warm-up: buffers, the first compile
    run(llm, prompts[:2], schema)
    rows = {"plain": [], "schema": []}
    grammar = []  # per schema run: seconds inside the grammar's work
    for _ in range(args.repeats):  # interleaved, so drift in the machine hits both alike
        rows["plain"].append(run(llm, prompts, plain))
        GRAMMAR_SECONDS[0] = 0.0
        rows["schema"].append(run(llm, prompts, schema))
        grammar.append(GRAMMAR_SECONDS[0])
    best = {k: max(t / s for t, s in v) for k, v in rows.items()}
    print(f"model {args.model} vocab {engine.config.vocab_size} device {engine.device} dtype {args.dtype}; "
          f"{args.requests} requests, batch {args.batch}, max_tokens {args.max_tokens}, best of {args.repeats}")
    print(f"{'run':8} {'tokens':>7} {'seconds':>8} {'tok/s':>9}")
    for k, v in rows.items():
        tokens, seconds = max(v, key=lambda ts: ts[0] / ts[1])
        print(f"{k:8} {tokens:7d} {seconds:8.3f} {tokens / seconds:9.1f}")
    print(f"schema / plain tok/s: {best['schema'] / best['plain']:.3f} "
          f"(grammars compiled: {engine.grammars.compiled})")
    per_token = [g / t * 1e6 for g, (t, _) in zip(grammar, rows["schema"])]
    share = [g / s for g, (_, s) in zip(grammar, rows["schema"])]
    print(f"grammar work (masks filled and applied, matchers advanced): {min(per_token):.0f} us per "
          f"constrained token, {min(share):.1%} of the schema run's time")
    summary = {"plain_tok_s": best["plain"], "schema_tok_s": best["schema"], "ratio": best["schema"] / best["plain"],
               "grammar_us_per_token": min(per_token), "grammar_share": min(share)}
    print(json.dumps(summary))
    harness.write_result(args, [{"run": k, "tokens": t, "seconds": s} for k, v in rows.items() for t, s in v],
                         {"schema_over_plain_tok_s": summary["ratio"]}, extra=summary)
    llm.close()


if __name__ == "__main__":
    main()
