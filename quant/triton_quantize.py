"""`quantize` of a compressed KV pool's new V rows in one Triton launch, the same bits as quant.groupwise.

Why: a decode layer-step quantizes its new V rows (per token, groups along the head) before it
stores them; through quant.groupwise that is about 30 launches on a GPU (min, max, the safe fp16
roundings by nextafter, the division, round, clamp, the non-finite flag, the packing), more than
the rest of the layer, at ~25 us of host time each (docs/DESIGN.md, "Decode passes on a GPU").

The same arithmetic in one program per line (a token's head of d values): the fp16 minimum rounded
down and the step rounded up (quant/group_params.py), each fp32 operation rounding to nearest as
torch's do (IEEE division by `div_rn`, nextafter by bit arithmetic, round half to even by floor),
so the codes, scales and minimums are torch's bit for bit (tests/quant/test_triton_quantize.py in
the interpreter; tests/offload/test_cuda.py on a GPU). A line's codes are packed in split halves
(byte i: code i, code i + d / 2).

Covered: 4 bits, asymmetric, fp16 scale and minimum, split halves per line, groups along the last
dimension that tile it exactly (what KVCompression's V is), x in fp32, fp16 or bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.config import QuantConfig
from quant.group_params import UnrepresentableGroups
from quant.qtensor import QTensor


def covers(config: QuantConfig, head_dim: int) -> bool:
    return (config.bits == 4 and not config.symmetric and not config.minimum_fp32 and config.line_halves
            and head_dim % 2 == 0 and head_dim % config.group_size == 0)


def quantize_lines(x: torch.Tensor, config: QuantConfig, *, nonfinite: torch.Tensor | None = None,
                   into: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None) -> QTensor | None:
    """x [..., d]: quant.groupwise.quantize(x, config), the same bits. nonfinite: a bool scalar on x's
    device set where some group's minimum or step is not a finite fp16 (inf, NaN or out of fp16's
    range), without a host sync; None: checked here (a sync). into: (tables, rows) to write x [T, H, d]
    straight into a KV pool's V tables of one layer (data [slots, H * d / 2], scale and minimum
    [slots, H * d / group]) at row rows[t] for token t, and return None (a store with no copy after it)."""
    dim = x.shape[-1]
    heads = x.shape[-2] if x.dim() >= 2 else 1
    lines = x.reshape(-1, heads, dim)  # [T, H, d]: a view of a fused projection's strided V (no copy)
    if lines.stride(-1) != 1:
        lines = lines.contiguous()
    num_lines, groups = lines.shape[0] * heads, dim // config.group_size
    if into is None:
        data = torch.empty(num_lines * dim // 2, dtype=torch.uint8, device=x.device)
        scale = torch.empty(num_lines * groups, dtype=torch.float16, device=x.device)
        minimum, rows = torch.empty_like(scale), data  # rows: unread
    else:
        (tables, rows), (data, scale, minimum) = into, (into[0][n] for n in ("data", "scale", "minimum"))
    flag = nonfinite if nonfinite is not None else torch.zeros((), dtype=torch.bool, device=x.device)
    if num_lines:
        _quantize_kernel[(num_lines,)](lines, data, scale, minimum, flag.view(torch.uint8), rows, lines.stride(0),
                                       lines.stride(1), **constants(config, heads, dim, into is not None), **OPTIONS)
    if nonfinite is None and bool(flag):
        raise UnrepresentableGroups("quantize needs finite values whose group minimum and step fit in fp16; "
                                    "got inf, NaN or a value out of that range")
    if into is not None:
        return None
    return QTensor(data=data, scale=scale, minimum=minimum, shape=tuple(x.shape), dtype=x.dtype, config=config)


# no a * b + c contracted into one rounding (Triton's default fuses them): torch's bits
OPTIONS = {"enable_fp_fusion": False}


def constants(config: QuantConfig, heads: int, dim: int, into_rows: bool = False) -> dict:
    """The kernel's compile-time constants for lines of `dim` values, `heads` per row (into_rows: each
    token's lines go to the table row its `rows` entry names)."""
    half, groups = dim // 2, dim // config.group_size
    return dict(INTO_ROWS=into_rows, HEADS=heads, HALF=half, HALF_PAD=triton.next_power_of_2(half),
                GROUP=config.group_size, GROUPS=groups,
                GROUPS_PAD=triton.next_power_of_2(groups), MAX_CODE=config.max_code)


@triton.jit
def _fp16_step(h, UP: tl.constexpr):
    """nextafter(h, +inf) (UP) or nextafter(h, -inf) of fp16 h, on its bits (sign and magnitude)."""
    bits = h.to(tl.int16, bitcast=True).to(tl.int32)  # negative: the sign bit is set
    if UP:  # +x: magnitude up; -0: the smallest positive; -x: magnitude down
        bits = tl.where(bits >= 0, bits + 1, tl.where(bits == -32768, 1, bits - 1))
    else:  # +x (x > 0): magnitude down; +0: the smallest negative; -x: magnitude up
        bits = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1))
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _next_up(x):
    """nextafter(x, +inf) of fp32 x >= 0 (spans and steps): one more in its bits."""
    return (x.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, minimum_ptr, flag_ptr, rows_ptr, stride_row, stride_head,
                     INTO_ROWS: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     GROUP: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, MAX_CODE: tl.constexpr):
    line = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, 2)[:, None]  # [2, 1] row 0: the line's first half, row 1: its second
    i = tl.arange(0, HALF_PAD)[None, :]  # [1, H]
    ok = (i < HALF) & (r < 2)  # [2, H]
    start = (line // HEADS) * stride_row + (line % HEADS) * stride_head  # line: (token, head)
    x = tl.load(x_ptr + start + r * HALF + i, mask=ok, other=0.0).to(tl.float32)
    group = (r * HALF + i) // GROUP  # [2, H] each value's group
    g = tl.arange(0, GROUPS_PAD)[:, None, None]  # [G, 1, 1]
    member = (group[None, :, :] == g) & ok[None, :, :]  # [G, 2, H]
    low = tl.min(tl.min(tl.where(member, x[None, :, :], float("inf")), axis=2), axis=1)  # [G]
    high = tl.max(tl.max(tl.where(member, x[None, :, :], float("-inf")), axis=2), axis=1)
    finite = tl.sum(tl.sum((member & ((x != x) | (tl.abs(x) == float("inf")))[None, :, :]).to(tl.int32), axis=2),
                    axis=1) == 0
    # quant/group_params.py: the minimum rounded down to fp16, the step up (each fp32 op rounds to nearest)
    nearest = low.to(tl.float16)
    minimum = tl.where(nearest.to(tl.float32) > low, _fp16_step(nearest, False), nearest)
    span = _next_up(high - minimum.to(tl.float32))
    step = tl.maximum(_next_up(tl.math.div_rn(span, tl.full(span.shape, MAX_CODE, tl.float32))), 2.0**-24)
    nearest = step.to(tl.float16)
    scale = tl.where(nearest.to(tl.float32) < step, _fp16_step(nearest, True), nearest)
    g_ok = tl.arange(0, GROUPS_PAD) < GROUPS
    representable = (tl.abs(scale.to(tl.float32)) < float("inf")) & (tl.abs(minimum.to(tl.float32)) < float("inf"))
    bad = g_ok & ~(finite & representable)
    tl.store(flag_ptr + tl.zeros([GROUPS_PAD], tl.int32), tl.full([GROUPS_PAD], 1, tl.uint8), mask=bad)
    if INTO_ROWS:  # token t's head h: line h of table row rows[t]
        out = tl.load(rows_ptr + line // HEADS).to(tl.int64) * HEADS + line % HEADS
    else:
        out = line
    tl.store(scale_ptr + out * GROUPS + tl.arange(0, GROUPS_PAD), scale, mask=g_ok)
    tl.store(minimum_ptr + out * GROUPS + tl.arange(0, GROUPS_PAD), minimum, mask=g_ok)
    # each value's own group's minimum and scale: a select over the few groups of the line (where,
    # not a product: an empty padding group's inf would make 0 * inf)
    value_min = tl.sum(tl.where(member, minimum.to(tl.float32)[:, None, None], 0.0), axis=0)  # [2, H]
    value_scale = tl.where(ok, tl.sum(tl.where(member, scale.to(tl.float32)[:, None, None], 0.0), axis=0), 1.0)
    steps = tl.math.div_rn(x - value_min, value_scale)
    down = tl.floor(steps)
    frac = steps - down  # exact: steps < 2**23
    odd = (down.to(tl.int32) % 2) == 1
    rounded = down + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)  # half to even, as torch.round
    codes = tl.minimum(tl.maximum(rounded, 0.0), MAX_CODE).to(tl.int32)  # [2, H]
    packed = tl.sum(tl.where(r == 0, codes, codes << 4), axis=0).to(tl.uint8)  # [H]: byte i = code i | code i + H
    tl.store(data_ptr + out * HALF + tl.arange(0, HALF_PAD), packed, mask=tl.arange(0, HALF_PAD) < HALF)
