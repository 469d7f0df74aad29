"""`flexsarathi <command>` (also `python -m flexsarathi`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from flexsarathi.cli.bench import add_bench_parser
from flexsarathi.cli.engine_args import add_compute_args, add_dtype_arg
from flexsarathi.cli.generate import add_generate_parser
from flexsarathi.cli.inspect_model import add_inspect_parser
from flexsarathi.cli.console import quiet_stderr_when_gone, show_warnings_as_lines, silence_stdout, stdout_is_closed
from flexsarathi.cli.file_checks import check_folder, check_output_file, positive_int, read_text_file
from flexsarathi.formats.hub import resolve_model
from flexsarathi.cli.policy import add_policy_parser
from flexsarathi.errors import FlexSarathiError
from flexsarathi.serve.command import add_serve_parser
from offload.disk_store import OffloadError
from offload.memory import MemoryBudgetError
from policy_search.errors import InfeasibleError, SolverMissingError, SpecError
from policy_search.model_registry import is_registered
from policy_search.policy import PolicyError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_compute_args(p)
    p.add_argument("--policy", default=None, help="policy JSON (from `flexsarathi policy --json`)")


def _engine_llm(args):
    """The LLM of `demo` / `perplexity`: every flag of _add_engine_args honoured."""
    from flexsarathi import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, policy=args.policy, cpu_matmul=args.cpu_matmul,
               compress_head=args.compress_head, cuda_graphs=False if args.no_cuda_graphs else None)


DEMO_PROMPT_LEN = 64


def _cmd_demo(args) -> int:
    import random

    from flexsarathi import SamplingParams

    print(f"loading {args.model} ...", flush=True)
    llm = _engine_llm(args)
    vocab, context = llm.engine.config.vocab_size, llm.engine.config.max_position_embeddings
    if (args.prompt_len or 0) >= context:  # the engine would name "prompt 0", not the flag
        raise FlexSarathiError(f"--prompt-len {args.prompt_len} leaves no room to generate in the model's context "
                               f"of {context} tokens")
    rng = random.Random(0)
    if llm.tokenizer is not None and args.prompt_len is None:  # text prompts, as many as asked
        texts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a bird"]
        prompts = [texts[i % len(texts)] for i in range(args.num_prompts)]
    else:  # random token ids: dummy weights have no tokenizer, and --prompt-len asks for a length
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len or DEMO_PROMPT_LEN)]
                   for _ in range(args.num_prompts)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                   ignore_eos=True))
    for out in outputs:
        shown = repr(out.text) if llm.tokenizer else f"{out.token_ids[:12]}..."
        print(f"[{out.request_id}] prompt {len(out.prompt_token_ids)} tokens -> {shown} ({out.finish_reason})")
    s = llm.last_stats
    print(f"{s['generated_tokens']} tokens in {s['seconds']:.2f} s over {s['passes']} passes: "
          f"{s['tokens_per_s']:.1f} tokens/s ({llm.engine.device}, {llm.engine.dtype})")
    return 0


def _cmd_perplexity(args) -> int:
    from flexsarathi.cli.perplexity import perplexity, split_documents

    text = read_text_file(args.text, "--text")
    llm = _engine_llm(args)
    result = perplexity(llm, split_documents(text, args.separator), stride=args.stride,
                        use_tqdm=not args.quiet)
    print(json.dumps({"model": args.model, "text": args.text, **result}))
    return 0


def _cmd_profile(args) -> int:
    from flexsarathi.machine.dtype_choice import is_auto
    from flexsarathi.engine.llm_engine import DEFAULT_OFFLOAD_DIR, resolve_device
    from flexsarathi.models.model_config import parse_dtype
    from flexsarathi.llm import LLM
    from flexsarathi.machine.profiler import profile_machine

    check_output_file(args.output, "--output")
    device = resolve_device(args.device)
    offload_dir = args.offload_dir or DEFAULT_OFFLOAD_DIR
    check_folder(offload_dir, "--offload-dir")
    dtype = None if is_auto(args.dtype) else parse_dtype(args.dtype, "--dtype")  # None: the engine's
    # The layer whose matmuls and attention are timed: the model's own where the user names it (rates
    # depend on the shapes: a small layer's matmuls run further from the machine's peak).
    model = None
    if args.model is not None:
        from flexsarathi.engine.planner_spec import planner_model_spec

        model = planner_model_spec(args.model, dtype)
    spec = profile_machine(offload_dir, LLM, dtype=dtype, disk_bytes=args.disk_mib << 20, model=model,
                           log=lambda line: print(line, file=sys.stderr, flush=True), device=device)
    spec.save(args.output)
    print(f"wrote {args.output}: {spec.describe()}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error of the command line (subcommand parsers
    are made by add_parser with the parent's class, so they inherit this)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flexsarathi", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate from a few prompts and print tokens/s")
    demo.add_argument("--model", default="dummy:opt-125m", help="checkpoint folder, dummy:<name> or a Hugging Face "
                      "repo")
    demo.add_argument("--num-prompts", type=positive_int, default=8)
    demo.add_argument("--prompt-len", type=positive_int, default=None,
                      help=f"random token-id prompts of this length (default: text prompts where the model has a "
                           f"tokenizer, else {DEMO_PROMPT_LEN} tokens)")
    demo.add_argument("--max-tokens", type=positive_int, default=32)
    _add_engine_args(demo)
    demo.set_defaults(func=_cmd_demo)

    ppl = sub.add_parser("perplexity", help="perplexity of a text file (JSON line)")
    ppl.add_argument("--model", required=True, help="checkpoint folder with tokenizer.json, or a Hugging Face repo")
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--separator", default=None, help="document separator, e.g. '<|endoftext|>'")
    ppl.add_argument("--stride", type=positive_int, default=None,
                     help="tokens a window moves on: documents longer than the model's context are "
                          "scored in windows of the context; each token is scored once, in the "
                          "window that gives it the most history (default: half the context)")
    ppl.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_args(ppl)
    ppl.set_defaults(func=_cmd_perplexity)

    prof = sub.add_parser("profile", help="measure this machine into a hardware JSON for --hardware")
    prof.add_argument("--output", "-o", default="hardware_profile.json")
    prof.add_argument("--offload-dir", default=None, help="folder whose disk is measured")
    prof.add_argument("--disk-mib", type=positive_int, default=512, help="size of the disk test file")
    prof.add_argument("--model", default=None, help="whose layer shapes the matmuls and attention are measured "
                      "on: a registered name (llama-2-7b), a checkpoint folder, a .gguf file or a Hugging Face repo "
                      "(default: opt-1.3b's)")
    add_dtype_arg(prof)  # measured in the dtype the engine computes in
    prof.add_argument("--device", default=None, help="the engine's compute device: cpu or cuda (default: cuda when "
                      "available); cpu profiles the host as the compute tier even where there is a GPU")
    prof.set_defaults(func=_cmd_profile)

    add_policy_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_inspect_parser(sub)
    add_serve_parser(sub)
    return parser


PLANNING_COMMANDS = ("policy", "profile")  # they read a model's shapes, not its weights


def _local_model(args) -> str:
    """args.model as a local path: a Hugging Face repo name resolved into its cache (fetched where
    missing). The planning commands take a registered name (`opt-30b`, `facebook/opt-30b`) as it is
    and fetch of a repo only what decides the plan (a full-precision checkpoint's config.json)."""
    plans = args.command in PLANNING_COMMANDS
    if plans and is_registered(args.model):
        return args.model
    return resolve_model(args.model, getattr(args, "gguf_file", None), config_only=plans)


USER_ERRORS = (FlexSarathiError, PolicyError, SpecError, InfeasibleError, SolverMissingError, MemoryBudgetError,
               OffloadError)


# An unexpected failure (a bug): sysexits.h's EX_SOFTWARE, apart from 1 (`generate`: some requests
# got error records, the job ran to its end) and 2 (bad input), so a script can tell them apart.
EXIT_CRASH = 70


def main(argv: list[str] | None = None) -> int:
    """Every failure ends in one `error: ...` line on stderr: exit 2 for bad input and for files
    or folders that cannot be used, EXIT_CRASH for an unexpected failure (its traceback only with
    FLEXSARATHI_TRACEBACK=1), 130 when interrupted. A stderr whose reader is gone ends nothing."""
    with quiet_stderr_when_gone():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:  # from the parsing on: a Ctrl-C while the parser is built is "interrupted" too
        args = build_parser().parse_args(argv)
        show_warnings_as_lines()
        if getattr(args, "model", None) is not None:  # a Hugging Face repo -> its local folder or GGUF file
            args.model = _local_model(args)
            if getattr(args, "lora", None):  # an adapter's hub name, fetched like a model's
                args.lora = resolve_model(args.lora)
        return args.func(args)
    except USER_ERRORS as exc:
        return _fail(f"error: {_one_line(exc)}", 2)
    except BrokenPipeError as exc:
        if not stdout_is_closed():  # another pipe (a subprocess, a socket) broke: an error
            return _fail(f"error: {exc.strerror or exc}", 2)
        silence_stdout()  # stdout's reader stopped reading (`| head`): no error, as for Unix tools
        return 0
    except OSError as exc:  # a file or folder the checks could not foresee (disk full, removed)
        where = f" ({exc.filename})" if exc.filename else ""
        return _fail(f"error: {exc.strerror or exc}{where}", 2)
    except KeyboardInterrupt:
        return _fail("error: interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - never a traceback on the command line
        if os.environ.get("FLEXSARATHI_TRACEBACK"):
            raise
        return _fail(f"error: unexpected {type(exc).__name__}: {_one_line(exc)} (a bug: rerun with "
                     f"FLEXSARATHI_TRACEBACK=1 and report the traceback)", EXIT_CRASH)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _fail(line: str, code: int) -> int:
    print(line, file=sys.stderr, flush=True)
    return code
