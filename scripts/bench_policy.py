#!/usr/bin/env python
"""Planner benchmarks (prints; asserts nothing):

(a) agreement with FlexGen on its own ground: the t4 preset's estimate of FlexGen's published
    policies (prompt 512, output 32) against its published throughput, and the search's best;
(b) the fusion's predicted value: best decode-maximal vs best block schedule, per model;
(c) the speed of a full search (opt-175b on t4 must take < 10 s).

    .venv/bin/python scripts/bench_policy.py [--hardware t4] [--models opt-30b opt-175b]
"""
from __future__ import annotations

import argparse
import sys
import time

import harness  # puts the repository root on sys.path
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from policy_search import HardwareSpec, ModelSpec, Policy, Workload, estimate, search_detailed  # noqa: E402
from policy_search.flexgen_placement import flexgen_weight_fields  # noqa: E402



# FlexGen (ICML'23) Table 2 / benchmark/flexgen/bench_suite.py: T4 16 GB, 208 GB RAM, 1.5 TB SSD.
FLEXGEN = [
    ("opt-30b", 7.32, Policy(gpu_batch_size=48, num_gpu_batches=3, **flexgen_weight_fields("opt-30b", 20, 80),
                             kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                             cpu_attention=True, scheduler="block")),
    ("opt-175b", 0.69, Policy(gpu_batch_size=32, num_gpu_batches=8, **flexgen_weight_fields("opt-175b", 0, 50),
                              kv_gpu=0.0, kv_cpu=0.0, kv_disk=1.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                              cpu_attention=True, scheduler="block", pin_weight=False)),
    # compressed runs (4-bit); the t4 dequantization rate was fitted to these three
    ("opt-6.7b", 29.12, Policy(gpu_batch_size=72, num_gpu_batches=1, compress_weight=True,
                               compress_kv=True, overlap=False, scheduler="block")),
    ("opt-30b", 8.38, Policy(gpu_batch_size=64, num_gpu_batches=8, w_gpu=0.0, w_cpu=1.0, w_disk=0.0,
                             kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                             compress_kv=True, scheduler="block")),
    ("opt-175b", 1.12, Policy(gpu_batch_size=48, num_gpu_batches=3, w_gpu=0.0, w_cpu=1.0, w_disk=0.0,
                              kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0, act_gpu=0.0, act_cpu=1.0, act_disk=0.0,
                              compress_weight=True, compress_kv=True, scheduler="block", pin_weight=False)),
    # all on the GPU, uncompressed
    ("opt-6.7b", 25.26, Policy(gpu_batch_size=2, num_gpu_batches=1, overlap=False, scheduler="block")),
]


def knobs(policy: Policy) -> str:
    comp = "+".join(n for n, on in (("w4", policy.compress_weight), ("kv4", policy.compress_kv)) if on)
    return (f"{policy.scheduler} {policy.gpu_batch_size}x{policy.num_gpu_batches} "
            f"w {policy.w_gpu:.0%}/{policy.w_cpu:.0%}/{policy.w_disk:.0%} "
            f"kv {policy.kv_gpu:.0%}/{policy.kv_cpu:.0%}/{policy.kv_disk:.0%} "
            f"act {policy.act_gpu:.0%}/{policy.act_cpu:.0%}/{policy.act_disk:.0%}"
            + (" cpu-attn" if policy.cpu_attention else "") + (f" {comp}" if comp else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="t4")
    parser.add_argument("--models", nargs="+", default=["opt-30b", "opt-175b"])
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    t4 = HardwareSpec.preset("t4")
    hardware = HardwareSpec.resolve(args.hardware)
    workload = Workload(prompt_len=512, gen_len=32)
    print(f"bench_policy: {cpu_line()}; planner arithmetic only (no matmuls; timings below are the search's)")

    print("(a) FlexGen's published policies on the t4 preset, prompt 512 / output 32")
    print(f"  {'model':<9}{'published':>10}{'estimate':>10}{'error':>8}  fits  policy")
    rows = []
    for name, published, policy in FLEXGEN:
        est = estimate(policy, ModelSpec.from_name(name), t4, workload)
        rows.append({"table": "a", "model": name, "published": published, "estimate": est.throughput,
                     "error": est.throughput / published - 1, "fits": est.fits, "policy": knobs(policy)})
        print(f"  {name:<9}{published:>10.2f}{est.throughput:>10.3f}{est.throughput / published - 1:>+8.0%}"
              f"  {'yes' if est.fits else 'no ':<4}  {knobs(policy)}")
    print("  ('fits' applies FlexGen's 80% planning rule to this model's memory arithmetic.)")

    print(f"\n(b) best decode-maximal vs best block schedule on {hardware.name}, prompt 512 / output 32")
    print(f"  {'model':<9}{'compression':<13}{'block':>10}{'decode-max':>12}{'ratio':>8}   policies")
    timings = []
    for name in args.models:
        model = ModelSpec.from_name(name)
        for label, constraints in (("searched", {}), ("off", {"compress_weight": False, "compress_kv": False})):
            started = time.perf_counter()
            result = search_detailed(model, hardware, workload, **constraints)
            elapsed = time.perf_counter() - started
            if not constraints:
                timings.append((name, elapsed, result.lps_solved))
            block_policy, block = result.best_by_scheduler["block"]
            dm_policy, dm = result.best_by_scheduler["decode-maximal"]
            rows.append({"table": "b", "model": name, "compression": label, "block": block.throughput,
                         "decode_max": dm.throughput, "ratio": dm.throughput / block.throughput,
                         "block_policy": knobs(block_policy), "decode_max_policy": knobs(dm_policy)})
            print(f"  {name:<9}{label:<13}{block.throughput:>10.3f}{dm.throughput:>12.3f}"
                  f"{dm.throughput / block.throughput:>7.2f}x   block: {knobs(block_policy)}")
            print(f"  {'':<9}{'':<13}{'':>10}{'':>12}{'':>8}   decode-maximal: {knobs(dm_policy)}, "
                  f"budget {dm_policy.prefill_budget}, bound {dm.bound}")
        for name_, flexgen_published, policy in FLEXGEN[:2]:
            if name_ == name:
                fg = estimate(policy, model, hardware, workload)
                print(f"  {'':<9}FlexGen's own policy on {hardware.name}: {fg.throughput:.3f} tokens/s "
                      f"(published {flexgen_published} on a T4)")

    print(f"\n(c) full search time on {hardware.name} (both schedulers, every knob)")
    for name, elapsed, lps in timings:
        print(f"  {name:<9}{elapsed:6.2f} s, {lps} placement LPs")
        rows.append({"table": "c", "model": name, "search_s": elapsed, "placement_lps": lps})
    harness.write_result(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
