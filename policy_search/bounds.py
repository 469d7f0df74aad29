"""Cheap bounds that let the search skip LPs.

The relaxation: from each memory row (constant + sum a_v x_v <= budget, all a_v >= 0) derive a box
of caps on the fractions (`fraction_box`), then minimise each time chain separately over the box (a
greedy fill, cheapest tier first; `time_lower_bound`). That bounds every pass's time from below, so
throughput from above (`placement_bound`); no box proves the knobs cannot fit at all.

Along a chain (fixed gpu_batch_size, growing running count B) memory only grows, so the box at B
contains the box at every larger B; and with a fixed box each chain's minimum is a concave function
of B that is >= 0 at B = 0, so relaxed time / B never rises. Hence for B' in (lo, hi),
    throughput(B') <= generated(hi-1) / time_lower_bound(costs(hi-1), fraction_box(costs(lo+1))),
a bound on a whole interval from two evaluations (the search's interval pruning).
"""
from __future__ import annotations

import numpy as np

from policy_search.cost_model import PassCost, time_terms
from policy_search.linear import FRACTIONS
from policy_search.policy import TIERS

_GROUPS = 3  # weights, KV cache, activations; each 3 tiers, in linear.FRACTIONS order


def _box(fixed: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    lower = np.zeros(len(FRACTIONS))
    upper = np.ones(len(FRACTIONS))
    for name, value in fixed.items():
        i = FRACTIONS.index(name)
        lower[i] = upper[i] = value
    return lower.reshape(_GROUPS, 3), upper.reshape(_GROUPS, 3)


def _group_mins(coefs: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """For coefs [rows, groups, 3]: min of sum(coefs * x) per row and group over lower <= x <= upper,
    sum(x) = 1: start at the lower bounds, fill the cheapest tiers first."""
    order = np.argsort(coefs, axis=-1, kind="stable")
    c = np.take_along_axis(coefs, order, axis=-1)
    lo = np.broadcast_to(lower, coefs.shape)
    room = np.take_along_axis(np.broadcast_to(upper, coefs.shape) - lo, order, axis=-1)
    rest = 1.0 - lower.sum(axis=-1)  # [groups]
    total = (coefs * lo).sum(axis=-1)
    for j in range(3):
        take = np.minimum(rest, room[..., j])
        total = total + c[..., j] * take
        rest = rest - take
    return total


def fraction_box(costs: list[PassCost], budgets: dict[str, float], fixed: dict[str, float]):
    """(lower, upper) [groups, 3] implied by each memory row alone; None if a row cannot hold."""
    lower, upper = _box(fixed)
    if (lower.sum(axis=1) > 1 + 1e-9).any() or (upper.sum(axis=1) < 1 - 1e-9).any():
        return None
    rows = np.array([cost.memory[t] for cost in costs for t in TIERS])
    limits = np.array([budgets[t] for _ in costs for t in TIERS])
    rows = rows[(rows[:, 1:] >= 0).all(axis=1)]  # the derivation needs non-negative coefficients
    coefs = rows[:, 1:].reshape(-1, _GROUPS, 3)
    for _ in range(2):  # a second sweep uses the tightened caps
        mins = _group_mins(coefs, lower, upper)  # [rows, groups]
        slack = limits[:len(rows)] - rows[:, 0] - mins.sum(axis=1)
        if (slack < 0).any():
            return None
        room = slack[:, None] + mins  # what each group may use at most, per row
        # a_v x + others (1 - x) <= room, with others the cheaper of the group's other two tiers
        others = np.stack([np.minimum(coefs[..., 1], coefs[..., 2]), np.minimum(coefs[..., 0], coefs[..., 2]),
                           np.minimum(coefs[..., 0], coefs[..., 1])], axis=-1)
        gap = coefs - others
        with np.errstate(divide="ignore", invalid="ignore"):
            caps = np.where(gap > 0, (room[..., None] - others) / gap, np.inf)
        upper = np.minimum(upper, np.maximum(caps.min(axis=0), 0.0))
        upper = np.maximum(upper, lower)
        if (upper.sum(axis=1) < 1 - 1e-9).any():
            return None
    return lower, upper


def time_lower_bound(costs: list[PassCost], overlap: bool, box) -> float:
    """Seconds the run takes at least, for any placement inside `box` (lower, upper)."""
    lower, upper = box
    seconds = 0.0
    for cost in costs:
        chains = np.array(list(time_terms(cost.resources, overlap, cost.on_host).values()))
        mins = chains[:, 0] + _group_mins(chains[:, 1:].reshape(-1, _GROUPS, 3), lower, upper).sum(axis=1)
        seconds += cost.shape.count * mins.max()
    return seconds


def placement_bound(costs: list[PassCost], generated_tokens: float, overlap: bool,
                    budgets: dict[str, float], fixed: dict[str, float], memory: bool = True) -> float:
    """Upper bound on throughput (tokens/s) over all placements; 0.0 when none can fit."""
    box = fraction_box(costs, budgets, fixed) if memory else free_box(fixed)
    if box is None:
        return 0.0
    seconds = time_lower_bound(costs, overlap, box)
    return generated_tokens / seconds if seconds > 0 else float("inf")


def free_box(fixed: dict[str, float]):
    """The box without memory caps: only the fixed fractions."""
    return _box(fixed)
