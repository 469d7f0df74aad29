"""Decode attention read straight from a compressed KV pool on a GPU: one Triton launch per layer.

Why: over a 4-bit pool the gather route (offload/kv_cache.py `_gather_compressed`) takes about 40
launches per decode layer-step on a GPU: three code tables selected and dequantized for K (with the
open blocks patched in) and again for V, the pass's new row patched into both, then SDPA over the
fp16 context it wrote out. A GPU decode step is host-bound at ~25 us a launch (docs/DESIGN.md,
"Decode passes on a GPU"), so those launches cost more than the bytes. This kernel reads each code
once, in registers, and writes nothing but the output: the same contract as the CPU kernel
(quant/cpu_kv_attention.py `decode_attention`), with the pass's new rows given as the micro-batch's
K and V codes plus each sequence's row there instead of a [B, H, d] copy (no scatter, and its V read
back from its codes as the pool's are).

What it computes is `flexsarathi.models.attention.attend` over the context the gather route builds
(blocks completed before the pass as quantized, the open block's keys in full precision, every value
as stored, the pass's new row), for one query row per sequence, in fp32: the same values read back
(code * scale + minimum in fp32) and the same softmax summed in another order, so equal to the fp64
reference within fp32 rounding (tests/quant/test_triton_kv_attention.py runs it in Triton's
interpreter on the CPU; tests/offload/test_cuda.py compiled, end to end).

One program per (sequence, KV head): its `heads / kv_heads` query heads share every code it reads.
Scores are an fp32 multiply and sum over the head dimension (not `tl.dot`: a GQA group is 1-8 query
heads, below tl.dot's 16 rows); tiles of BLOCK_N positions with an online softmax. Tile sizes are a
first choice, to be tuned where a GPU can time them.

Covered: what cpu_kv_attention covers (4 bits, asymmetric, fp16 scale and minimum, split halves per
line, V groups that tile the head) in any float dtype for q, the residual keys and the new rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant.config import QuantConfig


def covers(k_config: QuantConfig, v_config: QuantConfig, head_dim: int) -> bool:
    """Whether the kernel attends a pool stored with these configs (else: gather, then attend)."""
    def four_bit(c: QuantConfig) -> bool:
        return c.bits == 4 and not c.symmetric and not c.minimum_fp32 and c.line_halves

    return (four_bit(k_config) and four_bit(v_config) and k_config.group_size % 2 == 0 and head_dim % 2 == 0
            and head_dim % v_config.group_size == 0)


def decode_attention(k_codes: dict[str, torch.Tensor], blocks: torch.Tensor, complete_len: torch.Tensor,
                     k_open: torch.Tensor, residual_ids: torch.Tensor, v_codes: dict[str, torch.Tensor],
                     slots: torch.Tensor, value_group: int, q: torch.Tensor,
                     visible: tuple[torch.Tensor, torch.Tensor],
                     new_rows: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor] | None,
                     scale: float, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer, B sequences with one query row each (H KV heads of d channels, block size bs); every
    tensor on one device.

    k_codes: K tables (data [num_blocks, H * d * bs / 2] uint8, scale and minimum [num_blocks, H * d]
    fp16); blocks [B, nb] the sequences' block ids; complete_len [B]: positions before it read
    quantized blocks, later ones k_open [R, bs, H, d] at row residual_ids[b], token j % bs. v_codes:
    V tables (data [num_slots, H * d / 2], scale and minimum [num_slots, H * d / value_group]); slots
    [B, L]. q [B, heads, d]. visible: (lo, hi) [B], the keys [lo, hi) each query sees. new_rows:
    (k [T, H, d], v_codes, src [B], position [B]): sequence b's key at `position[b]` is row `src[b]` of
    k (-1: none) instead of the pool's, its value row `src[b]` of v_codes (V tables of the pass's T
    rows, laid out as the pool's: read back as the pool's are; None: the pool holds them already);
    or None (the pool holds both).
    Returns out [B, heads, d] in out_dtype (rounded from fp32 as the kernel stores it: no cast launched
    after it) and lse [B, heads] fp32 (natural log; -inf, out 0 where nothing is visible)."""
    batch, heads, dim = q.shape
    kv_heads, bs = k_open.shape[2], k_open.shape[1]
    out = torch.empty(batch, heads, dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    has_new = new_rows is not None
    k_new, v_new, new_src, new_pos = new_rows if has_new else (q, v_codes, complete_len, complete_len)  # unread
    new_v = has_new and v_new is not None
    v_new = v_new if new_v else v_codes  # unread
    # rows of q, K may be strided (a view of the fused qkv output: no copy launched), heads within a row not
    q = q if q.stride(-1) == 1 and q.stride(-2) == dim else q.contiguous()
    k_new = k_new if k_new.stride(-1) == 1 and k_new.stride(-2) == dim else k_new.contiguous()
    k_open = k_open.contiguous()
    _decode_kernel[(batch, kv_heads)](
        k_codes["data"], k_codes["scale"], k_codes["minimum"], blocks, complete_len, k_open, residual_ids,
        v_codes["data"], v_codes["scale"], v_codes["minimum"], slots, visible[0], visible[1],
        k_new, v_new["data"], v_new["scale"], v_new["minimum"], new_src, new_pos, q, out, lse, blocks.stride(0),
        slots.stride(0), k_new.stride(0), q.stride(0), scale,
        **constants(heads, kv_heads, dim, bs, value_group, has_new, new_v),
    )
    return out, lse


def constants(heads: int, kv_heads: int, dim: int, block_size: int, value_group: int, has_new: bool,
              new_v: bool) -> dict:
    """The kernel's compile-time constants for a layer of these shapes (has_new: the pass's new keys
    are read from its K; new_v: and their values from its V codes, not from the pool)."""
    group = heads // kv_heads
    group_pad, dim_pad = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    # [group_pad, block_n, dim_pad] fp32 products live in registers: at most 4096 of them per program
    # (ptxas for sm_80, d = 128: 255 registers and no spill at one query head per KV head, 128 at eight;
    # 8192 spilled at one). tests/quant/test_triton_compile.py compiles these shapes without a GPU.
    block_n = max(1, min(64, 4096 // (group_pad * dim_pad)))
    return dict(GROUP=group, GROUP_PAD=group_pad, DIM=dim, DIM_PAD=dim_pad, KV_HEADS=kv_heads, BS=block_size,
                VG=value_group, BLOCK_N=block_n, HAS_NEW=has_new, NEW_V=new_v)


# the block-table and slot-table widths grow with the context: not specialized on (a compiled variant
# per divisibility by 16 would be compiled mid-run, a second or more each, as contexts cross it)
@triton.jit(do_not_specialize=["stride_blocks", "stride_slots"])
def _decode_kernel(
    kd_ptr, ks_ptr, km_ptr, blocks_ptr, complete_ptr, open_ptr, residual_ptr,
    vd_ptr, vs_ptr, vm_ptr, slots_ptr, lo_ptr, hi_ptr,
    k_new_ptr, new_vd_ptr, new_vs_ptr, new_vm_ptr, new_src_ptr, new_pos_ptr, q_ptr, out_ptr, lse_ptr,
    stride_blocks, stride_slots, stride_k_new, stride_q, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, BS: tl.constexpr, VG: tl.constexpr, BLOCK_N: tl.constexpr, HAS_NEW: tl.constexpr,
    NEW_V: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    g, c = tl.arange(0, GROUP_PAD), tl.arange(0, DIM_PAD)  # [G] query heads of this KV head, [D] channels
    g_ok, c_ok = g < GROUP, c < DIM
    heads, tile = h * GROUP + g, g_ok[:, None] & c_ok[None, :]  # [G] sequence b's query heads of KV head h
    q = tl.load(q_ptr + b * stride_q + heads[:, None] * DIM + c[None, :], mask=tile, other=0.0).to(tl.float32)
    lo, hi = tl.load(lo_ptr + b), tl.load(hi_ptr + b)
    complete, residual_row = tl.load(complete_ptr + b), tl.load(residual_ptr + b)
    if HAS_NEW:
        k_new, v_new, new_pos = _new_row(k_new_ptr, new_vd_ptr, new_vs_ptr, new_vm_ptr, new_src_ptr, new_pos_ptr,
                                         stride_k_new, b, h, c, c_ok, DIM, KV_HEADS, VG, NEW_V)

    m, total = tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)  # [N] positions
        seen = (j >= lo) & (j < hi)
        k = _keys(kd_ptr, ks_ptr, km_ptr, open_ptr, blocks_ptr + b * stride_blocks, j, seen, complete, residual_row,
                  h, c, c_ok, DIM, KV_HEADS, BS)
        slot = tl.load(slots_ptr + b * stride_slots + j, mask=seen, other=0).to(tl.int64)
        v = _values(vd_ptr, vs_ptr, vm_ptr, slot, seen, h, c, c_ok, DIM, KV_HEADS, VG)
        if HAS_NEW:
            is_new = (j == new_pos)[:, None]
            k = tl.where(is_new, k_new[None, :], k)
            if NEW_V:
                v = tl.where(is_new, v_new, v)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_next = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_next == float("-inf"), 0.0, m_next)  # nothing seen yet: no inf - inf
        weights = tl.exp(scores - m_safe[:, None])  # [G, N]
        shrink = tl.exp(m - m_safe)
        total = total * shrink + tl.sum(weights, axis=1)
        acc = acc * shrink[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        m = m_next

    any_seen = total > 0
    out = acc / tl.where(any_seen, total, 1.0)[:, None]
    lse = tl.where(any_seen, m + tl.log(tl.where(any_seen, total, 1.0)), float("-inf"))
    rows = b * KV_HEADS * GROUP + heads  # [G] rows of out [B * heads, d]
    tl.store(out_ptr + rows[:, None] * DIM + c[None, :], out.to(out_ptr.dtype.element_ty), mask=tile)
    tl.store(lse_ptr + rows, lse, mask=g_ok)


@triton.jit
def _new_row(k_new_ptr, new_vd_ptr, new_vs_ptr, new_vm_ptr, new_src_ptr, new_pos_ptr, stride_k_new, b, h, c, c_ok,
             DIM: tl.constexpr, KV_HEADS: tl.constexpr, VG: tl.constexpr, NEW_V: tl.constexpr):
    """Sequence b's new key [D] and value [1, D] (zeros unless NEW_V: the pool holds it) of KV head h,
    fp32, and their position."""
    # src -1 comes with position -1 (no row of the pass): row 0 is read and never used
    src = tl.maximum(tl.load(new_src_ptr + b), 0)
    k_new = tl.load(k_new_ptr + src * stride_k_new + h * DIM + c, mask=c_ok, other=0.0).to(tl.float32)
    if NEW_V:
        v_new = _values(new_vd_ptr, new_vs_ptr, new_vm_ptr, src + tl.zeros([1], tl.int64), tl.zeros([1], tl.int32) == 0,
                        h, c, c_ok, DIM, KV_HEADS, VG)
    else:
        v_new = tl.zeros_like(k_new)[None, :]
    return k_new, v_new, tl.load(new_pos_ptr + b)


@triton.jit
def _keys(kd_ptr, ks_ptr, km_ptr, open_ptr, seq_blocks_ptr, j, seen, complete, residual_row, h, c, c_ok,
          DIM: tl.constexpr, KV_HEADS: tl.constexpr, BS: tl.constexpr):
    """K [N, D] fp32 of KV head h at positions j: completed blocks from their codes (per channel one
    group of bs tokens, split halves in each channel's line), the open block from the residual row."""
    coded = seen & (j < complete)
    t = j % BS
    half_bs: tl.constexpr = BS // 2
    block = tl.load(seq_blocks_ptr + j // BS, mask=coded, other=0).to(tl.int64)
    mask = coded[:, None] & c_ok[None, :]
    group = block[:, None] * (KV_HEADS * DIM) + (h * DIM + c)[None, :]  # [N, D] the channel's group in its block
    byte = tl.load(kd_ptr + group * half_bs + (t % half_bs)[:, None], mask=mask, other=0).to(tl.int32)
    code = tl.where((t >= half_bs)[:, None], byte >> 4, byte & 15).to(tl.float32)
    k_scale = tl.load(ks_ptr + group, mask=mask, other=0.0).to(tl.float32)
    k_min = tl.load(km_ptr + group, mask=mask, other=0.0).to(tl.float32)
    exact = tl.load(open_ptr + ((residual_row * BS + t) * KV_HEADS + h)[:, None] * DIM + c[None, :],
                    mask=(seen & (j >= complete))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    return tl.where(coded[:, None], code * k_scale + k_min, exact)


@triton.jit
def _values(vd_ptr, vs_ptr, vm_ptr, slot, seen, h, c, c_ok, DIM: tl.constexpr, KV_HEADS: tl.constexpr,
            VG: tl.constexpr):
    """V [N, D] fp32 of KV head h at `slot` [N]: each head's d values are a line of their own (split
    halves within the head), groups of VG along it."""
    mask = seen[:, None] & c_ok[None, :]
    byte = tl.load(vd_ptr + slot[:, None] * (KV_HEADS * DIM // 2) + (h * (DIM // 2) + c % (DIM // 2))[None, :],
                   mask=mask, other=0).to(tl.int32)
    code = tl.where((c >= DIM // 2)[None, :], byte >> 4, byte & 15).to(tl.float32)
    param = slot[:, None] * (KV_HEADS * DIM // VG) + ((h * DIM + c) // VG)[None, :]
    v_scale = tl.load(vs_ptr + param, mask=mask, other=0.0).to(tl.float32)
    v_min = tl.load(vm_ptr + param, mask=mask, other=0.0).to(tl.float32)
    return code * v_scale + v_min
