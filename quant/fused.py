"""`quantized_linear(x, qweight, bias)`: `F.linear(x, dequantize(qweight), bias)`, fused on CUDA.

CPU (and any non-CUDA device): dequantize into a reused buffer, then `F.linear` - this is what the
engine runs there for a weight in our own layout (a fresh allocation per call would cost more than
the dequantization itself: page-faulting new memory runs at a fraction of copy speed). A weight
in the CPU int4 kernel's layout (`Int4Packed`) goes to quant/int4pack.py: the kernel at few rows,
the same reused buffer and `F.linear` at many.
CUDA: a Triton kernel that reads the packed codes and dequantizes each tile in registers right
before its `tl.dot`, so the fp16 weight never exists in memory; where Triton is missing or the
layout is one the kernel does not cover, a `torch.compile`d dequantize + linear, which materialises
the weight once. Triton and the compiler are imported lazily: the package imports without them.
"""
from __future__ import annotations

import functools
import importlib.util
import threading

import torch
import torch.nn.functional as F

from quant.cpu_matmul import Int4Packed
from quant.groupwise import dequantize
from quant.int4pack import int4pack_linear
from quant.layout import GroupLayout
from quant.qtensor import QTensor


def quantized_linear(x: torch.Tensor, qweight: QTensor | Int4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x` `[..., in_features]`, `qweight` of shape `[out_features, in_features]` -> `[..., out_features]`.

    A weight held in the CPU int4 kernel's layout (`Int4Packed`) goes to quant/int4pack.py."""
    if isinstance(qweight, Int4Packed):
        if x.shape[-1] != qweight.shape[1]:
            raise ValueError(f"quantized_linear: x {tuple(x.shape)} does not match a weight of shape {qweight.shape}")
        return int4pack_linear(x, qweight, bias, _scratch(qweight.shape, x.dtype, x.device))
    if len(qweight.shape) != 2 or x.shape[-1] != qweight.shape[1]:
        raise ValueError(
            f"quantized_linear: x {tuple(x.shape)} does not match a weight of shape {qweight.shape} "
            "([out_features, in_features])"
        )
    if x.device.type != "cuda":
        return F.linear(x, dequantize(qweight, x.dtype, out=_scratch(qweight.shape, x.dtype, x.device)), bias)
    if _triton_installed():
        from quant import triton_kernels  # noqa: PLC0415 - lazy: imports triton

        if triton_kernels.supports(x, qweight):
            return triton_kernels.dequant_linear(x, qweight, bias)
    return _compiled_dequant_linear()(x, qweight.data, qweight.scale, qweight.minimum, bias, qweight.layout,
                                      qweight.config.bits, qweight.config.adjacent_pairs)


_local = threading.local()


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread buffer per (shape, dtype, device), reused by every call of that shape: a model
    has a handful of weight shapes, so this holds at most one dequantized weight of each."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    key = (tuple(shape), dtype, device)
    if key not in buffers:
        # A normal tensor, even when first asked for under inference mode (as the engine runs):
        # an inference tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            buffers[key] = torch.empty(shape, dtype=dtype, device=device)
    return buffers[key]


def dequant_linear_reference(x, data, scale, minimum, bias, layout: GroupLayout, bits: int,
                             adjacent_pairs: bool = False) -> torch.Tensor:
    """Plain-op dequantize + linear that `torch.compile` fuses into one dequant kernel and a matmul.

    The same arithmetic as `dequantize` (fp32, one rounding to `x.dtype`) written without in-place or
    `out=` tricks, which are there for eager CPU speed and only get in a compiler's way.
    """
    packed = data.view(layout.num_rows, layout.padded_len * bits // 8)  # one line of groups per row
    if bits == 4 and adjacent_pairs:
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(layout.num_rows, -1)
    elif bits == 4:
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=1)  # split halves of each line
    else:
        codes = packed
    codes = codes.reshape(layout.num_groups, layout.group_size)  # [num_groups, group_size]
    values = codes.float() * scale.float()[:, None] + minimum.float()[:, None]
    return F.linear(x, layout.from_groups(values.to(x.dtype)), bias)


@functools.cache
def _compiled_dequant_linear():
    return torch.compile(dequant_linear_reference, dynamic=False)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
