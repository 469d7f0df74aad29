"""The group-wise quantization format written from its specification, in numpy, independently of
quant/: the reference that the engine's quantized weights and KV blocks are checked against.

The format (docs/DESIGN.md, "Tiers"; policy_search/quant_format.py): min-max asymmetric groups of
`group_size` consecutive values along one dimension (weights: 64 along the input dimension; KV: V
per token along the head dimension, 64 or the head size; K per channel over one 64-token block),
`bits`-bit codes, an fp16 minimum (the value of code 0) and an fp16 step. Both are rounded towards
safety (quant/group_params.py's contract): the minimum is the largest fp16 <= the group's smallest
value; the step is the smallest fp16 >= an fp32 upper bound of (max - minimum) / max_code (the fp32
difference and quotient each stepped one ulp up after rounding), at least 2**-24. A value's code is
round-half-even((x - minimum) / step) in fp32, clamped to [0, max_code]; it reads back as
code * step + minimum in fp32 (the product is exact, the sum rounded once). A line whose length is
not a multiple of the group has a shorter last group (its minimum and maximum over its real values).
4-bit codes are packed two per byte as split halves of each line: byte j holds code j in its low
nibble and code j + n/2 in its high nibble (quant/packing.py's documented layout).
"""
from __future__ import annotations

import numpy as np
import torch

F32, F16 = np.float32, np.float16


def _largest_fp16_at_most(x: np.ndarray) -> np.ndarray:
    nearest = x.astype(F16)
    return np.where(nearest.astype(F32) > x, np.nextafter(nearest, F16(-np.inf)), nearest)


def _smallest_fp16_at_least(x: np.ndarray) -> np.ndarray:
    nearest = x.astype(F16)
    return np.where(nearest.astype(F32) < x, np.nextafter(nearest, F16(np.inf)), nearest)


def group_step_and_minimum(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [G, n] (a short last group padded with copies of its last value) -> fp16 step, minimum [G]."""
    max_code = F32(2**bits - 1)
    minimum = _largest_fp16_at_most(groups.min(axis=1))
    span = np.nextafter((groups.max(axis=1) - minimum.astype(F32)).astype(F32), F32(np.inf))
    step = np.maximum(np.nextafter((span / max_code).astype(F32), F32(np.inf)), F32(2.0**-24))
    return _smallest_fp16_at_least(step), minimum


def quantize_groups(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 [G, n] -> (uint8 codes [G, n], fp16 step [G], fp16 minimum [G])."""
    step, minimum = group_step_and_minimum(groups, bits)
    steps = ((groups - minimum.astype(F32)[:, None]).astype(F32) / step.astype(F32)[:, None]).astype(F32)
    return np.clip(np.rint(steps), 0, 2**bits - 1).astype(np.uint8), step, minimum


def read_back(codes: np.ndarray, step: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """codes [G, n], fp16 step and minimum [G] -> fp32 code * step + minimum."""
    return codes.astype(F32) * step.astype(F32)[:, None] + minimum.astype(F32)[:, None]


def to_groups(x: torch.Tensor, group_size: int, group_dim: int = -1) -> np.ndarray:
    """A tensor -> fp32 [lines * groups_per_line, group_size], lines along `group_dim`, a short last
    group padded with copies of the line's last value (so its min and max are its real values')."""
    lines = x.detach().float().movedim(group_dim, -1).reshape(-1, x.shape[group_dim]).numpy()
    pad = -lines.shape[1] % group_size
    lines = np.pad(lines, ((0, 0), (0, pad)), mode="edge")
    return np.ascontiguousarray(lines.reshape(-1, group_size))


def from_groups(values: np.ndarray, shape: tuple[int, ...], group_dim: int = -1) -> torch.Tensor:
    """to_groups' inverse: [G, group_size] -> a tensor of `shape` (padding dropped)."""
    moved = list(shape)
    moved.append(moved.pop(group_dim % len(shape)))
    lines = values.reshape(-1, values.size // int(np.prod(moved[:-1])))[:, :moved[-1]]
    return torch.from_numpy(np.ascontiguousarray(lines)).reshape(moved).movedim(-1, group_dim)


def round_trip(x: torch.Tensor, group_size: int, bits: int = 4, group_dim: int = -1) -> torch.Tensor:
    """What `x` reads back as after quantizing (fp32, x's shape)."""
    groups = to_groups(x, group_size, group_dim)
    return from_groups(read_back(*quantize_groups(groups, bits)), tuple(x.shape), group_dim)


def unpack_split_halves(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., m] -> codes [..., 2m]: low nibbles are the first half of the line, high the second."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
