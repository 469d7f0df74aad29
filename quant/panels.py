"""A 4-bit weight stored in the int8 kernel's panels: its rows reordered once at load, not per call.

quant/csrc/q4_int8_gemm.c multiplies 16 weight rows at a time with one 64-byte load holding 4 bytes
of each (a "panel": int32 lane r = row r's 8 codes). From row-major rows it builds each panel per
call; at decode row counts (16 rows of x) that packing and the scales' transposes took half the
call. A weight that stays resident for such passes is stored in that order instead (llama.cpp
repacks its weights at load the same way): rows [0, N - N % 16) in 16-row panels, each panel's
codes [K / 8][16 rows][4 bytes] and its scales and minimums [groups][16 rows]; the N % 16 rows after
them row-major. The same bytes, so the same memory; the kernel gives the same bits as from the
row-major weight (tests/quant/test_panels.py). `QTensor.panels` marks such a tensor;
`dequantize` and `from_panels` read it back row-major.

Packed in place, a few hundred panels at a time (one temporary of that size), so a load holds no
second copy of the weight.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from quant.qtensor import QTensor

PANEL_ROWS = 16
_CHUNK_PANELS = 256  # panels per in-place step: 8 MiB of codes at K = 4096


def stored_rows(rows: int) -> int:
    """The rows of a `rows`-row weight that lie in panels (the rest are row-major)."""
    return rows - rows % PANEL_ROWS


def can_store(q: QTensor) -> bool:
    """A 2-D 4-bit weight grouped along its rows, with at least one panel of rows and whole 4-byte
    units per row (K a multiple of 8), not stored in panels already."""
    return (not q.panels and q.config.bits == 4 and len(q.shape) == 2 and q.layout.group_dim == 1
            and q.shape[1] % 8 == 0 and q.shape[1] % q.config.group_size == 0 and q.shape[0] >= PANEL_ROWS)


def to_panels(q: QTensor) -> QTensor:
    """`q` stored in panels, IN PLACE: q's own buffers are reordered (do not use `q` afterwards)
    and the returned QTensor (panels=True) views them."""
    if not can_store(q):
        raise ValueError(f"to_panels: a weight of shape {q.shape} with {q.config} (panels={q.panels}) cannot be "
                         f"stored in {PANEL_ROWS}-row panels")
    _reorder_(q, to_panel_order=True)
    return replace(q, panels=True)


def from_panels(q: QTensor) -> QTensor:
    """A row-major copy of a weight stored in panels (`q` itself where it is not)."""
    if not q.panels:
        return q
    out = replace(q.clone(), panels=False)
    _reorder_(out, to_panel_order=False)
    return out


def _reorder_(q: QTensor, to_panel_order: bool) -> None:
    """q's panel rows reordered in place, chunk by chunk (each panel's bytes stay in its own rows)."""
    rows, cols = q.shape
    units, groups = cols // 8, cols // q.config.group_size  # 4-byte units of codes, groups per row
    views = ((q.data.view(rows, cols // 2), units, 4), (q.scale.view(rows, groups), groups, 1),
             (q.minimum.view(rows, groups), groups, 1))
    for start in range(0, stored_rows(rows), PANEL_ROWS * _CHUNK_PANELS):
        stop = min(stored_rows(rows), start + PANEL_ROWS * _CHUNK_PANELS)
        panels = (stop - start) // PANEL_ROWS
        for flat, per_row, width in views:
            block = flat[start:stop]
            # row-major [panels, 16 rows, per_row, width] <-> panel order [panels, per_row, 16 rows, width]
            shape = (panels, PANEL_ROWS, per_row, width) if to_panel_order else (panels, per_row, PANEL_ROWS, width)
            block.copy_(block.reshape(shape).transpose(1, 2).contiguous().view(block.shape))
