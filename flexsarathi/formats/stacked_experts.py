"""Expert weights a checkpoint stores as one tensor over all experts (models/base.py StackedExperts:
transformers' gpt-oss), turned into the engine's row stacks: pure functions of the stored tensors.

Two stored forms of a weight, both as transformers reads them:
- floats, [E, in, out] (x @ W per expert): each expert's matrix transposed to [out, in];
- MXFP4 (OCP microscaling FP4, OpenAI's release format): `<name>_blocks` [E, out, in / 32, 16] uint8,
  two E2M1 codes a byte (low nibble first), and `<name>_scales` [E, out, in / 32] uint8, a power of
  two per 32 values (E8M0: 2 ** e, e = s - 127; s = 255 is NaN), as transformers' `convert_moe_packed_tensors`
  decodes them.
An MXFP4 weight is held as exact 8-bit codes (`mxfp4_codes`, the engine's group-wise format: 9 bits a
value with its fp16 scale and minimum, against bfloat16's 16): each group's 32 values v * 2 ** e, v an
E2M1 value in [-6, 6] on a grid of halves, are code (2v + 12) in 0..24 times 2 ** (e - 1) plus the
minimum -12 * 2 ** (e - 1), both of which fp16 holds for e in [-23, 13] (a gpt-oss release's
scales lie well inside); a group beyond that range is rounded, the error measured and printed.
Biases are [E, out]. An interleaved stack (gate and up rows alternating) has each expert's even
rows put first, then its odd ones: the gate rows, then the up rows, as the engine fuses them.
"""
from __future__ import annotations

import torch

from flexsarathi.errors import CheckpointError
from flexsarathi.formats.prequantized import codes_to_qtensor
from flexsarathi.models.base import StackedExperts
from quant import QTensor, QuantConfig

MXFP4_GROUP = 32  # values per scale
BLOCKS, SCALES = "_blocks", "_scales"
# E2M1 code (sign bit 3; values 0, 0.5, 1, 1.5, 2, 3, 4, 6) -> 2v + 12: its 8-bit code on a grid of halves
# from -6 (+0 and -0 both 12)
_GRID_CODES = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8)
MXFP4_CODES = QuantConfig(bits=8, group_size=MXFP4_GROUP)  # what an MXFP4 stack is held as, exactly
_NAN_SCALE = 255  # E8M0's NaN
_LARGEST_SCALE = 127 + 13  # 2 ** 13: the minimum -6 * 2 ** 13 is fp16's largest power-of-two multiple it holds


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


def mxfp4_codes(blocks: torch.Tensor, scales: torch.Tensor, how: StackedExperts, dtype: torch.dtype,
                name: str) -> tuple[QTensor, float]:
    """An MXFP4 stack (blocks [E, out, in / 32, 16], scales [E, out, in / 32]) as the engine's 8-bit codes
    of MXFP4_CODES [E * out, in] (rows de-interleaved as `assemble`'s), and the largest difference from
    the decoded values (0.0: exact). A NaN scale, or one beyond 2 ** 13, is one CheckpointError naming the
    tensor."""
    if (first := _first(scales == _NAN_SCALE)) is not None:
        raise CheckpointError(f"tensor {name}{SCALES} has non-finite weights (scale byte 255, E8M0's NaN, the first at "
                              f"{list(first)}): the checkpoint is damaged; the engine would compute NaN logits from it")
    if (first := _first(scales > _LARGEST_SCALE)) is not None:  # fp16 holds no such minimum: refused, not inf
        raise CheckpointError(f"tensor {name}{SCALES} scales a group by 2 ** {int(scales[first]) - 127} (at "
                              f"{list(first)}), beyond the 2 ** 13 whose values the engine's 8-bit codes hold (fp16 "
                              "scales and minimums): the checkpoint is damaged or not gpt-oss's")
    experts, out = blocks.shape[:2]
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [E, out, G, 16, 2]: low nibble first
    codes = _GRID_CODES[nibbles].reshape(experts, out, -1)  # [E, out, in]
    scale = torch.ldexp(torch.ones(scales.shape), (scales.to(torch.int32) - 128).float())  # [E, out, G]: 2 ** (e - 1)
    codes, scale = _deinterleaved(codes, how), _deinterleaved(scale, how)
    return codes_to_qtensor(codes.reshape(experts * out, -1), scale.reshape(experts * out, -1), 12, MXFP4_CODES,
                            dtype)


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True of `mask`, None where there is none."""
    found = torch.nonzero(mask)
    return tuple(found[0].tolist()) if found.numel() else None


def assemble(how: StackedExperts, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The canonical stack in `dtype` from its stored floats (weights [E, in, out], biases [E, out]),
    one expert at a time (a layer's experts are its largest weights: one expert's transposed copy is
    held at a time beside the result)."""
    if how.bias:
        return _deinterleaved(stored.to(dtype), how).reshape(-1)
    experts, cols, out = stored.shape
    result = torch.empty(experts * out, cols, dtype=dtype)
    for e in range(experts):
        result[e * out:(e + 1) * out] = _deinterleaved(stored[e].t(), how)  # [out, in]
    return result


def _deinterleaved(rows: torch.Tensor, how: StackedExperts) -> torch.Tensor:
    """An expert's weight rows [out, in] (or every expert's biases [E, out]; or [E, out, ...] stacks of
    rows: `how.bias` False) with an interleaved stack's even rows first, then its odd ones."""
    if not how.interleaved:
        return rows
    dim = -1 if how.bias else (1 if rows.dim() == 3 else -2)
    index = torch.arange(rows.shape[dim])
    return rows.index_select(dim, torch.cat((index[0::2], index[1::2])))
