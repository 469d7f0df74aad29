"""`search(model, hardware, workload, **constraints) -> (Policy, Estimate)`.

The discrete knobs are enumerated; the placement fractions of each knob setting are an LP (lp.py).

  * combos: scheduler (block | decode-maximal) x compress_weight x compress_kv x cpu_attention, and
    for a model with experts x routed_expert_reads x cpu_experts;
  * for each combo, chains of one gpu_batch_size (powers of two and the running cap, then 3/4 and 3/2
    of each combo's best, where FlexGen's 48 x 3 lives), each chain running along num_gpu_batches from 1 to the most
    whose weights and KV cache fit all tiers together;
  * best-first branch and bound over open intervals of num_gpu_batches: the interval with the highest
    upper bound has its midpoint probed, until no interval can beat its scheduler's best by more than
    TOLERANCE. Feasibility is monotone along a chain, so the bisection also finds the largest block
    that fits (FlexGen doubles gbs and bisects the block count; this is the same walk with bounds).
    Upper bounds on an interval (lo, hi), all from "a pass never gets shorter when the running count
    B grows at fixed gpu_batch_size, while the tokens it generates grow in proportion":
      - proportional: throughput(B') <= throughput(lo) * B' / lo;
      - relaxation (bounds.py): the top's pass times minimised over the memory box of lo + 1;
      - for intervals at most NARROW wide, an LP with the top's time rows and lo + 1's memory rows.
    A probe is settled without its LP when the relaxation proves it cannot fit or cannot win.
  * prefill_budget is not free: below s * B / (n-1) the running set cannot stay full (the same as a
    smaller B), above it the budget goes unused; the search sets the steady-state value, and for a
    closed batch (all admitted at once) the fastest that fits (prefill_budget.py: no decode rides
    along its prompt passes, each of which streams or dequantizes the weights again).

Every LP runs on the same cost expressions `estimate()` evaluates, and the returned Estimate is
recomputed by `estimate()` from the returned Policy, so the policy fits every tier's budget under the
model's own memory arithmetic.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

from policy_search import lp
from policy_search.bounds import fraction_box, placement_bound, time_lower_bound
from policy_search.errors import InfeasibleError, SpecError
from policy_search.cost_model import working_bytes
from policy_search.estimate import Estimate, estimate, pass_costs
from policy_search.hardware import HardwareSpec
from policy_search.linear import FRACTIONS, evaluate
from policy_search.model_spec import ModelSpec
from policy_search.passes import steady_prefill_budget
from policy_search.prefill_budget import closed_batch_prefill_budget
from policy_search.policy import SCHEDULERS, TIERS, Policy
from policy_search.units import fmt_bytes
from policy_search.workload import Workload
from policy_search.working_set import worst_pass_bytes

_BOOL_KNOBS = ("compress_weight", "compress_kv", "cpu_attention", "routed_expert_reads", "cpu_experts")
_MOE_KNOBS = ("routed_expert_reads", "cpu_experts")  # tried only where the model has experts
_INT_KNOBS = ("gpu_batch_size", "num_gpu_batches", "prefill_budget")
CONSTRAINTS = ("scheduler", "overlap", "pin_weight", "max_running") + _BOOL_KNOBS + _INT_KNOBS + FRACTIONS
BOUND_SLACK = 1.02  # the proportionality bound holds up to small second-order terms (chunk re-reads)
MAX_RUNNING = 1 << 16
# Branch and bound stops refining where it cannot gain more than this: on a plateau (per-pass time
# growing with B, as when the KV cache bounds the pass) the proportional bound never prunes, and exact
# search would probe every num_gpu_batches. The result is within this factor of the best policy of the
# enumeration, so "more memory is never slower" also holds up to it.
TOLERANCE = 0.02
# 4-bit weights or KV cache the caller left open are chosen only for at least this much more
# throughput than the best exact policy (their quality cost: docs/BENCHMARKS.md, bench_quant)
LOSSY_MIN_SPEEDUP = 1.2
_LOSSY_KNOBS = ("compress_weight", "compress_kv")
TIE_BREAK = 1e-6
ROUND = 48  # points probed per branch-and-bound round (one stacked LP)
NARROW = 2.0  # intervals with hi <= NARROW x lo get an LP bound before being split
LARGEST_PASS_ROUNDS = 4  # re-solves of one LP on a lower gpu budget until its largest pass fits
MAX_LPS = 4000  # safety net: past this many LPs the search returns its incumbent (SearchResult.complete)


@dataclass(frozen=True)
class Combo:
    scheduler: str
    compress_weight: bool
    compress_kv: bool
    cpu_attention: bool
    routed_expert_reads: bool = False
    cpu_experts: bool = False


@dataclass
class _Point:
    status: str  # "fits" (value exact), "dominated" (value is an upper bound), "infeasible"
    value: float  # tokens/s
    policy: Policy | None = None


@dataclass
class _Chain:
    """One combo and gpu_batch_size, along num_gpu_batches in [1, max_batches]."""
    combo: Combo
    gpu_batch_size: int
    max_batches: int
    points: dict[int, _Point] = field(default_factory=dict)

    def intervals(self):
        """Open intervals (lo, hi) of unexplored num_gpu_batches; lo = 0 or a point that may fit."""
        edges = sorted(self.points)
        for lo, hi in zip([0] + edges, edges + [self.max_batches + 1]):
            if lo and self.points[lo].status == "infeasible":
                return  # feasibility is monotone along a chain: nothing above fits either
            if hi - lo >= 2:
                yield lo, hi


@dataclass(frozen=True)
class SearchResult:
    policy: Policy
    estimate: Estimate
    best_by_scheduler: dict[str, tuple[Policy, Estimate]]
    lps_solved: int
    seconds: float
    complete: bool  # False: stopped at MAX_LPS, the policy may be more than TOLERANCE from the best


def search(model: ModelSpec, hardware: HardwareSpec, workload: Workload,
           **constraints) -> tuple[Policy, Estimate]:
    """Best policy and its estimate. `constraints` fix knobs: scheduler, compress_weight, compress_kv,
    cpu_attention, routed_expert_reads, cpu_experts, overlap, gpu_batch_size, num_gpu_batches,
    prefill_budget, max_running (upper bound
    on gpu_batch_size x num_gpu_batches), pin_weight, or any placement fraction (w_gpu=0.2, ...)."""
    result = search_detailed(model, hardware, workload, **constraints)
    return result.policy, result.estimate


def search_detailed(model: ModelSpec, hardware: HardwareSpec, workload: Workload,
                    **constraints) -> SearchResult:
    """The best policy; where it compresses weights or KV to 4 bits (lossy) without the constraints
    asking for it, only if that is at least LOSSY_MIN_SPEEDUP x the best policy without compression
    (or nothing fits without): a 4-bit model answers differently, not worth a few percent."""
    result = _search_detailed(model, hardware, workload, constraints)
    free = [k for k in _LOSSY_KNOBS if k not in constraints]
    if not any(getattr(result.policy, k) for k in free):
        return result
    try:
        exact = _search_detailed(model, hardware, workload, {**constraints, **{k: False for k in free}})
    except InfeasibleError:
        return result
    chosen = result if result.estimate.throughput >= LOSSY_MIN_SPEEDUP * exact.estimate.throughput else exact
    return replace(chosen, lps_solved=result.lps_solved + exact.lps_solved,
                   seconds=result.seconds + exact.seconds, complete=result.complete and exact.complete)


def _search_detailed(model: ModelSpec, hardware: HardwareSpec, workload: Workload, constraints: dict) -> SearchResult:
    started = time.perf_counter()
    _check_constraints(constraints)
    _check_lengths(model, workload)
    searcher = _Searcher(model, hardware, workload, constraints)
    searcher.run()
    best: dict[str, tuple[Policy, Estimate]] = {}
    for scheduler, (value, policy) in searcher.incumbents.items():
        if policy is not None:
            if "prefill_budget" not in constraints:  # a closed batch's prompt passes carry no decodes
                policy = policy.replace(prefill_budget=closed_batch_prefill_budget(policy, model, hardware, workload))
            best[scheduler] = (policy, estimate(policy, model, hardware, workload))
    if not best:
        raise InfeasibleError(searcher.infeasible_message())
    policy, est = max(best.values(), key=lambda pe: pe[1].throughput)
    return SearchResult(policy=policy, estimate=est, best_by_scheduler=best, lps_solved=searcher.solved,
                        seconds=time.perf_counter() - started, complete=searcher.complete)


def kv_admission(workload: Workload) -> str:
    """Lifetime reservation where it is provably no worse: the outputs' lengths are known (no early
    stops), so a reservation holds exactly what the sequence will use and never preempts; on demand
    where requests stop early (Workload.max_tokens), so unused max_tokens hold no cache."""
    return "reserve" if workload.max_tokens is None else "on-demand"


def _check_constraints(constraints: dict) -> None:
    for name, value in constraints.items():
        if name not in CONSTRAINTS:
            raise SpecError(f"unknown search constraint {name!r}; known: {', '.join(CONSTRAINTS)}")
        if name == "scheduler" and value not in SCHEDULERS:
            raise SpecError(f"search constraint scheduler must be one of {SCHEDULERS}, got {value!r}")
        if name in _BOOL_KNOBS + ("overlap", "pin_weight") and not isinstance(value, bool):
            raise SpecError(f"search constraint {name} must be true or false, got {value!r}")
        if name in _INT_KNOBS + ("max_running",) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"search constraint {name} must be a positive integer, got {value!r}")
        if name in FRACTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= 1):
            raise SpecError(f"search constraint {name} must be a number in [0, 1], got {value!r}")


def _check_lengths(model: ModelSpec, workload: Workload) -> None:
    if workload.max_total_len > model.max_positions:
        raise SpecError(f"workload prompt + output reaches {workload.max_total_len} tokens, beyond "
                        f"{model.name}'s max_position_embeddings {model.max_positions}")


class _Searcher:
    def __init__(self, model: ModelSpec, hardware: HardwareSpec, workload: Workload, constraints: dict):
        self.model, self.hardware, self.workload = model, hardware, workload
        self.constraints = constraints
        self.fixed_fractions = tuple((n, float(constraints[n])) for n in FRACTIONS if n in constraints)
        self.fixed = dict(self.fixed_fractions)
        self.budgets = hardware.budgets()
        self._costs: dict = {}
        self._boxes: dict = {}
        self._interval_bounds: dict = {}
        self._lp_bounds: dict = {}
        self.solved = 0
        self.complete = True  # False when MAX_LPS stopped the branch and bound early
        self.incumbents: dict[str, tuple[float, Policy | None]] = {}
        self.bound_factor = BOUND_SLACK * (1 if workload.num_requests is None else 2)
        limit = constraints.get("max_running", MAX_RUNNING)
        if workload.num_requests is not None:
            limit = min(limit, workload.num_requests)
        self.max_running = limit

    # ---- enumeration -----------------------------------------------------------------------
    def combos(self) -> list[Combo]:
        def values(name, default):
            return (self.constraints[name],) if name in self.constraints else default
        moe = (False, True) if self.model.num_experts else (False,)
        return [Combo(*c) for c in itertools.product(
            values("scheduler", SCHEDULERS), values("compress_weight", (False, True)),
            values("compress_kv", (False, True)), values("cpu_attention", (False, True)),
            *(values(name, moe) for name in _MOE_KNOBS))]

    def running_cap(self, combo: Combo) -> int:
        """Largest B whose weights and KV cache alone fit in all tiers together (a necessary condition)."""
        m = self.model
        total = self.hardware.total_budget() - m.weight_bytes(combo.compress_weight)
        per_sequence = self.workload.max_total_len * m.num_layers * m.kv_bytes_per_token(combo.compress_kv)
        return max(0, min(self.max_running, int(total // per_sequence)))

    def batch_sizes(self, cap: int) -> list[int]:
        """Powers of two up to `cap`, and `cap` itself (the running cap: a closed batch of requests, or
        as many as fit, all in one micro-batch: FlexGen's 72 of its 4-bit OPT-6.7B policy is none of
        the powers and none of their 3/4 or 3/2)."""
        if "gpu_batch_size" in self.constraints:
            return [self.constraints["gpu_batch_size"]]
        return sorted({1 << i for i in range(cap.bit_length()) if 1 << i <= cap} | {cap})

    def run(self) -> None:
        chains: list[_Chain] = []
        for combo in self.combos():
            self.incumbents.setdefault(combo.scheduler, (0.0, None))
            cap = self.running_cap(combo)
            for gbs in self.batch_sizes(max(cap, 1)):
                chains.append(self.new_chain(combo, gbs, cap))
        self.branch_and_bound(chains)
        if "gpu_batch_size" in self.constraints:
            return
        # FlexGen's batch sizes are not all powers of two (48 x 3): try 3 x 2^k next to each combo's best.
        extra = []
        for combo in {c.combo for c in chains}:
            mine = [c for c in chains if c.combo == combo]
            best = max(mine, key=self.chain_best)
            if self.chain_best(best) <= 0:
                continue
            present = {c.gpu_batch_size for c in mine}
            for gbs in sorted({best.gpu_batch_size * 3 // 4, best.gpu_batch_size * 3 // 2}):
                if gbs >= 1 and gbs not in present:
                    extra.append(self.new_chain(combo, gbs, self.running_cap(combo)))
        if extra:
            self.branch_and_bound(chains + extra)

    def new_chain(self, combo: Combo, gbs: int, cap: int) -> _Chain:
        max_batches = cap // gbs
        if "num_gpu_batches" in self.constraints:
            nb = self.constraints["num_gpu_batches"]
            chain = _Chain(combo, gbs, nb)
            if nb > max_batches:
                chain.points[nb] = _Point("infeasible", 0.0)
            return chain
        return _Chain(combo, gbs, max_batches)

    @staticmethod
    def chain_best(chain: _Chain) -> float:
        return max((p.value for p in chain.points.values() if p.status == "fits"), default=0.0)

    def branch_and_bound(self, chains: list[_Chain]) -> None:
        """Best-first: probe the midpoints of the intervals with the highest bounds until no
        interval can beat its scheduler's incumbent by more than the tolerance."""
        while True:
            candidates, to_bound = [], []
            for chain in chains:
                incumbent = self.incumbents[chain.combo.scheduler][0] * (1 + TOLERANCE)
                if "num_gpu_batches" in self.constraints:
                    nb = chain.max_batches
                    if nb not in chain.points:
                        candidates.append((float("inf"), id(chain), chain, nb))
                    continue
                for lo, hi in chain.intervals():
                    bound = self.interval_bound(chain, lo, hi)
                    key = (chain.combo, chain.gpu_batch_size, lo, hi)
                    if bound > incumbent and key not in self._lp_bounds and lo and hi - lo > 2 \
                            and hi <= lo * NARROW:
                        to_bound.append((chain, lo, hi))
                        continue
                    bound = min(bound, self._lp_bounds.get(key, bound))
                    if bound > incumbent:
                        candidates.append((bound, id(chain), chain, (lo + hi) // 2))
            if to_bound:
                self.bound_intervals(to_bound)
                continue
            if not candidates:
                return
            if self.solved >= MAX_LPS:
                self.complete = False
                return
            candidates.sort(key=lambda c: -c[0])
            self.probe([(chain, nb) for _, _, chain, nb in candidates[:ROUND]])

    def bound_intervals(self, items: list[tuple[_Chain, int, int]]) -> None:
        """LP bounds on narrow intervals: the top's pass times under the bottom's memory rows."""
        problems = []
        for chain, lo, hi in items:
            policy, run, costs = self.costs(chain, hi - 1)
            memory = self.costs(chain, lo + 1)[2]
            problems.append(lp.PlacementLP(costs=tuple(costs), generated_tokens=run.generated_tokens,
                                           overlap=policy.overlap, budgets=self.budgets,
                                           fixed=self.fixed_fractions, memory_costs=tuple(memory),
                                           host_budget=self.hardware.host_budget))
        self.solved += len(problems)
        for (chain, lo, hi), solution in zip(items, lp.solve(problems)):
            bound = 1.0 / solution.seconds_per_token * self.bound_factor if solution.fits else 0.0
            self._lp_bounds[(chain.combo, chain.gpu_batch_size, lo, hi)] = bound

    def interval_bound(self, chain: _Chain, lo: int, hi: int) -> float:
        """Upper bound on throughput for num_gpu_batches strictly between lo and hi (bounds.py)."""
        key = (chain.combo, chain.gpu_batch_size, lo, hi)
        if key not in self._interval_bounds:
            top = hi - 1
            box = self.box(chain, lo + 1)
            if box is None:
                bound = 0.0  # nothing from lo + 1 up fits
            else:
                policy, run, costs = self.costs(chain, top)
                seconds = time_lower_bound(costs, policy.overlap, box)
                bound = run.generated_tokens / seconds * self.bound_factor if seconds > 0 else float("inf")
            if lo:  # more micro-batches never shorten a pass: throughput grows at most like B
                bound = min(bound, chain.points[lo].value * top / lo * self.bound_factor)
            self._interval_bounds[key] = bound
        return self._interval_bounds[key]

    def box(self, chain: _Chain, nb: int):
        key = (chain.combo, chain.gpu_batch_size, nb)
        if key not in self._boxes:
            _, _, costs = self.costs(chain, nb)
            self._boxes[key] = fraction_box(costs, self.budgets, self.fixed)
        return self._boxes[key]

    # ---- evaluation ------------------------------------------------------------------------
    def knobs(self, combo: Combo, gbs: int, nb: int) -> Policy:
        base = Policy(gpu_batch_size=gbs, num_gpu_batches=nb, scheduler=combo.scheduler,
                      compress_weight=combo.compress_weight, compress_kv=combo.compress_kv,
                      cpu_attention=combo.cpu_attention, routed_expert_reads=combo.routed_expert_reads,
                      cpu_experts=combo.cpu_experts,
                      overlap=self.constraints.get("overlap", True),
                      pin_weight=self.constraints.get("pin_weight", True))
        budget = self.constraints.get("prefill_budget")
        if budget is None:
            budget = (steady_prefill_budget(base, self.workload) if combo.scheduler == "decode-maximal"
                      else max(1, min(base.max_running, self.max_running) * self.workload.max_prompt_len))
        return base.replace(prefill_budget=budget, kv_admission=kv_admission(self.workload))

    def costs(self, chain: _Chain, nb: int):
        key = (chain.combo, chain.gpu_batch_size, nb)
        if key not in self._costs:
            policy = self.knobs(chain.combo, chain.gpu_batch_size, nb)
            run, costs = pass_costs(policy, self.model, self.hardware, self.workload)
            self._costs[key] = (policy, run, costs)
        return self._costs[key]

    def probe(self, items: list[tuple[_Chain, int]]) -> None:
        """Settle each (chain, num_gpu_batches): by the relaxation when it proves the point cannot
        fit or cannot beat the incumbent, else by its LP."""
        to_solve = []
        for chain, nb in items:
            policy, run, costs = self.costs(chain, nb)
            bound = placement_bound(costs, run.generated_tokens, policy.overlap, self.budgets, self.fixed)
            if bound <= 0:
                chain.points[nb] = _Point("infeasible", 0.0)
            elif bound <= self.incumbents[chain.combo.scheduler][0] * (1 + TOLERANCE):
                chain.points[nb] = _Point("dominated", bound)
            else:
                to_solve.append((chain, nb, policy, run, costs, bound))
        # Seconds per token are at least 1 / bound: a tie-break a millionth of that never decides
        # anything but ties.
        problems = [lp.PlacementLP(costs=tuple(costs), generated_tokens=run.generated_tokens,
                                   overlap=policy.overlap, budgets=self.budgets, fixed=self.fixed_fractions,
                                   tie_break=TIE_BREAK / bound, host_budget=self.hardware.host_budget)
                    for _, _, policy, run, costs, bound in to_solve]
        solutions = lp.solve(problems)
        self.solved += len(problems)
        for (chain, nb, policy, run, costs, _), problem, solution in zip(to_solve, problems, solutions):
            if solution.fits:
                solution = self.fit_largest_pass(problem, solution, policy, run)
            if not solution.fits:
                chain.points[nb] = _Point("infeasible", 0.0)
                continue
            placed = policy.replace(**solution.fractions)
            value = 1.0 / solution.seconds_per_token
            chain.points[nb] = _Point("fits", value, placed)
            scheduler = chain.combo.scheduler
            if value > self.incumbents[scheduler][0]:
                self.incumbents[scheduler] = (value, placed)

    def largest_pass_overshoot(self, policy: Policy, run, costs) -> float:
        """Bytes by which the engine's fail-early check (working_set.worst_pass_bytes: the largest
        pass of each kind the scheduler forms, beside the weights, buffers and KV pools) would
        exceed the gpu budget with this placement. The LP prices the run's modelled passes, which
        are averages (a steady pass holds a share of a prompt chunk); the engine refuses a batch
        whose largest possible pass does not fit, so the answer must fit that pass too."""
        wl, fractions = self.workload, {n: getattr(policy, n) for n in FRACTIONS}
        cost = costs[0]
        homes = evaluate(cost.memory["gpu"], fractions) - evaluate(
            working_bytes(cost.shape, run, policy, self.model), fractions)
        running = max(1, round(run.running))
        pools = {tier: getattr(policy, f"kv_{tier}") * run.kv_tokens for tier in TIERS}
        largest = worst_pass_bytes(self.model, policy, running, [wl.max_prompt_len] * running,
                                   [wl.max_total_len] * running, pools)
        return homes + largest - self.budgets["gpu"]

    def fit_largest_pass(self, problem: lp.PlacementLP, solution: lp.PlacementSolution, policy: Policy,
                         run) -> lp.PlacementSolution:
        """The LP's answer, re-solved on a gpu budget lowered by the overshoot until the largest
        pass fits too (largest_pass_overshoot); a solution that does not fit when it cannot."""
        budgets = dict(problem.budgets)
        for _ in range(LARGEST_PASS_ROUNDS):
            over = self.largest_pass_overshoot(policy.replace(**solution.fractions), run, problem.costs)
            if over <= 0:
                return solution
            budgets["gpu"] -= over + lp.MARGIN_BYTES
            if budgets["gpu"] <= 0:
                break
            solution = lp.solve([replace(problem, budgets=dict(budgets))])[0]
            self.solved += 1
            if not solution.fits:
                return solution
        return lp.PlacementSolution(overflow_bytes=max(over, 1.0), fractions=None, seconds_per_token=float("inf"))

    # ---- failure ---------------------------------------------------------------------------
    def infeasible_message(self) -> str:
        """Why nothing fits, with the arithmetic of the most frugal policy (1 sequence, all 4-bit)."""
        m, hw, wl = self.model, self.hardware, self.workload
        budgets = self.budgets
        have = (f"gpu {fmt_bytes(budgets['gpu'])} + cpu {fmt_bytes(budgets['cpu'])} + disk "
                f"{fmt_bytes(budgets['disk'])} ({hw.memory_usable_fraction:.0%} of {fmt_bytes(hw.gpu_memory)}"
                f" / {fmt_bytes(hw.cpu_memory)} / {fmt_bytes(hw.disk_memory)})")
        head = f"no policy fits {m.name} ({wl.describe()}) on {hw.name}"
        weights = m.weight_bytes(True)
        kv = wl.max_total_len * m.num_layers * m.kv_bytes_per_token(True)
        shared = "" if hw.host_budget is None else f", gpu + cpu within {fmt_bytes(hw.host_budget)} (both host RAM)"
        if weights + kv > hw.total_budget():
            return (f"{head}: it needs at least {fmt_bytes(weights + kv)} (weights "
                    f"{fmt_bytes(weights)} in 4-bit, {fmt_bytes(m.weight_bytes(False))} in fp16, plus "
                    f"one sequence's 4-bit KV cache {fmt_bytes(kv)}) but all tiers together hold "
                    f"{fmt_bytes(hw.total_budget())}: {have}{shared}")
        frugal = self.knobs(Combo("block", True, True, False), 1, 1)
        _, costs = pass_costs(frugal, m, hw, wl)
        off_gpu = {n: (1.0 if n.endswith("_cpu") else 0.0) for n in FRACTIONS}
        gpu_need = max(evaluate(c.memory["gpu"], off_gpu) for c in costs)
        if gpu_need > budgets["gpu"]:
            return (f"{head}: even one sequence with 4-bit weights and KV cache, everything offloaded, "
                    f"needs {fmt_bytes(gpu_need)} of GPU working memory (streamed layer buffers and "
                    f"activations) against a GPU budget of {fmt_bytes(budgets['gpu'])}; all tiers: {have}")
        return (f"{head}: the 4-bit weights ({fmt_bytes(weights)}) and one sequence's KV cache "
                f"({fmt_bytes(kv)}) fit in total, but no split satisfies every tier's working set at "
                f"once (disk-resident data needs host staging buffers, offloaded data GPU buffers); "
                f"tiers: {have}")
