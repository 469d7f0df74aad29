"""`flexsarathi generate --ray`: 2 actors x 1 CPU against 1 actor x 2 CPUs (and the single-process
run) on the same job, interleaved, on one local Ray instance the runs share (started here, so its
start-up is not in any run). Prints each run's wall time and generated tok/s (the summary's: for a
--ray run the driver's wall time, actor start-up included) and the ratios.

    .venv/bin/python scripts/bench_ray.py [--rounds 2] [--model dummy:opt-125m] [--max-tokens 32]

On a 2-core machine 2 actors cannot beat 1 by much: the cores are the same, only split
differently (1 actor x 1 CPU shows what one core does). With one actor per GPU the throughput
adds up per GPU.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import harness  # puts the repository root on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"tokens: (\d+) prompt, (\d+) generated in ([\d.]+) s")


def run(label: str, extra: list[str], common: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds of the command, generated tok/s from its summary)."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "flexsarathi", "generate", *common, "--output",
                               os.path.join(tmp, "out.jsonl"), *extra], cwd=REPO, env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - start
    match = SUMMARY.search(proc.stdout)
    if proc.returncode != 0 or not match:
        raise SystemExit(f"{label} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-2000:]}")
    generated, seconds = int(match.group(2)), float(match.group(3))
    print(f"{label:24s} wall {wall:6.1f} s  summary {seconds:6.1f} s  {generated / seconds:7.2f} generated tok/s",
          flush=True)
    return wall, generated / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="dummy:opt-125m")
    ap.add_argument("--input", default="pkg:dummy_opt.jsonl")
    ap.add_argument("--max-tokens", default="32")
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    import ray
    import torch

    from flexsarathi.engine.llm_engine import resolve_dtype
    from flexsarathi.machine.cpu_info import cpu_line

    # Every command below computes in what dtype auto picks (per thread count: each actor's own).
    print(f"bench_ray: {cpu_line(resolve_dtype('auto', torch.float32, torch.device('cpu')))}", flush=True)

    ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=256 << 20, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO, RAY_AUTH_MODE="token")
    common = ["--model", args.model, "--input", args.input, "--max-tokens", args.max_tokens, "--ignore-eos",
              "--overwrite"]
    cores = str(os.cpu_count())
    configs = {"single process": [],
               f"ray 1 actor x {cores} CPU": ["--ray", "--ray-address", address, "--ray-actors", "1",
                                              "--ray-cpus-per-actor", cores],
               "ray 1 actor x 1 CPU": ["--ray", "--ray-address", address, "--ray-actors", "1",
                                       "--ray-cpus-per-actor", "1"],
               f"ray 2 actors x {int(cores) // 2} CPU": ["--ray", "--ray-address", address, "--ray-actors", "2",
                                                         "--ray-cpus-per-actor", str(int(cores) // 2)]}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
            results[name].append(run(name, configs[name], common, env))
    ray.shutdown()
    median = {k: (statistics.median(w for w, _ in v), statistics.median(t for _, t in v)) for k, v in results.items()}
    one, two = names[1], names[3]
    print(f"\nmedians over {args.rounds} rounds ({os.cpu_count()} cores):")
    for name, (wall, tps) in median.items():
        print(f"  {name:24s} wall {wall:6.1f} s  {tps:7.2f} generated tok/s")
    print(f"2 actors / 1 actor: generated tok/s x{median[two][1] / median[one][1]:.2f}, "
          f"wall x{median[one][0] / median[two][0]:.2f} (speed-up)")
    print(f"2 actors / 1 actor x 1 CPU: generated tok/s x{median[two][1] / median[names[2]][1]:.2f}")
    print(f"1 actor / single process: wall x{median['single process'][0] / median[one][0]:.2f} (speed-up)")
    rows = [{"configuration": name, "rounds": [{"wall_s": w, "tok_s": t} for w, t in results[name]],
             "median_wall_s": wall, "median_tok_s": tps} for name, (wall, tps) in median.items()]
    harness.write_result(args, rows, {
        "2 actors / 1 actor tok/s": median[two][1] / median[one][1], "2 actors / 1 actor wall speed-up":
        median[one][0] / median[two][0], "2 actors / 1 actor x 1 CPU tok/s": median[two][1] / median[names[2]][1],
        "1 actor / single process wall speed-up": median["single process"][0] / median[one][0]})


if __name__ == "__main__":
    main()
