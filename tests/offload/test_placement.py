"""Weight placement: byte fractions honoured to within a row, and a complete disk store reused
without touching the source again."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.disk_store import DiskStore
from offload.memory import MemoryTracker
from offload.placement import TIERS, plan_layer
from offload.tiered_weights import TieredWeights
from offload.weights import RowSplit
from quant import QTensor, QuantConfig, dequantize, quantize

SHAPES = {"qkv": (96, 32), "o": (32, 32), "up": (80, 32), "down": (32, 80), "norm": (32,), "bias": (96,)}
QUANT = QuantConfig(bits=4, group_size=16, group_dim=-1)


@st.composite
def fractions(draw):
    a = draw(st.integers(0, 100))
    b = draw(st.integers(0, 100 - a))
    return a / 100, b / 100, (100 - a - b) / 100


@settings(max_examples=200, deadline=None)
@given(fractions(), st.booleans())
def test_every_tier_holds_its_fraction_of_bytes_to_within_a_row(f, compressed):
    plans = plan_layer(SHAPES, torch.bfloat16, QUANT if compressed else None, f)
    assert {p.name for p in plans} == {"qkv", "o", "up", "down"}  # 1-D tensors are not placed
    total = sum(p.shape[0] * p.row_bytes for p in plans)
    widest_row = max(p.row_bytes for p in plans)
    for tier, fraction in zip(TIERS, f):
        # each of the two cuts rounds to the nearest row of the tensor it falls in: half a row each
        assert abs(sum(p.bytes_on(tier) for p in plans) - fraction * total) <= widest_row
    for p in plans:  # pieces tile every tensor's rows, in tier order
        edges = [(piece.row_start, piece.row_end) for piece in p.pieces]
        assert edges[0][0] == 0 and edges[-1][1] == p.shape[0]
        assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))


def _layer(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in SHAPES.items()}


def _weights(tmp_path, quant, read_layer, overlap=True) -> TieredWeights:
    return TieredWeights(
        num_layers=3, layer_shapes=SHAPES, read_globals=lambda: {"embed": torch.ones(4, 32)},
        read_layer=read_layer, fractions=(0.3, 0.4, 0.3), device=torch.device("cpu"),
        dtype=torch.bfloat16, quant=quant, tracker=MemoryTracker(), overlap=overlap,
        disk_store=lambda: DiskStore(tmp_path, "test-store", direct_io=True))


def _plain(value):
    if isinstance(value, RowSplit):  # gpu rows in place, the rest from a working buffer
        return torch.cat([_plain(part) for part in value.parts])
    return dequantize(value) if isinstance(value, QTensor) else value


@pytest.mark.parametrize("quant", [None, QUANT], ids=["plain", "4-bit"])
def test_a_complete_store_is_reused_without_reading_the_source(tmp_path, quant):
    calls = []

    def read_layer(i):
        calls.append(i)
        return _layer(i)

    first = _weights(tmp_path, quant, read_layer)
    assert calls == [0, 1, 2]  # written once
    expected = [{k: _plain(v).clone() for k, v in first.get(i).items()} for i in range(3)]
    first.close()
    for i in range(3):  # the split layer is the source's layer (compressed: its round trip)
        for name, value in _layer(i).items():
            want = value if quant is None or value.dim() == 1 else dequantize(quantize(value, QUANT))
            assert torch.equal(expected[i][name], want), name

    calls.clear()
    again = _weights(tmp_path, quant, read_layer, overlap=False)
    assert calls == []  # gpu/cpu pieces and norms come from the store
    for i in range(3):
        got = again.get(i)
        assert got.keys() == expected[i].keys()
        for name in got:
            assert torch.equal(_plain(got[name]), expected[i][name]), (i, name)
    again.close()


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("num_layers", [1, 2, 3, 4])
def test_prefetch_across_passes_never_overwrites_the_layer_in_use(tmp_path, num_layers, prefetch):
    """The executor prefetches layers j+1 .. j+prefetch while j computes, wrapping to the next
    pass's first layers: with prefetch + 1 working slots and any layer count, none of those loads
    may land in the slot layer j is using."""
    weights = TieredWeights(
        num_layers=num_layers, layer_shapes=SHAPES, read_globals=lambda: {"embed": torch.ones(4, 32)},
        read_layer=_layer, fractions=(0.0, 0.5, 0.5), device=torch.device("cpu"), dtype=torch.bfloat16,
        quant=None, tracker=MemoryTracker(), overlap=True, prefetch=prefetch,
        disk_store=lambda: DiskStore(tmp_path, "prefetch", direct_io=True))
    assert weights.prefetch_depth == prefetch and len(weights._buffers) == prefetch + 1
    expected = [_layer(i) for i in range(num_layers)]
    weights.prefetch(0)
    for _ in range(3):  # passes
        for j in range(num_layers):
            got = weights.get(j)
            before = {k: v.clone() for k, v in got.items()}
            for ahead in range(1, prefetch + 1):  # as offload/executor.py does
                weights.prefetch((j + ahead) % num_layers)
            for _, future in list(weights._pending.values()):  # every prefetch has landed
                future.result()
            for name, value in got.items():  # ... and not in the buffers layer j is using
                assert torch.equal(value, before[name]) and torch.equal(value, expected[j][name]), (j, name)
            weights.release(j)
    weights.close()


@pytest.mark.parametrize("quant", [QuantConfig(), {"qkv": QuantConfig(), "o": None}, None])
def test_the_weights_said_quantized_on_placement_are_those_the_plan_quantizes(quant):
    """The engine leaves these weights' finiteness to quantize's scale check (flexsarathi/engine/
    llm_engine.py _checked_on_placement): exactly the plan's compressed ones."""
    from offload.placement import quantized_on_placement
    shapes = {"qkv": (96, 64), "o": (64, 64), "router": (4, 64), "norm": (64,)}
    resident = frozenset({"router"})
    plans = plan_layer(shapes, torch.float32, quant, (0.5, 0.5, 0.0), resident=resident)
    assert quantized_on_placement(shapes, quant, resident) == {p.name for p in plans if p.quant is not None}
