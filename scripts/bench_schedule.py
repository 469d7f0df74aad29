#!/usr/bin/env python
"""Decode-maximal (SARATHI) against FlexGen's block schedule, and on-demand KV admission against
lifetime reservation, side by side on one engine (prints; asserts nothing).

    .venv/bin/python scripts/bench_schedule.py --profile prof.json   # opt-350m, workloads a b c, 2 rounds
    .venv/bin/python scripts/bench_schedule.py --workloads b --rounds 3
    .venv/bin/python scripts/bench_schedule.py --quick          # smoke test: opt-125m, tiny workloads

Workloads (lengths drawn with a fixed seed; the same requests for every configuration):
  (a) long-tailed: --requests-a requests (256), prompt and output lengths lognormal, prompts
      32..1024, outputs 8..256, ignore_eos; --running-a sequences at once.
  (b) FlexGen's fixed shape: prompt 512, output 32, 4x more requests than running slots.
  (c) early stops: max_tokens 256, seeded sampling (temperature 1), each request stops at a stop
      token: from a first run up to a drawn position (lognormal, 8..256), the last token that had
      not occurred before (so it stops exactly there). The KV cache holds --kv-lifetimes-c lifetimes
      (prompt + max_tokens) of the mean request: reservation runs about that many at once, on
      demand runs as many as the cache holds now (up to --running-c), preempting when short.
Configurations per workload: block (FlexGen: whole prefills, lockstep decode; always reserving)
and decode-maximal; for (c) also decode-maximal with lifetime reservation. Each round runs every
configuration once, interleaved (block, decode-maximal, block, ...), so neighbours' load lands on
both; the table shows the median and the spread (min-max) over rounds.

Set-up, kept equal for every configuration: one engine (same executor, weights, dtype: --dtype, default auto, what
LLM(dtype='auto') computes in on this CPU); the
weights on disk (--w-disk) read with O_DIRECT, so the page cache never serves them (the
store's page cache is also dropped before each run, and each run prints the bytes it really read
from the disk); KV cache and activations on the compute device. Only how passes are formed
changes between runs (LLMEngine.set_schedule).

Per run: passes, generated tokens, seconds (the step loop: scheduling, pass, sampling),
tokens/s, and the mean compute share of pass time (1 - time waiting for weights / pass time).
The planner's prediction (policy_search.estimate, with a profile of this machine: --profile
loads one or measures and saves it) is printed next to each measured median.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import harness  # puts the repository root on sys.path
import torch

from harness import cpu_seconds, disk_read_bytes, drop_cache_of, machine_busy_seconds, say  # noqa: E402
from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.engine.llm_engine import resolve_dtype  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from policy_search import HardwareSpec, ModelSpec, Policy, Workload, estimate  # noqa: E402
from policy_search.passes import steady_prefill_budget  # noqa: E402


# ---- workloads --------------------------------------------------------------------------------
@dataclass
class Config:
    name: str
    policy: Policy  # the schedule fields of the engine's policy for this run


@dataclass
class Bench:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    configs: list[Config]
    workload: Workload  # what the planner is told
    same_tokens: bool = True  # whether every configuration must give the same tokens
    runs: dict[str, list["Run"]] = field(default_factory=dict)


@dataclass
class Run:
    passes: int
    tokens: int
    seconds: float
    compute_share: float
    disk_gb: float
    others_cores: float
    preemptions: int
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def lognormal_lengths(gen: torch.Generator, count: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    values = torch.exp(math.log(median) + sigma * torch.randn(count, generator=gen, dtype=torch.float64))
    return [int(min(hi, max(lo, round(v)))) for v in values.tolist()]


def random_prompts(gen: torch.Generator, lengths: list[int], vocab: int) -> list[list[int]]:
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy(max_tokens: int, stop: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          stop_token_ids=(stop,) if stop is not None else ())


def seeded(index: int, max_tokens: int, stop: int | None = None) -> SamplingParams:
    """Seeded sampling: each request's own generator, so its tokens do not depend on the batch.
    (Greedy outputs of dummy weights repeat a few tokens, so a stop token drawn from them would
    stop almost every request at once.)"""
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + index, ignore_eos=True,
                          stop_token_ids=(stop,) if stop is not None else ())


def first_new_token(tokens: list[int]) -> tuple[int, int]:
    """The stop token for a request whose reference output is `tokens`: the last token that first
    occurs where it is (so the request stops exactly there), and that length."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i + 1
    return tokens[0], 1


def schedules(base: Policy, reserve_too: bool = False) -> list[Config]:
    configs = [Config("block", base.replace(scheduler="block", kv_admission="reserve")),
               Config("decode-maximal", base.replace(scheduler="decode-maximal", kv_admission="on-demand"))]
    if reserve_too:
        configs.append(Config("decode-maximal reserve", base.replace(scheduler="decode-maximal",
                                                                     kv_admission="reserve")))
    return configs


def workload_a(args, gen, vocab, base: Policy) -> Bench:
    n = args.requests_a
    prompts = random_prompts(gen, lognormal_lengths(gen, n, args.prompt_median, 0.8, 32, 1024), vocab)
    outputs = lognormal_lengths(gen, n, args.output_median, args.output_sigma, 8, 256)
    policy = base.replace(gpu_batch_size=args.running_a, prefill_budget=args.budget_a)
    return Bench("a: long-tailed", prompts, [greedy(m) for m in outputs], schedules(policy),
                 Workload(pairs=tuple((len(p), m) for p, m in zip(prompts, outputs)), num_requests=n))


def workload_b(args, gen, vocab, base: Policy) -> Bench:
    running = args.running_b
    n = 4 * running
    prompts = random_prompts(gen, [args.prompt_b] * n, vocab)
    workload = Workload(prompt_len=args.prompt_b, gen_len=args.gen_b, num_requests=n)
    policy = base.replace(gpu_batch_size=running)
    policy = policy.replace(prefill_budget=steady_prefill_budget(policy, workload))
    return Bench("b: FlexGen 512/32", prompts, [greedy(args.gen_b)] * n, schedules(policy), workload)


def workload_c(args, gen, vocab, base: Policy, llm: LLM) -> Bench:
    """Stop tokens from a first greedy run (decode-maximal, ignore_eos, up to each drawn position)."""
    n, max_tokens = args.requests_c, 256
    prompts = random_prompts(gen, lognormal_lengths(gen, n, args.prompt_median, 0.8, 32, 1024), vocab)
    stop_at = lognormal_lengths(gen, n, args.output_median, args.output_sigma, 8, max_tokens)
    mean_life = statistics.mean(len(p) for p in prompts) + max_tokens
    longest = max(len(p) for p in prompts) + max_tokens
    capacity = max(longest, round(args.kv_lifetimes_c * mean_life))
    llm.engine.set_schedule(scheduler="decode-maximal", kv_admission="on-demand", kv_cache_tokens=None,
                            gpu_batch_size=args.running_c, prefill_budget=args.budget_a)
    say(f"  (c) reference run for the stop tokens ({n} requests, seeded sampling)")
    first = llm.generate(prompts, [seeded(i, m) for i, m in enumerate(stop_at)], use_tqdm=False)
    stops = [first_new_token(out.token_ids) for out in first]
    params = [seeded(i, max_tokens, tok) for i, (tok, _) in enumerate(stops)]
    policy = base.replace(gpu_batch_size=args.running_c, prefill_budget=args.budget_a, kv_cache_tokens=capacity)
    lengths = [length for _, length in stops]
    workload = Workload(pairs=tuple((len(p), m) for p, m in zip(prompts, lengths)), num_requests=n,
                        max_tokens=max_tokens)
    return Bench(f"c: early stops (KV {capacity} tokens)", prompts, params, schedules(policy, reserve_too=True),
                 workload)


# ---- running --------------------------------------------------------------------------------
class PassClock:
    """Times every pass and the part of it spent waiting for weights (wraps instance attributes)."""

    def __init__(self, llm: LLM):
        self.passes: list[tuple[float, float]] = []  # (seconds, waiting for weights)
        executor, weights = llm.engine.executor, llm.engine.weights
        run, get = executor.run, weights.get
        self._wait = 0.0

        def timed_get(*a, **k):
            t = time.perf_counter()
            try:
                return get(*a, **k)
            finally:
                self._wait += time.perf_counter() - t

        def timed_run(micro_batches):
            self._wait, t = 0.0, time.perf_counter()
            out = run(micro_batches)
            self.passes.append((time.perf_counter() - t, self._wait))
            return out

        weights.get, executor.run = timed_get, timed_run

    def compute_share(self) -> float:
        return statistics.mean(1 - wait / sec for sec, wait in self.passes) if self.passes else 0.0


def run_once(llm: LLM, bench: Bench, config: Config, clock: PassClock, store_files) -> Run:
    engine = llm.engine
    engine.set_schedule(**{f: getattr(config.policy, f) for f in
                           ("scheduler", "kv_admission", "kv_cache_tokens", "prefill_budget", "gpu_batch_size")})
    drop_cache_of(store_files)
    seqs = [engine.make_sequence(p, sp) for p, sp in zip(bench.prompts, bench.params)]
    engine.add_requests([[seq] for seq in seqs])
    clock.passes.clear()
    read0, busy0, cpu0 = disk_read_bytes(), machine_busy_seconds(), cpu_seconds()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    others = (machine_busy_seconds() - busy0 - (cpu_seconds() - cpu0)) / seconds
    return Run(len(clock.passes), sum(len(s.output_token_ids) for s in seqs), seconds, clock.compute_share(),
               (disk_read_bytes() - read0) / 1e9, others, engine.scheduler.num_preemptions,
               [list(s.output_token_ids) for s in seqs])


def predicted(bench: Bench, config: Config, model: ModelSpec, hardware: HardwareSpec | None) -> float | None:
    if hardware is None:
        return None
    return estimate(config.policy, model, hardware, bench.workload).throughput


# ---- report ---------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def report(bench: Bench, model: ModelSpec, hardware: HardwareSpec | None) -> tuple[list[dict], dict]:
    """Print the workload's table and ratios; return them (rows, ratios) for the JSON result."""
    say(f"\n== {bench.name}: {bench.workload.describe()}")
    say(f"{'configuration':<24}{'passes':>7}{'tokens':>8}{'seconds':>22}{'tok/s':>22}{'compute':>9}"
        f"{'disk GB':>9}{'preempt':>8}{'others':>7}{'planner':>9}{'meas/pred':>10}")
    medians, predictions, rows, ratios = {}, {}, [], {}
    for config in bench.configs:
        runs = bench.runs[config.name]
        tok_s = [r.tok_s for r in runs]
        medians[config.name] = statistics.median(tok_s)
        pred = predictions[config.name] = predicted(bench, config, model, hardware)
        ratio = f"{medians[config.name] / pred:10.2f}" if pred else f"{'-':>10}"
        say(f"{config.name:<24}{runs[0].passes:>7}{runs[0].tokens:>8}{spread([r.seconds for r in runs]):>22}"
            f"{spread(tok_s):>22}{statistics.mean(r.compute_share for r in runs):>9.2f}"
            f"{statistics.mean(r.disk_gb for r in runs):>9.2f}{runs[0].preemptions:>8}"
            f"{statistics.mean(r.others_cores for r in runs):>7.2f}{(pred or 0):>9.2f}{ratio}")
        rows.append({"workload": bench.name, "configuration": config.name, "passes": runs[0].passes,
                     "tokens": runs[0].tokens, "seconds": [r.seconds for r in runs], "tok_s": tok_s,
                     "median_tok_s": medians[config.name],
                     "compute_share": statistics.mean(r.compute_share for r in runs),
                     "disk_gb": statistics.mean(r.disk_gb for r in runs), "preemptions": runs[0].preemptions,
                     "others": statistics.mean(r.others_cores for r in runs), "planner_tok_s": pred})
    names = [c.name for c in bench.configs]
    for other in names[1:]:
        paired = [b.tok_s / a.tok_s for a, b in zip(bench.runs["block"], bench.runs[other])]
        planned = predictions.get(other, 0) / predictions["block"] if predictions.get("block") else None
        ratios[f"{bench.name}: {other} / block"] = statistics.median(paired)
        say(f"  {other} / block: {statistics.median(paired):.2f}x (per round {', '.join(f'{x:.2f}' for x in paired)})"
            + (f"; planner {planned:.2f}x" if planned else ""))
    if "decode-maximal reserve" in names:
        paired = [a.tok_s / b.tok_s for a, b in zip(bench.runs["decode-maximal"], bench.runs["decode-maximal reserve"])]
        ratios[f"{bench.name}: on-demand / reserve"] = statistics.median(paired)
        say(f"  on-demand / reserve (decode-maximal): {statistics.median(paired):.2f}x "
            f"(per round {', '.join(f'{x:.2f}' for x in paired)})")
    outputs = [r.outputs for c in names for r in bench.runs[c]]
    same = all(o == outputs[0] for o in outputs)
    say(f"  tokens identical across configurations and rounds: {same}"
        + ("" if same else "  <-- MISMATCH: " + divergence(outputs)))
    return rows, ratios


def divergence(outputs: list[list[list[int]]]) -> str:
    """How far runs agree: requests that differ from the first run, and the earliest differing index."""
    differ, first = 0, None
    for run in outputs[1:]:
        for a, b in zip(outputs[0], run):
            if a != b:
                differ += 1
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                first = at if first is None else min(first, at)
    return f"{differ} request outputs differ from the first run's (earliest at output index {first})"


def load_profile(args, model: ModelSpec) -> HardwareSpec | None:
    if args.no_planner:
        return None
    if args.profile and os.path.exists(args.profile):
        say(f"profile: {args.profile} (loaded)")
        return HardwareSpec.load(args.profile)
    from flexsarathi.machine.profiler import profile_machine

    say("profile: measuring this machine" + (f" (saved to {args.profile})" if args.profile else ""))
    spec = profile_machine(args.offload_dir, LLM, dtype=args.torch_dtype, model=model, log=lambda line: say("  " + line))
    if args.profile:
        spec.save(args.profile)
    return spec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-350m", help="dummy model (default opt-350m)")
    p.add_argument("--workloads", default="abc", help="which of a, b, c (default abc)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per workload (default 2)")
    p.add_argument("--w-disk", type=float, default=1.0, help="fraction of the weights on disk (default 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine a 2-thread OpenMP team waits "
                        "for whichever thread a neighbour descheduled, which moved pass times 10x)")
    p.add_argument("--requests-a", type=int, default=256)
    p.add_argument("--running-a", type=int, default=32)
    p.add_argument("--budget-a", type=int, default=512, help="prefill budget of (a) and (c)")
    p.add_argument("--prompt-median", type=float, default=48.0, help="lognormal median of prompts (a, c)")
    p.add_argument("--output-median", type=float, default=16.0, help="lognormal median of outputs (a, c)")
    p.add_argument("--output-sigma", type=float, default=0.8, help="lognormal sigma of outputs (a, c)")
    p.add_argument("--running-b", type=int, default=16)
    p.add_argument("--prompt-b", type=int, default=512)
    p.add_argument("--gen-b", type=int, default=32)
    p.add_argument("--requests-c", type=int, default=96)
    p.add_argument("--running-c", type=int, default=64)
    p.add_argument("--kv-lifetimes-c", type=float, default=8.0)
    p.add_argument("--profile", default=None, help="hardware profile JSON for the planner (loaded if it exists)")
    p.add_argument("--no-planner", action="store_true", help="skip the planner's predictions (no profile)")
    p.add_argument("--offload-dir", default="/tmp/fs_bench_schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (default auto: what LLM(dtype='auto') picks on this CPU by measurement)")
    p.add_argument("--quick", action="store_true", help="smoke test: opt-125m, a few short requests, 1 round")
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    if args.quick:
        args.model, args.rounds, args.no_planner = "opt-125m", 1, True
        args.requests_a, args.running_a, args.running_b, args.prompt_b, args.gen_b = 12, 4, 2, 64, 4
        args.requests_c, args.running_c, args.prompt_median, args.output_median = 8, 8, 40.0, 8.0
    return args


def main() -> int:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.torch_dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))  # for these threads
    say(f"bench_schedule: {cpu_line(args.torch_dtype)}; arguments: {' '.join(sys.argv[1:]) or '(defaults)'}")
    base = Policy(gpu_batch_size=8, w_gpu=1.0 - args.w_disk, w_disk=args.w_disk, weight_prefetch=2)
    llm = LLM(f"dummy:{args.model}", enable_prefix_caching=False,
              dtype=args.torch_dtype, policy=base, offload_dir=args.offload_dir, direct_io=True)
    store = llm.engine.weights.store
    store_files = store.data_files() if store is not None else []
    if store is not None and not store.direct_io_active:
        say("WARNING: the weight store fell back to buffered reads: the page cache may serve them")
    model = ModelSpec.from_name(f"dummy:{args.model}", bytes_per_value=llm.engine.dtype.itemsize)
    hardware = load_profile(args, model)
    gen, vocab = torch.Generator().manual_seed(args.seed), llm.engine.config.vocab_size
    benches = []
    for key in args.workloads:
        if key == "a":
            benches.append(workload_a(args, gen, vocab, base))
        elif key == "b":
            benches.append(workload_b(args, gen, vocab, base))
        elif key == "c":
            benches.append(workload_c(args, gen, vocab, base, llm))
    llm.generate([[5] * 8], greedy(1), use_tqdm=False)  # warm-up pass
    clock = PassClock(llm)
    rows, ratios = [], {}
    for bench in benches:
        for r in range(args.rounds):
            for config in bench.configs:
                run = run_once(llm, bench, config, clock, store_files)
                bench.runs.setdefault(config.name, []).append(run)
                say(f"  [{time.strftime('%H:%M:%S')}] {bench.name} round {r + 1} {config.name}: {run.passes} passes, "
                    f"{run.seconds:.1f} s, {run.tok_s:.2f} tok/s, compute share {run.compute_share:.2f}, "
                    f"{run.preemptions} preemptions, others on {run.others_cores:.2f} cores")
        table, paired = report(bench, model, hardware)
        rows, ratios = rows + table, ratios | paired
    llm.close()
    harness.write_result(args, rows, ratios, dtype=args.torch_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
