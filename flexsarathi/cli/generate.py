"""`flexsarathi generate`: run a batch file of prompts (plain text, JSONL, or OpenAI Batch API
requests) and write one record per request, as requests finish.

Crash-safe and resumable: rerun the same command after Ctrl-C or kill -9 and it skips the
requests already in --output (a torn last line is redone); a record answers the request it was
written for (an input changed under its id is refused). A bad line becomes an error record and
the job goes on; --retry-errors redoes them. --ray runs the requests on a pool of engines (Ray Data
actors, one LLM each; this machine or a cluster) and writes the same records to the same file.
Exit code: 0 every line succeeded, 1 some lines are error records, 2 the job could not start (bad
model, policy, arguments, input file, or an --output of another job), 3 the Ray cluster failed
partway (the finished records are kept: rerun to resume), 70 an unexpected failure (a bug).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from importlib import resources

from flexsarathi.cli.embedding_requests import EmbeddingAsk, job_lines, run_lines
from flexsarathi.cli.request_files import (FORMATS, BatchRequest, adapter_fingerprints, check_unique_ids, error_record,
                                          read_requests, result_record, route_to_adapters)
from flexsarathi.cli.engine_args import (add_lora_modules_arg, add_model_args, build_llm, describe_policy, hardware_of,
                                         lora_modules, memory_summary, resolve_policy)
from flexsarathi.cli.console import say as say_line
from flexsarathi.cli.file_checks import check_not_the_input
from flexsarathi.errors import FlexSarathiError
from flexsarathi.cli.result_file import ResultFile
from flexsarathi.engine.pooling import PoolingParams
from flexsarathi.engine.sampling import SamplingParams
from flexsarathi.formats.harmony import speaks_harmony
from flexsarathi.formats.tool_calls import PARSERS

PACKAGE_PREFIX = "pkg:"  # --input pkg:NAME reads a prompt set shipped in flexsarathi/prompts/


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="run a batch file of prompts (text, JSONL, OpenAI Batch)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_lora_modules_arg(p)
    p.add_argument("--input", "-i", required=True,
                   help=f"prompt file; {PACKAGE_PREFIX}NAME for a set shipped with flexsarathi "
                        f"({', '.join(packaged_prompt_sets())})")
    p.add_argument("--output", "-o", required=True, help="JSONL results (appended; resumed on rerun)")
    p.add_argument("--input-format", choices=("auto", *FORMATS), default="auto",
                   help="default: detected from the content")
    fix = p.add_mutually_exclusive_group()
    fix.add_argument("--overwrite", action="store_true", help="start --output afresh")
    fix.add_argument("--repair", action="store_true", help="move --output's damaged lines to OUTPUT.rejected "
                     "and redo their requests (the good records are kept)")
    p.add_argument("--retry-errors", action="store_true", help="take --output's error records out and redo their "
                   "requests (after fixing the input, say); the finished records are kept")
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
    add_tool_call_parser_arg(p)
    p.add_argument("--embed", action="store_true",
                   help="embed each line of a plain-text --input (records: id, embeddings, usage) instead of "
                        "continuing it")
    add_ray_args(p)
    p.set_defaults(func=run_generate)
    return p


def add_tool_call_parser_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the format a chat reply's tool calls are read in (tool_choice auto); default: the one "
                        "the model's chat template teaches")


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """The --ray flags (parsed without importing ray: only `--ray` does)."""
    g = p.add_argument_group("Ray Data (pip install 'flexsarathi[ray]')")
    g.add_argument("--ray", action="store_true", help="run the requests on Ray Data actors, one engine each")
    g.add_argument("--ray-address", default=None, metavar="ADDR", help="a running cluster ('auto' = the one "
                   "`ray start` made on this node, or HOST:PORT); default: start a local instance")
    g.add_argument("--ray-actors", type=int, default=None, metavar="N", help="engines (default 1)")
    g.add_argument("--ray-gpus-per-actor", type=float, default=None, metavar="G", help="default 0 (CPU)")
    g.add_argument("--ray-cpus-per-actor", type=float, default=None, metavar="C",
                   help="CPU cores per actor, its torch threads (default 1)")
    g.add_argument("--ray-batch-size", type=int, default=None, metavar="B", help="requests per actor call "
                   "(default: the job split evenly over the actors, at most 8x the policy's running sequences)")


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


class PartialJobError(FlexSarathiError):
    """The job stopped partway for a reason outside the requests (a Ray actor or node lost)."""


def run_generate(args) -> int:
    defaults = _sampling_defaults(args)
    _check_ray_args(args)
    if args.retry_errors and args.overwrite:
        raise FlexSarathiError("--retry-errors and --overwrite: pass one (--overwrite redoes every request)")
    input_path = _input_path(args.input)
    check_not_the_input(input_path, args.output)
    fmt, requests = read_requests(input_path, args.input_format)
    check_unique_ids(requests)
    if args.embed:
        _texts_to_embed(fmt, requests, args.input)
    modules = lora_modules(args)
    adapters = _route_to_adapters(requests, modules, args.model)
    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype
    from flexsarathi.formats.opened_model import open_model

    opened = open_model(args.model, lora=args.lora)  # once per job: the engine built below takes it as it is
    source = opened.source
    # The dtype resolved once (auto: this machine's cached choice) for the engine, every Ray actor
    # and the file's meta: a resume in another dtype is refused.
    if args.ray:  # for the actors' device (GPU actors may be driven from a machine without one)
        from flexsarathi.ray.spec import job_dtype
        args.dtype = job_dtype(args.dtype, source.config.checkpoint_dtype, args.device, args.ray_gpus_per_actor or 0)
    else:
        dtype = resolve_dtype(args.dtype, source.config.checkpoint_dtype, resolve_device(args.device))
        args.dtype = str(dtype).removeprefix("torch.")
    meta = {"job": "flexsarathi generate", "format": fmt, "model": _model_name(args.model),
            "weights": source.fingerprint, "dtype": args.dtype, "seed": args.seed, "sampling": defaults,
            **({"task": "embed"} if args.embed else {}),
            **({"tool_call_parser": args.tool_call_parser} if args.tool_call_parser else {}),
            **({"lora_modules": adapters} if adapters else {})}
    out = ResultFile(args.output, fmt, meta, overwrite=args.overwrite, repair=args.repair, requests=requests,
                     retry_errors=args.retry_errors)
    try:
        return _run_job(args, fmt, requests, opened, defaults, out)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished records are in {args.output}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    except PartialJobError as exc:
        print(f"error: {exc}; the finished records are in {args.output}: rerun the same command to resume",
              file=sys.stderr)
        return 3
    finally:
        out.close()


def _route_to_adapters(requests: list[BatchRequest], modules: dict[str, str], model: str) -> dict:
    """With --lora-modules: each request's adapter from its "model" (request_files.route_to_adapters);
    returns {name: adapter fingerprint} for the file's meta (a resume with changed adapters is
    refused), each adapter folder read here, before any work (with --ray, the actors read the same
    folders: the same paths on every node, as the model's)."""
    if not modules:
        return {}
    fingerprints = adapter_fingerprints(modules)
    route_to_adapters(requests, modules, {model, os.path.basename(os.path.normpath(model)), _model_name(model)})
    return fingerprints


def _texts_to_embed(fmt: str, requests: list[BatchRequest], path: str) -> None:
    """--embed: each line of a plain-text file is a text to embed (its record: id, embeddings, usage)."""
    if fmt != "text":
        raise FlexSarathiError(f"--embed reads a plain-text file (one text per line); {path} is {fmt} lines, which "
                               "say what they ask themselves: a JSONL record with \"input\", an OpenAI line for "
                               "/v1/embeddings")
    for req in requests:
        req.embedding, req.prompt = EmbeddingAsk([req.prompt]), None


def _check_ray_args(args) -> None:
    given = [f"--ray-{name.replace('_', '-')}" for name in ("address", "actors", "gpus_per_actor",
                                                            "cpus_per_actor", "batch_size")
             if getattr(args, f"ray_{name}") is not None]
    if given and not args.ray:
        raise FlexSarathiError(f"{', '.join(given)} need(s) --ray")
    for name in ("actors", "batch_size"):
        value = getattr(args, f"ray_{name}")
        if value is not None and value < 1:
            raise FlexSarathiError(f"--ray-{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("gpus_per_actor", "cpus_per_actor"):
        value = getattr(args, f"ray_{name}")
        if value is not None and not value >= (0 if name == "gpus_per_actor" else 0.01):
            raise FlexSarathiError(f"--ray-{name.replace('_', '-')} must be a positive number, got {value}")
    if args.ray:
        import flexsarathi.ray  # noqa: F401 - without Ray Data: one clear error before any work


def _model_name(model: str) -> str:
    return os.path.realpath(model) if os.path.isdir(model) else model


# Sequences prepared (tokenized) and run at a time (a request's n, an embedding line's inputs): a
# job of millions of prompts holds one chunk's token ids and engine sequences (~4 KB each), not
# every one's; the engine stays built between chunks, and a chunk is many times the running set,
# so its tail costs little.
CHUNK_SEQUENCES = 8192


def request_chunks(requests: list[BatchRequest], limit: int | None = None):
    """The requests in runs whose sequences add up to at most `limit` (CHUNK_SEQUENCES; a larger
    request alone): what one engine call holds at once."""
    limit = CHUNK_SEQUENCES if limit is None else limit
    chunk, weight = [], 0
    for req in requests:
        n = req.sampling.get("n", 1)
        w = len(req.embedding.inputs) if req.embedding is not None else n if isinstance(n, int) and n > 0 else 1
        if chunk and weight + w > limit:
            yield chunk
            chunk, weight = [], 0
        chunk.append(req)
        weight += w
    if chunk:
        yield chunk


def _run_job(args, fmt: str, requests: list[BatchRequest], opened, defaults: dict, out: ResultFile) -> int:
    say = (lambda *a: None) if args.quiet else say_line
    pending = [r for r in requests if r.key not in out.done]
    say(f"{len(requests)} requests ({fmt}) in {args.input}: {len(requests) - len(pending)} already in "
        f"{args.output}{' (a torn last line was cut off and is redone)' if out.torn else ''}"
        f"{f' ({out.rejected} damaged or duplicate lines moved to {out.rejected_path})' if out.rejected else ''}"
        f"{f' ({out.retried} error records taken out to be redone)' if out.retried else ''}, "
        f"{len(pending)} to run")
    tokenizer = opened.tokenizer
    args.task = _job_task(pending)
    record = _recorder(fmt, out, tokenizer, os.path.basename(os.path.normpath(args.model)))
    engine = _JobEngine(args, say, opened)
    chunks = [pending] if args.ray else list(request_chunks(pending))  # Ray's actors take them as they stream
    failed = done = 0
    try:
        for chunk in chunks:
            if len(chunks) > 1:
                say(f"requests {done + 1}-{done + len(chunk)} of {len(pending)}")
            done += len(chunk)
            params = {r.key: _prepare(r, tokenizer, defaults, args.seed, args.tool_call_parser) for r in chunk}
            for req in chunk:
                if req.error:
                    out.append(error_record(fmt, req, req.error))
                    failed += 1
            runnable = [r for r in chunk if not r.error]
            if runnable:
                failed += engine.run(job_lines(args.task, runnable), params, record)
            for req in chunk:  # what the chunk tokenized: its records are written
                req.input_token_ids = None
                if req.prompt is not None or req.messages is not None:
                    req.prompt_token_ids = None
    finally:
        engine.close()
    stats = engine.stats
    _summary(say, len(pending) - failed, failed, out.errors, stats, args.output,
             _ran(engine.policy, stats, fitted=not args.policy) if stats else None)
    return 1 if failed + out.errors else 0


class _JobEngine:
    """The job's engine: built for its first chunk of runnable requests (--policy auto plans for
    those), run chunk after chunk; `stats` the chunks' together (a Ray job runs as one chunk)."""

    def __init__(self, args, say, opened):
        self.args, self.say, self.opened = args, say, opened
        self.llm = self.policy = self.stats = None

    def run(self, lines, params: dict, record) -> int:
        """Error records written for `lines`' requests."""
        if self.args.ray:
            stats, self.policy, failed = _run_on_ray(self.args, lines, params, record, self.say, self.opened)
            self._add(stats)
            return failed
        if self.llm is None:
            self.llm, self.policy = build_llm(self.args, _workload(self.args, lines, params), opened=self.opened)
            self.say(f"policy: {describe_policy(self.policy, fitted=not self.args.policy)}")
            self.say(f"device: {self.llm.engine.device}, {str(self.llm.engine.dtype).removeprefix('torch.')}")
        failed = sum(run_lines(self.llm, lines, params, record, use_tqdm=not self.args.quiet,
                               lora_modules=lora_modules(self.args)))
        self._add(self.llm.last_stats)
        return failed

    def _add(self, stats: dict) -> None:
        """The chunks' statistics together: counts and seconds summed, memory and running as last."""
        if self.stats is None:
            self.stats = dict(stats)
            return
        for key in ("requests", "failed", "prompt_tokens", "generated_tokens", "passes", "seconds",
                    "prefill_tokens_computed", "preemptions", "prefix_cache_hit_tokens"):
            if key in stats:
                self.stats[key] = self.stats.get(key, 0) + stats[key]
        self.stats.update(memory=stats["memory"], running=stats.get("running"),
                          tokens_per_s=self.stats["generated_tokens"] / (self.stats["seconds"] or 1e-9))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()


def _job_task(pending: list[BatchRequest]) -> str:
    """"embed" where the job's first runnable line is a /v1/embeddings one, else "generate": one
    engine runs a job, so each line of the other kind is an error record (OpenAI's batches hold
    one endpoint too)."""
    first = next((r for r in pending if not r.error), None)
    if first is None:
        return "generate"
    task = "embed" if first.embedding is not None else "generate"
    for req in pending:
        if not req.error and (req.embedding is not None) != (task == "embed"):
            other = "a request for text" if task == "embed" else "an embedding request"
            req.error = (f"line {req.line}: this job {'embeds' if task == 'embed' else 'generates text'} (as its "
                         f"first request, line {first.line}, asks): {other} goes in a file of its own")
    return task


def _run_on_ray(args, lines, params: dict, record, say, opened):
    """(stats, policy, error records written): the same requests on Ray Data actors; the policy
    is searched here, once, and every actor builds its LLM with it (and opens the model itself:
    `opened` is this process's)."""
    from flexsarathi.ray.job import RayJobError, RayOptions, run_requests
    from flexsarathi.ray.spec import EngineSpec

    hardware = hardware_of(args)
    policy = resolve_policy(args, hardware, _workload(args, lines, params))
    say(f"policy: {describe_policy(policy, fitted=not args.policy)}")
    spec = EngineSpec.of(args.model, policy, hardware=hardware, dtype=args.dtype, device=args.device,
                         offload_dir=args.offload_dir, cpu_matmul=args.cpu_matmul, compress_head=args.compress_head,
                         fit_running=not args.policy, task=args.task,
                         enable_prefix_caching=args.enable_prefix_caching, lora=args.lora,
                         enable_lora=bool(lora_modules(args)))
    options = RayOptions(address=args.ray_address, actors=args.ray_actors or 1,
                         gpus_per_actor=args.ray_gpus_per_actor or 0, cpus_per_actor=args.ray_cpus_per_actor or 1,
                         batch_size=args.ray_batch_size)
    failed = 0

    def on_output(index: int, output) -> None:
        nonlocal failed
        done = lines.add(index, output)
        if done is not None:
            failed += record(*done)

    try:
        prompts = lines.prompts()
        adapters = lines.lora_requests(lora_modules(args)) or [None] * len(prompts)
        stats = run_requests(spec, options, list(zip(prompts, lines.params(params), adapters)), on_output,
                             say=say, progress=not args.quiet)
    except RayJobError as exc:
        raise PartialJobError(str(exc)) from None
    return stats, policy, failed


def _prepare(req: BatchRequest, tokenizer, defaults: dict, seed: int,
             tool_parser: str | None = None) -> SamplingParams | None:
    """The request's SamplingParams, its prompt as token ids; sets req.error where it cannot run.
    tool_parser: the format a reply's tool calls are read in (None: the one the chat template teaches)."""
    if req.error:
        return None
    if req.embedding is not None:
        return _prepare_embedding(req, tokenizer)
    try:
        fields = {**defaults, **req.sampling}
        fields.setdefault("seed", None)
        if fields["seed"] is None:
            fields["seed"] = request_seed(seed, req.key)
        params = SamplingParams(**fields)
        if req.messages is not None:
            if tokenizer is None:
                raise FlexSarathiError("this model has no tokenizer.json, so no chat template")
            if req.tools is not None:
                req.tools = req.tools.with_parser(tool_parser, tokenizer.chat_template)
            req.harmony = speaks_harmony(tokenizer.chat_template) or (req.tools is not None and
                                                                      req.tools.parser == "harmony")
            if req.reasoning_effort is not None and "reasoning_effort" not in (tokenizer.chat_template or ""):
                raise FlexSarathiError("body.reasoning_effort is handed to the chat template, and this model's "
                                       "does not read it")
            req.prompt_token_ids = tokenizer.apply_chat_template(
                req.messages, **req.chat_options, tools=list(req.tools.tools) if req.tools else None)
        elif req.prompt is not None:
            if tokenizer is None:
                raise FlexSarathiError("the prompt is text, but this model has no tokenizer.json: give "
                                       "\"prompt_token_ids\"")
            req.prompt_token_ids = tokenizer.encode(req.prompt)
        return params
    except (FlexSarathiError, TypeError) as exc:
        req.error = f"line {req.line}: {exc}"
        return None


def _prepare_embedding(req: BatchRequest, tokenizer) -> PoolingParams | None:
    """An embedding line's PoolingParams, its inputs as token ids; sets req.error where it cannot run."""
    try:
        ids = []
        for k, item in enumerate(req.embedding.inputs):
            if isinstance(item, str) and tokenizer is None:
                raise FlexSarathiError(f"input {k} is text, but this model has no tokenizer.json: give token ids")
            try:
                ids.append(tokenizer.encode(item) if isinstance(item, str) else item)
            except FlexSarathiError as exc:
                raise FlexSarathiError(f"input {k}: {exc}") from None
        req.input_token_ids = ids
        return PoolingParams(dimensions=req.embedding.dimensions, normalize=req.embedding.normalize)
    except FlexSarathiError as exc:
        req.error = f"line {req.line}: {exc}"
        return None


def _workload(args, lines, params: dict):
    """The job's lengths, for --policy auto, as the engine will run them: a prompt longer than the
    model's context is refused by the engine (that line's error record), so it is left out, and an
    output is cut where prompt + output reach the context (an embedding's is its one pooled row).
    None (the planner's default workload) when no request can run. Only read with --policy auto."""
    if args.policy != "auto":
        return None
    from policy_search import ModelSpec, Workload

    context = ModelSpec.from_name(args.model).max_positions
    pairs = []
    for ids, p in zip(lines.prompts(), lines.params(params)):
        prompt = len(ids["prompt_token_ids"] if isinstance(ids, dict) else ids)  # a salted line's: a dict
        if isinstance(p, PoolingParams):
            pairs += [(prompt, 1)] if prompt <= context else []
        elif prompt < context:
            # n completions share one prefill and the prompt's KV: the others are planned as
            # 1-token prompts (their own KV is about their outputs; their decode attention,
            # over the shared prompt too, is undercounted).
            gen = context - prompt if p.max_tokens is None else min(p.max_tokens, context - prompt)  # None: to the end
            pairs += [(prompt, gen)] + [(1, gen)] * (p.n - 1)
    if not pairs:
        return None
    return Workload(pairs=tuple(pairs), num_requests=len(pairs))


def _recorder(fmt: str, out: ResultFile, tokenizer, model: str):
    """record(request, output) -> 1 when it appended an error record, else 0: one output as it
    finishes, wherever it ran (this process or a Ray actor)."""
    decode = tokenizer.decode if tokenizer else None

    def record(req: BatchRequest, output) -> int:
        """output: a RequestOutput, or an embedding line's EmbeddingRequestOutputs (one per input)."""
        outputs = output if isinstance(output, list) else [output]
        k, failed = next(((k, o) for k, o in enumerate(outputs) if o.error is not None), (0, None))
        if failed is not None:
            # refused: before any pass (the request's fault: its prompt, a sampling value the model
            # cannot take, a grammar that does not compile); else it failed in a pass (non-finite logits)
            error = re.sub(r"^prompt \d+: ", "", failed.error) if len(outputs) > 1 else failed.error
            where = f"line {req.line}: input {k}" if len(outputs) > 1 else f"line {req.line}"
            message = re.sub(r"^prompt \d+", f"{where}: prompt", error) \
                if re.match(r"prompt \d+", error) else f"{where}: {error}"
            out.append(error_record(fmt, req, message, "invalid_request" if failed.refused else "generation_failed"))
            return 1
        if not isinstance(output, list):
            output.prompt = req.prompt
        out.append(result_record(fmt, req, output, req.lora or model, decode))
        return 0

    return record


def _ran(policy, stats: dict, fitted: bool) -> str:
    """The policy as it ran: a fitted running set's size as the batch had it (one process; Ray's
    actors fit their own)."""
    running = stats.get("running")
    return describe_policy(policy, fitted) + (f"; {running} running" if fitted and running else "")


def _summary(say, ok: int, failed: int, earlier_errors: int, stats: dict | None, output: str,
             policy: str | None) -> None:
    """earlier_errors: the error records the file held before this run (they count in the exit code)."""
    earlier = f"; the file also holds {earlier_errors} error records of earlier runs" if earlier_errors else ""
    say(f"done: {ok} ok, {failed} failed{earlier} -> {output}")
    if not stats:
        return
    seconds = stats["seconds"]
    if stats["generated_tokens"] or not stats["prompt_tokens"]:
        say(f"tokens: {stats['prompt_tokens']} prompt, {stats['generated_tokens']} generated in {seconds:.2f} s "
            f"({stats['passes']} passes): {stats['tokens_per_s']:.2f} generated tok/s, "
            f"{(stats['prompt_tokens'] + stats['generated_tokens']) / (seconds or 1e-9):.2f} total tok/s")
    else:  # an embedding job: prompts only
        say(f"tokens: {stats['prompt_tokens']} prompt (embedded) in {seconds:.2f} s ({stats['passes']} passes): "
            f"{stats['prompt_tokens'] / (seconds or 1e-9):.2f} prompt tok/s")
    if stats.get("prefix_cache_hit_tokens"):
        say(f"prefix cache: {stats['prefix_cache_hit_tokens']} tokens found cached, not computed")
    say(f"policy: {policy}")
    say(f"peak memory: {memory_summary(stats['memory'])}")
