"""Affine expressions in the placement fractions, shared by the estimator and the LP.

An expression is a numpy vector `[constant, coef(w_gpu), coef(w_cpu), ..., coef(act_disk)]`, so the
cost model is written once with ordinary arithmetic (`expr = W * (w_cpu + w_disk) + 3.0`) and then
either evaluated at a policy's fractions (`evaluate`) or handed to the LP solver term by term.
"""
from __future__ import annotations

import numpy as np

FRACTIONS = ("w_gpu", "w_cpu", "w_disk", "kv_gpu", "kv_cpu", "kv_disk", "act_gpu", "act_cpu", "act_disk")
FRACTION_GROUPS = (("w_gpu", "w_cpu", "w_disk"), ("kv_gpu", "kv_cpu", "kv_disk"),
                   ("act_gpu", "act_cpu", "act_disk"))
_INDEX = {name: i + 1 for i, name in enumerate(FRACTIONS)}
SIZE = len(FRACTIONS) + 1


def const(value: float) -> np.ndarray:
    out = np.zeros(SIZE)
    out[0] = value
    return out


def var(name: str) -> np.ndarray:
    out = np.zeros(SIZE)
    out[_INDEX[name]] = 1.0
    return out


class Fractions:
    """The nine placement fractions as expressions: `f.w_cpu`, `f.kv_off_gpu` (= kv_cpu + kv_disk)..."""

    def __init__(self) -> None:
        for name in FRACTIONS:
            setattr(self, name, var(name))
        self.w_off_gpu = self.w_cpu + self.w_disk
        self.kv_off_gpu = self.kv_cpu + self.kv_disk
        self.act_off_gpu = self.act_cpu + self.act_disk


FRACTION_EXPRS = Fractions()


def evaluate(expr: np.ndarray, fractions: dict[str, float]) -> float:
    point = np.array([1.0] + [float(fractions[name]) for name in FRACTIONS])
    return float(expr @ point)


def terms(expr: np.ndarray) -> tuple[float, list[tuple[str, float]]]:
    """(constant, [(fraction name, coefficient), ...]) with zero coefficients dropped."""
    return float(expr[0]), [(name, float(expr[i + 1])) for i, name in enumerate(FRACTIONS)
                            if expr[i + 1] != 0.0]
