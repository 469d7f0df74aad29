"""Streams placed weights to the compute device: the executor's LayerWeightStore over the tiers.

Before use, the rows of every weight that are off the gpu tier are assembled in a working buffer on
the compute device (with overlap, 1 + `prefetch` buffers: layers j+1 .. j+prefetch load while layer
j computes); a weight with rows on the gpu tier too is used as its gpu rows in place beside the
buffered ones (offload.weights.RowSplit). On a CPU-only machine the compute device is the CPU and
the gpu tier is a budgeted working set in host memory, so cpu-tier weights are still copied into
working buffers, exactly as on a GPU.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from offload.disk_store import DiskStore, StoreCorruptError
from offload.host_buffer import align_up, aligned_empty, pinned_empty
from offload.linked_blocks import read_rows
from offload.host_malloc import release_free_heap
from offload.memory import MemoryBudgetError, MemoryTracker
from offload.placed_layers import AllReads, PlacedLayers, linked_bytes, store_key
from offload.placement import QuantFormats, TensorPlan, WeightPlan, Weights, assemble, compress_resident
from offload.streams import bind_thread, indexed
from offload.weights import ROW_BLOCKS, RowSplit
from quant import QTensor, QuantConfig, cpu_int8_matmul, panels


class TieredWeights:
    """LayerWeightStore over gpu / cpu / disk tiers (see offload.weights)."""

    def __init__(self, *, num_layers: int, layer_shapes: dict[str, tuple[int, ...]],
                 read_globals: Callable[[], dict], read_layer: Callable[[int], dict],
                 fractions: tuple[float, float, float], device: torch.device, dtype: torch.dtype,
                 quant: QuantFormats, tracker: MemoryTracker, overlap: bool, prefetch: int = 1,
                 disk_store: Callable[[], DiskStore] | None = None, pin_memory: bool = False,
                 row_blocks: dict[str, int] | None = None, resident: frozenset[str] = frozenset(),
                 routed_reads: bool = False, cpu_blocks: bool = False, compressed_globals: dict[str, QuantConfig] | None = None,
                 linked_extents: Callable[[int], dict] | None = None, linked_blocks: Callable[[int], dict] | None = None, int4_layout: bool = True,
                 load_bytes: tuple[int, int] = (0, 0), int8_panels: bool = False,
                 panel_globals: frozenset[str] = frozenset()):
        """layer_shapes: one dict for every layer or one per layer; row_blocks, resident: see
        offload.placement.plan_layer. For weights stacked from row blocks (experts): routed_reads
        reads the blocks off the gpu tier only when the model asks for them (after routing);
        cpu_blocks leaves a block held whole on the cpu tier there, for the model to compute on
        the CPU (RowBlockAccess). linked_extents, linked_blocks: see offload.placed_layers.PlacedLayers;
        compressed_globals: global weights (the LM head) kept in that format (_place_globals);
        int4_layout: see offload.placement.uses_kernel_layout. load_bytes: (the largest layer as
        read_layer gives it, what reading one weight holds besides): the load's own memory
        (_reserve_load), held on the cpu tier while the weights are placed. int8_panels: the passes
        multiply 4-bit weights with the int8 kernel on this (CPU) device: each one's gpu-tier rows
        are stored in its panels (quant/panels.py), reordered in place once placed, and so are the
        global weights named in panel_globals (the LM head: multiplied, never looked up by row)."""
        self.routed_reads, self.cpu_blocks, self.int4_layout = routed_reads, cpu_blocks, int4_layout
        self._cpu_blocks_of: dict[int, frozenset[int]] = {}  # id(LayerPlan) -> blocks computed on the cpu tier
        # experts read after routing; experts computed on the cpu tier (per micro-batch); layer loads with experts left
        self.stats = {"experts_read": 0, "experts_on_cpu": 0, "expert_loads": 0}
        self.num_layers, self.device, self.dtype = num_layers, torch.device(device), dtype
        self.plan = WeightPlan.make(num_layers=num_layers, layer_shapes=layer_shapes, dtype=dtype,
                                    quant=quant, fractions=fractions, overlap=overlap, prefetch=prefetch,
                                    device=self.device, row_blocks=row_blocks, resident=resident, int4_layout=int4_layout)
        self.prefetch_depth = self.plan.prefetch_depth
        self._streams = [bool(self.plan.layer(j).streamed) for j in range(num_layers)]  # else: _resident_layers
        self._resident_layers: dict[int, Weights] = {}  # layers with nothing streamed: their weights, once
        self.cuda = self.device.type == "cuda"
        self.plan.reserve(tracker, store_bytes := (self.plan.store_bytes - linked_bytes(self.plan, linked_extents, linked_blocks)
                                                   if self.plan.needs_disk else 0))
        loading, read_ahead = _reserve_load(tracker, *load_bytes)
        self._panelled: frozenset[tuple[int, str]] = frozenset()  # (layer, name): gpu rows in the int8 kernel's panels
        in_panels = int8_panels and self.device.type == "cpu"
        self._panel_globals = panel_globals if in_panels else frozenset()
        try:
            self._globals = self._place_globals(read_globals(), compressed_globals or {}, tracker)
            self.store = disk_store() if self.plan.needs_disk else None
            self.placed = PlacedLayers(self.plan, read_layer, self.store, self.device, pin_memory and self.cuda,
                                       linked_extents, linked_blocks, store_bytes, read_ahead)
            self._panelled = self._store_panels() if in_panels else frozenset()
        finally:
            tracker.release("cpu", loading, LOADING)
            release_free_heap()
        self._make_buffers(tracker, overlap)

    def _store_panels(self) -> frozenset[tuple[int, str]]:
        """Every 4-bit weight's gpu-tier piece the int8 kernel covers, reordered into its panels
        in place (the piece is used where it is, never copied to a working buffer): {(layer, name)}.
        A piece of fewer rows than a panel, a kernel layout's or stacked experts' stay as they are."""
        done = set()
        for layer in range(self.num_layers):
            for plan in self.plan.layer(layer).tensors:
                if plan.quant is None or plan.kernel_layout or plan.blocks != 1 or not plan.gpu_rows:
                    continue
                q = assemble(plan, self.placed.pieces[layer][(plan.name, 0)], rows=plan.gpu_rows)
                if _panels_fit(q):
                    panels.to_panels(q)  # the piece's bytes reordered
                    done.add((layer, plan.name))
        return frozenset(done)

    def _make_buffers(self, tracker: MemoryTracker, overlap: bool) -> None:
        """The working slots, staging buffers, prefetch thread and per-slot state of the streamer."""
        self._block_staging, self._staging_at = self._linked_staging(tracker), 0  # and its next free byte
        self._kinds = self.plan.kinds
        layouts = self._slot_layouts(_off_gpu_rows)
        self._buffers = [_slot_views(layouts, self._working_buffer) for _ in range(self.plan.num_slots)]
        self._staging = self._pinned_staging(tracker) if self.cuda and self.store is not None else None
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="weight-prefetch", initializer=bind_thread,
                                         initargs=(indexed(self.device),)) if overlap else None)
        self._stream = torch.cuda.Stream(self.device) if self.cuda and overlap else None
        self._pending: dict[int, tuple[int, Future | None]] = {}  # layer -> (slot, its load)
        self._in_use: dict[int, int] = {}  # layer -> slot, from get() to release()
        self._next_slot = 0  # slots go round in prefetch order (any layer count, across passes)
        # CUDA: per slot, an event recorded when the pass releases its layer; the next load into it waits
        self._slot_free: list[torch.cuda.Event | None] = [None] * self.plan.num_slots
        self._blocks_in: list[set[int]] = [set() for _ in range(self.plan.num_slots)]  # routed reads done
        # CUDA with disk pieces: per slot, an event after the copies out of its staging buffers; the next
        # disk read into them waits for it only (this layer's reads overlap the last one's copies up)
        self._staging_free: list[torch.cuda.Event | None] = [None] * self.plan.num_slots

    def _place_globals(self, tensors: dict, compressed: dict[str, QuantConfig], tracker: MemoryTracker) -> dict:
        """The embeddings and head on the compute device (those named in `compressed` in that format;
        those the source gives as codes, in theirs)."""
        placed, nbytes = {}, 0
        for name, tensor in tensors.items():
            if isinstance(tensor, QTensor):  # a source's own codes (a GGUF's Q4_0 head): kept as they are
                placed[name], size = tensor.to(self.device), tensor.nbytes
            elif name in compressed:
                placed[name], size = compress_resident(name, tensor, self.dtype, compressed[name], self.device,
                                                       self.int4_layout)
            else:
                placed[name], size = tensor.to(self.device), tensor.nbytes
            if name in self._panel_globals and _panels_fit(placed[name]):
                placed[name] = panels.to_panels(placed[name])
            nbytes += size
        tracker.reserve("gpu", nbytes, "embeddings and head")
        return placed

    def _pinned_staging(self, tracker: MemoryTracker) -> list[list[dict[str, list[torch.Tensor]]]]:
        """Disk -> pinned host staging -> device: per slot, only each streamed tensor's disk rows
        (for any layer kind), so the pinned memory is what the disk tier needs, not a whole layer."""
        layouts = self._slot_layouts(_disk_rows)
        tracker.reserve("cpu", self.plan.num_slots * _arena_bytes(layouts), "weight staging (pinned)")
        return [_slot_views(layouts, _pinned) for _ in range(self.plan.num_slots)]

    def _linked_staging(self, tracker: MemoryTracker) -> torch.Tensor | None:
        """One layer load's disk rows of its block-linked weights (offload/linked_blocks.py), as read."""
        need = 0
        for layer, linked in enumerate(self.placed.linked):
            need = max(need, sum(linked[p.name].staging_bytes(*_disk_rows(p)) for p in self.plan.layer(layer).streamed
                                 if p.name in linked))
        if not need:
            return None
        tracker.reserve("cpu", need, "linked weight blocks staging")
        return aligned_empty((need,), torch.uint8)

    def _slot_layouts(self, rows_of: Callable[[TensorPlan], tuple[int, int]]) -> list[tuple[int, dict]]:
        """One working slot's layout per distinct layer plan (index: its place in plan.kinds): the
        bytes it needs and, per streamed tensor with rows in `rows_of(plan)` = [first, end), a
        (byte offset, numel, dtype) per component, each starting on a 4096-byte boundary (as
        O_DIRECT reads want). A slot is one byte arena of the largest kind's size."""
        layouts = []
        for kind in self.plan.kinds:
            offset, views = 0, {}
            for p in kind.streamed:
                first, end = rows_of(p)
                if end <= first:
                    continue
                views[p.name] = []
                for cm in p.components:
                    views[p.name].append((offset, cm.numel(end - first), cm.dtype))
                    offset = align_up(offset + cm.nbytes(end - first))
            layouts.append((offset, views))
        return layouts

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
        if layer in self._pending or layer in self._resident_layers:  # the latter: nothing to load, no slot
            return
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._buffers)
        if self._pool is None or not self._streams[layer]:
            # Serial: one working buffer, filled in get() once the previous layer is done with it.
            self._pending[layer] = (slot, None)
        else:
            self._pending[layer] = (slot, self._pool.submit(self._load, layer, slot))

    def get(self, layer: int) -> Weights:
        resident = self._resident_layers.get(layer)
        if resident is not None:  # nothing streamed: the views assembled at its first get, no slot held
            return resident
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
            in_panels = (layer, plan.name) in self._panelled
            if plan.resident:
                weights[plan.name] = assemble(plan, self.placed.pieces[layer][(plan.name, 0)], panels=in_panels)
            elif plan.gpu_rows:  # its gpu rows in place, the rest from the working buffer
                streamed = plan.shape[0] - plan.gpu_rows
                weights[plan.name] = RowSplit((
                    assemble(plan, self.placed.pieces[layer][(plan.name, 0)], rows=plan.gpu_rows, panels=in_panels),
                    assemble(plan, buffers[plan.name], rows=streamed)))
            else:
                weights[plan.name] = assemble(plan, buffers[plan.name])
        access = self.block_access(layer, slot)
        if access is not None:
            weights[ROW_BLOCKS] = access
            self.stats["expert_loads"] += 1
        elif not self._streams[layer]:  # the same views every pass: assembled once
            self._resident_layers[layer] = weights
        return weights

    def release(self, layer: int) -> None:
        """The slot may be refilled: at once on the CPU (compute is synchronous), after the
        compute stream passes this point on CUDA."""
        slot = self._in_use.pop(layer, None)
        if slot is not None and self._stream is not None and self._streams[layer]:
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
        self._staging_free = [None] * len(self._staging_free)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._drain_stream()
        if self.store is not None:
            self.store.close()

    def _drain_stream(self) -> None:
        """Wait for the copies still queued on the prefetch stream. The last layer of a pass starts
        loading the next pass's first ones, so after a run copies may be in flight into the working
        buffers (from pinned host memory): they must land before that memory goes back to the
        allocators, or they write into whatever is handed out next (another engine's tensors)."""
        if self._stream is not None:
            self._stream.synchronize()

    def __del__(self) -> None:
        # Dropped without close(): the same wait, before the buffers are freed (CPython finalizes
        # an object before releasing its attributes). Nothing to wait for while the interpreter
        # shuts down: the CUDA context goes with it.
        if getattr(self, "_stream", None) is not None and not sys.is_finalizing():
            self._drain_stream()

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
        if not self._streams[layer]:
            # Every weight of the layer is resident: nothing to copy, no event to wait for (a
            # decode pass of such layers is captured in a CUDA graph: offload/decode_graphs.py).
            return None
        if self._staging_free[slot] is not None:
            self._staging_free[slot].synchronize()  # copies out of this slot's staging buffers are done
        self._blocks_in[slot] = set()  # experts read after routing (RowBlockAccess) start over
        self._staging_at = 0  # the block staging is free: the previous load's splits are done
        reads = []
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext(), AllReads() as pending:
            if self._stream is not None and self._slot_free[slot] is not None:
                self._stream.wait_event(self._slot_free[slot])  # the layer that used it is computed
            for plan in self.plan.layer(layer).streamed:
                for i, piece in enumerate(plan.pieces):
                    for lo, hi in self._rows_now(layer, plan, piece):
                        self._copy_rows(layer, slot, plan, i, lo, hi, pending, reads)
            self._finish_reads(reads)
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
                if self._staging is not None:
                    self._staging_free[slot] = event
                return event
            if self.cuda and self._staging is not None:
                # Serial: the copies run on the compute stream, ordered with the layer's compute;
                # only the staging buffers' reuse needs an event.
                self._staging_free[slot] = torch.cuda.Event()
                self._staging_free[slot].record(torch.cuda.current_stream(self.device))
        return None

    def _rows_now(self, layer: int, plan: TensorPlan, piece) -> list[tuple[int, int]]:
        """The piece's row ranges a layer load copies: none of a gpu piece (used in place), all of
        any other, except for experts (stacked row blocks) read after routing (routed_reads) or
        computed where they are (cpu_blocks)."""
        if piece.tier == "gpu":
            return []
        if plan.blocks == 1 or not (self.routed_reads or self.cpu_blocks):
            return [(piece.row_start, piece.row_end)]
        if self.routed_reads:
            return []
        on_cpu = self._on_cpu(layer)
        return [r for e in range(plan.blocks) if e not in on_cpu for r in [_clip(plan, e, piece)] if r is not None]

    def _copy_rows(self, layer: int, slot: int, plan: TensorPlan, i: int, row_lo: int, row_hi: int,
                   pending: AllReads, reads: list) -> None:
        """Rows [row_lo, row_hi) of piece i of `plan` into the slot's buffer (disk reads queued in
        `reads`, finished by _finish_reads)."""
        piece, kind = plan.pieces[i], self._kind(layer)
        buffers = self._buffers[slot][kind][plan.name]
        linked = self.placed.linked[layer].get(plan.name) if piece.tier == "disk" else None
        split = []  # a linked weight's (dest, target) per component: its blocks are split into the targets
        for c, (cm, buf) in enumerate(zip(plan.components, buffers)):
            lo, hi = cm.numel(row_lo), cm.numel(row_hi)
            dest = buf[lo - cm.numel(plan.gpu_rows):hi - cm.numel(plan.gpu_rows)]  # buffers start at gpu_rows
            if piece.tier == "disk":
                if self._staging:  # its views start at the tensor's first disk row
                    first = cm.numel(_disk_rows(plan)[0])
                    target = self._staging[slot][kind][plan.name][c][lo - first:hi - first]
                else:
                    target = dest
                if linked is not None:
                    split.append((dest, target))
                    continue
                future = pending.add(self.store.read_range_async(
                    store_key(layer, plan.name, cm), lo * cm.dtype.itemsize, target))
                reads.append((future, dest, target))
            else:
                held = self.placed.pieces[layer][(plan.name, i)][c]  # the piece's rows from row_start
                base = cm.numel(piece.row_start)
                dest.copy_(held[lo - base:hi - base], non_blocking=True)

        if split:
            self._read_linked_rows(layer, plan.name, linked, row_lo, row_hi, split, pending, reads)

    def _read_linked_rows(self, layer: int, name: str, linked, row_lo: int, row_hi: int, split: list,
                          pending: AllReads, reads: list) -> None:
        """Rows [row_lo, row_hi) of a block-linked weight: their blocks read into the block staging,
        split into the components' targets once read, then copied to the device where staged."""
        need = linked.staging_bytes(row_lo, row_hi)
        staging = self._block_staging[self._staging_at:self._staging_at + need]
        self._staging_at += need
        for future, finish in read_rows(self.store, layer, name, linked, row_lo, row_hi, staging,
                                        [target for _, target in split]):
            reads.append((pending.add(future), finish, None))
        reads.extend((None, dest, target) for dest, target in split if target is not dest)

    @staticmethod
    def _finish_reads(reads: list) -> None:
        """Each entry: (future or None, dest, staged): wait, then copy staged into dest; or
        (future, finish, None): wait, then finish() (a linked weight's split)."""
        for future, dest, staged in reads:
            if future is not None:
                future.result()
            if callable(dest):
                dest()
            elif staged is not dest:
                dest.copy_(staged, non_blocking=True)

    # ---- experts: stacked row blocks read after routing, or computed on the cpu tier ------------
    def _on_cpu(self, layer: int) -> frozenset[int]:
        """cpu_blocks: the blocks (experts) every stacked weight of the layer holds whole in a
        cpu-tier piece: computed there, never copied."""
        plan = self.plan.layer(layer)
        if not self.cpu_blocks:
            return frozenset()
        if id(plan) not in self._cpu_blocks_of:
            stacked = [p for p in plan.streamed if p.blocks > 1]
            blocks = range(stacked[0].blocks) if stacked else range(0)
            self._cpu_blocks_of[id(plan)] = frozenset(
                e for e in blocks if all(self._cpu_piece(p, e) is not None for p in stacked))
        return self._cpu_blocks_of[id(plan)]

    def _cpu_piece(self, plan: TensorPlan, block: int) -> int | None:
        lo, hi = block * plan.block_rows, (block + 1) * plan.block_rows
        for i, piece in enumerate(plan.pieces):
            if piece.tier == "cpu" and piece.row_start <= lo and hi <= piece.row_end:
                return i
        return None

    def block_access(self, layer: int, slot: int) -> RowBlockAccess | None:
        stacked = [p for p in self.plan.layer(layer).streamed if p.blocks > 1]
        if not stacked or not (self.routed_reads or self.cpu_blocks):
            return None
        return RowBlockAccess(self, layer, slot, stacked)


LOADING = "loading (layers in flight)"


def _panels_fit(weight) -> bool:
    """A QTensor the int8 kernel multiplies that can be stored in its panels."""
    return (isinstance(weight, QTensor) and panels.can_store(weight)
            and cpu_int8_matmul.covers(torch.empty(0, weight.shape[1]), weight))


def _reserve_load(tracker: MemoryTracker, layer_bytes: int, read_bytes: int) -> tuple[int, bool]:
    """Reserve on the cpu tier what the load holds beside the weights it has placed: the layer being
    placed and, where the budget has room, the next one read ahead (PlacedLayers), each as the
    source gives it, plus one weight's read (WeightSource.load_bytes). -> (bytes reserved, whether
    to read ahead). The tier's peak then shows the load's; released once every layer is placed."""
    for layers in (2, 1):
        need = layers * layer_bytes + read_bytes
        try:
            tracker.reserve("cpu", need, LOADING)
            return need, layers == 2
        except MemoryBudgetError:
            if layers == 1:
                raise
    raise AssertionError("unreachable")


def _clip(plan: TensorPlan, block: int, piece) -> tuple[int, int] | None:
    """The rows of `block` inside `piece`, or None."""
    lo, hi = max(block * plan.block_rows, piece.row_start), min((block + 1) * plan.block_rows, piece.row_end)
    return (lo, hi) if lo < hi else None


class RowBlockAccess:
    """The experts of one streamed layer in its working slot (offload.weights.ROW_BLOCKS): `load`
    reads the routed ones not read yet (routed_reads), `on_cpu` gives an expert held whole on the
    cpu tier as views of that memory, to compute there (cpu_blocks)."""

    def __init__(self, weights: TieredWeights, layer: int, slot: int, stacked: list[TensorPlan]):
        self.weights, self.layer, self.slot, self.stacked = weights, layer, slot, stacked

    def on_cpu(self, block: int) -> dict | None:
        """{name: the block's rows} where every stacked weight holds the block on the cpu tier."""
        w = self.weights
        if block not in w._on_cpu(self.layer):
            return None
        out = {}
        for plan in self.stacked:
            i = w._cpu_piece(plan, block)
            piece, held = plan.pieces[i], w.placed.pieces[self.layer][(plan.name, i)]
            lo, hi = block * plan.block_rows - piece.row_start, (block + 1) * plan.block_rows - piece.row_start
            out[plan.name] = assemble(plan, [t[cm.numel(lo):cm.numel(hi)] for t, cm in zip(held, plan.components)],
                                      rows=plan.block_rows)
        w.stats["experts_on_cpu"] += 1
        return out

    def load(self, blocks) -> ExpertReads:
        """Queue the reads of `blocks` not in the slot yet (routed_reads; none without: the layer
        was loaded whole), expert by expert in order, and return the context that hands them out:
        `ready(e)` waits for expert e's reads only, so the first experts compute while the later
        ones are still read; leaving it waits for every read (even after an error)."""
        w = self.weights
        missing = sorted(set(blocks) - w._blocks_in[self.slot]) if w.routed_reads else []
        reads: dict[int, list] = {}
        pending = AllReads()
        try:
            for e in missing:  # expert-major: expert e's rows of every stacked weight, then e + 1
                reads[e] = []
                for plan in self.stacked:
                    for i, piece in enumerate(plan.pieces):
                        rows = _clip(plan, e, piece) if piece.tier != "gpu" else None
                        if rows is not None:
                            w._copy_rows(self.layer, self.slot, plan, i, *rows, pending, reads[e])
        except BaseException:
            pending.__exit__(*sys.exc_info())  # nothing left writing into the slot
            raise
        w.stats["experts_read"] += len(missing)
        return ExpertReads(self, reads, pending)


class ExpertReads:
    """The routed experts' reads of one layer in flight (RowBlockAccess.load). An expert counts as
    in the slot only once `ready` has finished its reads, so a pass interrupted between experts
    leaves none half-read marked valid."""

    def __init__(self, access: RowBlockAccess, reads: dict[int, list], pending: AllReads):
        self.access, self.reads, self.pending = access, reads, pending
        self.staged = any(reads.values())

    def ready(self, block: int) -> None:
        """Block until `block`'s rows are in the slot's buffers (a no-op for one already there)."""
        reads = self.reads.pop(block, None)
        if reads is None:
            return
        TieredWeights._finish_reads(reads)
        self.access.weights._blocks_in[self.access.slot].add(block)

    def __enter__(self) -> ExpertReads:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        w = self.access.weights
        try:
            self.pending.__exit__(exc_type, exc, tb)
        finally:
            if w.cuda and self.staged:  # copies out of the staging buffers (compute stream) end before its next fill
                torch.cuda.current_stream(w.device).synchronize()


def _off_gpu_rows(plan: TensorPlan) -> tuple[int, int]:
    """[first, end) of the rows a working buffer holds: those off the gpu tier (a tail)."""
    return plan.gpu_rows, plan.shape[0]


def _disk_rows(plan: TensorPlan) -> tuple[int, int]:
    """[first, end) spanning the tensor's disk pieces ((0, 0) without any)."""
    disk = [piece for piece in plan.pieces if piece.tier == "disk"]
    return (disk[0].row_start, disk[-1].row_end) if disk else (0, 0)


def _arena_bytes(layouts: list[tuple[int, dict]]) -> int:
    return max([size for size, _ in layouts] + [0])


def _slot_views(layouts: list[tuple[int, dict]], make: Callable[[int, torch.dtype], torch.Tensor]) -> list[dict[str, list[torch.Tensor]]]:
    """One slot: an arena from `make` and, per layer kind, the views `layouts` name in it."""
    arena = make(_arena_bytes(layouts), torch.uint8)
    return [{name: [arena[o:o + n * dt.itemsize].view(dt) for o, n, dt in comps] for name, comps in views.items()}
            for _, views in layouts]


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return pinned_empty((numel,), dtype)  # page-locked at exactly its size (counted by the tracker)
