"""The group-wise quantization formats the engine stores and the planner prices: one definition.

Stdlib only, so the planner reads it without torch; quant/ (QuantConfig's defaults), offload/
(KVCompression's defaults) and the engine (its weight and KV formats) read the same numbers.
Every group keeps `bits`-bit codes plus an fp16 scale and an fp16 minimum (quant/group_params.py).
Why these groupings: docs/DESIGN.md, "Quantization".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GROUP_PARAM_BYTES = 2 * 2  # fp16 scale + fp16 minimum per group


def group_bytes(bits: int, group_size: int, minimum_bytes: int = 2) -> int:
    """Stored bytes of one group: its codes, its fp16 scale and its minimum (fp16, or fp32 for a
    pre-quantized checkpoint's integer zero points)."""
    return group_size * bits // 8 + GROUP_PARAM_BYTES - 2 + minimum_bytes


@dataclass(frozen=True)
class WeightFormat:
    bits: int = 4
    group_size: int = 64  # along the input dimension of a Linear weight [out, in]
    minimum_bytes: int = 2  # 4: the minimum kept in fp32 (a pre-quantized checkpoint's zero points)
    # False: the disk tier streams a checkpoint's own blocks, which hold no minimum (GGUF Q4_0's is
    # -8 * scale, derived as the rows are read: offload/linked_blocks.py); memory tiers hold one
    minimum_streamed: bool = True

    @property
    def bytes_per_value(self) -> float:
        return group_bytes(self.bits, self.group_size, self.minimum_bytes) / self.group_size

    @property
    def streamed_bytes_per_value(self) -> float:
        """What the disk tier reads per value."""
        return self.bytes_per_value - (0 if self.minimum_streamed else self.minimum_bytes / self.group_size)


@dataclass(frozen=True)
class KVFormat:
    bits: int = 4
    # K: per channel, one group per block of tokens; 64-token blocks keep the scales and minimums
    # at 1/16 of the codes (4.5 bits per value at 4 bits).
    block_size: int = 64
    value_group: int = 64  # V: per token along the head dimension, capped at the head size

    def value_group_for(self, head_dim: int) -> int:
        """V's group size for this head size (even, so two 4-bit codes share a byte)."""
        return min(self.value_group, head_dim + head_dim % 2)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Stored bytes of one token's K and V in one layer (K's group spread over its block)."""
        k = num_kv_heads * head_dim * group_bytes(self.bits, self.block_size) / self.block_size
        v_group = self.value_group_for(head_dim)
        v = num_kv_heads * math.ceil(head_dim / v_group) * group_bytes(self.bits, v_group)
        return k + v


WEIGHT_FORMAT = WeightFormat()
KV_FORMAT = KVFormat()

# Rows up to which a 4-bit weight in the CPU int4 kernel's layout is multiplied by that kernel
# (quant/int4pack.py), above it dequantized + bf16 GEMM: the kernel dequantizes inside its tiles,
# so its cost grows with the rows far faster than a GEMM's (measured crossover: docs/BENCHMARKS.md,
# "bench_quant_cpu"). The planner prices the same rule.
CPU_INT4_KERNEL_MAX_ROWS = 64

# Rows up to which a CUDA engine multiplies a 4-bit weight with the fused Triton kernel on an sm_80+
# GPU (quant/fused.py use_triton: it reads the codes, no dequantized copy), above it dequantizes +
# fp16 GEMM (the kernel's tiles lose to cuBLAS there: docs/BENCHMARKS.md, "bench_triton_gpu"). The
# planner prices the same rule where a profile measured the kernel (HardwareSpec.gpu_int4_matmul_flops).
GPU_INT4_KERNEL_MAX_ROWS = 256
