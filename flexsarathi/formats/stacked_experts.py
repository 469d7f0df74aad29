"""Expert weights a checkpoint stores as one tensor over all experts (models/base.py StackedExperts:
transformers' gpt-oss), turned into the engine's row stacks: pure functions of the stored tensors.

Two stored forms of a weight, both as transformers reads them:
- floats, [E, in, out] (x @ W per expert): each expert's matrix transposed to [out, in];
- MXFP4 (OCP microscaling FP4, OpenAI's release format): `<name>_blocks` [E, out, in / 32, 16] uint8,
  two E2M1 codes a byte (low nibble first), and `<name>_scales` [E, out, in / 32] uint8, a power of
  two per 32 values (E8M0: 2 ** (s - 127)). Decoded exactly: every code times its power of two is a
  float32 (and a bfloat16) as it is, as transformers' `convert_moe_packed_tensors` decodes them.
Biases are [E, out]. An interleaved stack (gate and up rows alternating) has each expert's even
rows put first, then its odd ones: the gate rows, then the up rows, as the engine fuses them.
"""
from __future__ import annotations

import math

import torch

from flexsarathi.errors import CheckpointError
from flexsarathi.models.base import StackedExperts

# E2M1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"


def stored_form(name: str, available, how: StackedExperts) -> str:
    """"float" where the checkpoint holds `name`, "mxfp4" where it holds its blocks and scales (a
    weight's: biases are floats)."""
    if name in available:
        return "float"
    if not how.bias and name + BLOCKS in available and name + SCALES in available:
        return "mxfp4"
    raise CheckpointError(f"tensor {name} is missing from the checkpoint (nor are its MXFP4 {name}{BLOCKS} and "
                          f"{name}{SCALES} there)")


def stored_shapes(how: StackedExperts, form: str, num_experts: int, shape: tuple[int, ...]) -> dict[str, tuple]:
    """{suffix: the stored shape} of a canonical stack of `shape` ([E * out, in] or [E * out])."""
    out = shape[0] // num_experts
    if how.bias:
        return {"": (num_experts, out)}
    cols = shape[1]
    if form == "float":
        return {"": (num_experts, cols, out)}
    if cols % MXFP4_GROUP:
        raise CheckpointError(f"MXFP4 weights need rows of a multiple of {MXFP4_GROUP} values, got {cols}")
    return {BLOCKS: (num_experts, out, cols // MXFP4_GROUP, MXFP4_GROUP // 2),
            SCALES: (num_experts, out, cols // MXFP4_GROUP)}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] float32, exactly."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.flatten(-2)


def assemble(how: StackedExperts, form: str, parts: dict[str, torch.Tensor], num_experts: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The canonical stack in `dtype` from the stored tensors ({suffix: tensor}, stored_shapes'),
    one expert at a time (a layer's experts are its largest weights: one expert's conversion is held
    at a time beside the result)."""
    if how.bias:
        stored = parts[""]
        return _deinterleaved(stored.to(dtype), how).reshape(-1)
    if form == "float":
        stored = parts[""]  # [E, in, out]
        experts, cols, out = stored.shape
    else:
        experts, out = parts[BLOCKS].shape[:2]
        cols = math.prod(parts[BLOCKS].shape[2:]) * 2
    result = torch.empty(experts * out, cols, dtype=dtype)
    for e in range(experts):
        if form == "float":
            matrix = parts[""][e].t()  # [out, in]
        else:
            matrix = dequantize_mxfp4(parts[BLOCKS][e], parts[SCALES][e])  # [out, in]
        result[e * out:(e + 1) * out] = _deinterleaved(matrix, how)
    return result


def _deinterleaved(rows: torch.Tensor, how: StackedExperts) -> torch.Tensor:
    """An expert's weight rows [out, in] (or every expert's biases [E, out]) with an interleaved
    stack's even rows first, then its odd ones."""
    if not how.interleaved:
        return rows
    dim = -1 if how.bias else -2
    index = torch.arange(rows.shape[dim])
    return rows.index_select(dim, torch.cat((index[0::2], index[1::2])))
