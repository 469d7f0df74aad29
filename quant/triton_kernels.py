"""Triton kernel for `quantized_linear` on CUDA: dequantize weight tiles in registers before `tl.dot`.

Imported (with triton) only by `quant.fused`, on a CUDA input where triton is installed. Covered
layout: a 2-d weight `[N, K]` grouped along K (`group_dim=-1`), K a multiple of `group_size`,
`group_size` a multiple of 16, x in fp16 / bf16; quant/fused.py calls it only at few rows on
sm_80+ (`use_triton`). At 4 bits each weight row is packed on its own in split halves: byte `j`
of row `n` holds code `(n, j)` (low nibble) and code `(n, j + K / 2)` (high nibble). A K-tile that divides both the group and `K / 2` lies in one half of the row and one group:
it is one contiguous byte tile and one shift.
"""
import torch
import triton
import triton.language as tl

from quant.qtensor import QTensor


def _block_k(qweight: QTensor) -> int | None:
    in_features, group = qweight.shape[1], qweight.config.group_size
    half = in_features // 2 if qweight.config.bits == 4 else in_features
    return next((b for b in (64, 32, 16) if group % b == 0 and half % b == 0), None)


def supports(x: torch.Tensor, qweight: QTensor) -> bool:
    layout = qweight.layout
    return (
        x.dtype in (torch.float16, torch.bfloat16)
        and x.device == qweight.device
        and len(qweight.shape) == 2
        and not (qweight.config.adjacent_pairs or qweight.config.group_halves)  # it reads split halves of each line
        and layout.groups_are_contiguous
        and _block_k(qweight) is not None
        and x.numel() > 0
        and qweight.shape[0] > 0
    )


def dequant_linear(x: torch.Tensor, qweight: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = qweight.shape
    x2d = x.reshape(-1, in_features)  # [M, K]
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_tokens = x2d.shape[0]
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)  # [M, N]
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_n = block_n_for(out_features, triton.cdiv(num_tokens, block_m), _multiprocessors(x.device))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _dequant_matmul_kernel[grid](
        x2d, qweight.data, qweight.scale, qweight.minimum, bias if bias is not None else out, out,
        num_tokens, in_features, out_features, x2d.stride(0), out.stride(0),
        GROUP_SIZE=qweight.config.group_size, PACKED=qweight.config.bits == 4, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(qweight),
    )
    return out.view(*x.shape[:-1], out_features)


def block_n_for(out_features: int, row_blocks: int, multiprocessors: int) -> int:
    """Weight rows per program: 64, or narrower until every SM has a program. At decode (one row
    block) a fixed 64 left SMs idle on a 7168-wide output (112 programs for an H100's 132 SMs); 32
    gives 224. The layer shapes of large models then fill the GPU without split-K; tl.dot needs
    at least 16."""
    for block_n in (64, 32):
        if row_blocks * triton.cdiv(out_features, block_n) >= multiprocessors:
            return block_n
    return 16


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter (TRITON_INTERPRET=1, CPU tensors): any grid is fine
    return torch.cuda.get_device_properties(device).multi_processor_count


# M (the pass's rows) is not specialized on (Triton keys a compiled variant on an int's divisibility by
# 16 and == 1): rows change every pass, and each new variant is a compile of a second or more mid-run
@triton.jit(do_not_specialize=["M"])
def _dequant_matmul_kernel(
    x_ptr, data_ptr, scale_ptr, minimum_ptr, bias_ptr, out_ptr,
    M, K, N, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr, PACKED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows
    mask_m = offs_m < M
    mask_n = offs_n < N
    groups_per_row = K // GROUP_SIZE
    row_bytes = K // 2 if PACKED else K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        g = k0 // GROUP_SIZE
        if PACKED:
            half = K // 2
            high = k0 >= half  # this tile's codes are the high nibbles of its row's bytes
            byte0 = k0 - half * high
            shift = 4 * high
        else:
            byte0 = k0
            shift = 0
        byte_cols = byte0 + tl.arange(0, BLOCK_K)
        codes = tl.load(data_ptr + offs_n[:, None] * row_bytes + byte_cols[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0)  # uint8 [BLOCK_N, BLOCK_K]
        if PACKED:
            codes = (codes >> shift) & 0x0F
        group = offs_n * groups_per_row + g  # [BLOCK_N]: BLOCK_K divides the group
        scale = tl.load(scale_ptr + group, mask=mask_n, other=0.0).to(tl.float32)
        minimum = tl.load(minimum_ptr + group, mask=mask_n, other=0.0).to(tl.float32)
        w = (codes.to(tl.float32) * scale[:, None] + minimum[:, None]).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
