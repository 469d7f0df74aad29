"""Block-wise FP8 checkpoints (`quantization_config` {"quant_method": "fp8", "weight_block_size": [128,
128]}: DeepSeek's format, used by Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2): a linear weight is stored as
float8 e4m3 [out, in] beside `<name>_scale_inv`, float32 [ceil(out / b0), ceil(in / b1)], one factor
per block (a multiplier, despite its name); the other tensors are floats.

Read as transformers reads them where it cannot run FP8 kernels: each weight times its blocks'
factors in float32, then cast to the run dtype (the same products, so the same bits, where the
blocks divide the shape; a last partial block, which transformers refuses, takes its block's factor
like the others). The engine then holds them as it holds any float checkpoint (the policy may compress
them to its own 4-bit codes).
"""
from __future__ import annotations

import json
import os

import torch

from flexsarathi.errors import CheckpointError

SCALE = "_scale_inv"  # the factors of `<name>`: `<name>_scale_inv`
FP8_KINDS = ("F8_E4M3",)  # safetensors dtypes of the weights
_FORMATS = ("e4m3", None)


def fp8_blocks(folder: str) -> tuple[int, int] | None:
    """The [rows, cols] of a block-wise FP8 checkpoint's blocks; None where config.json names no fp8
    quantization. One CheckpointError for an FP8 config this reads no blocks from (per-tensor scales,
    e5m2)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            quantization = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # ModelConfig.from_folder says what is wrong with it
    if not isinstance(quantization, dict) or str(quantization.get("quant_method", "")).lower() != "fp8":
        return None
    where = f"{path}: quantization_config"
    if quantization.get("fmt") not in _FORMATS:
        raise CheckpointError(f"{where}: fp8 fmt {quantization.get('fmt')!r} is not supported (e4m3 is)")
    block = quantization.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: fp8 weight_block_size must be [rows, cols] of positive integers, got "
                              f"{block!r} (per-tensor FP8 scales are not supported; block-wise ones are)")
    return block[0], block[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The factors' shape of a weight of `shape` in blocks of `block`."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 [out, in] times its blocks' float32 factors [ceil(out / b0), ceil(in / b1)] -> float32 [out, in]."""
    rows, cols = weight.shape
    grid_rows, grid_cols = scale_inv.shape
    values = weight.to(torch.float32)
    if (grid_rows * block[0], grid_cols * block[1]) != (rows, cols):  # partial last blocks: padded to whole ones
        values = torch.zeros(grid_rows * block[0], grid_cols * block[1]).index_put_(
            (torch.arange(rows)[:, None], torch.arange(cols)), values)
    blocks = values.view(grid_rows, block[0], grid_cols, block[1])
    product = (blocks * scale_inv.to(torch.float32)[:, None, :, None]).view(values.shape)
    return product if product.shape == (rows, cols) else product[:rows, :cols]
