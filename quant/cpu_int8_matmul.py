"""`int8_linear(x, qweight, bias)`: a 4-bit weight times x rounded to int8, on the CPU's integer units.

Why: on a CPU without AVX-512 the engine's other path for a 4-bit weight dequantizes the whole
weight to fp32 on every call, then multiplies (quant/fused.py): at decode rows the dequantization
costs several times the matmul (llama-2-7b's 11008 x 4096 at 32 rows, 2 threads: 150 ms against
90 ms for F.linear on fp32 weights). llama.cpp instead rounds x to int8 and multiplies the codes
by it with AVX2's 32-lane integer multiply-add (vpmaddubsw). quant/csrc/q4_int8_gemm.c does that on
our own layouts (split halves of a line or of a group, adjacent pairs; fp16 or fp32 minimums), reading half a byte per
weight: 38 ms at 32 rows (one plane; two: 75 ms), 3.4 ms at 1 row (2 threads; end to end:
docs/BENCHMARKS.md, "llama.cpp side by side"). From 4 rows of x on, 8 weight rows at a time are interleaved into a small
buffer so that the integer lanes hold 8 outputs (the kernel's "panel"); a weight the engine keeps
resident for this kernel is stored in those panels once, at load (quant/panels.py), as llama.cpp
repacks its weights.

Arithmetic (what the tests hold it to): per row of x and per block of XB consecutive values (32,
64 or 128, inside one weight group), `step = max|x| / 127` and `xq = round(x / step)`; with the
codes centred on 8 and `zero = minimum + 8 * scale` (the value of code 8),

    y[m, n] = sum_g scale[n, g] * sum_{k in g} (code[n, k] - 8) * xq[m, k] * step[m, block(k)]
              + zero[n, g] * sum_{k in g} x[m, k]                         (x's exact fp32 sum)

with exact integer block sums and fp32 accumulation. So the result differs from
`F.linear(x, dequantize(qweight))` only by `sum_k scale * (code - 8)[n, k] * (x - xq * step)[m, k]`,
at most `sum_k |w - zero| * step / 2` (`error_bound`), plus fp32 rounding. (Centring matters: the
uncentred sum weighs x's rounding by |w - minimum|, about 3x more for a weight's usual groups.) A NaN or an
infinity in x makes its outputs NaN, never finite.

The kernel is C, compiled once per machine and loaded with ctypes by quant/cpu_kernels.py; a call
releases the GIL and splits the output rows over torch's own OpenMP threads. It has three
instruction paths with one arithmetic (the same bits): AVX2 (vpmaddubsw), AVX-VNNI and AVX-512 VNNI
(vpdpbusd, 256- and 512-bit), the best the CPU's flags allow unless $FLEXSARATHI_INT8_ISA (or the
`isa` argument) names one; `KERNEL.isa_name()` says which runs.
Where there is no compiler, no AVX2, or the build fails, `unavailable_reason()` says why and the
engine keeps the dequantizing path ("auto") or refuses ("int8"): flexsarathi/engine/llm_engine.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

import torch

from quant.cpu_kernels import CSRC, Kernel
from quant.panels import PANEL_ROWS, from_panels, stored_rows
from quant.qtensor import QTensor

SOURCE = CSRC / "q4_int8_gemm.c"
MODES = ("auto", "int8x2", "int8", "dequantize")  # the engine's `cpu_matmul` choice
RUN_MODES = MODES[1:]  # what a pass runs: "auto" resolved (flexsarathi/engine/llm_engine.py)
# Rows of x up to which "int8x2" runs the kernel; above, dequantize + F.linear (exact, and as fast
# there: two planes double the integer work, while one dequantization serves every row).
# Measured on an AVX2 EPYC: llama-2-7b's 11008 x 4096, 2 threads, 64 rows: 149 ms against 197 ms for
# dequantize + F.linear; 128 rows: 297 against 282.
INT8X2_MAX_ROWS = 64
ROW_ALIGN = 8  # output rows per thread's share are a multiple of it (cache lines of y)
# Output-row ranges per thread, taken in turn (OpenMP's dynamic schedule): a core that other work
# slows (the engine's disk reads, a shared machine's neighbours) takes fewer.
GEMM_CHUNKS_PER_THREAD = 4

_state = threading.local()  # .mode: this thread's choice for quantized_linear (see cpu_matmul_mode)


@contextlib.contextmanager
def cpu_matmul_mode(mode: str):
    """`quantized_linear` on the CPU uses this kernel inside the block: "int8" (x rounded to one int8
    plane per block, llama.cpp's arithmetic) or "int8x2" (two planes, ~16 bits, up to
    INT8X2_MAX_ROWS rows); "dequantize" or outside any block: the exact dequantizing path. The
    engine's passes run inside one (its `cpu_matmul` setting). Thread-local."""
    if mode not in RUN_MODES:
        raise ValueError(f"cpu_matmul_mode: {mode!r} is not one of {', '.join(map(repr, RUN_MODES))}")
    before = getattr(_state, "mode", "dequantize")
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = before


def planes_for(x: torch.Tensor) -> int:
    """How many int8 planes this thread's mode computes `x` with: 0 (dequantize instead), 1 or 2."""
    mode = getattr(_state, "mode", "dequantize")
    if mode == "int8":
        return 1
    if mode == "int8x2" and x.numel() <= INT8X2_MAX_ROWS * max(1, x.shape[-1]):
        return 2
    return 0


def covers(x: torch.Tensor, qweight: QTensor) -> bool:
    """The kernel computes `x @ qweightᵀ`: CPU fp32/bf16 x, a 4-bit weight [N, K] grouped along K in
    groups of a multiple of 32 that tile K exactly (group halves: 32, 64 or 128), K a multiple of 64,
    contiguous buffers."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or qweight.device.type != "cpu":
        return False
    c, shape = qweight.config, qweight.shape
    if c.bits != 4 or len(shape) != 2 or c.group_dim not in (-1, 1):
        return False
    k = shape[1]
    if c.group_halves and c.group_size > 128:  # a 64-code chunk's halves would lie in two x blocks
        return False
    return (c.group_size % 32 == 0 and k % c.group_size == 0 and k % 64 == 0
            and all(t.is_contiguous() for t in (qweight.data, qweight.scale, qweight.minimum)))


def x_block(qweight: QTensor) -> int:
    """Values of x per int8 step: the largest of 128, 64, 32 inside one weight group (and, for the
    split-halves layout, tiling each half row)."""
    group, k = qweight.config.group_size, qweight.shape[1]
    for block in (128, 64, 32):
        if group % block == 0 and (layout_code(qweight) or (k // 2) % block == 0):
            return block
    raise ValueError(f"x_block: group size {group} is not a multiple of 32")  # covers() rules this out


def layout_code(qweight: QTensor) -> int:
    """The kernel's code layout: 0 split halves of each line, 1 adjacent pairs, 2 split halves of
    each group (GGUF Q4_0's)."""
    return 1 if qweight.config.adjacent_pairs else 2 if qweight.config.group_halves else 0


def int8_linear(x: torch.Tensor, qweight: QTensor, bias: torch.Tensor | None = None, planes: int = 1,
                isa: str | None = None) -> torch.Tensor:
    """`x` `[..., K]` (fp32 or bf16) @ qweightᵀ (+ bias) -> `[..., N]` in x's dtype (see the module).
    planes=2: x as two int8 planes (its rounding's residual, 254x finer, as M more rows), ~16 bits.
    isa: the instruction path to run ("avx2", "avx_vnni", "avx512_vnni"; None: KERNEL's), every
    path giving the same bits."""
    lib = (KERNEL if isa is None else kernel_for(isa)).lib()
    n, k = qweight.shape
    if not covers(x, qweight) or x.shape[-1] != k or planes not in (1, 2):
        raise ValueError(f"int8_linear: x {tuple(x.shape)} {x.dtype} on {x.device} and a weight {qweight.shape} "
                         f"with {qweight.config}, planes={planes}, are not a case this kernel covers")
    flat = x.reshape(-1, k).to(torch.float32).contiguous()  # [M, K]
    m = flat.shape[0]
    y = torch.empty(planes * m, n, dtype=torch.float32)  # plane p's product in rows [p * M, (p + 1) * M)
    if m:
        group, block, pairs = qweight.config.group_size, x_block(qweight), layout_code(qweight)
        xq = torch.empty(planes * m, k, dtype=torch.int8)
        steps = torch.empty(planes * m, k // block, dtype=torch.float32)
        sums = torch.empty(planes * m, k // group, dtype=torch.float32)
        rounded_sums = torch.empty(planes * m, k // group, dtype=torch.float32)

        threads = max(1, torch.get_num_threads())
        fine = [t[m].data_ptr() for t in (xq, steps, sums, rounded_sums)] if planes == 2 else [None] * 4
        lib.fs_quantize_x_all(flat.data_ptr(), m, k, k, group, block, pairs, xq.data_ptr(), steps.data_ptr(),
                              sums.data_ptr(), rounded_sums.data_ptr(), *fine, threads)
        packed = stored_rows(n) if qweight.panels else 0  # rows in the kernel's panels (quant/panels.py)
        lib.fs_q4_gemm_all(xq.data_ptr(), steps.data_ptr(), sums.data_ptr(), rounded_sums.data_ptr(), planes * m, k,
                           group, block, qweight.data.data_ptr(), qweight.scale.data_ptr(), qweight.minimum.data_ptr(),
                           int(qweight.config.minimum_fp32), pairs, packed, n,
                           gemm_step(n, threads, PANEL_ROWS if packed else ROW_ALIGN), y.data_ptr(), n, threads)
    out = y[:m] + y[m:] if planes == 2 else y
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], n)


def gemm_step(n: int, threads: int, align: int = ROW_ALIGN) -> int:
    """Output rows per range the kernel's threads take in turn: GEMM_CHUNKS_PER_THREAD ranges per
    thread, each a multiple of `align` (ROW_ALIGN; a weight stored in panels: whole panels)."""
    step = -(-n // (threads * GEMM_CHUNKS_PER_THREAD))
    return -(-step // align) * align


def error_bound(x: torch.Tensor, qweight: QTensor, planes: int = 1) -> torch.Tensor:
    """fp64 `[..., N]`: how far `int8_linear(x, qweight, planes=planes)` may lie from
    `F.linear(x, dequantize(qweight))` in exact arithmetic: sum_k |scale * (code - 8)| * step / 2
    (each x moves by at most half its step; with two planes, half the residual's 254x finer step)."""
    from quant.groupwise import dequantize  # noqa: PLC0415 - only the tests and benchmarks need it

    qweight = from_panels(qweight)
    n, k = qweight.shape
    flat = x.reshape(-1, k).double()
    block = x_block(qweight)
    steps = flat.view(-1, k // block, block).abs().amax(-1) / (127 if planes == 1 else 127 * 254)  # [M, K / block]
    group = qweight.config.group_size
    zero = qweight.minimum.double().view(n, -1) + 8 * qweight.scale.double().view(n, -1)
    scaled_codes = (dequantize(qweight, torch.float64) - zero.repeat_interleave(group, 1)).abs()  # [N, K]
    return (steps.repeat_interleave(block, 1) / 2) @ scaled_codes.T


_p, _i, _flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
KERNEL = Kernel("int8_linear", SOURCE, {
    "fs_quantize_x_all": [_p, _i, _i, _i, _i, _i, _flag, _p, _p, _p, _p, _p, _p, _p, _p, _flag],
    "fs_q4_gemm_all": [_p, _p, _p, _p, _i, _i, _i, _i, _p, _p, _p, _flag, _flag, _i, _i, _i, _p, _i, _flag]},
    isa_paths=True)  # AVX-512 VNNI, AVX-VNNI or AVX2, by the CPU's flags or $FLEXSARATHI_INT8_ISA
available, unavailable_reason = KERNEL.available, KERNEL.unavailable_reason
_by_isa: dict[str, Kernel] = {}


def kernel_for(isa: str) -> Kernel:
    """The kernel on instruction path `isa`, loaded once per process."""
    if isa not in _by_isa:
        _by_isa[isa] = KERNEL.for_isa(isa)
    return _by_isa[isa]
