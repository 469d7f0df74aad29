"""A 4-bit weight kept in the CPU int4 kernel's layout (`Int4Packed`), multiplied at any row count.

Up to `CPU_INT4_KERNEL_MAX_ROWS` rows, torch's int4 kernel (`linear_4bit`): it dequantizes inside
its tiles and reads half a byte per weight. Above it the kernel's cost grows far faster than a
GEMM's, so the weight is dequantized whole into a reused buffer and multiplied by `F.linear`.

`dequantize_int4pack` reads the kernel's layout back: per block of 64 output rows and per input
index k, 32 bytes whose low nibbles are rows 0..31 and high nibbles rows 32..63. A byte transpose
per block (`[in, 32]` -> `[32, in]`, on a chunk that stays in cache) puts the codes in row order;
the nibbles then unpack into rows 0..31 and 32..63 of the block, as our split-half codes do. It
computes what the kernel computes for each weight, `(c - 8) * s + z` in fp32 from the bf16 `s` and
`z` (the product is exact: 4 by 8 significant bits), rounded once more to the output dtype: the
prefill path multiplies by the kernel's own weights, rounded to bf16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS
from quant.cpu_matmul import BLOCK_ROWS, Int4Packed, linear_4bit
from quant.groupwise import per_group_affine_
from quant.packing import unpack_4bit_into

_CHUNK_VALUES = 2**20  # weights per chunk: the byte and code temporaries stay ~1.5 MiB
_ZERO_CODE = 8


def int4pack_linear(x: torch.Tensor, weight: Int4Packed, bias: torch.Tensor | None,
                    scratch: torch.Tensor) -> torch.Tensor:
    """`x` `[..., in]` @ weightᵀ (+ bias); `scratch`: a reused `[out, in]` buffer of x's dtype."""
    rows = x.numel() // max(1, x.shape[-1])
    if x.dtype == torch.bfloat16 and rows <= CPU_INT4_KERNEL_MAX_ROWS:
        return linear_4bit(x, weight, bias)
    return F.linear(x, dequantize_int4pack(weight, out=scratch), bias)


def dequantize_int4pack(weight: Int4Packed, dtype: torch.dtype = torch.bfloat16, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """`[out, in]` weights `(c - 8) * s + z` (fp32, then rounded to `dtype`), as the kernel reads them."""
    out_features, in_features = weight.shape
    if out is None:
        out = torch.empty(out_features, in_features, dtype=dtype)
    if (out.shape != (out_features, in_features) or not out.is_contiguous()
            or out.dtype not in (torch.bfloat16, torch.float32) or out.device.type != "cpu"):
        raise ValueError(f"dequantize_int4pack: out must be a contiguous bf16 or fp32 CPU tensor "
                         f"[{out_features}, {in_features}], got {out.dtype} {tuple(out.shape)} on {out.device}")
    blocks = out_features // BLOCK_ROWS
    per_chunk = max(1, _CHUNK_VALUES // (BLOCK_ROWS * in_features))  # blocks per chunk
    packed = weight.packed.view(blocks, in_features, BLOCK_ROWS // 2)
    rows = out.view(blocks, 2, BLOCK_ROWS // 2, in_features)  # [block, nibble half, 32, in]
    scale = weight.scales_zeros[..., 0].float().reshape(-1)  # [out * groups], row-major groups
    zero = weight.scales_zeros[..., 1].float().reshape(-1)
    groups_per_block = BLOCK_ROWS * in_features // weight.group_size
    n = min(per_chunk, blocks)
    in_row_order = torch.empty(n, BLOCK_ROWS // 2, in_features, dtype=torch.uint8)
    codes = torch.empty(n, 2, BLOCK_ROWS // 2, in_features, dtype=torch.uint8)
    for start in range(0, blocks, per_chunk):
        stop = min(blocks, start + per_chunk)
        n = stop - start
        in_row_order[:n].copy_(packed[start:stop].transpose(1, 2))  # [n, 32, in]
        unpack_4bit_into(in_row_order[:n], codes[:n, 0], codes[:n, 1])
        signed = codes[:n].view(torch.int8).sub_(_ZERO_CODE)  # c - 8, exact
        rows[start:stop].copy_(signed)
        groups = slice(start * groups_per_block, stop * groups_per_block)
        per_group_affine_(rows[start:stop].view(-1, weight.group_size), scale[groups], zero[groups])
    return out
