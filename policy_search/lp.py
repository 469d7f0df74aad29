"""Placement fractions as linear programs, solved with pulp's CBC, many at a time.

For fixed discrete knobs the cost model is affine in the nine fractions, so the best placement is an
LP: minimise total time / generated tokens, with each pass's time above every chain of resources
(`cost_model.time_terms`) and each tier's memory within budget for every pass.

Starting CBC costs ~10 ms, more than solving one of these LPs, so independent LPs are stacked into
one problem with disjoint variables (the optimum of a sum of independent problems is each one's
optimum). An infeasible member would make the whole stack infeasible, hence two phases:
  1. feasibility: minimise each member's overflow o_i, the GiB by which its worst tier must grow;
  2. optimisation of the members with o_i ~ 0, o_i capped at its phase-1 value (always feasible).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pulp

try:  # PuLP < 4 ships a CBC binary (coin_api.pulp_cbc_path); PuLP 4 has neither that module nor the binary
    from pulp.apis import coin_api
except ImportError:
    coin_api = None

from policy_search.cost_model import PassCost, time_terms
from policy_search.errors import SolverMissingError
from policy_search.linear import FRACTION_GROUPS, FRACTIONS, terms
from policy_search.policy import TIERS
from policy_search.units import GiB, MiB

BATCH = 120  # LPs stacked per CBC call
FEASIBLE_OVERFLOW_GIB = 1e-6  # phase-1 overflow below this (1 KiB) counts as fitting
# Budgets shrink by this much in the LP so the cleaned-up solution still fits exactly.
MARGIN_BYTES = 1 * MiB
MARGIN_RELATIVE = 1e-6
_TIER_RANK = {"gpu": 0, "cpu": 1, "disk": 2}


@dataclass(frozen=True)
class PlacementLP:
    """One LP: a knob setting's pass costs, its budgets and any fractions fixed by the caller."""
    costs: tuple[PassCost, ...]
    generated_tokens: float
    overlap: bool
    budgets: dict[str, float]  # bytes per tier
    fixed: tuple[tuple[str, float], ...] = ()
    # When the pass is bound by something placement does not change (compute, say), many placements
    # tie; this weight (seconds per token per unit fraction, tiny) breaks ties toward faster tiers.
    tie_break: float = 0.0
    # Memory rows from other costs than the time rows (the search's interval bounds: the time of the
    # interval's top with the memory of its bottom). None: the same costs.
    memory_costs: tuple[PassCost, ...] | None = None
    # HardwareSpec.host_budget: the gpu and cpu tiers together within it (both the host's RAM)
    host_budget: float | None = None


@dataclass(frozen=True)
class PlacementSolution:
    overflow_bytes: float  # 0 when the knobs fit; else how far the tightest tier is over
    fractions: dict[str, float] | None  # None when it does not fit
    seconds_per_token: float  # total time / generated tokens (inf when it does not fit)

    @property
    def fits(self) -> bool:
        return self.fractions is not None


def solve(problems: list[PlacementLP]) -> list[PlacementSolution]:
    out: list[PlacementSolution] = []
    for start in range(0, len(problems), BATCH):
        chunk = problems[start:start + BATCH]
        overflows = _solve_chunk(chunk, phase="feasibility")
        fitting = [i for i, o in enumerate(overflows) if o <= FEASIBLE_OVERFLOW_GIB]
        solved = dict(zip(fitting, _solve_chunk([chunk[i] for i in fitting], phase="optimise",
                                                 caps=[overflows[i] for i in fitting])))
        for i, problem in enumerate(chunk):
            if i in solved:
                fractions, seconds = solved[i]
                out.append(PlacementSolution(0.0, fractions, seconds / problem.generated_tokens))
            else:
                out.append(PlacementSolution(overflows[i] * GiB, None, float("inf")))
    return out


def _budget_rows(problem: PlacementLP) -> list[tuple[np.ndarray, float]]:
    """(expression in bytes, budget with margin) for every distinct (pass, tier) memory row."""
    rows, seen = [], set()
    for cost in problem.memory_costs or problem.costs:
        for tier in TIERS:
            expr = cost.memory[tier]
            key = (tier, expr.tobytes())
            if key in seen:
                continue
            seen.add(key)
            rows.append((expr, _less_margin(problem.budgets[tier])))
        if problem.host_budget is not None:  # the two tiers in the host's RAM, together
            expr = cost.memory["gpu"] + cost.memory["cpu"]
            key = ("host", expr.tobytes())
            if key not in seen:
                seen.add(key)
                rows.append((expr, _less_margin(problem.host_budget)))
    return rows


def _less_margin(budget: float) -> float:
    return budget - min(budget, MARGIN_BYTES + MARGIN_RELATIVE * budget)


def _affine(expr: np.ndarray, xs: dict, scale: float = 1.0, extra=()) -> tuple[pulp.LpAffineExpression, float]:
    constant, coefs = terms(expr)
    items = [(xs[name], coef * scale) for name, coef in coefs] + list(extra)
    return pulp.LpAffineExpression(items), constant * scale


def _solve_chunk(chunk: list[PlacementLP], phase: str, caps: list[float] | None = None):
    if not chunk:
        return []
    prob = pulp.LpProblem(f"placement_{phase}", pulp.LpMinimize)
    objective, handles = [], []
    for i, problem in enumerate(chunk):
        handles.append(_add_member(prob, objective, i, problem, phase, None if caps is None else caps[i]))
    prob.setObjective(pulp.LpAffineExpression(objective))
    status = prob.solve(_solver())
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"CBC returned {pulp.LpStatus[status]} for a stacked {phase} LP; "
                           "this is a planner bug (every member is feasible by construction)")
    if phase == "feasibility":
        return [max(0.0, h.varValue or 0.0) for h in handles]
    results = []
    for xs, times in handles:
        fractions = _clean({name: x.varValue or 0.0 for name, x in xs.items()})
        seconds = sum((t.varValue or 0.0) * count for t, count in times)
        results.append((fractions, seconds))
    return results


def _add_member(prob: pulp.LpProblem, objective: list, i: int, problem: PlacementLP, phase: str,
                cap: float | None):
    """Member i's variables and rows; appends its objective terms. Returns its overflow variable
    (feasibility) or (fraction variables, [(pass seconds, count)]) (optimise)."""
    fixed = dict(problem.fixed)
    xs = {}
    for name in FRACTIONS:
        low, high = (fixed[name], fixed[name]) if name in fixed else (0, 1)
        xs[name] = _variable(prob, f"p{i}_{name}", low, high)
    for group in FRACTION_GROUPS:
        prob.addConstraint(pulp.LpConstraint(
            pulp.LpAffineExpression([(xs[n], 1.0) for n in group]), pulp.LpConstraintEQ, rhs=1.0))
    overflow = _variable(prob, f"p{i}_overflow", 0, None if cap is None else cap + 1e-9)
    for expr, budget in _budget_rows(problem):
        # memory (GiB) - overflow <= budget (GiB)
        lhs, constant = _affine(expr, xs, 1.0 / GiB, extra=[(overflow, -1.0)])
        prob.addConstraint(pulp.LpConstraint(lhs, pulp.LpConstraintLE, rhs=budget / GiB - constant))
    if phase == "feasibility":
        objective.append((overflow, 1.0))
        return overflow
    times = []
    for k, cost in enumerate(problem.costs):
        seconds = _variable(prob, f"p{i}_t{k}", 0, None)
        times.append((seconds, cost.shape.count))
        for expr in time_terms(cost.resources, problem.overlap, cost.on_host).values():
            # pass seconds - chain(fractions) >= chain constant
            lhs, constant = _affine(-expr, xs, extra=[(seconds, 1.0)])
            prob.addConstraint(pulp.LpConstraint(lhs, pulp.LpConstraintGE, rhs=-constant))
    scale = 1.0 / problem.generated_tokens  # objective in seconds per generated token
    objective.extend((t, count * scale) for t, count in times)
    objective.append((overflow, 1e-3))  # within its phase-1 cap; keep it at 0 when free
    if problem.tie_break:
        objective.extend((xs[name], problem.tie_break * _TIER_RANK[name.split("_")[1]]) for name in FRACTIONS)
    return xs, times


def _variable(prob: pulp.LpProblem, name: str, low, high):
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3 (the PuLP 4 way)
        return prob.add_variable(name, low, high)
    return pulp.LpVariable(name, low, high)


def _solver() -> pulp.LpSolver:
    """CBC: the binary bundled with pulp < 4 (PULP_CBC_CMD's, without its PuLP-4 deprecation
    warning), else the one PuLP 4 finds (its `cbc` extra's cbcbox wheel, or `cbc` on PATH)."""
    bundled = getattr(coin_api, "pulp_cbc_path", None)
    path = bundled if bundled and os.access(bundled, os.X_OK) else None
    solver = pulp.COIN_CMD(path=path, msg=False)
    if not solver.available():
        raise SolverMissingError(
            f"the policy search needs the CBC solver, and pulp {pulp.__version__} finds none: install "
            "pulp<4 (bundles CBC; what `pip install flexsarathi` asks for), or `pip install 'pulp[cbc]'`, "
            "or put a `cbc` executable on PATH")
    return solver


def _clean(fractions: dict[str, float]) -> dict[str, float]:
    """Clip solver noise and make each group sum to exactly 1."""
    out = {}
    for group in FRACTION_GROUPS:
        values = np.clip([fractions[n] for n in group], 0.0, 1.0)
        values[values < 1e-9] = 0.0
        values = values / values.sum()
        out.update({n: float(v) for n, v in zip(group, values)})
    return out
