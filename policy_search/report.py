"""Human-readable report of a policy and its estimate, and the JSON file `flexsarathi policy --json`
writes: {"policy": {...}, "estimate": {...}, "model": ..., "hardware": ..., "workload": ...}, which
`Policy.load` (and so `LLM(..., policy=path)` and the CLI) accepts."""
from __future__ import annotations

import json
import os

from policy_search.cost_model import RESOURCES
from policy_search.estimate import Estimate
from policy_search.hardware import HardwareSpec
from policy_search.model_spec import ModelSpec
from policy_search.policy import TIERS, Policy
from policy_search.units import fmt_bytes
from policy_search.workload import Workload

_KINDS = (("weights", "w"), ("KV cache", "kv"), ("activations", "act"))


def _onoff(flag: bool) -> str:
    return "on" if flag else "off"


def format_report(policy: Policy, est: Estimate, model: ModelSpec, hardware: HardwareSpec,
                  workload: Workload, title: str | None = None) -> str:
    lines = [title or f"Policy for {model.name} on {hardware.name} ({workload.describe()})",
             f"  model     {model.describe()}",
             f"  hardware  {hardware.describe()}",
             ""]
    sched = (f"{policy.scheduler}: {policy.gpu_batch_size} sequences x {policy.num_gpu_batches} "
             f"micro-batches = {policy.max_running} running")
    if policy.scheduler == "decode-maximal":
        sched += f", prefill budget {policy.prefill_budget} tokens/pass"
    lines += [f"Schedule    {sched}",
              f"            overlap {_onoff(policy.overlap)}, CPU attention {_onoff(policy.cpu_attention)}, "
              f"4-bit weights {_onoff(policy.compress_weight)}, 4-bit KV cache {_onoff(policy.compress_kv)}",
              "",
              f"{'Placement':<14}{'GPU':>12}{'CPU':>12}{'disk':>12}"]
    for label, prefix in _KINDS:
        cells = "".join(f"{getattr(policy, f'{prefix}_{t}'):>12.1%}" for t in TIERS)
        lines.append(f"  {label:<12}{cells}")
    lines.append(f"  {'peak memory':<12}" + "".join(f"{fmt_bytes(est.peak_memory[t]):>12}" for t in TIERS))
    lines.append(f"  {'budget':<12}" + "".join(f"{fmt_bytes(est.budgets[t]):>12}" for t in TIERS)
                 + f"   ({hardware.memory_usable_fraction:.0%} of capacity)")
    if not est.fits:
        over = ", ".join(f"{t} by {fmt_bytes(b)}" for t, b in est.over_budget.items())
        lines.append(f"  DOES NOT FIT: over budget on {over}")
    lines += ["",
              f"Throughput  {est.throughput:.3f} generated tokens/s "
              f"({est.generated_tokens:.0f} tokens in {est.total_seconds:.1f} s, prefill included; "
              f"{'steady state' if est.steady_state else f'{est.requests:.0f} requests'})",
              f"Bound by    {est.bound}",
              "",
              f"{'Passes':<14}{'count':>8}{'decode':>9}{'prompt':>9}{'s/pass':>10}{'total s':>10}  bound",
              ]
    for p in est.passes:
        lines.append(f"  {p.kind:<12}{p.count:>8.1f}{p.decode_tokens:>9.0f}{p.prompt_tokens:>9.0f}"
                     f"{p.seconds:>10.3f}{p.total_seconds:>10.1f}  {p.bound}")
    lines += ["", "Resource busy time per pass, seconds"]
    lines.append(f"  {'':<12}" + "".join(f"{r:>14}" for r in RESOURCES))
    for p in est.passes:
        lines.append(f"  {p.kind:<12}" + "".join(f"{p.resources[r]:>14.3f}" for r in RESOURCES))
    return "\n".join(lines)


def policy_file(policy: Policy, est: Estimate, model: ModelSpec, hardware: HardwareSpec,
                workload: Workload) -> dict:
    return {"policy": policy.to_dict(), "estimate": est.to_dict(), "model": model.name,
            "hardware": hardware.to_dict(), "workload": workload.to_dict()}


def write_policy_file(path: str | os.PathLike, policy: Policy, est: Estimate, model: ModelSpec,
                      hardware: HardwareSpec, workload: Workload) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(policy_file(policy, est, model, hardware, workload), f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # never leave a half-written policy file
