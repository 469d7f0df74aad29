"""Streams placed weights to the compute device: the executor's LayerWeightStore over the tiers.

Before use, every non-resident tensor is assembled in a working buffer on the compute device (with
overlap, 1 + `prefetch` buffers: layers j+1 .. j+prefetch load while layer j computes). On a
CPU-only machine the compute device is the CPU and the gpu tier is a budgeted working set in host
memory, so cpu-tier weights are still copied into working buffers, exactly as on a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from offload.disk_store import DiskStore, StoreCorruptError
from offload.host_buffer import align_up, aligned_empty
from offload.memory import MemoryTracker
from offload.placed_layers import AllReads, PlacedLayers, store_key
from offload.placement import WeightPlan, Weights, assemble
from quant import QuantConfig


class TieredWeights:
    """LayerWeightStore over gpu / cpu / disk tiers (see offload.weights)."""

    def __init__(self, *, num_layers: int, layer_shapes: dict[str, tuple[int, ...]],
                 read_globals: Callable[[], dict], read_layer: Callable[[int], dict],
                 fractions: tuple[float, float, float], device: torch.device, dtype: torch.dtype,
                 quant: QuantConfig | None, tracker: MemoryTracker, overlap: bool, prefetch: int = 1,
                 disk_store: Callable[[], DiskStore] | None = None, pin_memory: bool = False,
                 row_blocks: dict[str, int] | None = None, resident: frozenset[str] = frozenset()):
        """layer_shapes: one dict for every layer or one per layer; row_blocks, resident: see
        offload.placement.plan_layer."""
        self.num_layers, self.device, self.dtype = num_layers, torch.device(device), dtype
        self.plan = WeightPlan.make(num_layers=num_layers, layer_shapes=layer_shapes, dtype=dtype,
                                    quant=quant, fractions=fractions, overlap=overlap, prefetch=prefetch,
                                    device=self.device, row_blocks=row_blocks, resident=resident)
        self.prefetch_depth = self.plan.prefetch_depth
        self.cuda = self.device.type == "cuda"
        self.plan.reserve(tracker)
        self._globals = {k: v.to(self.device) for k, v in read_globals().items()}
        tracker.reserve("gpu", sum(t.nbytes for t in self._globals.values()), "embeddings and head")
        self.store = disk_store() if self.plan.needs_disk else None
        self.placed = PlacedLayers(self.plan, read_layer, self.store, self.device, pin_memory and self.cuda)
        self._kinds = self.plan.kinds
        self._buffers = [self._slot_buffers(self._working_buffer) for _ in range(self.plan.num_slots)]
        self._staging = None
        if self.cuda and self.store is not None:  # disk -> pinned host staging -> device
            self._staging = [self._slot_buffers(_pinned) for _ in range(self.plan.num_slots)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-prefetch") if overlap else None
        self._stream = torch.cuda.Stream(self.device) if self.cuda and overlap else None
        self._pending: dict[int, tuple[int, Future | None]] = {}  # layer -> (slot, its load)
        self._in_use: dict[int, int] = {}  # layer -> slot, from get() to release()
        self._next_slot = 0  # slots go round in prefetch order (any layer count, across passes)
        # CUDA: an event per slot, recorded on the compute stream when the pass releases the layer
        # in it; the next load into the slot waits for it (compute is asynchronous on a GPU).
        self._slot_free: list[torch.cuda.Event | None] = [None] * self.plan.num_slots

    def _slot_buffers(self, make: Callable[[int, torch.dtype], torch.Tensor]) -> list[dict[str, list[torch.Tensor]]]:
        """One working slot: one byte buffer the size of the largest layer's streamed tensors and,
        per distinct layer plan, a flat view of it per streamed tensor and component (each starting
        on a 4096-byte boundary, as O_DIRECT reads want). Index: the plan's place in plan.kinds."""
        layouts = []
        for kind in self.plan.kinds:
            offset, views = 0, {}
            for p in kind.streamed:
                views[p.name] = []
                for cm in p.components:
                    views[p.name].append((offset, cm.numel(p.shape[0]), cm.dtype))
                    offset = align_up(offset + cm.nbytes(p.shape[0]))
            layouts.append((offset, views))
        arena = make(max([size for size, _ in layouts] + [0]), torch.uint8)
        return [{name: [arena[o:o + n * dt.itemsize].view(dt) for o, n, dt in comps] for name, comps in views.items()}
                for _, views in layouts]

    def _kind(self, layer: int) -> int:
        """Index of the layer's plan in plan.kinds (its views in a slot)."""
        plan = self.plan.layer(layer)
        return next(i for i, k in enumerate(self._kinds) if k is plan)

    def _working_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # On the host, working buffers start on a 4096-byte boundary so that O_DIRECT reads of disk
        # pieces land in them directly (an unaligned buffer costs every chunk a bounce copy).
        if self.device.type == "cpu":
            return aligned_empty((numel,), dtype)
        return torch.empty(numel, dtype=dtype, device=self.device)

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
        weights: Weights = dict(self.placed.small[layer])
        buffers = self._buffers[slot][self._kind(layer)]
        for plan in self.plan.layer(layer).tensors:
            if plan.resident:
                weights[plan.name] = assemble(plan, self.placed.pieces[layer][(plan.name, 0)])
            else:
                weights[plan.name] = assemble(plan, buffers[plan.name])
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
            self.placed.rebuild_store(damage)
            return self._load_slot(layer, slot)

    def _load_slot(self, layer: int, slot: int):
        if self._stream is not None:
            self._stream.synchronize()  # copies out of this slot's staging buffers are done
        reads = []
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext(), AllReads() as pending:
            if self._stream is not None and self._slot_free[slot] is not None:
                self._stream.wait_event(self._slot_free[slot])  # the layer that used it is computed
            kind = self._kind(layer)
            for plan in self.plan.layer(layer).streamed:
                buffers = self._buffers[slot][kind][plan.name]
                for i, piece in enumerate(plan.pieces):
                    for c, (cm, buf) in enumerate(zip(plan.components, buffers)):
                        lo, hi = cm.numel(piece.row_start), cm.numel(piece.row_end)
                        if piece.tier == "disk":
                            target = self._staging[slot][kind][plan.name][c][lo:hi] if self._staging else buf[lo:hi]
                            future = pending.add(self.store.read_range_async(
                                store_key(layer, plan.name, cm), lo * cm.dtype.itemsize, target))
                            reads.append((future, buf[lo:hi], target))
                        else:
                            buf[lo:hi].copy_(self.placed.pieces[layer][(plan.name, i)][c], non_blocking=True)
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





def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)
