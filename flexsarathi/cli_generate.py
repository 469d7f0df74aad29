"""`flexsarathi generate`: run a batch file of prompts (plain text, JSONL, or OpenAI Batch API
requests) and write one record per request, as requests finish.

Crash-safe and resumable: rerun the same command after Ctrl-C or kill -9 and it skips the
requests already in --output (a torn last line is redone). A bad line becomes an error record and
the job goes on. Exit code: 0 every line succeeded, 1 some lines are error records, 2 the job
could not start (bad model, policy, arguments, input file, or an --output of another job).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from importlib import resources

from flexsarathi.batch_io import (FORMATS, BatchRequest, check_unique_ids, error_record, read_requests,
                                  result_record)
from flexsarathi.cli_common import add_model_args, build_llm, describe_policy, memory_summary
from flexsarathi.errors import FlexSarathiError
from flexsarathi.result_file import ResultFile
from flexsarathi.sampling import SamplingParams

PACKAGE_PREFIX = "pkg:"  # --input pkg:NAME reads a prompt set shipped in flexsarathi/prompts/


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="run a batch file of prompts (text, JSONL, OpenAI Batch)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--input", "-i", required=True,
                   help=f"prompt file; {PACKAGE_PREFIX}NAME for a set shipped with flexsarathi "
                        f"({', '.join(packaged_prompt_sets())})")
    p.add_argument("--output", "-o", required=True, help="JSONL results (appended; resumed on rerun)")
    p.add_argument("--input-format", choices=("auto", *FORMATS), default="auto",
                   help="default: detected from the content")
    p.add_argument("--overwrite", action="store_true", help="start --output afresh")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, policy or summary")
    g = p.add_argument_group("sampling defaults (a request's own fields win)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=0,
                   help="a request without its own seed samples with one derived from this and its id, "
                        "so a resumed job samples what an uninterrupted one would")
    p.set_defaults(func=run_generate)
    return p


def packaged_prompt_sets() -> list[str]:
    folder = resources.files("flexsarathi") / "prompts"
    return sorted(f.name for f in folder.iterdir() if f.name.endswith((".txt", ".jsonl")))


def _input_path(name: str) -> str:
    if not name.startswith(PACKAGE_PREFIX):
        return name
    path = resources.files("flexsarathi") / "prompts" / name[len(PACKAGE_PREFIX):]
    if not path.is_file():
        raise FlexSarathiError(f"--input {name}: no such prompt set; shipped: {', '.join(packaged_prompt_sets())}")
    return str(path)


def _sampling_defaults(args) -> dict:
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "min_tokens": args.min_tokens, "stop": list(args.stop),
                "ignore_eos": args.ignore_eos}
    SamplingParams(**defaults)  # a bad flag fails the job before any work
    return defaults


def request_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "little") >> 2


def run_generate(args) -> int:
    defaults = _sampling_defaults(args)
    fmt, requests = read_requests(_input_path(args.input), args.input_format)
    check_unique_ids(requests)
    from flexsarathi.checkpoint import open_weight_source
    from flexsarathi.tokenizer import load_tokenizer

    source = open_weight_source(args.model)
    tokenizer = load_tokenizer(args.model, source.config)
    meta = {"job": "flexsarathi generate", "format": fmt, "model": _model_name(args.model),
            "weights": source.fingerprint, "dtype": args.dtype, "seed": args.seed, "sampling": defaults}
    out = ResultFile(args.output, fmt, meta, overwrite=args.overwrite)
    try:
        return _run_job(args, fmt, requests, tokenizer, defaults, out)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished records are in {args.output}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    finally:
        out.close()


def _model_name(model: str) -> str:
    return os.path.realpath(model) if os.path.isdir(model) else model


def _run_job(args, fmt: str, requests: list[BatchRequest], tokenizer, defaults: dict, out: ResultFile) -> int:
    say = (lambda *a: None) if args.quiet else (lambda text: print(text, flush=True))
    pending = [r for r in requests if r.key not in out.done]
    say(f"{len(requests)} requests ({fmt}) in {args.input}: {len(requests) - len(pending)} already in "
        f"{args.output}{' (a torn last line was cut off and is redone)' if out.torn else ''}, "
        f"{len(pending)} to run")
    params = {r.key: _prepare(r, tokenizer, defaults, args.seed) for r in pending}
    failed = 0
    for req in pending:
        if req.error:
            out.append(error_record(fmt, req, req.error))
            failed += 1
    runnable = [r for r in pending if not r.error]
    stats = policy = None
    if runnable:
        llm, policy = build_llm(args, _workload(runnable, params))
        say(f"policy: {describe_policy(policy)}")
        say(f"device: {llm.engine.device}, {str(llm.engine.dtype).removeprefix('torch.')}")
        try:
            failed += _generate(llm, fmt, runnable, params, out, args)
            stats = llm.last_stats
        finally:
            llm.close()
    _summary(say, len(pending) - failed, failed, stats, args.output, describe_policy(policy) if stats else None)
    return 1 if failed + out.errors else 0


def _prepare(req: BatchRequest, tokenizer, defaults: dict, seed: int) -> SamplingParams | None:
    """The request's SamplingParams, its prompt as token ids; sets req.error where it cannot run."""
    if req.error:
        return None
    try:
        fields = {**defaults, **req.sampling}
        fields.setdefault("seed", None)
        if fields["seed"] is None:
            fields["seed"] = request_seed(seed, req.key)
        params = SamplingParams(**fields)
        if req.messages is not None:
            if tokenizer is None:
                raise FlexSarathiError("this model has no tokenizer.json, so no chat template")
            req.prompt_token_ids = tokenizer.apply_chat_template(req.messages)
        elif req.prompt is not None:
            if tokenizer is None:
                raise FlexSarathiError("the prompt is text, but this model has no tokenizer.json: give "
                                       "\"prompt_token_ids\"")
            req.prompt_token_ids = tokenizer.encode(req.prompt)
        return params
    except (FlexSarathiError, TypeError) as exc:
        req.error = f"line {req.line}: {exc}"
        return None


def _workload(requests: list[BatchRequest], params: dict):
    """The job's lengths, for --policy auto."""
    from policy_search import Workload

    pairs = [(len(r.prompt_token_ids), params[r.key].max_tokens) for r in requests]
    return Workload(pairs=tuple(pairs), num_requests=sum(params[r.key].n for r in requests))


def _generate(llm, fmt: str, runnable: list[BatchRequest], params: dict, out: ResultFile, args) -> int:
    """Runs the requests, appending each record as it finishes; returns the error records written."""
    model, failed = os.path.basename(os.path.normpath(args.model)), 0
    decode = (lambda t: llm.tokenizer.decode([t])) if llm.tokenizer else str
    outputs = llm.generate_iter([r.prompt_token_ids for r in runnable], [params[r.key] for r in runnable],
                                use_tqdm=not args.quiet, on_error="record")
    for index, output in outputs:
        req = runnable[index]
        if output.error is not None:
            out.append(error_record(fmt, req, re.sub(r"^prompt \d+", f"line {req.line}: prompt", output.error)))
            failed += 1
        else:
            output.prompt = req.prompt
            out.append(result_record(fmt, req, output, model, decode))
    return failed


def _summary(say, ok: int, failed: int, stats: dict | None, output: str, policy: str | None) -> None:
    say(f"done: {ok} ok, {failed} failed -> {output}")
    if not stats:
        return
    seconds = stats["seconds"]
    say(f"tokens: {stats['prompt_tokens']} prompt, {stats['generated_tokens']} generated in {seconds:.2f} s "
        f"({stats['passes']} passes): {stats['tokens_per_s']:.2f} generated tok/s, "
        f"{(stats['prompt_tokens'] + stats['generated_tokens']) / (seconds or 1e-9):.2f} total tok/s")
    say(f"policy: {policy}")
    say(f"peak memory: {memory_summary(stats['memory'])}")
