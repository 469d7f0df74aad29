"""`flexsarathi policy`: search the best offloading policy for a model, machine and workload, print
its placement, batch sizes, predicted throughput, peak memory per tier and bounding resource, and
optionally write the policy JSON that `LLM(..., policy=...)` and `--policy` accept.

A thin layer over `policy_search` (the planner); registered by flexsarathi/cli/main.py.
"""
from __future__ import annotations

import argparse
import sys

from flexsarathi.cli.engine_args import add_compress_head_arg, add_dtype_arg
from flexsarathi.cli.console import say
from flexsarathi.cli.file_checks import check_output_file, gib, positive_gib
from policy_search import (HardwareSpec, InfeasibleError, Policy, PolicyError, SpecError,
                           Workload, estimate, format_report, search_detailed, write_policy_file)
from policy_search.hardware import PRESETS
from policy_search.hf_config import dtype_name
from policy_search.units import GiB


def add_policy_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "policy", help="search the best offloading policy and print its estimate",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="checkpoint folder with config.json, a registered name (opt-30b), dummy:<name> or a "
                        "Hugging Face repo (org/name[@revision]; of a full-precision one only its JSON files "
                        "are fetched)")
    p.add_argument("--hardware", default="t4",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON profile from `flexsarathi profile`")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--workload", default=None,
                   help="file of (prompt_len, gen_len) pairs, a distribution (overrides the two above)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests in the run (default: an unbounded stream, steady state)")
    for tier in ("gpu", "cpu", "disk"):
        p.add_argument(f"--{tier}-mem", type=positive_gib if tier == "gpu" else gib, default=None, metavar="GIB",
                       help=f"{tier.upper() if tier != 'disk' else 'disk'} capacity in GiB "
                            "(overrides the hardware's)")
    p.add_argument("--scheduler", choices=("decode-maximal", "block"), default=None,
                   help="search only this scheduler (default: both)")
    for knob, what in (("compress-weight", "4-bit weights"), ("compress-kv", "4-bit KV cache"),
                       ("cpu-attention", "decode attention on the CPU"),
                       ("routed-expert-reads", "reading only the routed experts (MoE)"),
                       ("cpu-experts", "computing cpu-tier experts on the CPU (MoE)")):
        p.add_argument(f"--{knob}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"force {what} on or off (default: searched)")
    p.add_argument("--gpu-batch-size", type=int, default=None, help="fix the micro-batch size")
    p.add_argument("--num-gpu-batches", type=int, default=None, help="fix the micro-batch count")
    add_dtype_arg(p)  # what the engine computes in: the bytes per weight, KV and activation value
    add_compress_head_arg(p)  # priced as the engine holds it: an untied head in the weight format
    p.add_argument("--policy", default=None,
                   help="estimate this policy JSON instead of searching")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="write {policy, estimate} here (what --policy and LLM(policy=...) load)")
    p.set_defaults(func=run_policy)
    return p


def _specs(args):
    """(PlannedModel, HardwareSpec, Workload) of the arguments."""
    from flexsarathi.engine.planner_spec import planned_model
    from flexsarathi.machine.dtype_choice import is_auto

    hardware = HardwareSpec.resolve(args.hardware)
    hardware = hardware.with_memory(**{tier: None if value is None else value * GiB for tier, value in (
        ("gpu", args.gpu_mem), ("cpu", args.cpu_mem), ("disk", args.disk_mem))})
    if not is_auto(args.dtype):
        dtype_name(args.dtype, "--dtype")  # a bad name is one error naming the flag
    # The engine's dtype on the planned machine (auto: a half dtype on a GPU, this machine's measured
    # choice on a CPU profile), not on this one; a pre-quantized checkpoint priced in its own format.
    planned = planned_model(args.model, args.dtype, device="cpu" if hardware.compute_on_host else "cuda",
                            compress_head=args.compress_head)
    if args.compress_head and planned.spec.tie_embeddings:  # the engine refuses it: so does its plan
        raise SpecError(f"--compress-head: {planned.spec.name} has no LM head of its own (its head is its "
                        "tied input embeddings)")
    if args.workload:
        workload = Workload.from_file(args.workload, num_requests=args.num_requests)
    else:
        workload = Workload(prompt_len=args.prompt_len, gen_len=args.gen_len,
                            num_requests=args.num_requests)
    return planned, hardware, workload


def run_policy(args) -> int:
    if args.json:
        check_output_file(args.json, "--json")  # before the search, not after it
    try:
        planned, hardware, workload = _specs(args)
        model = planned.spec
        report = []  # printed once the JSON is written: a reader that stops early loses no file
        if args.policy:
            policy = Policy.load(args.policy)
            est = estimate(policy, model, hardware, workload)
            report.append(format_report(policy, est, model, hardware, workload,
                                        title=f"Estimate of {args.policy} for {model.name} on {hardware.name} "
                                              f"({workload.describe()})"))
        else:
            constraints = {name: value for name, value in (
                ("scheduler", args.scheduler), ("compress_weight", args.compress_weight),
                ("compress_kv", args.compress_kv), ("cpu_attention", args.cpu_attention),
                ("routed_expert_reads", args.routed_expert_reads), ("cpu_experts", args.cpu_experts),
                ("gpu_batch_size", args.gpu_batch_size), ("num_gpu_batches", args.num_gpu_batches))
                if value is not None}
            result = search_detailed(model, hardware, workload, **planned.search_constraints(constraints))
            policy, est = result.policy, result.estimate
            report += [format_report(policy, est, model, hardware, workload), ""]
            report += [f"best {scheduler:<15} {best.throughput:10.3f} tokens/s"
                       for scheduler, (_, best) in sorted(result.best_by_scheduler.items())]
            report.append(f"searched {result.lps_solved} placement LPs in {result.seconds:.2f} s"
                          + ("" if result.complete else " (stopped at the LP limit: best found so far)"))
        if args.json:
            write_policy_file(args.json, policy, est, model, hardware, workload)
            report.append(f"wrote {args.json}")
        for line in report:
            say(line)
    except (SpecError, InfeasibleError, PolicyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
