"""The fp16 scale and minimum of each group, chosen so the round-trip error is at most half a step.

Both are rounded towards safety when cast to fp16: the minimum DOWN (so no value lies below code 0)
and the step UP (so `(max - minimum) / scale <= max_code`: no value lies above the top code). Every
value then sits within `scale / 2` of a code, and that is the round-trip error, up to the fp32
rounding of the arithmetic that picks and reads back the code.
"""
from __future__ import annotations

import torch

from quant.config import QuantConfig

# The smallest positive fp16 (a subnormal). Constant groups get this step instead of 0, so codes are
# computed without dividing by zero; a constant fp16 group then reads back exactly (code 0 = minimum).
_SMALLEST_STEP = 2.0**-24
_FP16_MAX = torch.finfo(torch.float16).max


def scale_and_minimum(groups: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `[num_groups, group_size]` -> fp16 (scale, minimum), each `[num_groups]`."""
    if config.symmetric:
        # Codes [0, max_code] stand for (code - zero_code) * scale, e.g. [-8, 7] * scale at 4 bits:
        # the positive side is one step shorter, so it sets the step.
        absmax = groups.abs().amax(dim=-1)
        step = _next_up(absmax / _constant(absmax, config.max_code - config.zero_code))
        scale = _round_up_to_fp16(step.clamp_(min=_SMALLEST_STEP))
        minimum = scale * -config.zero_code  # exact in fp16: the zero code is a power of two
        return scale, minimum
    group_min, group_max = groups.amin(dim=-1), groups.amax(dim=-1)  # aminmax is not vectorised on CPU
    minimum = _round_down_to_fp16(group_min)
    # Each fp32 operation rounds to nearest, so stepping one ulp up afterwards gives an upper bound
    # of the exact span and the exact step; rounding up to fp16 then keeps it one.
    span = _next_up(group_max - minimum.float())
    step = _next_up(span / _constant(span, config.max_code))
    scale = _round_up_to_fp16(step.clamp_(min=_SMALLEST_STEP))
    return scale, minimum


_CONSTANTS: dict[tuple, torch.Tensor] = {}  # (device, dtype, value) -> a 0-dim tensor that broadcasts


def _constant(like: torch.Tensor, value: float) -> torch.Tensor:
    """value as a 0-dim tensor on like's device and dtype, made once.

    Why a tensor and not a Python number: on CUDA, `x / number` is computed as x * (1 / number)
    (PyTorch's div_true_kernel_cuda for a CPU scalar), up to an ulp off the IEEE quotient the CPU
    and quant/triton_quantize.py compute, so a step could round below the exact one and the two
    devices' codes differ; a device tensor divisor gets a true division. Made once: a [groups]-sized
    full_like per call was one kernel launch more (a compressed KV store runs several per layer)."""
    key = (like.device, like.dtype, value)
    if key not in _CONSTANTS:
        with torch.inference_mode(False):  # usable in and out of inference mode
            _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return _CONSTANTS[key]


def _infinity(like: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """+-inf as a 0-dim tensor on like's device and dtype (what nextafter steps towards)."""
    return _constant(like, sign * float("inf"))


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, _infinity(x))


def _round_up_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the smallest fp16 >= x."""
    nearest = x.half()
    below = nearest.float() < x
    return torch.where(below, torch.nextafter(nearest, _infinity(nearest)), nearest)


def _round_down_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 <= x."""
    nearest = x.half()
    above = nearest.float() > x
    return torch.where(above, torch.nextafter(nearest, _infinity(nearest, -1.0)), nearest)


class UnrepresentableGroups(ValueError):
    """Some group's minimum or step is not a finite fp16: the values hold a NaN or an inf (which
    propagate through the group's min and max), or a magnitude beyond fp16's range."""


def check_representable(scale: torch.Tensor, minimum: torch.Tensor) -> None:
    if not (torch.isfinite(scale).all() and torch.isfinite(minimum).all()):
        raise UnrepresentableGroups(
            "quantize needs finite values whose group minimum and step fit in fp16 "
            f"(magnitude <= {_FP16_MAX:g}); got inf, NaN or a value out of that range"
        )
