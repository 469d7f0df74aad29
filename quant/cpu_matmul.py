"""`linear_4bit(x, packed, bias)`: torch's CPU int4 kernel on a 4-bit weight packed once for it.

The engine's CPU path dequantizes the whole weight into a working buffer and then multiplies: at
decode row counts the dequantization costs 3-5x the matmul it feeds (opt-1.3b's 8192 x 2048 fc1 at
1 row, bf16, 2 threads: 7.0 ms against 1.4 ms for the uncompressed matmul). torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`) dequantizes inside its tiles and reads half a byte per weight:
0.3 ms there. Its cost grows with the rows far faster than a GEMM's (crossover ~64-128 rows), and
its vectorised form is bf16-only (fp32 runs a scalar loop, 4-100x slower than dequantize + matmul).

It wants its own layout, which is machine-specific (64-row blocks, K-major, two lanes per byte on
AVX-512; another on AVX2). `to_int4pack` builds it from our split-half codes with a few torch ops (a
byte shuffle, no arithmetic), checked byte for byte against torch's own converter on this machine
before first use (`layout_matches_torch`). The shuffle is a transposing copy: 1.5-20 ms per opt-1.3b
weight, as much as the dequantization it would save, so the engine keeps such weights AT REST in
this layout (resident pieces, cpu-tier pieces and the disk store: offload/placement.py), packed
once when the store is written; quant/int4pack.py multiplies by them at any row count.

The scales and zeros are kept row-major, `[out, in / group, 2]`, so that a row range of the weight
is one contiguous slice of them too; the kernel wants `[in / group, out, 2]` and silently misreads
a strided view of it (torch 2.13: wrong results, no error), so `linear_4bit` transposes that small
tensor per call (1/4 of the codes' bytes at group 64; opt-1.3b's fc1, 1 thread, CPU time: 0.3 ms,
6% of the call at 30 rows, 75% at 1 row; at 1 row an opt-1.3b pass's linears still take half the
uncompressed matmuls' time, docs/BENCHMARKS.md "bench_quant_cpu"), moving each (scale, zero) pair as one
int32 (`kernel_order_scales`).

Arithmetic: the kernel computes `(c - 8) * s + z` in fp32 from bf16 `s` and `z`, accumulates in
fp32 and rounds once to bf16. Our format reads back `c * scale + minimum` from fp16 `scale` and
`minimum`; `s = bf16(scale)`, `z = bf16(minimum + 8 * scale)` differ from those by at most half a
bf16 ulp each, so each weight differs from `dequantize`'s by at most `8 u scale + u |z| + u |w|`
(`u = 2**-8`; the last term is `dequantize`'s own bf16 rounding). `weight_error_bound` gives it;
the tests hold the kernel's product to it. fp32 activations never take this path (the kernel is
bf16-only in its vectorised form, and it would change fp32 arithmetic).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quant.config import QuantConfig
from quant.packing import unpack_4bit_into
from quant.qtensor import QTensor

BLOCK_ROWS = 64  # output rows per block of the AVX-512 int4 layout: row pieces fall on these
_ZERO_CODE = 8  # the kernel reads a code c as (c - 8) * scale + zero
# Names the layout `to_int4pack` writes (AVX-512 lanes, 64-row blocks, row-major bf16 scales and
# zeros); part of the disk store's key, so that a store in another layout is rebuilt, never misread.
KERNEL_LAYOUT_ID = "int4pack-avx512-b64-rowmajor-sz"


@dataclass(frozen=True, eq=False)
class Int4Packed:
    """A 4-bit weight in the kernel's layout, packed once (`pack_for_cpu_kernel`) and reused."""
    packed: torch.Tensor  # uint8 [out, in / 2], this machine's int4 layout (blocks of 64 rows)
    scales_zeros: torch.Tensor  # bf16 [out, in / group, 2], row-major (the kernel's transposed)
    shape: tuple[int, int]  # [out_features, in_features]
    group_size: int

    @classmethod
    def from_flat(cls, packed: torch.Tensor, scales_zeros: torch.Tensor, shape: tuple[int, int],
                  group_size: int) -> Int4Packed:
        """The two stored components (flat, as a disk store or a working buffer holds them)."""
        out_features, in_features = shape
        return cls(packed.view(out_features, in_features // 2),
                   scales_zeros.view(out_features, in_features // group_size, 2), shape, group_size)

    def rows(self, start: int, stop: int) -> Int4Packed:
        """Rows [start, stop) on 64-row block boundaries, as a view (blocks are contiguous)."""
        if start % BLOCK_ROWS or stop % BLOCK_ROWS or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"Int4Packed.rows({start}, {stop}): rows must be whole {BLOCK_ROWS}-row blocks "
                             f"within [0, {self.shape[0]}]")
        return Int4Packed(self.packed[start:stop], self.scales_zeros[start:stop], (stop - start, self.shape[1]),
                          self.group_size)

    def components(self) -> list[torch.Tensor]:
        """The stored form: flat uint8 codes, then flat bf16 scales and zeros (row-major both)."""
        return [self.packed.reshape(-1), self.scales_zeros.reshape(-1)]


def pack_for_cpu_kernel(qweight: QTensor) -> Int4Packed | None:
    """`qweight` in the kernel's layout, or None where the kernel does not cover it on this machine."""
    if not kernel_covers(qweight):
        return None
    packed, scales_zeros = to_int4pack(qweight)
    return Int4Packed(packed, scales_zeros.transpose(0, 1).contiguous(), tuple(qweight.shape),
                      qweight.config.group_size)


def kernel_order_scales(scales_zeros: torch.Tensor) -> torch.Tensor:
    """Row-major `[out, in / group, 2]` bf16 scales and zeros -> the kernel's `[in / group, out, 2]`
    (a new contiguous tensor). Each (scale, zero) pair moves as one int32: a 2-D transpose of 4-byte
    elements, 2.4-3.7x faster here than the 3-D copy of 2-byte pairs (llama-2-70b's four matrices:
    13 against 32-49 ms per layer, 2 threads; 1-3 s of a 32-row decode pass over 80 layers)."""
    out_features, groups, _ = scales_zeros.shape
    if not scales_zeros.is_contiguous() or scales_zeros.storage_offset() % 2:  # no int32 view here
        return scales_zeros.transpose(0, 1).contiguous()
    pairs = scales_zeros.view(torch.int32).view(out_features, groups)
    return pairs.t().contiguous().view(torch.bfloat16).view(groups, out_features, 2)


def linear_4bit(x: torch.Tensor, weight: Int4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 `x` `[..., in]` @ weightᵀ (+ bias) -> bf16 `[..., out]`, by torch's CPU int4 kernel."""
    out_features, in_features = weight.shape
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != in_features:
        raise ValueError(f"linear_4bit: needs bf16 CPU x [..., {in_features}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    flat = x.reshape(-1, in_features).contiguous()
    kernel_order = kernel_order_scales(weight.scales_zeros)  # [in / group, out, 2]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight.packed, weight.group_size, kernel_order)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], out_features)


def kernel_covers(qweight: QTensor) -> bool:
    """4-bit min-max weights `[out, in]` grouped along `in`, whole 64-row blocks, this machine's layout ours."""
    return qweight.device.type == "cpu" and kernel_covers_shape(qweight.shape, qweight.config)


def kernel_covers_shape(shape: tuple[int, ...], config: QuantConfig) -> bool:
    """`kernel_covers` for a weight of `shape` quantized with `config` (before it exists)."""
    if not kernel_covers_format(config) or len(shape) != 2:
        return False
    out_features, in_features = shape
    return out_features % BLOCK_ROWS == 0 and out_features > 0 and in_features % config.group_size == 0


def kernel_covers_format(config: QuantConfig) -> bool:
    """4-bit min-max grouped along the input dimension, a group size the kernel takes, our layout
    this machine's."""
    return (config.line_halves and not config.symmetric and config.group_dim in (-1, 1)
            and config.group_size in (32, 64, 128, 256) and layout_matches_torch())


def to_int4pack(qweight: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our codes -> (the kernel's packed uint8 `[out, in / 2]`, bf16 scales and zeros `[in / group, out, 2]`)."""
    out_features, in_features = qweight.shape
    codes = torch.empty(out_features, in_features, dtype=torch.uint8)
    half = in_features // 2
    unpack_4bit_into(qweight.data.view(out_features, half), codes[:, :half], codes[:, half:])
    # AVX-512 layout: per block of 64 rows and per input index k, 32 bytes; byte d (d < 16) holds
    # rows d (low nibble) and d + 32 (high), byte 16 + d rows d + 16 and d + 48.
    lanes = codes.view(out_features // BLOCK_ROWS, 4, 16, in_features)  # [blocks, lane, 16, in]
    paired = lanes[:, 2:].bitwise_left_shift(4).bitwise_or_(lanes[:, :2])  # [blocks, 2, 16, in]
    packed = paired.permute(0, 3, 1, 2).contiguous().view(out_features, half)
    return packed, scales_and_zeros(qweight)


def scales_and_zeros(qweight: QTensor) -> torch.Tensor:
    """bf16 `[in / group, out, 2]`: (bf16(scale), bf16(minimum + 8 * scale)), the sum in fp32."""
    out_features = qweight.shape[0]
    scale = qweight.scale.float().view(out_features, -1)  # [out, groups]
    zero = qweight.minimum.float().view(out_features, -1) + _ZERO_CODE * scale
    return torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)


def weight_error_bound(qweight: QTensor) -> torch.Tensor:
    """fp32 `[out, in]`: how far the kernel's weight may lie from `dequantize(qweight, bfloat16)`."""
    from quant.groupwise import dequantize  # noqa: PLC0415 - only the tests and benchmarks need it

    u = 2.0**-8  # bf16 unit roundoff
    out_features, in_features = qweight.shape
    scale = qweight.scale.float().view(out_features, -1)
    zero = (qweight.minimum.float().view(out_features, -1) + _ZERO_CODE * scale).abs()
    per_group = (_ZERO_CODE * u) * scale + u * zero * (1 + 2.0**-24)  # the fp32 sum's own rounding
    per_value = per_group.repeat_interleave(qweight.config.group_size, dim=1)
    return per_value + u * dequantize(qweight, torch.float32).abs()


@functools.cache
def layout_matches_torch() -> bool:
    """Our packing equals torch's converter on this machine (its layout depends on the CPU)."""
    probe = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2 * BLOCK_ROWS, 128), generator=probe, dtype=torch.int32)
    try:
        expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    except (RuntimeError, AttributeError):
        return False
    from quant.packing import pack_4bit  # noqa: PLC0415

    config = QuantConfig(bits=4, group_size=64)
    groups = codes.numel() // config.group_size
    q = QTensor(data=pack_4bit(codes.to(torch.uint8)).view(-1), scale=torch.ones(groups, dtype=torch.float16),
                minimum=torch.zeros(groups, dtype=torch.float16), shape=tuple(codes.shape), dtype=torch.bfloat16,
                config=config)
    return expected.shape == (codes.shape[0], codes.shape[1] // 2) and torch.equal(to_int4pack(q)[0], expected)
