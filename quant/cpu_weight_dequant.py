"""4-bit weights dequantized on the CPU in one C pass (quant/csrc/q4_dequant.c).

Why: a prompt pass multiplies every 4-bit weight by dequantizing it into a reused buffer, then
`F.linear` (quant/fused.py; the int8 kernels' integer work grows with the rows, a GEMM's
dequantization does not). torch's route unpacks the nibbles into temporaries, widens them and
applies the groups' affine (batch norm) in three passes: 0.32 s per prompt pass of opt-1.3b's
4-bit layers on 2 cores of a Zen 5, a fifth of the pass (scripts/bench_offload.py). The kernel
reads each byte once and writes each value once, with the arithmetic of
`quant.groupwise.dequantize` (code * scale + minimum in fp32, one rounding, then to bf16 to
nearest-even): the same bits (tests/quant/test_cpu_weight_dequant.py).

Covered: 4 bits, fp16 scale and minimum, groups along the rows of a 2-D weight [N, K] that tile
them (every layout: split halves of each line, adjacent pairs, split halves of each group) into
fp32 or bf16, on a CPU with AVX2 and a C compiler. Elsewhere `covers` is False and dequantize
keeps torch's route; `unavailable_reason()` says why.
"""
from __future__ import annotations

import ctypes

import torch

from quant.cpu_kernels import CSRC, Kernel
from quant.qtensor import QTensor

SOURCE = CSRC / "q4_dequant.c"


def covers(q: QTensor, dtype: torch.dtype) -> bool:
    """Whether the kernel writes `dequantize(q, dtype)` (else torch's route does)."""
    c = q.config
    if q.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or len(q.shape) != 2 or q.panels:
        return False
    if c.bits != 4 or c.minimum_fp32 or c.group_dim not in (-1, 1) or q.shape[1] % c.group_size:
        return False
    return (q.scale.dtype == q.minimum.dtype == torch.float16 and q.data.is_contiguous() and q.scale.is_contiguous()
            and q.minimum.is_contiguous() and available())


def dequantize_into(q: QTensor, out: torch.Tensor) -> torch.Tensor:
    """`out` [N, K] (contiguous fp32 or bf16 on the CPU) = code * scale + minimum, as
    quant.groupwise.dequantize computes it; `covers(q, out.dtype)` must hold."""
    rows, k = q.shape
    if not covers(q, out.dtype) or tuple(out.shape) != (rows, k) or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"cpu_weight_dequant: a weight {q.shape} with {q.config} into {out.dtype} "
                         f"{tuple(out.shape)} is not a case this kernel covers")
    layout = 1 if q.config.adjacent_pairs else 2 if q.config.group_halves else 0
    threads = max(1, min(torch.get_num_threads(), rows))
    KERNEL.lib().fs_q4_dequantize(q.data.data_ptr(), q.scale.data_ptr(), q.minimum.data_ptr(), rows, k,
                                  q.config.group_size, layout, out.data_ptr(), int(out.dtype == torch.bfloat16),
                                  threads)
    return out


_p, _i = ctypes.c_void_p, ctypes.c_int64
KERNEL = Kernel("cpu_weight_dequant", SOURCE, {"fs_q4_dequantize": [_p, _p, _p, _i, _i, _i, ctypes.c_int, _p,
                                                                     ctypes.c_int, ctypes.c_int]})
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
