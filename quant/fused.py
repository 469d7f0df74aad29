"""`quantized_linear(x, qweight, bias)`: `F.linear(x, dequantize(qweight), bias)`, fused on CUDA where it pays.

CPU (and any non-CUDA device): inside `cpu_matmul_mode("int8x2" or "int8")` (the engine's passes
with its `cpu_matmul` setting; int8x2 is the default where the kernel builds), x rounded to int8
times the 4-bit codes on the integer units (quant/cpu_int8_matmul.py). Otherwise, and for what that kernel does not cover,
dequantize into a reused buffer, then `F.linear` - this is what the engine runs there for a weight in our own layout (a fresh allocation per call would cost more than
the dequantization itself: page-faulting new memory runs at a fraction of copy speed). A weight
in the CPU int4 kernel's layout (`Int4Packed`) goes to quant/int4pack.py: the kernel at few rows,
the same reused buffer and `F.linear` at many.
CUDA (`use_triton` is the rule): at few rows (decode) on sm_80+ a Triton kernel that reads the
packed codes and dequantizes each tile in registers right before its `tl.dot`, so the fp16 weight
never exists in memory and a decode reads 4 bits per weight instead of 16. Everywhere else - many
rows (prefill is compute-bound: one dequantization then cuBLAS's tensor-core GEMM beats
re-dequantizing each weight tile once per 64-row block), sm_75 (recent Triton has no tensor-core
path there), no triton, or a layout the kernel does not cover - the same reused-buffer dequantize
+ `F.linear` as on the CPU. No `torch.compile` in the hot path: with static shapes it recompiled
for every new token count (seconds each) until the recompile limit. Triton is imported lazily:
the package imports without it.
"""
from __future__ import annotations

import functools
import importlib.util
import threading

import torch
import torch.nn.functional as F

from policy_search.quant_format import GPU_INT4_KERNEL_MAX_ROWS
from quant import cpu_int8_matmul
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
    if x.device.type == "cuda":
        if _triton_installed():
            from quant import triton_kernels  # noqa: PLC0415 - lazy: imports triton

            rows = x.numel() // max(1, x.shape[-1])
            if use_triton(rows, _capability(x.device)) and triton_kernels.supports(x, qweight):
                return triton_kernels.dequant_linear(x, qweight, bias)
        out = _cuda_scratch(qweight.shape[0] * qweight.shape[1], x.dtype, x.device).view(qweight.shape)
        return F.linear(x, dequantize(qweight, x.dtype, out=out), bias)
    planes = cpu_int8_matmul.planes_for(x)
    if planes and cpu_int8_matmul.covers(x, qweight) and cpu_int8_matmul.available():
        return cpu_int8_matmul.int8_linear(x, qweight, bias, planes)
    return F.linear(x, dequantize(qweight, x.dtype, out=_scratch(qweight.shape, x.dtype, x.device)), bias)


def _cuda_scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`numel` values of ONE per-thread buffer per (dtype, device), grown to the largest weight seen:
    linears run one after another on one stream, so the next one's dequantization is ordered after
    the previous matmul read it. The gpu tier is charged one largest layer weight for it
    (offload/memory.py, cuda_reserve_bytes)."""
    buffers = getattr(_local, "cuda", None)
    if buffers is None:
        buffers = _local.cuda = {}
    key = (dtype, device)
    if key not in buffers or buffers[key].numel() < numel:
        buffers.pop(key, None)  # freed before the larger one is allocated
        with torch.inference_mode(False):
            buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key][:numel]


# Rows up to which the fused kernel runs (decode passes and small prompt chunks). Above it a GEMM
# is compute-bound and one dequantization (a few passes over the fp16 weight at HBM speed) costs
# less than the kernel's per-64-row-block re-dequantization and its non-tensor-core-tuned tiles.
# Measured (scripts/bench_triton_gpu.py, LLaMA-2-70B layer shapes; docs/BENCHMARKS.md): the kernel
# is 2.4-3.2x faster than dequantize + cuBLAS at 256 rows (H100 and H200), 0.92-0.99x at 1024 and
# 0.40-0.44x at 4096 (H200); 256 is the largest row count measured where it wins.
TRITON_MAX_ROWS = GPU_INT4_KERNEL_MAX_ROWS  # one rule with the planner's pricing
TRITON_MIN_CAPABILITY = (8, 0)  # sm_80+: bf16 and fp16 tensor cores in Triton's tl.dot


def use_triton(rows: int, capability: tuple[int, int] | None) -> bool:
    """The dispatch rule: the fused Triton kernel for `rows` rows on a GPU of `capability`."""
    return capability is not None and tuple(capability) >= TRITON_MIN_CAPABILITY and 0 < rows <= TRITON_MAX_ROWS


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


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
                             adjacent_pairs: bool = False, group_halves: bool = False) -> torch.Tensor:
    """Plain-op dequantize + linear that `torch.compile` fuses into one dequant kernel and a matmul.

    The same arithmetic as `dequantize` (fp32, one rounding to `x.dtype`) written without in-place or
    `out=` tricks, which are there for eager CPU speed and only get in a compiler's way.
    """
    packed = data.view(layout.num_rows, layout.padded_len * bits // 8)  # one line of groups per row
    if bits == 4 and adjacent_pairs:
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(layout.num_rows, -1)
    elif bits == 4 and group_halves:
        groups = packed.reshape(layout.num_groups, layout.group_size // 2)
        codes = torch.cat([groups & 0x0F, groups >> 4], dim=1)  # split halves of each group
    elif bits == 4:
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=1)  # split halves of each line
    else:
        codes = packed
    codes = codes.reshape(layout.num_groups, layout.group_size)  # [num_groups, group_size]
    values = codes.float() * scale.float()[:, None] + minimum.float()[:, None]
    return F.linear(x, layout.from_groups(values.to(x.dtype)), bias)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
