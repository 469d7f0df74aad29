"""Triton kernel for `quantized_linear` on CUDA: dequantize weight tiles in registers before `tl.dot`.

Imported (with triton) only by `quant.fused`, on a CUDA input where triton is installed. Covered
layout: a 2-d weight `[N, K]` grouped along K (`group_dim=-1`), K a multiple of `group_size`,
`group_size` a multiple of 16, x in fp16 / bf16; at 4 bits also an even N. `pack_4bit` splits the flat code sequence in halves, so then the packed
bytes form a `[N / 2, K]` matrix whose low nibbles are weight rows `0 .. N/2 - 1` and whose high
nibbles are rows `N/2 .. N - 1`: each program loads a byte tile once and computes two output tiles.
"""
import torch
import triton
import triton.language as tl

from quant.qtensor import QTensor


def supports(x: torch.Tensor, qweight: QTensor) -> bool:
    layout, config = qweight.layout, qweight.config
    rows, in_features = qweight.shape
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and x.device == qweight.device
        and layout.groups_are_contiguous
        and config.group_size % 16 == 0
        and (config.bits == 8 or rows % 2 == 0)
        and x.numel() > 0
        and rows > 0
    )


def dequant_linear(x: torch.Tensor, qweight: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = qweight.shape
    x2d = x.reshape(-1, in_features)  # [M, K]
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_tokens = x2d.shape[0]
    packed = qweight.config.bits == 4
    byte_rows = out_features // 2 if packed else out_features
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)  # [M, N]
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = 64
    block_k = next(b for b in (64, 32, 16) if qweight.config.group_size % b == 0)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(byte_rows, block_n))
    _dequant_matmul_kernel[grid](
        x2d, qweight.data, qweight.scale, qweight.minimum, bias if bias is not None else out, out,
        num_tokens, in_features, byte_rows, x2d.stride(0), out.stride(0),
        GROUP_SIZE=qweight.config.group_size, PACKED=packed, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(*x.shape[:-1], out_features)


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, data_ptr, scale_ptr, minimum_ptr, bias_ptr, out_ptr,
    M, K, BYTE_ROWS, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    offs_r = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] byte rows
    mask_m = offs_m < M
    mask_r = offs_r < BYTE_ROWS
    groups_per_row = K // GROUP_SIZE
    # Groups of the high-nibble rows start half the code sequence later.
    high_group_offset = BYTE_ROWS * groups_per_row
    acc_low = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_high = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        codes = tl.load(data_ptr + offs_r[:, None] * K + offs_k[None, :],
                        mask=mask_r[:, None] & mask_k[None, :], other=0)  # uint8 [BLOCK_N, BLOCK_K]
        group = offs_r * groups_per_row + k0 // GROUP_SIZE  # [BLOCK_N]: BLOCK_K divides GROUP_SIZE
        scale = tl.load(scale_ptr + group, mask=mask_r, other=0.0).to(tl.float32)
        minimum = tl.load(minimum_ptr + group, mask=mask_r, other=0.0).to(tl.float32)
        low = (codes & 0x0F) if PACKED else codes
        w = (low.to(tl.float32) * scale[:, None] + minimum[:, None]).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc_low += tl.dot(x, tl.trans(w))
        if PACKED:
            scale = tl.load(scale_ptr + high_group_offset + group, mask=mask_r, other=0.0).to(tl.float32)
            minimum = tl.load(minimum_ptr + high_group_offset + group, mask=mask_r, other=0.0).to(tl.float32)
            w = ((codes >> 4).to(tl.float32) * scale[:, None] + minimum[:, None]).to(x.dtype)
            acc_high += tl.dot(x, tl.trans(w))
    out_mask = mask_m[:, None] & mask_r[None, :]
    if HAS_BIAS:
        acc_low += tl.load(bias_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_r[None, :],
             acc_low.to(out_ptr.dtype.element_ty), mask=out_mask)
    if PACKED:
        offs_high = offs_r + BYTE_ROWS  # output columns of the high-nibble rows
        if HAS_BIAS:
            acc_high += tl.load(bias_ptr + offs_high, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_high[None, :],
                 acc_high.to(out_ptr.dtype.element_ty), mask=out_mask)

