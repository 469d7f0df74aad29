#!/usr/bin/env python
"""FlexSarathi against FlexGen itself on one CUDA GPU, with T4 memory caps (prints; asserts nothing).

    python scripts/bench_flexgen_gpu.py                       # every case below
    python scripts/bench_flexgen_gpu.py --cases opt-6.7b      # the cases of one model
    python scripts/bench_flexgen_gpu.py --cases opt-6.7b/all-gpu --skip-flexgen
    python scripts/bench_flexgen_gpu.py --plan-only --cpu-gib 108   # no GPU: what the planner expects

--plan-only needs no GPU: each of our runs' policy (FlexGen's, the searched one), the planner's
predicted tok/s and its memory check, on the hardware the run would get (--cpu-gib: the GPU
machine's CPU tier; --profile: its measured rates). Otherwise needs a CUDA GPU and, for the baseline, the `flexgen` package (pip install flexgen==0.1.8: FlexGen's
own `flexgen.flex_opt`). Each run is its own process (a clean CUDA context and pinned-memory state),
FlexGen's and ours one after the other for each case, so the ratio is taken on the same machine
minutes apart. The table's last column is ours / FlexGen; every figure is FlexGen's definition:
generated tokens / (prefill + decode seconds) of one measured run after a warm-up.

Cases: FlexGen's published T4 policies for prompt 512 / output 32 (benchmark/flexgen/bench_suite.py
of the FlexGen repository), dummy weights (`--path _DUMMY_` there, `dummy:<model>` here):
* opt-6.7b/all-gpu: `--percent 100 0 100 0 100 0 --gpu-batch-size 2 --overlap False`;
* opt-6.7b/4bit: the same placement, `--gpu-batch-size 72 --compress-weight --compress-cache`;
* opt-30b/cpu-weights: `--percent 20 80 0 100 0 100 --gpu-batch-size 48 --num-gpu-batches 1
  --cpu-cache-compute`: FlexGen's ablation-suite policy. Its headline policy (3 GPU batches of 48)
  keeps 108 GB of KV cache on the host beside 48 GB of weights: more than a 128 GiB machine has.
Ours runs the same policy (block schedule, as FlexGen; and decode-maximal on the same engine), and
the policy our planner searches for the t4 preset (`policy="auto"`). Our engine holds itself to a
T4's memory, the whole of it for FlexGen's policies and the searched one alike (15 GiB: the 15360 MiB
CUDA reports on a T4, where FlexGen ran them; its 6.7B all-GPU policy needs 13 GB, over the
planner's default 80% rule), so the search is compared with FlexGen's policies at the same budget.
The a100-80g case keeps that preset as a user gets it. CPU: the preset's
208 GiB or 85% of this machine's RAM, the smaller. FlexGen has no caps: it uses what its policy asks
for. The report names the GPU that ran.

FlexGen asks the Hugging Face hub for OPT's tokenizer only to turn its fixed prompt ("Paris is the
capital city of", left-padded to the prompt length) into ids; there is no hub here, so the wrapper
gives it those ids (seven ids below OPT's vocabulary, padded with OPT's pad id 1). With dummy
weights the ids do not change the work.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness  # puts the repository root on sys.path

REPO = Path(__file__).resolve().parents[1]

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from flexsarathi.machine.profiler import _host_memory  # noqa: E402
from policy_search import Policy  # noqa: E402
from policy_search.flexgen_placement import flexgen_weight_fields  # noqa: E402
from policy_search.units import GiB  # noqa: E402

T4_CUDA_GIB = 15.0  # a 16 GB T4 as CUDA reports it: 15360 MiB


@dataclass(frozen=True)
class Case:
    name: str  # model/policy
    model: str  # registered name, e.g. opt-6.7b
    flexgen_args: tuple[str, ...] | None  # FlexGen's flags for this policy (None: ours only)
    policy: Policy | None  # the same policy in our fields (None: only the searched one)
    ours_auto: bool = True  # also run the policy our planner searches for `hardware`
    schedulers: tuple[str, ...] = field(default=("block", "decode-maximal"))
    hardware: str = "t4"  # the preset whose memory caps our engine
    auto_4bit: bool = False  # search among 4-bit-weight policies only
    requests: int = 0  # a closed workload of this many requests for the search (0: a steady stream)
    # the searched policy's run: a closed batch of this many requests, searched for as one (0: requests);
    # FlexGen's best run on the model has that many (its block), so both runs serve the same batch
    searched_requests: int = 0


def flexgen_case(name: str, model: str, percent: tuple[int, ...], gbs: int, ngb: int = 1, cpu_attention=False,
                 overlap=True, compress=False, **options) -> Case:
    """A FlexGen policy given once: its `flex_opt` flags and the same policy in our fields (weights:
    the bytes FlexGen's rule places, flexgen_weight_fields)."""
    args = ("--percent", *map(str, percent), "--gpu-batch-size", str(gbs), "--num-gpu-batches", str(ngb),
            "--overlap", str(overlap))
    args += ("--cpu-cache-compute",) * cpu_attention + ("--compress-weight", "--compress-cache") * compress
    _, _, kv_gpu, kv_cpu, act_gpu, act_cpu = (p / 100 for p in percent)
    policy = Policy(gpu_batch_size=gbs, num_gpu_batches=ngb, **flexgen_weight_fields(model, percent[0], percent[1]),
                    kv_gpu=kv_gpu, kv_cpu=kv_cpu, kv_disk=1 - kv_gpu - kv_cpu, act_gpu=act_gpu, act_cpu=act_cpu,
                    act_disk=1 - act_gpu - act_cpu, cpu_attention=cpu_attention, overlap=overlap,
                    compress_weight=compress, compress_kv=compress, scheduler="block")
    return Case(name, model, args, policy, **options)


CASES = [
    flexgen_case("opt-6.7b/all-gpu", "opt-6.7b", (100, 0, 100, 0, 100, 0), 2, overlap=False, searched_requests=72),
    flexgen_case("opt-6.7b/4bit", "opt-6.7b", (100, 0, 100, 0, 100, 0), 72, overlap=False, compress=True,
                 ours_auto=False),
    flexgen_case("opt-30b/cpu-weights", "opt-30b", (20, 80, 0, 100, 0, 100), 48, cpu_attention=True,
                 searched_requests=48),
    # FlexGen runs OPT only: ours alone, 4-bit weights (codes drawn, as scripts/bench_70b.py) on A100-80GB caps
    # (64 requests: the steady-stream policy runs 4096 sequences at once, minutes of prefill alone)
    Case("llama-2-70b/4bit", "llama-2-70b", None, None, hardware="a100-80g", auto_4bit=True, requests=64),
]

# FlexGen's own entry point with the tokenizer replaced (no hub here); argv: FlexGen's flags.
FLEXGEN_MAIN = """
import argparse, sys
import flexgen.flex_opt as flex_opt

class Ids:  # what FlexGen reads of a tokenizer's output
    def __init__(self, input_ids): self.input_ids = input_ids

class FixedPromptTokenizer:
    PROMPT_IDS = [2, 32826, 16, 5, 812, 343, 9]  # stand-ins for "</s>Paris is the capital city of"
    pad_token_id = 1  # OPT's
    def __call__(self, prompts, padding, max_length):
        pad = [self.pad_token_id] * (max_length - len(self.PROMPT_IDS))
        return Ids([pad + self.PROMPT_IDS for _ in prompts])  # left padding, as FlexGen asks

class NoHub:
    @staticmethod
    def from_pretrained(*args, **kwargs): return FixedPromptTokenizer()

flex_opt.AutoTokenizer = NoHub
parser = argparse.ArgumentParser()
flex_opt.add_parser_arguments(parser)
flex_opt.run_flexgen(parser.parse_args(sys.argv[1:]))
"""


def run_flexgen(case: Case, lengths: tuple[int, int], work: Path, *, timeout: float) -> dict:
    log = work / f"flexgen-{case.name.replace('/', '-')}.log"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-c", FLEXGEN_MAIN, "--model", f"facebook/{case.model}", "--path", "_DUMMY_",
            "--offload-dir", str(work / "flexgen_offload"), "--prompt-len", str(lengths[0]),
            "--gen-len", str(lengths[1]), "--log-file", str(log), *case.flexgen_args]
    done = _run(argv, timeout)
    if done.get("error"):
        return done
    fields = {}
    for line in log.read_text().splitlines():
        for part in line.split("\t"):
            key, _, value = part.partition(":")
            fields[key.strip()] = value.strip()
    return {"tok_s": float(fields["total throughput"].split()[0]), "seconds": float(fields["total latency"].split()[0]),
            "peak_gpu": fields.get("peak gpu mem", "?"), "projected": fields.get("projected")}


def run_ours(case: Case, policy: str, schedulers: tuple[str, ...], lengths: tuple[int, int], work: Path,
             cpu_mem_gib: float, *, timeout: float, profile: str | None = None) -> list[dict]:
    """One process: the engine is built once (weights made once) and measured with each scheduler in
    turn (LLMEngine.set_schedule; placement unchanged). policy: a policy file or "auto"."""
    if policy == "auto" and case.auto_4bit:
        policy = "auto-4bit"
    requests = (case.searched_requests or case.requests) if policy.startswith("auto") else case.requests
    argv = [sys.executable, str(Path(__file__).resolve()), "--ours-run", "cuda", case.model, policy, case.hardware,
            profile or "-", f"{cpu_mem_gib:.1f}", str(work / "ours_offload"), str(lengths[0]), str(lengths[1]),
            str(requests), *schedulers]
    done = _run(argv, timeout)
    if done.get("error"):
        return [done]
    return [json.loads(line) for line in done["stdout"].splitlines() if line.startswith("{")]


def ours_run(device: str, model: str, policy: str, preset: str, profile: str, cpu_mem_gib: float, offload_dir: str,
             prompt_len: int, gen_len: int, requests: int, schedulers: list[str]) -> None:
    """`flexsarathi bench`'s protocol on one engine: a warm-up (32-token prompts, two tokens each;
    where decode passes replay CUDA graphs, also one decode pass at the measured prompt length, so
    the graph of the measured shape is captured before the clock starts, as FlexGen's own one-time
    set-up is), then per scheduler one measured run of policy.max_running prompts; one JSON line
    each (with the warm-up's capture time)."""
    from flexsarathi import LLM, SamplingParams
    from flexsarathi.cli.bench import WARMUP_MAX_TOKENS, WARMUP_PROMPT_LEN, _prompts
    from flexsarathi.cli.engine_args import describe_policy, device_name
    from flexsarathi.engine.planner_spec import planned_model
    from policy_search import HardwareSpec, Workload, estimate

    hardware = planned_hardware(preset, profile, cpu_mem_gib)
    workload = Workload(prompt_len=prompt_len, gen_len=gen_len, num_requests=requests or None)
    if policy == "auto-4bit":
        policy = LLM.search_policy(f"dummy:{model}", hardware, workload, "float16", device=device,
                                   compress_weight=True)
    # dummy_weight_codes: 4-bit weights drawn as codes (quantizing 7B-70B random draws on the CPU takes
    # minutes); no effect on uncompressed weights
    with LLM(f"dummy:{model}", enable_prefix_caching=False,
             dtype="float16", device=device, policy=policy, hardware=hardware,
             offload_dir=offload_dir, workload=workload if policy == "auto" else None,
             dummy_weight_codes=True) as llm:
        engine = llm.engine
        count, vocab = requests or engine.policy.max_running, engine.config.vocab_size
        llm.generate(_prompts(count, WARMUP_PROMPT_LEN, vocab, 1),
                     SamplingParams(max_tokens=WARMUP_MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
        if engine.graph_passes:  # one decode pass at the measured shape: its CUDA graph is captured here
            llm.generate(_prompts(count, prompt_len, vocab, 1), SamplingParams(max_tokens=2, temperature=0,
                                                                               ignore_eos=True), use_tqdm=False)
        capture_s = engine.graph_passes.graphs.capture_seconds if engine.graph_passes else 0.0
        spec = planned_model(f"dummy:{model}", "float16", device=device).spec
        # the run measured, priced as it runs: `count` requests (FlexGen's block; the searched policy's
        # closed batch, the workload it was searched for)
        measured = Workload(prompt_len=prompt_len, gen_len=gen_len, num_requests=count)
        for scheduler in schedulers or [engine.policy.scheduler]:
            phases = _measured_run(llm, scheduler, measured, (spec, hardware))
            s = llm.last_stats
            predicted = estimate(engine.policy, spec, hardware, measured).throughput
            print(json.dumps({"scheduler": scheduler, "tok_s": s["tokens_per_s"], "seconds": s["seconds"],
                              "predicted_tok_s": predicted, "planned_with": hardware.name,
                              "policy": describe_policy(engine.policy), "device": device_name(engine.device),
                              "num_prompts": count, "peak_gpu": s["memory"]["gpu"]["peak"],
                              "graph_passes": engine.stats["graph_passes"], "warm_up_capture_s": capture_s,
                              "phases": phases.summary()}), flush=True)


def _measured_run(llm, scheduler: str, measured, planned: tuple) -> "harness.StepPhases":
    """One measured run of the batch `measured` (a Workload) with `scheduler`, timed by phase. Where
    it is one closed batch, decode-maximal runs at the prefill budget the planner (`planned`: spec,
    hardware) picks for it (policy_search/prefill_budget.py: its prompt passes carry no decodes, so fewer,
    larger ones stream or dequantize the weights fewer times), or where the engine's own check of
    the largest pass refuses it (before any work), the next smaller whole-prompt budget."""
    from flexsarathi import SamplingParams
    from flexsarathi.cli.bench import _prompts
    from offload.memory import MemoryBudgetError
    from policy_search.prefill_budget import budget_candidates, closed_batch_prefill_budget

    engine, count, (prompt_len, gen_len) = llm.engine, measured.num_requests, measured.lengths[0]
    budgets = [engine.policy.prefill_budget]
    if scheduler == "decode-maximal":
        chosen = closed_batch_prefill_budget(engine.policy.replace(scheduler=scheduler), *planned, measured)
        budgets = [b for b in reversed(budget_candidates(prompt_len, count)) if b <= chosen] or budgets
    for i, budget in enumerate(budgets):
        engine.set_schedule(scheduler=scheduler, prefill_budget=budget)
        try:
            with harness.StepPhases(engine) as phases:
                llm.generate(_prompts(count, prompt_len, engine.config.vocab_size, 0),
                             SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True), use_tqdm=False)
            return phases
        except MemoryBudgetError as exc:
            if i == len(budgets) - 1:
                raise
            print(f"prefill budget {budget} refused ({exc}); trying {budgets[i + 1]}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable: budgets is never empty")


def planned_hardware(preset: str, profile: str, cpu_mem_gib: float):
    """What our engine and planner run under: this machine's measured rates (a profile; "-": the
    preset's) with the preset's memory, the CPU's capped at cpu_mem_gib; on t4 the whole T4, for
    FlexGen's policies and the search alike (see the docstring)."""
    from policy_search import HardwareSpec

    caps = HardwareSpec.preset(preset)
    base = HardwareSpec.load(profile) if profile != "-" else caps
    hardware = base.with_memory(gpu=caps.gpu_memory, cpu=min(cpu_mem_gib * GiB, caps.cpu_memory))
    if preset == "t4":
        hardware = hardware.replace(memory_usable_fraction=1.0).with_memory(gpu=T4_CUDA_GIB * GiB)
    return hardware


def plan_case(case: Case, lengths: tuple[int, int], cpu_mem_gib: float, profile: str | None,
              schedulers: tuple[str, ...]) -> list[dict]:
    """--plan-only: what the planner predicts for each of our runs of the case (FlexGen's policy per
    scheduler, the searched one) on the hardware they would run under, and whether its memory model
    fits them there: arithmetic only, no GPU (run before a GPU session to see what it will measure)."""
    from flexsarathi import LLM
    from flexsarathi.cli.engine_args import describe_policy
    from flexsarathi.engine.planner_spec import planned_model
    from policy_search import Workload, estimate
    from policy_search.prefill_budget import closed_batch_prefill_budget

    hardware = planned_hardware(case.hardware, profile or "-", cpu_mem_gib)
    searched = Workload(prompt_len=lengths[0], gen_len=lengths[1],
                        num_requests=case.searched_requests or case.requests or None)
    spec = planned_model(f"dummy:{case.model}", "float16", device="cuda").spec
    runs = [(f"ours, FlexGen's policy, {s}", case.policy.replace(scheduler=s))
            for s in (schedulers if case.policy is not None else ())]
    if case.ours_auto:
        constraints = {"compress_weight": True} if case.auto_4bit else {}
        runs.append((f"ours, searched for {case.hardware}", LLM.search_policy(
            f"dummy:{case.model}", hardware, searched, "float16", device="cuda", **constraints)))
    out = []
    for who, policy in runs:
        # what the run measures, decode-maximal over a closed batch at the budget the planner picks
        # for it (as _measured_run does, before the engine's own check)
        priced = searched  # the searched policy: the batch it was searched for (and runs)
        if who.startswith("ours, FlexGen's policy"):  # FlexGen's block
            priced = Workload(prompt_len=lengths[0], gen_len=lengths[1], num_requests=policy.max_running)
        policy = policy.replace(prefill_budget=closed_batch_prefill_budget(policy, spec, hardware, priced))
        est = estimate(policy, spec, hardware, priced)
        out.append({"case": case.name, "who": who, "predicted_tok_s": est.throughput, "fits": est.fits,
                    "over_budget": est.over_budget,
                    "peak_gpu_gib": est.peak_memory["gpu"] / GiB, "gpu_budget_gib": est.budgets["gpu"] / GiB,
                    "bound": est.bound, "policy": describe_policy(policy), "planned_with": hardware.name})
    return out


def chosen_cases(names: list[str] | None) -> list[Case]:
    """The cases named (a case's name or its model's), in the order named: a short GPU lease runs
    the first first. None: every case."""
    if not names:
        return list(CASES)
    chosen = [c for name in names for c in CASES if name in (c.name, c.model)]
    unknown = [name for name in names if not any(name in (c.name, c.model) for c in CASES)]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {[c.name for c in CASES]} or their models")
    return list(dict.fromkeys(chosen))


def _run(argv: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    return {"stdout": done.stdout}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=None, help="case names or model names, run in this order "
                        "(default: all)")
    parser.add_argument("--skip-flexgen", nargs="*", default=None, metavar="CASE",
                        help="run ours alone: for every case, or for the cases (or models) named (FlexGen's figure "
                             "for them from an earlier run on this GPU)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole script: no run starts "
                        "after it, and each run's timeout is cut to what is left (a GPU lease is short)")
    parser.add_argument("--schedulers", nargs="+", default=None, choices=("block", "decode-maximal"),
                        help="our runs of FlexGen's policies with these schedulers only (default: both)")
    parser.add_argument("--work", default=None, help="folder for offload files (default: a temporary one)")
    parser.add_argument("--profile", default=None, help="a `flexsarathi profile` JSON of this machine: our "
                        "planner searches and predicts with its measured rates (host overhead per layer, eager and "
                        "graph, included), held to each case's preset memory (T4's); default: the preset itself")
    parser.add_argument("--plan-only", action="store_true", help="no runs (no GPU needed): the planner's "
                        "prediction and memory check of each of our runs, on the hardware they would run under")
    parser.add_argument("--cpu-gib", type=float, default=None, help="our CPU tier's cap in GiB (default: the "
                        "t4 preset's 208 or 85%% of this machine's RAM, the smaller); with --plan-only, the GPU "
                        "machine's (its 85%%)")
    parser.add_argument("--ours-run", nargs="+", help=argparse.SUPPRESS)  # internal: one engine's runs
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    if args.ours_run:
        device, model, policy, preset, profile, cpu_mem_gib, offload_dir, prompt_len, gen_len, requests, *schedulers = \
            args.ours_run
        ours_run(device, model, policy, preset, profile, float(cpu_mem_gib), offload_dir, int(prompt_len), int(gen_len),
                 int(requests), schedulers)
        return 0
    if args.plan_only:
        return plan_only(args)
    if args.skip_flexgen:
        chosen_cases(args.skip_flexgen)  # an unknown case name fails here, before any run
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = chosen_cases(args.cases)
    cpu_mem = args.cpu_gib or min(208.0, 0.85 * (_host_memory() / GiB))
    print(f"GPU: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB), "
          f"torch {torch.__version__}; {cpu_line()}; RAM {(_host_memory() / GiB):.0f} GiB")
    print(f"ours: T4 caps (GPU {T4_CUDA_GIB:.0f} GiB whole, for FlexGen's policies and the searched one alike; "
          f"CPU {cpu_mem:.0f} GiB), fp16; prompt {args.prompt_len}, output {args.gen_len}\n")
    results = run_cases(args, cases, cpu_mem)
    harness.write_result(args, results, {f"{r['case']}: {r['who']} / FlexGen": r["over_flexgen"]
                                         for r in results if r.get("over_flexgen")})
    return 0


def _skips_flexgen(skipped: list[str] | None, case: Case) -> bool:
    """--skip-flexgen: None (not given) runs FlexGen; [] skips it everywhere; names, for those cases."""
    return skipped is not None and (not skipped or case.name in skipped or case.model in skipped)


def run_cases(args, cases: list[Case], cpu_mem: float) -> list[dict]:
    """Per case, FlexGen's run, ours with its policy (per scheduler), ours searched: a line each as it
    ends (the results so far are in the log when a lease ends mid-way)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_flexgen_gpu_"))
    lengths = (args.prompt_len, args.gen_len)
    results = []
    timeout = _Timeouts(args.timeout, args.deadline)
    for case in cases:
        flexgen = {"error": "no FlexGen run (FlexGen runs OPT only)"}
        if case.flexgen_args is not None:
            flexgen = ({"error": "skipped"} if _skips_flexgen(args.skip_flexgen, case)
                       else timeout.run(run_flexgen, case, lengths, work))
            _report(results, case, "FlexGen (flexgen.flex_opt)", flexgen, flexgen)
        schedulers = tuple(s for s in case.schedulers if not args.schedulers or s in args.schedulers)
        if case.policy is not None and schedulers:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                policy_file = f.name
            case.policy.save(policy_file)
            for result in timeout.run(run_ours, case, policy_file, schedulers, lengths, work, cpu_mem,
                                      profile=args.profile, many=True):
                _report(results, case, f"ours, FlexGen's policy, {result.get('scheduler', '?')}", result, flexgen)
        if case.ours_auto:
            searched = f"ours, searched for {case.hardware}" + (" (4-bit weights)" if case.auto_4bit else "")
            for result in timeout.run(run_ours, case, "auto", (), lengths, work, cpu_mem, profile=args.profile,
                                      many=True):
                _report(results, case, searched, result, flexgen)
    return results


def plan_only(args) -> int:
    """--plan-only: plan_case for every chosen case, a line each, and the JSON result."""
    cases = chosen_cases(args.cases)
    cpu_mem = args.cpu_gib or min(208.0, 0.85 * (_host_memory() / GiB))
    print(f"planned, not run: {cpu_line()}; CPU capped at {cpu_mem:.0f} GiB; prompt {args.prompt_len}, "
          f"output {args.gen_len}; rates: {args.profile or 'each case preset'}\n")
    results = []
    for case in cases:
        schedulers = tuple(s for s in case.schedulers if not args.schedulers or s in args.schedulers)
        for r in plan_case(case, (args.prompt_len, args.gen_len), cpu_mem, args.profile, schedulers):
            results.append(r)
            over = "".join(f" ({tier} over by {excess / GiB:.2f} GiB)" for tier, excess in r["over_budget"].items())
            print(f"{case.name:<20} {r['who']:<36} predicted {r['predicted_tok_s']:9.2f} tok/s  gpu "
                  f"{r['peak_gpu_gib']:6.2f} of {r['gpu_budget_gib']:.2f} GiB{over}  bound {r['bound']}  "
                  f"[{r['policy']}]", flush=True)
    harness.write_result(args, results, {})
    return 0


class _Timeouts:
    """Each run's timeout: `per_run` seconds, cut to what is left of `deadline` seconds from now
    (None: no deadline); a run that would start with under a minute left is skipped, said so. Each
    result gets the run's wall seconds (process start and weight set-up included), to plan leases."""

    def __init__(self, per_run: float, deadline: float | None):
        self.per_run, self.ends = per_run, None if deadline is None else time.monotonic() + deadline

    def run(self, fn, *args, many: bool = False, **kwargs):
        left = self.per_run if self.ends is None else min(self.per_run, self.ends - time.monotonic())
        if left < 60:
            skipped = {"error": "skipped: the --deadline is (nearly) spent"}
            return [skipped] if many else skipped
        started = time.monotonic()
        out = fn(*args, timeout=left, **kwargs)
        wall = round(time.monotonic() - started, 1)
        for result in out if many else [out]:
            result["wall_s"] = wall
        return out


def _report(results: list, case: Case, who: str, result: dict, flexgen: dict) -> None:
    results.append({"case": case.name, "who": who, **result})
    if result.get("error"):
        print(f"{case.name:<20} {who:<42} FAILED: {result['error']} (wall {result.get('wall_s', 0):.0f} s)", flush=True)
        return
    ratio = ""
    if "tok_s" in flexgen and flexgen is not result:
        results[-1]["over_flexgen"] = result["tok_s"] / flexgen["tok_s"]
        ratio = f"{result['tok_s'] / flexgen['tok_s']:.2f}x"
    extra = f"  [{result['policy']}]" if "policy" in result else ""
    if "predicted_tok_s" in result:  # the planner's estimate of the same run, and how far off it is
        extra = (f"  predicted {result['predicted_tok_s']:.2f} ({result['planned_with']}; measured / predicted "
                 f"{result['tok_s'] / result['predicted_tok_s']:.2f})" + extra)
    print(f"{case.name:<20} {who:<42} {result['tok_s']:9.2f} tok/s  {result['seconds']:8.2f} s  {ratio:>6}{extra}"
          f"  (wall {result.get('wall_s', 0):.0f} s)", flush=True)
    if result.get("phases"):  # ours: where the measured run's time went
        print(" " * 22 + "phases: " + "; ".join(f"{name} {p['calls']} x {p['ms_each']:.2f} ms (median "
                                                f"{p['ms_median']:.2f}, max {p['ms_max']:.2f})"
                                                for name, p in result["phases"].items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
