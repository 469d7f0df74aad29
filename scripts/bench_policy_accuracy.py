#!/usr/bin/env python
"""Planner accuracy on this machine: predicted vs measured throughput, side by side (prints; asserts
nothing).

    .venv/bin/python scripts/bench_policy_accuracy.py                       # opt-1.3b, ~5 min
    .venv/bin/python scripts/bench_policy_accuracy.py --profile prof.json   # reuse a measured profile
    .venv/bin/python scripts/bench_policy_accuracy.py --model opt-125m --num-prompts 8 --gen-len 4  # smoke

The issue's target: for three or more placements of a dummy model that needs offloading, with the
measured profile, predicted (`policy_search.estimate`) vs measured (`LLM.generate`) throughput within
25%. For each placement the script prints both, their ratio, and per pass kind the predicted and the
measured median pass time with the resource the planner says bounds it.

How it is set up
----------------
* Profile: `--profile PATH` is loaded when it exists; otherwise this machine is measured first
  (`flexsarathi.machine.profiler.profile_machine`: the model's layer shapes in the run's dtype (--dtype,
  default auto: what LLM(dtype='auto') computes in on this CPU), attention on the
  workload's prompt length and decode context) and saved there. On a
  busy machine prefer measuring in the same run: the rates then see the same neighbours as the runs.
* "Needs offloading": the gpu tier (on a CPU-only machine, a budgeted working set in host memory)
  gets the largest working set of the placements below (per the planner, +15%) and no more; the
  script checks that the whole model does not fit in it. The engine enforces the same budget.
* Placements (all with the measured profile, prompt/output lengths and request count of the flags):
  weights on the cpu tier; weights on disk (O_DIRECT reads, page cache bypassed); weights
  30/40/30 gpu/cpu/disk; weights on cpu with the KV cache on cpu and CPU decode attention; and
  FlexGen's block schedule with weights on disk. The decode-maximal runs use the planner's
  steady prefill budget (s * B / n prompt tokens per pass), as `search` would.
* Timing: `LLM.generate` end to end (prefill + decode), greedy, ignore_eos, after a short warm-up
  of each engine; throughput = generated tokens / seconds (`llm.last_stats`), the planner's
  definition. Engine construction (placing weights; the disk store is written once and reused) is
  timed separately and not part of the throughput. Pass times are recorded around the executor.
* Noise: other processes share the 2 cores, and a busy neighbour slows small torch ops far more
  than its share (OpenMP teams wait for a descheduled thread). The CPU time other processes took
  during the profile and during each run is printed (in cores): a row measured with others on
  ~1 core is not comparable with a profile measured alone. --repeats N runs each placement N times
  and reports the median; the profile's rates are medians of their own repeats.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import harness  # puts the repository root on sys.path
import torch

from harness import Neighbours, say  # noqa: E402

from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.engine.llm_engine import resolve_dtype  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from flexsarathi.machine.profiler import profile_machine  # noqa: E402
from policy_search import HardwareSpec, ModelSpec, Policy, Workload, estimate  # noqa: E402
from policy_search.passes import steady_prefill_budget  # noqa: E402
from policy_search.units import GiB  # noqa: E402

ALL_GPU = dict(w_gpu=1.0, w_cpu=0.0, w_disk=0.0, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
               act_gpu=1.0, act_cpu=0.0, act_disk=0.0)


def placements(gbs: int, micro_batches: int) -> list[tuple[str, Policy]]:
    base = Policy(gpu_batch_size=gbs, num_gpu_batches=micro_batches, **ALL_GPU)
    # the same running set in twice as many micro-batches (each streams the layer's weights again)
    split = base.replace(gpu_batch_size=max(1, gbs // 2), num_gpu_batches=2 * micro_batches)
    return [
        ("w cpu", base.replace(w_gpu=0.0, w_cpu=1.0)),
        ("w disk", base.replace(w_gpu=0.0, w_disk=1.0)),
        ("w 30/40/30, 2x micro-b.", split.replace(w_gpu=0.3, w_cpu=0.4, w_disk=0.3)),
        ("w cpu, kv cpu, cpu-attn", base.replace(w_gpu=0.0, w_cpu=1.0, kv_gpu=0.0, kv_cpu=1.0,
                                                  cpu_attention=True)),
        ("w disk, block", base.replace(w_gpu=0.0, w_disk=1.0, scheduler="block")),
    ]


def prepare(policy: Policy, workload: Workload) -> Policy:
    """Decode-maximal runs get the planner's steady prefill budget, as `search` picks it."""
    if policy.scheduler != "decode-maximal":
        return policy
    return policy.replace(prefill_budget=steady_prefill_budget(policy, workload))


def knobs(p: Policy) -> str:
    return (f"{p.scheduler} {p.gpu_batch_size}x{p.num_gpu_batches} budget {p.prefill_budget} "
            f"w {p.w_gpu:.0%}/{p.w_cpu:.0%}/{p.w_disk:.0%} kv {p.kv_gpu:.0%}/{p.kv_cpu:.0%}/{p.kv_disk:.0%}"
            + (" cpu-attn" if p.cpu_attention else ""))


def load_or_measure_profile(args, model: ModelSpec) -> HardwareSpec:
    path = args.profile
    if path and os.path.exists(path):
        say(f"profile: {path} (loaded)")
        return HardwareSpec.load(path)
    say("profile: measuring this machine (use --profile PATH to keep it)")
    # The model's layer shapes in the run's dtype, attention on this workload's prompt and decode context.
    spec = profile_machine(args.offload_dir, LLM, dtype=args.torch_dtype, model=model, log=lambda line: say("  " + line),
                           prompt_len=args.prompt_len, decode_context=args.prompt_len + args.gen_len // 2,
                           decode_seqs=args.gpu_batch_size)
    if path:
        spec.save(path)
        say(f"profile: saved to {path}")
    return spec


class PassTimer:
    """Wraps the engine's pass executor to record (tokens, seconds) of every pass, and the weight
    streamer to record per pass the time the pass waited for weights (`get`) and the time the
    loader was busy (`_load`, on the prefetch thread): where a placement's time goes."""

    def __init__(self, llm: LLM):
        self.executor, weights = llm.engine.executor, llm.engine.weights
        self.inner = self.executor.run
        self.passes: list[tuple[int, int, float]] = []  # (decode tokens, prompt tokens, seconds)
        self.waits: list[tuple[float, float, float]] = []  # (waited for weights, loader busy, process CPU) s
        self._acc = {"get": 0.0, "_load": 0.0}
        for name in self._acc:
            setattr(weights, name, self._timed(getattr(weights, name), name))
        self.executor.run = self._run

    def _timed(self, fn, name):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._acc[name] += time.perf_counter() - start
        return timed

    def _run(self, micro_batches):
        self._acc.update(get=0.0, _load=0.0)
        start, cpu = time.perf_counter(), time.process_time()
        out = self.inner(micro_batches)
        tokens = sum(mb.num_tokens for mb in micro_batches)
        sampled = sum(mb.logit_rows.numel() for mb in micro_batches)
        self.passes.append((tokens, sampled, time.perf_counter() - start))
        self.waits.append((self._acc["get"], self._acc["_load"], time.process_time() - cpu))
        return out


def run_placement(name: str, policy: Policy, args, hw: HardwareSpec, prompts: list[list[int]]) -> dict:
    start = time.perf_counter()
    llm = LLM(args.model_id, enable_prefix_caching=False,
              dtype=args.torch_dtype, policy=policy, offload_dir=args.offload_dir,
              direct_io=True, hardware=hw)
    built = time.perf_counter() - start
    timer = PassTimer(llm)
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([p[:16] for p in prompts[:2]], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(args.repeats):
        timer.passes.clear()
        timer.waits.clear()
        neighbours = Neighbours()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append((dict(llm.last_stats) | {"neighbours": neighbours.cores()},
                     list(timer.passes), list(timer.waits)))
    llm.close()
    del llm, timer
    runs.sort(key=lambda r: r[0]["tokens_per_s"])
    stats, passes, waits = runs[len(runs) // 2]
    return {"built": built, "stats": stats, "passes": passes, "waits": waits,
            "all": [(r[0]["tokens_per_s"], r[0]["neighbours"]) for r in runs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-1.3b", help="dummy model name (default opt-1.3b)")
    parser.add_argument("--profile", default=None, help="hardware profile JSON: loaded if it exists, "
                                                        "else measured and saved there")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--gpu-batch-size", type=int, default=16)
    parser.add_argument("--num-gpu-batches", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="run only the placements of these names")
    parser.add_argument("--offload-dir", default="/tmp/fs_policy_accuracy")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype (default auto: what LLM(dtype='auto') picks on this CPU)")
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    args.model_id = args.model if args.model.startswith("dummy:") else f"dummy:{args.model}"
    t0 = time.perf_counter()
    os.makedirs(args.offload_dir, exist_ok=True)

    args.torch_dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))
    say(f"bench_policy_accuracy: {cpu_line(args.torch_dtype)}")
    model = ModelSpec.from_name(args.model_id, bytes_per_value=args.torch_dtype.itemsize)
    neighbours = Neighbours()
    loaded = bool(args.profile and os.path.exists(args.profile))
    measured = load_or_measure_profile(args, model)
    profile_neighbours = None if loaded else neighbours.cores()
    workload = Workload(prompt_len=args.prompt_len, gen_len=args.gen_len, num_requests=args.num_prompts)
    chosen = [(name, prepare(policy, workload)) for name, policy in
              placements(args.gpu_batch_size, args.num_gpu_batches)
              if not args.only or name in args.only]
    # The gpu tier holds the largest working set of the placements (+15%), and no more.
    budget = 1.15 * max(estimate(p, model, measured, workload).peak_memory["gpu"] for _, p in chosen)
    hw = measured.with_memory(gpu=budget / measured.memory_usable_fraction)
    say(f"model {args.model_id}: {model.describe()}")
    say(f"hardware: {hw.describe()}")
    all_gpu = estimate(Policy(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches),
                       model, hw, workload)
    say(f"gpu-tier budget {budget / GiB:.2f} GiB (the placements' largest working set + 15%): all on the gpu "
        f"tier needs {all_gpu.peak_memory['gpu'] / GiB:.2f} GiB -> "
        f"{'fits (!)' if all_gpu.fits else 'does not fit: the model needs offloading'}")
    say(f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.gen_len} generated each, "
        f"greedy, ignore_eos; {args.repeats} run(s) per placement")

    rng = random.Random(0)
    prompts = [[rng.randrange(10, model.vocab_size - 10) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    rows = []
    for name, policy in chosen:
        est = estimate(policy, model, hw, workload)
        if not est.fits:
            say(f"{name}: does not fit the budgets per the planner ({est.over_budget}); skipped")
            continue
        say(f"[{time.perf_counter() - t0:5.0f}s] {name}: {knobs(policy)}; load average {os.getloadavg()[0]:.2f}")
        result = run_placement(name, policy, args, hw, prompts)
        stats = result["stats"]
        measured_tps = stats["tokens_per_s"]
        say(f"         built in {result['built']:.1f} s; {stats['passes']} passes, "
            f"{stats['generated_tokens']} tokens in {stats['seconds']:.2f} s = {measured_tps:.2f} tok/s "
            f"(runs: {', '.join(f'{x:.2f} with others on {c:.2f} cores' for x, c in result['all'])}); "
            f"predicted {est.throughput:.2f} tok/s "
            f"over {sum(p.count for p in est.passes):.0f} passes")
        for p in est.passes:
            say(f"         predicted {p.kind:<11} x{p.count:5.1f}: {p.decode_tokens:5.1f} decode + "
                f"{p.prompt_tokens:6.1f} prompt tokens, {p.seconds:6.3f} s, bound {p.bound} "
                f"({', '.join(f'{r} {s:.3f}' for r, s in p.resources.items() if s > 0)})")
        passes = result["passes"]
        by_tokens: dict[int, list[float]] = {}
        for tokens, _, seconds in passes:
            by_tokens.setdefault(tokens, []).append(seconds)
        summary = ", ".join(f"{t} tok: {len(s)} x {statistics.median(s):.3f} s"
                            for t, s in sorted(by_tokens.items(), key=lambda kv: -len(kv[1]))[:4])
        say(f"         measured passes (tokens: count x median s): {summary}")
        n = max(len(result["waits"]), 1)
        waited, loading, cpu = (sum(w[i] for w in result["waits"]) / n for i in range(3))
        say(f"         per pass: waited for weights {waited:.3f} s, weight loader busy {loading:.3f} s, "
            f"process CPU {cpu:.3f} s")
        rows.append((name, policy, est, measured_tps, stats["neighbours"]))

    say("")
    say(f"{args.model_id}, prompt {args.prompt_len}, output {args.gen_len}, {args.num_prompts} requests, "
        f"{args.gpu_batch_size}x{args.num_gpu_batches} running, gpu-tier budget {budget / GiB:.2f} GiB; "
        f"profile {args.profile or '(measured in this run)'}")
    say(f"profile measured with others on {profile_neighbours:.2f} cores" if profile_neighbours is not None
        else "profile loaded from a file")
    header = (f"{'placement':<26} {'predicted tok/s':>15} {'measured tok/s':>14} {'measured/predicted':>18} "
              f"{'others (cores)':>14}  bound (planner)")
    say(header)
    say("-" * len(header))
    for name, policy, est, measured_tps, others in rows:
        bounds = ", ".join(dict.fromkeys(f"{p.kind.split()[0]}: {p.bound}" for p in est.passes))
        say(f"{name:<26} {est.throughput:>15.2f} {measured_tps:>14.2f} {measured_tps / est.throughput:>18.2f} "
            f"{others:>14.2f}  {bounds}")
    within = sum(1 for _, _, est, m, _ in rows if abs(m / est.throughput - 1) <= 0.25)
    say(f"{within} of {len(rows)} placements within 25%; total {time.perf_counter() - t0:.0f} s")
    harness.write_result(args, [{"placement": name, "policy": knobs(policy), "predicted_tok_s": est.throughput,
                                 "measured_tok_s": m, "measured_over_predicted": m / est.throughput, "others": others}
                                for name, policy, est, m, others in rows],
                         {"placements_within_25pct": within, "placements": len(rows)}, dtype=args.torch_dtype,
                         extra={"hardware": hw.describe(), "profile_neighbours": profile_neighbours})
    return 0


if __name__ == "__main__":
    sys.exit(main())
