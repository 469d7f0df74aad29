"""Weight placement: which rows of each layer weight live on which tier, and what that costs.

Per layer, the large (2-D) weights are laid end to end and cut at `w_gpu` and `w_gpu + w_cpu` of
their bytes; a tensor that straddles a cut is split by rows, so every tier holds its fraction to
within one row (FlexGen assigns whole tensors by their midpoint, which makes GPU memory jump with
the percentage). Norms and biases are tiny and stay on the compute device.

A placed tensor is one or more flat components (a plain weight: itself; a compressed one: codes,
scales, minimums), each with a fixed number of elements per original row, so a row range is a
contiguous slice of every component: in memory, and as a byte range of the disk store.

Where the engine computes in bf16 on the CPU, a 4-bit weight the CPU int4 kernel covers is kept in
that kernel's layout (`Int4Packed`: codes in 64-row blocks, then row-major bf16 scales and zeros;
quant/cpu_matmul.py) on every tier, packed once as it is placed: it costs the same bytes as our
own layout (two bytes of scale and two of zero per group) and saves the per-pass dequantization at
decode row counts. Its row pieces fall on 64-row block boundaries.

Before use, every non-resident tensor is assembled in a working buffer on the compute device (with
overlap, 1 + `prefetch` buffers); offload/tiered_weights.py streams them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from offload.memory import MemoryTracker
from policy_search.policy import TIERS
from quant import QTensor, QuantConfig, dequantize, quantize
from quant.cpu_matmul import BLOCK_ROWS, KERNEL_LAYOUT_ID, Int4Packed, kernel_covers_format, kernel_covers_shape, \
    pack_for_cpu_kernel

Weights = dict[str, object]
# One format for every 2-D weight, or one per canonical tensor name (a pre-quantized checkpoint's
# own formats; None: that tensor stays in the compute dtype).
QuantFormats = QuantConfig | None | Mapping[str, QuantConfig | None]


def quant_of(quant: QuantFormats, name: str) -> QuantConfig | None:
    return quant.get(name) if isinstance(quant, Mapping) else quant


@dataclass(frozen=True)
class Component:
    suffix: str  # "" for a plain tensor; "data" / "scale" / "minimum" for a QTensor; "packed" /
    # "scales_zeros" for a weight in the CPU int4 kernel's layout
    dtype: torch.dtype
    per_row: int  # elements per original row

    def numel(self, rows: int) -> int:
        return rows * self.per_row

    def nbytes(self, rows: int) -> int:
        return rows * self.per_row * self.dtype.itemsize


@dataclass(frozen=True)
class Piece:
    tier: str
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, int]
    dtype: torch.dtype  # the compute dtype it dequantizes / loads to
    quant: QuantConfig | None
    components: tuple[Component, ...]
    pieces: tuple[Piece, ...]
    kernel_layout: bool = False  # 4-bit in the CPU int4 kernel's layout (pieces on 64-row blocks)
    blocks: int = 1  # equal row blocks stacked in it (a layer's experts), each addressable alone

    @property
    def block_rows(self) -> int:
        return self.shape[0] // self.blocks

    @property
    def row_bytes(self) -> int:
        return sum(c.nbytes(1) for c in self.components)

    def bytes_on(self, tier: str) -> int:
        return sum(p.rows for p in self.pieces if p.tier == tier) * self.row_bytes

    @property
    def resident(self) -> bool:
        return all(p.tier == "gpu" for p in self.pieces)

    @property
    def gpu_rows(self) -> int:
        """Rows [0, gpu_rows) on the gpu tier (tiers are cut in order gpu, cpu, disk): used in place;
        only rows [gpu_rows, rows) are streamed into a working buffer (offload.weights.RowSplit)."""
        return sum(p.rows for p in self.pieces if p.tier == "gpu")


def uses_kernel_layout(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None,
                       quant: QuantConfig | None, int4_layout: bool = True) -> bool:
    """A weight of `shape` is kept in the CPU int4 kernel's layout: bf16 compute on the CPU, 4-bit
    weights the kernel covers on this machine, and the engine not preferring the int8 kernel
    (int4_layout=False: row-major, what quant/cpu_int8_matmul.py multiplies)."""
    return (int4_layout and quant is not None and dtype == torch.bfloat16 and device is not None
            and torch.device(device).type == "cpu" and kernel_covers_shape(shape, quant))


def weight_layout_tag(dtype: torch.dtype, device: torch.device, quant: QuantConfig | None,
                      int4_layout: bool = True) -> str:
    """Names the stored layout of the weights the kernel covers, for the disk store's key: a store
    written in another layout (older code, another machine's kernel) then has another key and is
    rebuilt, never misread."""
    if int4_layout and quant is not None and dtype == torch.bfloat16 and torch.device(device).type == "cpu" \
            and kernel_covers_format(quant):
        return KERNEL_LAYOUT_ID
    return "rowmajor"


def components_of(shape: tuple[int, int], dtype: torch.dtype, quant: QuantConfig | None,
                  kernel_layout: bool = False) -> tuple[Component, ...]:
    rows, cols = shape
    if quant is None:
        return (Component("", dtype, cols),)
    groups_per_row = -(-cols // quant.group_size)
    if kernel_layout:  # per row on average: a 64-row block is the unit (see BLOCK_ROWS)
        return (Component("packed", torch.uint8, cols // 2), Component("scales_zeros", torch.bfloat16, 2 * groups_per_row))
    return (Component("data", torch.uint8, groups_per_row * quant.bytes_per_group),
            Component("scale", torch.float16, groups_per_row),
            Component("minimum", torch.float32 if quant.minimum_fp32 else torch.float16, groups_per_row))


def quantized_on_placement(shapes: dict[str, tuple[int, ...]], quant: QuantFormats,
                           resident: frozenset[str] = frozenset()) -> frozenset[str]:
    """The layer weights `plan_layer` gives a format (2-D, not resident): a source that gives them
    in floating point has them quantized as they are placed (flat_components), and quantize
    refuses a group whose scale or minimum is not a finite fp16, so that pass checks their values."""
    return frozenset(name for name, shape in shapes.items()
                     if len(shape) == 2 and name not in resident and quant_of(quant, name) is not None)


def plan_layer(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, quant: QuantFormats,
               fractions: tuple[float, float, float], device: torch.device | None = None,
               row_blocks: dict[str, int] | None = None, resident: frozenset[str] = frozenset(),
               int4_layout: bool = True) -> list[TensorPlan]:
    """Cut the layer's 2-D weights at the fraction boundaries of their total bytes (row granularity;
    64-row blocks for a weight in the CPU int4 kernel's layout). `device`: the compute device.
    row_blocks: weights made of that many equal row blocks (experts): the kernel layout only where
    every block is whole 64-row blocks, so that a block stays a contiguous row range. resident: 2-D
    weights kept with the small tensors (uncompressed, on the compute device). int4_layout: see
    uses_kernel_layout."""
    blocks = row_blocks or {}

    def kernel(name, shape, q):
        return uses_kernel_layout((shape[0] // blocks.get(name, 1), shape[1]), dtype, device, q, int4_layout)

    plans = [(name, shape, quant_of(quant, name)) for name, shape in shapes.items()
             if len(shape) == 2 and name not in resident]
    plans = [(name, shape, q, kernel(name, shape, q)) for name, shape, q in plans]
    plans = [(name, shape, q, k, components_of(shape, dtype, q, k)) for name, shape, q, k in plans]
    row_bytes = {name: sum(c.nbytes(1) for c in comps) for name, _, _, _, comps in plans}
    total = sum(shape[0] * row_bytes[name] for name, shape, _, _, _ in plans)
    cuts = [fractions[0] * total, (fractions[0] + fractions[1]) * total]  # byte positions
    out, offset = [], 0
    for name, shape, q, kernel, comps in plans:
        rows, rb = shape[0], row_bytes[name]
        unit = BLOCK_ROWS if kernel else 1
        # Row index where each cut falls inside this tensor, rounded to the nearest unit of rows.
        boundaries = [min(rows, max(0, round((cut - offset) / (rb * unit)) * unit)) for cut in cuts]
        edges = [0, boundaries[0], max(boundaries[0], boundaries[1]), rows]
        pieces = tuple(Piece(tier, edges[i], edges[i + 1]) for i, tier in enumerate(TIERS)
                       if edges[i + 1] > edges[i])
        out.append(TensorPlan(name, (shape[0], shape[1]), dtype, q, comps, pieces, kernel, blocks.get(name, 1)))
        offset += rows * rb
    return out


def compress_resident(name: str, weight: torch.Tensor | QTensor, dtype: torch.dtype, quant: QuantConfig,
                      device: torch.device, int4_layout: bool = True) -> tuple[torch.Tensor | QTensor | Int4Packed, int]:
    """A 2-D weight kept whole on the compute device in `quant`'s format, in the form the model
    multiplies layer weights of that format (a QTensor, or the CPU int4 kernel's layout where the
    layers use it): (the weight, its bytes)."""
    plan = plan_layer({name: tuple(weight.shape)}, dtype, quant, (1.0, 0.0, 0.0), device, int4_layout=int4_layout)[0]
    components = [c.to(device) for c in flat_components(weight, plan)]
    return assemble(plan, components), sum(c.nbytes for c in components)


def flat_components(tensor: torch.Tensor | QTensor, plan: TensorPlan) -> list[torch.Tensor]:
    """The tensor as it is stored: flat components (compressed when the plan says so). A source may
    give a weight already quantized (dummy codes): kept as it is in the plan's format, else
    dequantized first."""
    if isinstance(tensor, QTensor) and tensor.config != plan.quant:
        tensor = dequantize(tensor, plan.dtype)
    if plan.quant is None:
        return [tensor.reshape(-1)]
    q = tensor if isinstance(tensor, QTensor) else quantize(tensor, plan.quant)
    if plan.kernel_layout:
        return pack_for_cpu_kernel(q).components()
    return [q.data, q.scale, q.minimum]


def assemble(plan: TensorPlan, components: list[torch.Tensor], rows: int | None = None, panels: bool = False):
    """Flat components -> the weight the model uses (a tensor, a QTensor, or an Int4Packed);
    rows: the components hold that many of the weight's rows (one expert's), not all; panels: a
    QTensor's components are stored in the int8 kernel's panels (quant/panels.py)."""
    shape = plan.shape if rows is None else (rows, plan.shape[1])
    if plan.quant is None:
        return components[0].view(shape)
    if plan.kernel_layout:
        return Int4Packed.from_flat(*components, shape, plan.quant.group_size)
    data, scale, minimum = components
    return QTensor(data=data, scale=scale, minimum=minimum, shape=shape, dtype=plan.dtype, config=plan.quant,
                   panels=panels)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's cut: its 2-D weights over the tiers, and its small tensors (norms, biases,
    routers) resident on the compute device."""

    tensors: tuple[TensorPlan, ...]
    small_shapes: dict[str, tuple[int, ...]]

    @property
    def streamed(self) -> list[TensorPlan]:
        return [p for p in self.tensors if not p.resident]

    def bytes_on(self, tier: str) -> int:
        return sum(p.bytes_on(tier) for p in self.tensors)

    @property
    def large_bytes(self) -> int:
        return sum(p.shape[0] * p.row_bytes for p in self.tensors)

    @property
    def streamed_bytes(self) -> int:
        """Bytes of a working slot holding this layer's streamed rows: those off the gpu tier (the
        slot aligns each component's start to 4096 bytes on top: at most 4 KiB each)."""
        return sum((p.shape[0] - p.gpu_rows) * p.row_bytes for p in self.streamed)

    def small_bytes(self, dtype: torch.dtype) -> int:
        return sum(torch.Size(s).numel() for s in self.small_shapes.values()) * dtype.itemsize


@dataclass(frozen=True)
class WeightPlan:
    """Where every weight of the model lives and the bytes each tier and the working buffers need.
    Every layer is cut at the same fractions; layers of different shapes (a mixture-of-experts
    model's dense layers among sparse ones) have plans of their own (`layer(j)`)."""

    num_layers: int
    layers: tuple[LayerPlan, ...]  # per layer (layers of equal shapes share one LayerPlan)
    dtype: torch.dtype
    num_slots: int  # working buffers a streamed layer is assembled in
    prefetch_depth: int  # layers loading ahead of the one computing

    @classmethod
    def make(cls, *, num_layers: int, layer_shapes: dict[str, tuple[int, ...]] | list[dict[str, tuple[int, ...]]],
             dtype: torch.dtype, quant: QuantFormats, fractions: tuple[float, float, float], overlap: bool,
             prefetch: int, device: torch.device | None = None, row_blocks: dict[str, int] | None = None,
             resident: frozenset[str] = frozenset(), int4_layout: bool = True) -> WeightPlan:
        """layer_shapes: one dict for every layer, or one per layer; int4_layout: see uses_kernel_layout."""
        per_layer = [layer_shapes] * num_layers if isinstance(layer_shapes, dict) else list(layer_shapes)
        if len(per_layer) != num_layers:
            raise ValueError(f"WeightPlan: {len(per_layer)} layer shape dicts for {num_layers} layers")
        kinds: dict[tuple, LayerPlan] = {}
        for shapes in per_layer:
            key = tuple(sorted(shapes.items()))
            if key not in kinds:
                small = {k: s for k, s in shapes.items() if len(s) != 2 or k in resident}
                kinds[key] = LayerPlan(tuple(plan_layer(shapes, dtype, quant, fractions, device, row_blocks,
                                                        resident, int4_layout)), small)
        return cls(num_layers, tuple(kinds[tuple(sorted(s.items()))] for s in per_layer), dtype,
                   num_slots=prefetch + 1 if overlap else 1, prefetch_depth=prefetch if overlap else 1)

    def layer(self, layer: int) -> LayerPlan:
        return self.layers[layer]

    @property
    def kinds(self) -> list[LayerPlan]:
        """The distinct layer plans, in order of first appearance."""
        seen: list[LayerPlan] = []
        for plan in self.layers:
            if not any(plan is k for k in seen):
                seen.append(plan)
        return seen

    def _uniform(self) -> LayerPlan:
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("WeightPlan: layers differ in shapes; use layer(j)")
        return kinds[0]

    @property
    def tensors(self) -> tuple[TensorPlan, ...]:
        """The layers' 2-D weights where every layer has the same shapes."""
        return self._uniform().tensors

    @property
    def small_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._uniform().small_shapes

    @property
    def streamed(self) -> list[TensorPlan]:
        return self._uniform().streamed

    @property
    def needs_disk(self) -> bool:
        return any(k.bytes_on("disk") for k in self.kinds)

    @property
    def small_bytes(self) -> int:
        return sum(plan.small_bytes(self.dtype) for plan in self.layers)

    @property
    def store_bytes(self) -> int:
        """Bytes of the disk store: every layer whole (all its pieces and small tensors)."""
        return sum(plan.large_bytes for plan in self.layers) + self.small_bytes

    @property
    def slot_bytes(self) -> int:
        """A working slot holds any layer's streamed tensors: the largest."""
        return max(k.streamed_bytes for k in self.kinds)

    def reserve(self, tracker: MemoryTracker, store_bytes: int | None = None) -> None:
        """Reserve every tier's bytes before any weight is read: a policy that does not fit fails
        here, with the arithmetic, rather than halfway through loading. store_bytes: what the disk
        store writes when the source's links replace some of it (default: everything)."""
        resident = sum(p.bytes_on("gpu") for plan in self.layers for p in plan.tensors if p.resident)
        split_gpu_rows = sum(p.bytes_on("gpu") for plan in self.layers for p in plan.streamed)
        tracker.reserve("gpu", resident + split_gpu_rows + self.small_bytes, "weights (gpu tier)")
        tracker.reserve("gpu", self.num_slots * self.slot_bytes, "weight working buffers")
        tracker.reserve("cpu", sum(plan.bytes_on("cpu") for plan in self.layers), "weights (cpu tier)")
        if self.needs_disk:
            tracker.reserve("disk", self.store_bytes if store_bytes is None else store_bytes, "weights (disk tier)")
