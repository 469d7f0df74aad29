"""Gather + dequantize of a compressed paged KV cache on the CPU, one C pass (quant/csrc/kv_dequant.c).

Why: CPU attention at decode reads every cached key and value of every layer on every step, and a
4-bit cache must be dequantized first. torch's route (advanced indexing of the codes, unpacking,
an affine pass, a permuting copy) took 198 ms per layer for llama-2-7b's 32 sequences x 144
tokens against 49 ms to gather an fp32 cache, and made 4-bit KV cost ~40% of the generation
phase beyond RAM (docs/BENCHMARKS.md, "llama.cpp side by side"). The kernel reads each code once
and writes each fp32 value once, with the same arithmetic as quant.groupwise.dequantize (so the
same bits: tests/quant/test_cpu_kv_dequant.py).

Covered: what offload/kv_cache.py's KVCompression stores (4 bits, asymmetric, fp16 scale and
minimum, split halves per line) into fp32 on a CPU with AVX2 and a C compiler. Elsewhere
`covers` is False and the pool keeps torch's route; `unavailable_reason()` says why.
"""
from __future__ import annotations

import ctypes

import torch

from quant.config import QuantConfig
from quant.cpu_kernels import CSRC, Kernel, split

SOURCE = CSRC / "kv_dequant.c"


def covers(config: QuantConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this kernel produces this pool's values (else: quant.groupwise.dequantize)."""
    return (device.type == "cpu" and dtype == torch.float32 and config.bits == 4 and not config.symmetric
            and not config.minimum_fp32 and config.line_halves and available())


def keys(codes: dict[str, torch.Tensor], blocks: torch.Tensor, length: int, kv_heads: int, head_dim: int,
         block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes: one layer's K tables (data [num_blocks, W * bs / 2] uint8, scale and minimum
    [num_blocks, W] fp16, W = kv_heads * head_dim, groups of one channel over a block's tokens);
    blocks [B, nb] int64, nb = ceil(length / bs) -> fp32 [B, length, kv_heads, head_dim] (into `out`,
    contiguous, where given)."""
    lib = KERNEL.lib()
    data, scale, minimum = (_contiguous(codes[n]) for n in ("data", "scale", "minimum"))
    blocks = blocks.to(torch.int64).contiguous()
    batch, nb = blocks.shape
    width = kv_heads * head_dim
    out = _output(out, (batch, length, kv_heads, head_dim))

    def run(b0: int, b1: int) -> None:
        scratch = torch.empty(2, width, dtype=torch.float32)
        lib.fs_kv_keys(data.data_ptr(), scale.data_ptr(), minimum.data_ptr(), blocks.data_ptr(), nb, length,
                       width, block_size, b0, b1, out.data_ptr(), scratch[0].data_ptr(), scratch[1].data_ptr())

    split(run, batch, torch.get_num_threads())
    return out


def values(codes: dict[str, torch.Tensor], slots: torch.Tensor, kv_heads: int, head_dim: int,
           config: QuantConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes: one layer's V tables (data [num_slots, kv_heads * P / 2] uint8, scale and minimum
    [num_slots, kv_heads * P / G] fp16, P = head_dim padded to the group size G, groups along each
    head's dimension); slots [B, L] int64 -> fp32 [B, L, kv_heads, head_dim] (into `out` where given)."""
    lib = KERNEL.lib()
    data, scale, minimum = (_contiguous(codes[n]) for n in ("data", "scale", "minimum"))
    slots = slots.to(torch.int64).contiguous()
    batch, length = slots.shape
    group = config.group_size
    padded = -(-head_dim // group) * group
    out = _output(out, (batch, length, kv_heads, head_dim))

    def run(b0: int, b1: int) -> None:
        lib.fs_kv_values(data.data_ptr(), scale.data_ptr(), minimum.data_ptr(), slots.data_ptr(), length,
                         kv_heads, head_dim, padded, group, b0, b1, out.data_ptr())

    split(run, batch, torch.get_num_threads())
    return out


def _output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"cpu_kv_dequant: out must be a contiguous fp32 CPU tensor of shape {shape}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("cpu_kv_dequant: the KV tables of a layer must be contiguous")
    return t


_p, _i = ctypes.c_void_p, ctypes.c_int64
KERNEL = Kernel("cpu_kv_dequant", SOURCE, {"fs_kv_keys": [_p, _p, _p, _p, _i, _i, _i, _i, _i, _i, _p, _p, _p],
                                           "fs_kv_values": [_p, _p, _p, _p, _i, _i, _i, _i, _i, _i, _i, _p]})
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
