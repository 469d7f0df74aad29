"""quant/panels.py: a 4-bit weight stored in the int8 kernel's 16-row panels, reordered in place.

References: the panel order as quant/csrc/q4_int8_gemm.c states it (byte 64 t + 4 r + i of panel p
is row 16 p + r's byte 4 t + i; scales and minimums [groups][16 rows]), recomputed here from the
row-major bytes; `dequantize` of the row-major weight; and the kernel's own output from the
row-major weight, bit for bit, on every instruction path this CPU has.
"""
from __future__ import annotations

import pytest
import torch

from quant import QTensor, QuantConfig, dequantize, quantize
from quant import cpu_int8_matmul as k8
from quant.cpu_kernels import ISA_PATHS, missing_cpu_flags
from quant.panels import PANEL_ROWS, can_store, from_panels, stored_rows, to_panels

needs_kernel = pytest.mark.skipif(not k8.available(), reason=f"int8 kernel not available: {k8.unavailable_reason()}")
LAYOUTS = ("line", "pairs", "group")
# (rows, K, group): whole panels only; 5 rows after 3 panels (row by row); 13 after 2 (an 8-row
# panel packed per call, then 5 rows); one panel; the kernel's multi-sweep K
SHAPES = [(32, 256, 64), (53, 512, 32), (45, 320, 64), (16, 128, 128), (40, 2048, 64)]


def _weight(rows: int, k: int, group: int, layout: str, m32: bool, seed: int) -> QTensor:
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize(w, QuantConfig(bits=4, group_size=group, adjacent_pairs=layout == "pairs",
                                   group_halves=layout == "group", minimum_fp32=m32))


def _panel_order(q: QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored bytes the kernel reads, element by element from the row-major weight."""
    rows, k = q.shape
    groups = k // q.config.group_size
    data, scale, minimum = q.data.view(rows, k // 2), q.scale.view(rows, groups), q.minimum.view(rows, groups)
    out = [t.clone() for t in (q.data, q.scale, q.minimum)]
    for r in range(stored_rows(rows)):
        p, lane = divmod(r, PANEL_ROWS)
        for t in range(k // 8):
            at = p * PANEL_ROWS * (k // 2) + 64 * t + 4 * lane
            out[0][at:at + 4] = data[r, 4 * t:4 * t + 4]
        for g in range(groups):
            out[1][p * PANEL_ROWS * groups + PANEL_ROWS * g + lane] = scale[r, g]
            out[2][p * PANEL_ROWS * groups + PANEL_ROWS * g + lane] = minimum[r, g]
    return tuple(out)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,k,group", SHAPES[:3])
def test_to_panels_reorders_in_place_as_the_kernel_reads_and_dequantize_reads_it_back(layout, rows, k, group):
    q = _weight(rows, k, group, layout, m32=layout == "pairs", seed=rows + k)
    want = _panel_order(q)
    held = q.clone()
    pointers = [t.data_ptr() for t in (held.data, held.scale, held.minimum)]
    stored = to_panels(held)
    assert stored.panels and [t.data_ptr() for t in (stored.data, stored.scale, stored.minimum)] == pointers
    for got, expected in zip((stored.data, stored.scale, stored.minimum), want):
        assert torch.equal(got, expected)
    assert torch.equal(dequantize(stored), dequantize(q))
    back = from_panels(stored)
    assert not back.panels and all(torch.equal(a, b) for a, b in zip((back.data, back.scale, back.minimum),
                                                                      (q.data, q.scale, q.minimum)))
    assert torch.equal(stored.data, want[0])  # from_panels copied: the stored tensor is as it was


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows,k,group", SHAPES)
def test_the_kernel_gives_the_row_major_bits_from_panels_on_every_path(layout, rows, k, group):
    """Rows of x that go row by row (1-3, each panel unpacked), through panel tiles (4 and up), more
    than one sweep (K = 2048); 1 and 2 planes; 1 and 2 threads: the same bits as the row-major
    weight on every path (and each path equals AVX2's: tests/quant/test_cpu_int8_matmul.py)."""
    q = _weight(rows, k, group, layout, m32=group == 32, seed=rows * k)
    stored = to_panels(q.clone())
    row_counts = (1, 3, 4, 6, 13) + ((2 * (256 * 1024 // k) + 5,) if k == 2048 else ())
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in (name for name, path in ISA_PATHS.items() if not missing_cpu_flags(path)):
                for m in row_counts:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + threads)) * 2
                    for planes in (1, 2):
                        want = k8.int8_linear(x, q, planes=planes, isa=isa)
                        got = k8.int8_linear(x, stored, planes=planes, isa=isa)
                        assert torch.equal(got, want), (isa, m, planes, threads, (got - want).abs().max())
    finally:
        torch.set_num_threads(previous)


def test_what_cannot_be_stored_in_panels_is_refused():
    q = _weight(32, 128, 64, "line", False, seed=1)
    eight_bit = quantize(torch.randn(32, 128), QuantConfig(bits=8, group_size=64))
    few = _weight(PANEL_ROWS - 1, 128, 64, "line", False, seed=2)
    for bad in (eight_bit, few):
        assert not can_store(bad)
        with pytest.raises(ValueError, match="cannot be stored in 16-row panels"):
            to_panels(bad)
    stored = to_panels(q.clone())
    with pytest.raises(ValueError, match="panels=True"):
        to_panels(stored)
    with pytest.raises(ValueError, match="stored in panels"):
        stored.rows(0, 16)
    with pytest.raises(ValueError, match="panels=True"):
        stored.take_rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="QTensor.panels is True only for a 2-D 4-bit weight"):
        QTensor(data=eight_bit.data, scale=eight_bit.scale, minimum=eight_bit.minimum, shape=eight_bit.shape,
                dtype=eight_bit.dtype, config=eight_bit.config, panels=True)
