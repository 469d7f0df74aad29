"""Weight placement across tiers by byte fractions, and streaming to the compute device.

Per layer, the large (2-D) weights are laid end to end and cut at `w_gpu` and `w_gpu + w_cpu` of
their bytes; a tensor that straddles a cut is split by rows, so every tier holds its fraction to
within one row (FlexGen assigns whole tensors by their midpoint, which makes GPU memory jump with
the percentage). Norms and biases are tiny and stay on the compute device.

A placed tensor is one or more flat components (a plain weight: itself; a compressed one: codes,
scales, minimums), each with a fixed number of elements per original row, so a row range is a
contiguous slice of every component: in memory, and as a byte range of the disk store.

Before use, every non-resident tensor is assembled in a working buffer on the compute device (with
overlap, 1 + `prefetch` buffers: layers j+1 .. j+prefetch load while layer j computes). On a
CPU-only machine the compute device is the CPU and the gpu tier is a budgeted working set in host
memory, so cpu-tier weights are still copied into working buffers, exactly as on a GPU.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from offload.disk_store import DiskStore, OffloadError, StoreCorruptError, aligned_empty
from offload.memory import MemoryTracker
from quant import QTensor, QuantConfig, quantize

TIERS = ("gpu", "cpu", "disk")
Weights = dict[str, object]


@dataclass(frozen=True)
class Component:
    suffix: str  # "" for a plain tensor; "data" / "scale" / "minimum" for a QTensor
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

    @property
    def row_bytes(self) -> int:
        return sum(c.nbytes(1) for c in self.components)

    def bytes_on(self, tier: str) -> int:
        return sum(p.rows for p in self.pieces if p.tier == tier) * self.row_bytes

    @property
    def resident(self) -> bool:
        return all(p.tier == "gpu" for p in self.pieces)


def components_of(shape: tuple[int, int], dtype: torch.dtype, quant: QuantConfig | None) -> tuple[Component, ...]:
    rows, cols = shape
    if quant is None:
        return (Component("", dtype, cols),)
    groups_per_row = -(-cols // quant.group_size)
    return (Component("data", torch.uint8, groups_per_row * quant.bytes_per_group),
            Component("scale", torch.float16, groups_per_row),
            Component("minimum", torch.float16, groups_per_row))


def plan_layer(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, quant: QuantConfig | None,
               fractions: tuple[float, float, float]) -> list[TensorPlan]:
    """Cut the layer's 2-D weights at the fraction boundaries of their total bytes (row granularity)."""
    plans = [(name, shape, components_of(shape, dtype, quant)) for name, shape in shapes.items()
             if len(shape) == 2]
    row_bytes = {name: sum(c.nbytes(1) for c in comps) for name, _, comps in plans}
    total = sum(shape[0] * row_bytes[name] for name, shape, _ in plans)
    cuts = [fractions[0] * total, (fractions[0] + fractions[1]) * total]  # byte positions
    out, offset = [], 0
    for name, shape, comps in plans:
        rows, rb = shape[0], row_bytes[name]
        # Row index where each cut falls inside this tensor, rounded to the nearest row.
        boundaries = [min(rows, max(0, round((cut - offset) / rb))) for cut in cuts]
        edges = [0, boundaries[0], max(boundaries[0], boundaries[1]), rows]
        pieces = tuple(Piece(tier, edges[i], edges[i + 1]) for i, tier in enumerate(TIERS)
                       if edges[i + 1] > edges[i])
        out.append(TensorPlan(name, (shape[0], shape[1]), dtype, quant, comps, pieces))
        offset += rows * rb
    return out


def flat_components(tensor: torch.Tensor, plan: TensorPlan) -> list[torch.Tensor]:
    """The tensor as it is stored: flat components (compressed when the plan says so)."""
    if plan.quant is None:
        return [tensor.reshape(-1)]
    q = quantize(tensor, plan.quant)
    return [q.data, q.scale, q.minimum]


def assemble(plan: TensorPlan, components: list[torch.Tensor]):
    """Flat components -> the weight the model uses (a tensor, or a QTensor)."""
    if plan.quant is None:
        return components[0].view(plan.shape)
    data, scale, minimum = components
    return QTensor(data=data, scale=scale, minimum=minimum, shape=plan.shape, dtype=plan.dtype,
                   config=plan.quant)


class TieredWeights:
    """LayerWeightStore over gpu / cpu / disk tiers (see offload.weights)."""

    def __init__(self, *, num_layers: int, layer_shapes: dict[str, tuple[int, ...]],
                 read_globals: Callable[[], dict], read_layer: Callable[[int], dict],
                 fractions: tuple[float, float, float], device: torch.device, dtype: torch.dtype,
                 quant: QuantConfig | None, tracker: MemoryTracker, overlap: bool, prefetch: int = 1,
                 disk_store: Callable[[], DiskStore] | None = None, pin_memory: bool = False):
        self.num_layers, self.device, self.dtype = num_layers, torch.device(device), dtype
        self.plans = plan_layer(layer_shapes, dtype, quant, fractions)  # same for every layer
        self.small_shapes = {k: s for k, s in layer_shapes.items() if len(s) != 2}
        self.overlap = overlap
        self.cuda = self.device.type == "cuda"
        self.pin = pin_memory and self.cuda
        num_slots = prefetch + 1 if overlap else 1
        self.prefetch_depth = prefetch if overlap else 1
        streamed = [p for p in self.plans if not p.resident]
        per_slot = sum(p.shape[0] * p.row_bytes for p in streamed)
        resident = sum(p.bytes_on("gpu") for p in self.plans if p.resident) * num_layers
        small = sum(torch.Size(s).numel() for s in self.small_shapes.values()) * dtype.itemsize * num_layers
        split_gpu_rows = sum(p.bytes_on("gpu") for p in streamed) * num_layers
        # Reserve everything before any weight is read: a policy that does not fit fails here,
        # with the arithmetic, rather than halfway through loading.
        tracker.reserve("gpu", resident + split_gpu_rows + small, "weights (gpu tier)")
        tracker.reserve("gpu", num_slots * per_slot, "weight working buffers")
        tracker.reserve("cpu", sum(p.bytes_on("cpu") for p in self.plans) * num_layers, "weights (cpu tier)")
        disk_bytes = sum(p.shape[0] * p.row_bytes for p in self.plans) * num_layers
        needs_disk = any(p.bytes_on("disk") for p in self.plans)
        if needs_disk:
            tracker.reserve("disk", disk_bytes + small, "weights (disk tier)")
        self._globals = {k: v.to(self.device) for k, v in read_globals().items()}
        tracker.reserve("gpu", sum(t.nbytes for t in self._globals.values()), "embeddings and head")

        self.store = disk_store() if needs_disk else None
        self._read_layer, self._store_bytes = read_layer, disk_bytes + small
        self._small: list[dict[str, torch.Tensor]] = []
        self._parts: list[dict[tuple[str, int], list[torch.Tensor]]] = []  # (name, piece) -> comps
        try:
            self._place_all(rewrite=False)
        except StoreCorruptError as damage:  # a reused store failed its checksums: never use it
            warnings.warn(f"{damage}; rebuilding the store from the source", RuntimeWarning, stacklevel=2)
            self._place_all(rewrite=True, damage=damage)

        # On the host, working buffers start on a 4096-byte boundary so that O_DIRECT reads of disk
        # pieces land in them directly (an unaligned buffer costs every chunk a bounce copy).
        def working_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
            if self.device.type == "cpu":
                return aligned_empty((numel,), dtype)
            return torch.empty(numel, dtype=dtype, device=self.device)

        self._buffers = [{p.name: [working_buffer(cm.numel(p.shape[0]), cm.dtype)
                                   for cm in p.components] for p in streamed} for _ in range(num_slots)]
        self._staging = None
        if self.cuda and needs_disk:  # disk -> pinned host staging -> device
            self._staging = [{p.name: [torch.empty(cm.numel(p.shape[0]), dtype=cm.dtype, pin_memory=True)
                                       for cm in p.components] for p in streamed} for _ in range(num_slots)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-prefetch") if overlap else None
        self._stream = torch.cuda.Stream(self.device) if self.cuda and overlap else None
        self._pending: dict[int, tuple[int, Future | None]] = {}  # layer -> (slot, its load)
        self._in_use: dict[int, int] = {}  # layer -> slot, from get() to release()
        self._next_slot = 0  # slots go round in prefetch order (any layer count, across passes)
        # CUDA: an event per slot, recorded on the compute stream when the pass releases the layer
        # in it; the next load into the slot waits for it (compute is asynchronous on a GPU).
        self._slot_free: list[torch.cuda.Event | None] = [None] * num_slots

    def _place_all(self, *, rewrite: bool, damage: StoreCorruptError | None = None) -> None:
        """Every layer's small tensors and gpu/cpu pieces; the disk store written first when it is
        absent, incomplete or (`rewrite`) damaged. A complete store holds every layer as placed and
        compressed: the resident pieces are read from it instead of regenerating or re-quantizing
        the layer from the source."""
        store = self.store
        write = store is not None and (rewrite or not store.is_complete())
        writer = store.begin_write(total_bytes=self._store_bytes) if write else None
        self._small, self._parts = [], []
        try:
            for layer in range(self.num_layers):
                if store is not None and writer is None:
                    small, parts = self._read_layer_from_store(layer)
                else:
                    weights = self._source_layer(layer, damage)
                    small = {k: weights[k].to(self.device) for k in self.small_shapes}
                    parts = self._place_layer(weights, layer, writer)
                    del weights
                self._small.append(small)
                self._parts.append(parts)
            if writer is not None:
                writer.commit()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise

    def _source_layer(self, layer: int, damage: StoreCorruptError | None) -> dict:
        """The layer's weights from the source; when they are wanted to rebuild a damaged store and
        the source cannot give them, the error names the damaged file and the source's failure."""
        try:
            return self._read_layer(layer)
        except Exception as exc:
            if damage is None:
                raise
            raise OffloadError(f"{damage}; it cannot be rebuilt because the source weights of layer "
                               f"{layer} cannot be read ({type(exc).__name__}: {exc})") from exc

    def _rebuild_store(self, damage: StoreCorruptError) -> None:
        """Rewrite the whole store from the source (found damaged while running). Only the disk
        pieces are read from it after loading, so the gpu/cpu pieces in memory stay as they are."""
        warnings.warn(f"{damage}; rebuilding the store from the source", RuntimeWarning, stacklevel=3)
        with self.store.begin_write(total_bytes=self._store_bytes) as writer:
            for layer in range(self.num_layers):
                self._write_layer(self._source_layer(layer, damage), layer, writer)
            writer.commit()

    @staticmethod
    def _key(layer: int, name: str, comp: Component) -> str:
        return f"{layer}.{name}{'.' + comp.suffix if comp.suffix else ''}"

    @staticmethod
    def _small_key(layer: int, name: str) -> str:
        return f"{layer}.small.{name}"

    def _place_layer(self, weights: dict, layer: int, writer) -> dict:
        """The layer's gpu- and cpu-tier pieces, cut from its weights (compressed per the plan);
        with a writer, the layer also goes to the disk store whole (every tensor's components and
        the small tensors)."""
        parts = {}
        for plan in self.plans:
            comps = flat_components(weights[plan.name], plan)
            for i, piece in enumerate(plan.pieces):
                if piece.tier == "disk":
                    continue
                target = self.device if piece.tier == "gpu" else torch.device("cpu")
                sliced = [c[cm.numel(piece.row_start):cm.numel(piece.row_end)].to(target).clone()
                          for c, cm in zip(comps, plan.components)]
                if piece.tier == "cpu" and self.pin:
                    sliced = [t.pin_memory() for t in sliced]
                parts[(plan.name, i)] = sliced
            if writer is not None:
                self._add_tensor(writer, layer, plan, comps)
        if writer is not None:
            for k in self.small_shapes:
                writer.add(self._small_key(layer, k), weights[k])
        return parts

    def _write_layer(self, weights: dict, layer: int, writer) -> None:
        """The layer to the disk store, as _place_layer writes it (same names, same order)."""
        for plan in self.plans:
            self._add_tensor(writer, layer, plan, flat_components(weights[plan.name], plan))
        for k in self.small_shapes:
            writer.add(self._small_key(layer, k), weights[k])

    def _add_tensor(self, writer, layer: int, plan: TensorPlan, comps: list[torch.Tensor]) -> None:
        for comp, cm in zip(comps, plan.components):
            writer.add(self._key(layer, plan.name, cm), comp)

    def _read_layer_from_store(self, layer: int) -> tuple[dict, dict]:
        """(small tensors, gpu- and cpu-tier pieces) of `layer`, read from the complete store."""
        store = self.store
        small = {k: store.read_tensor(self._small_key(layer, k)).to(self.device) for k in self.small_shapes}
        parts = {}
        with _AllReads() as reads:
            for plan in self.plans:
                for i, piece in enumerate(plan.pieces):
                    if piece.tier == "disk":
                        continue
                    sliced = []
                    for cm in plan.components:
                        lo, hi = cm.numel(piece.row_start), cm.numel(piece.row_end)
                        host = aligned_empty((hi - lo,), cm.dtype, pin_memory=self.pin and piece.tier == "cpu")
                        reads.add(store.read_range_async(self._key(layer, plan.name, cm), lo * cm.dtype.itemsize, host))
                        sliced.append(host)
                    parts[(plan.name, i)] = (piece.tier, sliced)
        return small, {key: [t.to(self.device) if tier == "gpu" else t for t in sliced]
                       for key, (tier, sliced) in parts.items()}

    # ---- LayerWeightStore -----------------------------------------------------------------
    def global_weights(self) -> Weights:
        return self._globals

    def prefetch(self, layer: int) -> None:
        if layer in self._pending:
            return
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._buffers)
        if self._pool is None:
            # Serial: one working buffer, filled in get() once the previous layer is done with it.
            self._pending[layer] = (slot, None)
        else:
            self._pending[layer] = (slot, self._pool.submit(self._load, layer, slot))

    def get(self, layer: int) -> Weights:
        if layer not in self._pending:
            self.prefetch(layer)
        slot, future = self._pending.pop(layer)
        event = future.result() if future is not None else self._load(layer, slot)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._in_use[layer] = slot
        weights: Weights = dict(self._small[layer])
        for plan in self.plans:
            if plan.resident:
                weights[plan.name] = assemble(plan, self._parts[layer][(plan.name, 0)])
            else:
                weights[plan.name] = assemble(plan, self._buffers[slot][plan.name])
        return weights

    def release(self, layer: int) -> None:
        """The slot may be refilled: at once on the CPU (compute is synchronous), after the
        compute stream passes this point on CUDA."""
        slot = self._in_use.pop(layer, None)
        if slot is not None and self._stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[slot] = event

    def reset(self) -> None:
        """After an interrupted pass: cancel the prefetches not started, wait for the one running
        (it writes into a working buffer and reads the store), and forget which layer sits in which
        slot, so the next pass starts with every slot free, as a fresh engine's does."""
        for _, future in self._pending.values():
            if future is not None:
                future.cancel()
        if self._pool is not None:
            self._pool.submit(int).result()  # one worker: every load submitted before is finished
        if self.store is not None:
            self.store.drain()  # reads a serial load started before it was interrupted
        if self._stream is not None:
            self._stream.synchronize()
        self._pending.clear()
        self._in_use.clear()
        self._next_slot = 0
        self._slot_free = [None] * len(self._slot_free)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    # ---- loading --------------------------------------------------------------------------
    def _load(self, layer: int, slot: int):
        """Assemble every streamed tensor of `layer` in working buffer `slot` (runs on the
        prefetch thread when overlapping). Returns a CUDA event to wait on, or None. A damaged
        store is rebuilt from the source and the layer read again (this thread is the only one
        reading the store once the weights are placed)."""
        try:
            return self._load_slot(layer, slot)
        except StoreCorruptError as damage:
            self._rebuild_store(damage)
            return self._load_slot(layer, slot)

    def _load_slot(self, layer: int, slot: int):
        if self._stream is not None:
            self._stream.synchronize()  # copies out of this slot's staging buffers are done
        reads = []
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext(), _AllReads() as pending:
            if self._stream is not None and self._slot_free[slot] is not None:
                self._stream.wait_event(self._slot_free[slot])  # the layer that used it is computed
            for plan in self.plans:
                if plan.resident:
                    continue
                buffers = self._buffers[slot][plan.name]
                for i, piece in enumerate(plan.pieces):
                    for c, (cm, buf) in enumerate(zip(plan.components, buffers)):
                        lo, hi = cm.numel(piece.row_start), cm.numel(piece.row_end)
                        if piece.tier == "disk":
                            target = self._staging[slot][plan.name][c][lo:hi] if self._staging else buf[lo:hi]
                            future = pending.add(self.store.read_range_async(
                                self._key(layer, plan.name, cm), lo * cm.dtype.itemsize, target))
                            reads.append((future, buf[lo:hi], target))
                        else:
                            buf[lo:hi].copy_(self._parts[layer][(plan.name, i)][c], non_blocking=True)
            for future, dest, staged in reads:
                future.result()
                if staged is not dest:
                    dest.copy_(staged, non_blocking=True)
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                return event
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
        return None



class _AllReads:
    """Collects read futures; leaving the block waits for every one, even after an error, so no
    reader thread still writes into a buffer (or reads a file about to be rewritten) when the
    caller moves on. Without an error in the block, the first failed read raises."""

    def __init__(self):
        self.futures: list[Future] = []

    def add(self, future: Future) -> Future:
        self.futures.append(future)
        return future

    def __enter__(self) -> "_AllReads":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        wait(self.futures)
        if exc_type is None:
            for future in self.futures:
                future.result()
