"""`flexsarathi <command>` (also `python -m flexsarathi`)."""
from __future__ import annotations

import argparse
import json
import sys

from flexsarathi.cli_bench import add_bench_parser
from flexsarathi.cli_generate import add_generate_parser
from flexsarathi.cli_policy import add_policy_parser
from flexsarathi.errors import FlexSarathiError
from offload.disk_store import OffloadError
from offload.memory import MemoryBudgetError
from policy_search.errors import InfeasibleError, SpecError
from policy_search.policy import PolicyError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default=None, help="compute dtype: float32, float16, bfloat16 "
                   "(default: float32 on CPU, the checkpoint's half dtype on GPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--policy", default=None, help="policy JSON (from `flexsarathi policy --json`)")


def _cmd_demo(args) -> int:
    import random

    from flexsarathi import LLM, SamplingParams

    print(f"loading {args.model} ...", flush=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, policy=args.policy)
    vocab = llm.engine.config.vocab_size
    rng = random.Random(0)
    if llm.tokenizer is not None:
        prompts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a bird"]
    else:  # dummy weights have no tokenizer: prompts are token ids
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
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
    from flexsarathi import LLM
    from flexsarathi.perplexity import perplexity, split_documents

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise FlexSarathiError(f"cannot read --text {args.text}: {exc.strerror}") from None
    llm = LLM(args.model, dtype=args.dtype, device=args.device, policy=args.policy)
    result = perplexity(llm, split_documents(text, args.separator), use_tqdm=not args.quiet)
    print(json.dumps({"model": args.model, "text": args.text, **result}))
    return 0


def _cmd_profile(args) -> int:
    from flexsarathi.engine import DEFAULT_OFFLOAD_DIR
    from flexsarathi.profiler import profile_machine

    spec = profile_machine(args.offload_dir or DEFAULT_OFFLOAD_DIR, disk_bytes=args.disk_mib << 20,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    spec.save(args.output)
    print(f"wrote {args.output}: {spec.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexsarathi", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate from a few prompts and print tokens/s")
    demo.add_argument("--model", default="dummy:opt-125m", help="checkpoint folder or dummy:<name>")
    demo.add_argument("--num-prompts", type=int, default=8)
    demo.add_argument("--prompt-len", type=int, default=64)
    demo.add_argument("--max-tokens", type=int, default=32)
    _add_engine_args(demo)
    demo.set_defaults(func=_cmd_demo)

    ppl = sub.add_parser("perplexity", help="perplexity of a text file (JSON line)")
    ppl.add_argument("--model", required=True, help="checkpoint folder with tokenizer.json")
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--separator", default=None, help="document separator, e.g. '<|endoftext|>'")
    ppl.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_args(ppl)
    ppl.set_defaults(func=_cmd_perplexity)

    prof = sub.add_parser("profile", help="measure this machine into a hardware JSON for --hardware")
    prof.add_argument("--output", "-o", default="hardware_profile.json")
    prof.add_argument("--offload-dir", default=None, help="folder whose disk is measured")
    prof.add_argument("--disk-mib", type=int, default=512, help="size of the disk test file")
    prof.set_defaults(func=_cmd_profile)

    add_policy_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FlexSarathiError, PolicyError, SpecError, InfeasibleError, MemoryBudgetError, OffloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
