"""Decode attention read straight from a paged KV cache on the CPU (quant/csrc/kv_attention.c):
`decode_attention` from a compressed pool's codes, `plain_decode_attention` from a plain pool's
slots in place (its own docstring; opt-1.3b's 30 x 150 tokens per layer: 1.3 ms against 22 ms to
gather the context and run SDPA on it, docs/DESIGN.md "KV cache").

Why: CPU attention at decode reads every cached key and value of every layer on every step. With a
4-bit cache the gather route (quant/cpu_kv_dequant.py) first writes the whole context out as fp32
(70 MB per layer for llama-2-7b's 32 sequences x 144 tokens), then the attention kernel streams it
again: ~50 ms per layer and decode step on 2 cores, a fifth of the generation phase beyond RAM
(docs/BENCHMARKS.md, "llama.cpp side by side"). This kernel scores the keys from their codes
(q . k = sum_c (q_c * scale_c) * code_c + sum_c q_c * minimum_c per K line) and adds the values
from theirs, reading each code once and writing nothing but the output.

What it computes is `flexsarathi.models.attention.attend` over the context the gather route builds
(quantized blocks, the open block's full-precision keys, the pass's new row patched in), for one
query row per sequence: the same softmax in another order of fp32 operations, so equal to it
within fp32 rounding (tests/quant/test_cpu_kv_attention.py holds it to 1e-5 relative to the
output's scale) and with the same greedy tokens end to end (tests/offload/test_kv_cache.py).

Covered: the layouts KVCompression stores (4 bits, asymmetric, fp16 scale and minimum, split halves
per line; V groups that tile the head exactly) with fp32 queries and residual keys, and plain
fp32 / bf16 / fp16 pools of heads of a multiple of 8, on a CPU with AVX2 and a C compiler.
Elsewhere `covers` / `covers_plain` is False and the pool keeps the gather route.
"""
from __future__ import annotations

import ctypes

import torch

from quant.config import QuantConfig
from quant.cpu_kernels import CSRC, Kernel

SOURCE = CSRC / "kv_attention.c"


def covers(k_config: QuantConfig, v_config: QuantConfig, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this kernel attends a pool stored with these configs (else: gather, then attend)."""
    def four_bit(c: QuantConfig) -> bool:
        return c.bits == 4 and not c.symmetric and not c.minimum_fp32 and c.line_halves

    return (dtype == torch.float32 and four_bit(k_config) and four_bit(v_config) and k_config.group_size % 2 == 0
            and head_dim % 2 == 0 and head_dim % v_config.group_size == 0 and available())


def decode_attention(k_codes: dict[str, torch.Tensor], blocks: torch.Tensor, complete_len: torch.Tensor,
                     k_open: torch.Tensor, residual_ids: torch.Tensor, v_codes: dict[str, torch.Tensor],
                     slots: torch.Tensor, value_group: int, q: torch.Tensor, visible: tuple[torch.Tensor, torch.Tensor],
                     new: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer, B sequences with one query row each (H KV heads of d channels, block size bs).

    k_codes: K tables (data [num_blocks, H * d * bs / 2] uint8, scale and minimum [num_blocks, H * d]
    fp16); blocks [B, nb] the sequences' block ids (position j in block j // bs); complete_len [B]:
    positions before it read quantized blocks, later ones k_open [R, bs, H, d] fp32 at row
    residual_ids[b], token j % bs. v_codes: V tables (data [num_slots, H * d / 2], scale and minimum
    [num_slots, H * d / value_group]); slots [B, L]. q [B, heads, d] fp32. visible: (lo, hi) [B],
    the keys [lo, hi) each query sees. new: (k [B, H, d], v [B, H, d], position [B], -1 for none),
    the pass's own row, read instead of the pool there.
    Returns out [B, heads, d] fp32 and lse [B, heads] (natural log; -inf, out 0 where nothing is visible)."""
    lib = KERNEL.lib()
    kd, ks, km = (_contiguous(k_codes[n]) for n in ("data", "scale", "minimum"))
    vd, vs, vm = (_contiguous(v_codes[n]) for n in ("data", "scale", "minimum"))
    batch, heads, dim = q.shape
    kv_heads, bs = k_open.shape[2], k_open.shape[1]
    q, k_open = q.float().contiguous(), _contiguous(k_open)
    k_new, v_new, new_pos = (_contiguous(t) for t in new)
    ints = [t.to(torch.int64).contiguous() for t in (blocks, complete_len, residual_ids, slots, *visible, new_pos)]
    blocks, complete_len, residual_ids, slots, lo, hi, new_pos = ints
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    lse = torch.empty(batch, heads, dtype=torch.float32)

    threads = max(1, min(torch.get_num_threads(), batch))
    per_thread = dim + bs + heads * (slots.shape[1] + dim)
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    lib.fs_kv_decode_attention_all(kd.data_ptr(), ks.data_ptr(), km.data_ptr(), blocks.data_ptr(), blocks.shape[1],
                                   k_open.data_ptr(), residual_ids.data_ptr(), vd.data_ptr(), vs.data_ptr(),
                                   vm.data_ptr(), slots.data_ptr(), slots.shape[1], lo.data_ptr(), hi.data_ptr(),
                                   complete_len.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), new_pos.data_ptr(),
                                   q.data_ptr(), heads, kv_heads, dim, bs, value_group, scale, batch, out.data_ptr(),
                                   lse.data_ptr(), scratch.data_ptr(), per_thread, threads)
    return out, lse


# The element kinds of a plain pool the kernel reads (quant/csrc/kv_attention.c `load8`).
_PLAIN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def covers_plain(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel attends a plain pool of this dtype and head size in place (else: gather, then attend)."""
    return dtype in _PLAIN_KINDS and head_dim % 8 == 0 and available()


def plain_decode_attention(kv: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                           visible: tuple[torch.Tensor, torch.Tensor],
                           new: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a plain pool, B sequences with one query row each, read in place.

    kv [num_slots, 2, H, d] (K then V per slot; fp32, bf16 or fp16); slots [B, L]: sequence b's key
    j at slot slots[b, j]; q [B, heads, d] (any float dtype; widened to fp32); visible (lo, hi) [B]:
    the keys [lo, hi) each query sees; new (k [B, H, d], v [B, H, d], position [B], -1 for none): the
    pass's own row, read instead of the pool there (give it as the pool would store it).
    Returns out [B, heads, d] fp32 and lse [B, heads] (natural log; -inf, out 0 where nothing is
    visible): `flexsarathi.models.attention.attend` over the gathered context, summed in another
    order of fp32 operations (tests/quant/test_cpu_kv_attention.py holds it to 1e-5 of the output's
    scale)."""
    lib = KERNEL.lib()
    batch, heads, dim = q.shape
    kv_heads = kv.shape[2]
    if kv.dtype not in _PLAIN_KINDS or kv.shape[1:] != (2, kv_heads, dim) or dim % 8 or heads % kv_heads:
        raise ValueError(f"plain_decode_attention: a pool of {tuple(kv.shape)} {kv.dtype} and queries {tuple(q.shape)} "
                         "are not a case this kernel covers")
    kv, q = _contiguous(kv), q.float().contiguous()
    k_new, v_new = (_contiguous(t.float().contiguous()) for t in new[:2])
    slots, lo, hi, new_pos = (t.to(torch.int64).contiguous() for t in (slots, *visible, new[2]))
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    lse = torch.empty(batch, heads, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), batch * kv_heads))  # a few sequences: split by heads
    per_thread = heads * (slots.shape[1] + dim)
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    lib.fs_plain_decode_attention_all(kv.data_ptr(), _PLAIN_KINDS[kv.dtype], slots.data_ptr(), slots.shape[1],
                                      lo.data_ptr(), hi.data_ptr(), k_new.data_ptr(), v_new.data_ptr(),
                                      new_pos.data_ptr(), q.data_ptr(), heads, kv_heads, dim, scale, batch,
                                      out.data_ptr(), lse.data_ptr(), scratch.data_ptr(), per_thread, threads)
    return out, lse


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("cpu_kv_attention: every table and input must be a contiguous CPU tensor")
    return t


_p, _i, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KERNEL = Kernel("cpu_kv_attention", SOURCE, {
    "fs_kv_decode_attention_all": [_p, _p, _p, _p, _i, _p, _p, _p, _p, _p, _p, _i, _p, _p, _p, _p, _p, _p, _p, _i, _i,
                                   _i, _i, _i, _f, _i, _p, _p, _p, _i, ctypes.c_int],
    "fs_plain_decode_attention_all": [_p, ctypes.c_int, _p, _i, _p, _p, _p, _p, _p, _p, _i, _i, _i, _f, _i, _p, _p, _p,
                                      _i, ctypes.c_int]})
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
