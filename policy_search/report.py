"""Human-readable report of a policy and its estimate, and the JSON file `flexsarathi policy --json`
writes: {"policy": {...}, "estimate": {...}, "model": ..., "hardware": ..., "workload": ...}, which
`Policy.load` (and so `LLM(..., policy=path)` and the CLI) accepts."""
from __future__ import annotations

import json
import os

from policy_search.cost_model import RESOURCES, STEP, delegates_experts
from policy_search.estimate import Estimate, estimate
from policy_search.hardware import HardwareSpec
from policy_search.model_spec import ModelSpec
from policy_search.passes import run_shape
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
    moe = (f", routed expert reads {_onoff(policy.routed_expert_reads)}, CPU experts {_onoff(policy.cpu_experts)}"
           if model.num_experts else "")
    lines += [f"Schedule    {sched}",
              f"            overlap {_onoff(policy.overlap)}, CPU attention {_onoff(policy.cpu_attention)}, "
              f"4-bit weights {_onoff(policy.compress_weight)}, 4-bit KV cache {_onoff(policy.compress_kv)}{moe}",
              "",
              f"{'Placement':<14}{'GPU':>12}{'CPU':>12}{'disk':>12}"]
    for label, prefix in _KINDS:
        cells = "".join(f"{getattr(policy, f'{prefix}_{t}'):>12.1%}" for t in TIERS)
        lines.append(f"  {label:<12}{cells}")
    lines.append(f"  {'peak memory':<12}" + "".join(f"{fmt_bytes(est.peak_memory[t]):>12}" for t in TIERS))
    lines.append(f"  {'budget':<12}" + "".join(f"{fmt_bytes(est.budgets[t]):>12}" for t in TIERS)
                 + f"   ({hardware.memory_usable_fraction:.0%} of capacity)")
    if est.host_budget is not None:  # a CPU-only machine: the GPU and CPU columns are both its RAM
        lines.append(f"  {'GPU + CPU':<12}{fmt_bytes(est.peak_host):>12} of {fmt_bytes(est.host_budget)} "
                     "(both tiers are host RAM here)")
    if not est.fits:
        over = ", ".join(f"{t} by {fmt_bytes(b)}" for t, b in est.over_budget.items())
        lines.append(f"  DOES NOT FIT: over budget on {over}")
    if model.num_experts:
        lines += [""] + moe_lines(policy, est, model, hardware, workload)
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
    columns = (*RESOURCES, STEP)  # the step: the engine's host work around the pass
    lines.append(f"  {'':<12}" + "".join(f"{r:>14}" for r in columns))
    for p in est.passes:
        lines.append(f"  {p.kind:<12}" + "".join(f"{p.resources[r]:>14.3f}" for r in columns))
    return "\n".join(lines)


def touched_fractions(policy: Policy, est: Estimate, model: ModelSpec) -> list[dict]:
    """Per modelled pass: the expected share of a sparse layer's experts one micro-batch's rows
    route to (what its matmuls read) and the whole pass's rows (what routed reads fetch)."""
    out = []
    for p in est.passes:
        tokens = p.decode_tokens + p.prompt_tokens
        out.append({"kind": p.kind, "rows_per_micro_batch": tokens / policy.num_gpu_batches,
                    "micro_batch": model.expert_touched_fraction(tokens / policy.num_gpu_batches),
                    "pass": model.expert_touched_fraction(tokens)})
    return out


def _option_line(name: str, flag: bool, what: str, policy: Policy, est: Estimate, model: ModelSpec,
                 hardware: HardwareSpec, workload: Workload) -> str:
    """Whether a MoE option is on, and why: the same placement's estimate with it flipped."""
    other = estimate(policy.replace(**{name: not flag}), model, hardware, workload)
    ratio = est.throughput / other.throughput if other.throughput > 0 else float("inf")
    return (f"            {what} {_onoff(flag)}: {ratio:.2f}x the throughput with it {_onoff(not flag)} "
            f"at this placement ({other.throughput:.3f} tokens/s, bound by {other.bound})")


def moe_lines(policy: Policy, est: Estimate, model: ModelSpec, hardware: HardwareSpec,
              workload: Workload) -> list[str]:
    """The experts' share of the weights, the routed FLOPs, the experts touched per pass and the
    MoE options with their reasons (`flexsarathi policy` prints them for models with experts)."""
    c = policy.compress_weight
    layers, experts = model.num_layers, model.layer_expert_bytes(c) * model.num_layers
    share = "".join(f"{fmt_bytes(getattr(policy, f'w_{t}') * experts):>12}" for t in TIERS)
    flops, all_flops = 2 * model.layer_active_matrix_params, 2 * model.layer_matrix_params
    lines = [f"Experts     {model.num_experts} per layer, top-{model.experts_per_token}, in "
             f"{model.sparse_layers} of {layers} layers: {fmt_bytes(experts)} of the "
             f"{fmt_bytes(model.weight_bytes(c))} weights ({'4-bit' if c else 'uncompressed'})",
             f"  {'placed':<12}{share}",
             f"            routed FLOPs: {layers * flops / 1e9:.2f} GFLOP per token over the layers' matmuls "
             f"({model.num_active_params / 1e9:.2f}B of {model.num_params / 1e9:.2f}B params; all "
             f"experts would be {layers * all_flops / 1e9:.2f})",
             "            experts touched per layer, uniform routing 1 - (1 - k/E)^rows: per micro-batch / per pass"]
    for t in touched_fractions(policy, est, model):
        lines.append(f"              {t['kind']:<12}{t['rows_per_micro_batch']:>9.1f} rows  "
                     f"{t['micro_batch']:>7.1%} / {t['pass']:>7.1%}")
    lines.append(_option_line("routed_expert_reads", policy.routed_expert_reads,
                              "routed expert reads (only touched cpu/disk experts)",
                              policy, est, model, hardware, workload))
    lines.append(_option_line("cpu_experts", policy.cpu_experts, "CPU experts (cpu-tier experts computed there)",
                              policy, est, model, hardware, workload))
    if policy.cpu_experts:
        shapes = run_shape(policy, workload).passes
        delegated = [p.kind for p in shapes if delegates_experts(p, policy, model, hardware)]
        lines.append(f"              on the CPU in: {', '.join(delegated) or 'no pass'}; the other passes copy "
                     f"the experts (the CPU would be slower than the link)")
    return lines


def policy_file(policy: Policy, est: Estimate, model: ModelSpec, hardware: HardwareSpec,
                workload: Workload) -> dict:
    out = {"policy": policy.to_dict(), "estimate": est.to_dict(), "model": model.name,
           "hardware": hardware.to_dict(), "workload": workload.to_dict()}
    if model.num_experts:
        out["experts"] = {"num_experts": model.num_experts, "experts_per_token": model.experts_per_token,
                          "sparse_layers": model.sparse_layers,
                          "expert_bytes": model.num_layers * model.layer_expert_bytes(policy.compress_weight),
                          "active_params": model.num_active_params, "params": model.num_params,
                          "touched_fraction": touched_fractions(policy, est, model)}
    return out


def write_policy_file(path: str | os.PathLike, policy: Policy, est: Estimate, model: ModelSpec,
                      hardware: HardwareSpec, workload: Workload) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(policy_file(policy, est, model, hardware, workload), f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # never leave a half-written policy file
