"""`estimate(policy, model, hardware, workload) -> Estimate`: throughput, per-pass breakdown and
per-tier peak memory of one policy, under the same arithmetic the LP optimises.

Throughput is FlexGen's: generated tokens / total time, prefill included.
"""
from __future__ import annotations

from dataclasses import dataclass

from policy_search.cost_model import RESOURCES, STEP, PassCost, pass_cost, time_terms
from policy_search.graphs import graphs_refused
from policy_search.hardware import HardwareSpec
from policy_search.linear import FRACTIONS, evaluate
from policy_search.model_spec import ModelSpec
from policy_search.pass_shape import RunShape
from policy_search.passes import run_shape
from policy_search.policy import TIERS, Policy
from policy_search.workload import Workload

_FIT_TOLERANCE = 1e-9  # relative slack for float rounding when comparing with a budget


@dataclass(frozen=True)
class PassEstimate:
    kind: str  # "prefill", "decode i/k", "mixed", "ramp/drain"
    count: float  # passes of this kind in the modelled run
    decode_tokens: float
    prompt_tokens: float
    seconds: float  # one pass, all layers
    resources: dict[str, float]  # seconds per pass each resource is busy, and "step": the host's step around it
    bound: str  # the busiest resource of the binding chain (or the host's step): what this pass waits on
    memory: dict[str, float]  # bytes per tier while this pass runs

    @property
    def total_seconds(self) -> float:
        return self.count * self.seconds

    def to_dict(self) -> dict:
        return {"kind": self.kind, "count": self.count, "decode_tokens": self.decode_tokens,
                "prompt_tokens": self.prompt_tokens, "seconds": self.seconds, "bound": self.bound,
                "resources_seconds": self.resources, "memory_bytes": self.memory}


@dataclass(frozen=True)
class Estimate:
    throughput: float  # generated tokens / s over the modelled run
    total_seconds: float
    generated_tokens: float
    requests: float
    steady_state: bool  # the modelled run is one turnover of an unbounded stream
    passes: tuple[PassEstimate, ...]
    peak_memory: dict[str, float]  # bytes per tier, the largest over the run's passes
    budgets: dict[str, float]  # bytes per tier the hardware allows (usable fraction applied)
    # HardwareSpec.host_budget (the gpu and cpu tiers are both host RAM: their sum within it) and
    # the largest such sum over the passes; None on a GPU machine
    host_budget: float | None = None
    peak_host: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.over_budget

    @property
    def over_budget(self) -> dict[str, float]:
        """Bytes by which each tier that does not fit exceeds its budget ("gpu+cpu": the two tiers
        together beyond host_budget)."""
        limits = {**self.budgets, **({} if self.host_budget is None else {"gpu+cpu": self.host_budget})}
        peaks = {**self.peak_memory, "gpu+cpu": self.peak_host}
        return {t: peaks[t] - limit for t, limit in limits.items() if peaks[t] > limit * (1 + _FIT_TOLERANCE) + 1}

    @property
    def bound(self) -> str:
        """The resource that bounds the most run time (summed over the passes it bounds)."""
        by_resource: dict[str, float] = {}
        for p in self.passes:
            by_resource[p.bound] = by_resource.get(p.bound, 0.0) + p.total_seconds
        return max(by_resource, key=by_resource.get)

    def time_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.passes:
            key = "decode" if p.kind.startswith("decode") else p.kind
            out[key] = out.get(key, 0.0) + p.total_seconds
        return out

    def to_dict(self) -> dict:
        return {"throughput_tokens_per_s": self.throughput, "total_seconds": self.total_seconds,
                "generated_tokens": self.generated_tokens, "requests": self.requests,
                "steady_state": self.steady_state, "fits": self.fits, "bound": self.bound,
                "peak_memory_bytes": self.peak_memory, "budget_bytes": self.budgets,
                "host_budget_bytes": self.host_budget, "peak_host_bytes": self.peak_host,
                "passes": [p.to_dict() for p in self.passes]}


def pass_costs(policy: Policy, model: ModelSpec, hardware: HardwareSpec,
               workload: Workload, graphed: bool = False) -> tuple[RunShape, list[PassCost]]:
    """The run's pass shapes and their cost expressions (what both `estimate` and the LP use;
    graphed: see cost_model.pass_cost)."""
    run = run_shape(policy, workload)
    return run, [pass_cost(shape, run, policy, model, hardware, graphed) for shape in run.passes]


def estimate(policy: Policy, model: ModelSpec, hardware: HardwareSpec, workload: Workload) -> Estimate:
    """The policy's throughput and memory; its decode passes priced as the engine runs them (from
    CUDA graphs where policy_search.graphs allows, at HardwareSpec.graph_layer_overhead)."""
    graphed = graphs_refused(policy, model.num_experts > 0) is None
    run, costs = pass_costs(policy, model, hardware, workload, graphed)
    fractions = {name: getattr(policy, name) for name in FRACTIONS}
    passes = []
    for cost in costs:
        resources = {name: evaluate(cost.resources[name], fractions) for name in (*RESOURCES, STEP)}
        chains = {name: evaluate(expr, fractions) for name, expr in
                  time_terms(cost.resources, policy.overlap, cost.on_host).items()}
        binding = max(chains, key=chains.get)
        members = (_HOST_CHAIN_MEMBERS if cost.on_host else _CHAIN_MEMBERS).get(binding, RESOURCES)
        passes.append(PassEstimate(
            kind=cost.shape.kind, count=cost.shape.count, decode_tokens=cost.shape.decode_tokens,
            prompt_tokens=cost.shape.prompt_tokens, seconds=chains[binding], resources=resources,
            bound=max((*members, STEP), key=resources.get),
            memory={t: evaluate(cost.memory[t], fractions) for t in TIERS}))
    total = sum(p.total_seconds for p in passes)
    peak = {t: max(p.memory[t] for p in passes) for t in TIERS}
    return Estimate(throughput=run.generated_tokens / total if total > 0 else float("inf"),
                    total_seconds=total, generated_tokens=run.generated_tokens, requests=run.requests,
                    steady_state=run.steady_state, passes=tuple(passes), peak_memory=peak,
                    budgets=hardware.budgets(), host_budget=hardware.host_budget,
                    peak_host=max(p.memory["gpu"] + p.memory["cpu"] for p in passes))


_CHAIN_MEMBERS = {
    "routed": ("gpu", "disk->host", "host->device"),  # cost_model.ROUTED
    "load": ("disk->host", "host->device"),
    "store": ("device->host", "host->disk"),
    "compute": ("gpu", "cpu"),
    "host": ("host->device", "cpu"),
}
_HOST_CHAIN_MEMBERS = {
    "routed": ("gpu", "disk->host", "host->device"),
    "load": ("disk->host",),
    "store": ("host->disk",),
    "compute": ("gpu", "cpu", "host->device", "device->host"),
}
