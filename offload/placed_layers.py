"""Every layer's weights put where the plan says: gpu/cpu pieces in memory, the layer in the store.

The disk store is written once, reused by later runs, and rebuilt from the source when found damaged."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from offload.disk_store import DiskStore, OffloadError, StoreCorruptError
from offload.errors import UnquantizableWeight
from offload.store_writer import DiskStoreWriter
from offload.host_buffer import aligned_empty, pinned_empty
from offload.host_malloc import release_free_heap
from offload.linked_blocks import LinkedWeight, linked_key, read_rows
from offload.placement import Component, TensorPlan, WeightPlan, flat_components
from quant import QTensor, UnrepresentableGroups

Pieces = dict[tuple[str, int], list[torch.Tensor]]  # (tensor name, piece index) -> its components


def store_key(layer: int, name: str, comp: Component) -> str:
    return f"{layer}.{name}{'.' + comp.suffix if comp.suffix else ''}"


def small_key(layer: int, name: str) -> str:
    return f"{layer}.small.{name}"


class PlacedLayers:
    """Per layer: its small tensors on the compute device and its gpu/cpu pieces (`small[layer]`,
    `pieces[layer]`); disk pieces stay in `store`, read by the streamer as it needs them."""

    def __init__(self, plan: WeightPlan, read_layer: Callable[[int], dict], store: DiskStore | None,
                 device: torch.device, pin: bool, linked_extents: Callable[[int], dict] | None = None,
                 linked_blocks: Callable[[int], dict] | None = None, store_bytes: int | None = None,
                 read_ahead: bool = True):
        """linked_extents(layer): the source's components that lie as they are in its files;
        linked_blocks(layer): its weights whose rows lie in its files as blocks (offload/
        linked_blocks.py); both linked by the store, not copied (flexsarathi/formats/checkpoint.py
        `WeightSource`). store_bytes: what the store writes (its free-space check; default the
        plan's whole store). read_ahead: from the source, read layer j + 1 while layer j is placed
        (two layers in flight; TieredWeights reserves their bytes)."""
        self.plan, self.store, self.device, self.pin = plan, store, device, pin
        self.read_ahead = read_ahead
        self._read_layer = read_layer
        self._linked_extents = linked_extents or (lambda layer: {})
        self._linked_blocks = linked_blocks or (lambda layer: {})
        self.linked: list[dict[str, LinkedWeight]] = []  # per layer: the weights the store links as blocks
        self.store_bytes = plan.store_bytes if store_bytes is None else store_bytes
        self.small: list[dict[str, torch.Tensor]] = []
        self.pieces: list[Pieces] = []
        try:
            self._place_all(rewrite=False)
        except StoreCorruptError as damage:  # a reused store failed its checksums: never use it
            warnings.warn(f"{damage}; rebuilding the store from the source", RuntimeWarning, stacklevel=3)
            self._place_all(rewrite=True, damage=damage)

    def _place_all(self, *, rewrite: bool, damage: StoreCorruptError | None = None) -> None:
        """Every layer's small tensors and gpu/cpu pieces; the disk store written first when it is
        absent, incomplete or (`rewrite`) damaged. A complete store holds every layer as placed and
        compressed: the resident pieces are read from it instead of regenerating or re-quantizing
        the layer from the source."""
        store = self.store
        write = store is not None and (rewrite or not store.is_complete())
        writer = store.begin_write(total_bytes=self.store_bytes) if write else None
        from_source = store is None or writer is not None
        # From the source, layer j + 1 is read (and decoded: a GGUF's codes, a dummy's draws) on a
        # thread while layer j is cut, compressed and written: the two overlap (file reads, numpy
        # and torch release the GIL) and at most two layers are held at once.
        reader = ThreadPoolExecutor(1, thread_name_prefix="source-read") if from_source and self.read_ahead else None
        ahead: Future | None = None
        self.small, self.pieces, self.linked = [], [], []
        try:
            for layer in range(self.plan.num_layers):
                if not from_source:
                    self.linked.append(self._linked_in_store(layer, self._linked_blocks(layer)))
                    small, pieces = self._read_from_store(layer)
                else:
                    link_only = writer is not None  # weights the store only links need no decoding
                    weights = ahead.result() if ahead is not None else self._source_layer(layer, damage, link_only)
                    ahead = None
                    if layer + 1 < self.plan.num_layers and reader is not None:
                        ahead = reader.submit(self._source_layer, layer + 1, damage, link_only)
                    small = {k: weights[k].to(self.device) for k in self.plan.layer(layer).small_shapes}
                    blocks = self._blocks_to_link(weights, layer) if writer is not None else {}
                    pieces = self._place_layer(weights, layer, writer, blocks)
                    self.linked.append(blocks)
                    del weights
                self.small.append(small)
                self.pieces.append(pieces)
                release_free_heap()  # the layer's freed conversion, else kept between the blocks it placed
            if writer is not None:
                writer.commit()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            if reader is not None:  # a read ahead still running ends before the caller goes on
                reader.shutdown(wait=True, cancel_futures=True)

    def _source_layer(self, layer: int, damage: StoreCorruptError | None, link_only: bool = False) -> dict:
        """The layer's weights from the source; when they are wanted to rebuild a damaged store and
        the source cannot give them, the error names the damaged file and the source's failure.
        link_only: the weights the store will only link (whole on the disk tier) are asked for
        as `skip`, which a source may leave out after checksumming their bytes."""
        skip = self._link_only(layer) if link_only else frozenset()
        try:
            return self._read_layer(layer, skip) if skip else self._read_layer(layer)
        except Exception as exc:
            if damage is None:
                raise
            raise OffloadError(f"{damage}; it cannot be rebuilt because the source weights of layer "
                               f"{layer} cannot be read ({type(exc).__name__}: {exc})") from exc

    def rebuild_store(self, damage: StoreCorruptError) -> None:
        """Rewrite the whole store from the source (found damaged while running). Only the disk
        pieces are read from it after loading, so the gpu/cpu pieces in memory stay as they are."""
        warnings.warn(f"{damage}; rebuilding the store from the source", RuntimeWarning, stacklevel=4)
        with self.store.begin_write(total_bytes=self.store_bytes) as writer:
            for layer in range(self.plan.num_layers):
                self._write_layer(self._source_layer(layer, damage, link_only=True), layer, writer)
            writer.commit()

    def _place_layer(self, weights: dict, layer: int, writer: DiskStoreWriter | None,
                     blocks: dict[str, LinkedWeight]) -> Pieces:
        """The layer's gpu- and cpu-tier pieces, cut from its weights (compressed per the plan);
        with a writer, the layer also goes to the disk store whole (every tensor's components and
        the small tensors)."""
        pieces = {}
        layer_plan = self.plan.layer(layer)
        links = self._linked_extents(layer) if writer is not None else {}
        for plan in layer_plan.tensors:
            if plan.name in blocks and all(p.tier == "disk" for p in plan.pieces):
                _link_blocks(writer, layer, plan.name, blocks[plan.name])  # nothing else to cut or convert
                continue
            comps = _components(weights, plan, layer)
            for i, piece in enumerate(plan.pieces):
                if piece.tier == "disk":
                    continue
                target = self.device if piece.tier == "gpu" else torch.device("cpu")
                sliced = [_own_rows(c, cm.numel(piece.row_start), cm.numel(piece.row_end), target)
                          for c, cm in zip(comps, plan.components)]
                if piece.tier == "cpu" and self.pin:  # exactly its bytes (offload/host_buffer.py)
                    sliced = [pinned_empty(t.shape, t.dtype).copy_(t) for t in sliced]
                pieces[(plan.name, i)] = sliced
            if plan.name in blocks:
                _link_blocks(writer, layer, plan.name, blocks[plan.name])
            elif writer is not None:
                _add_tensor(writer, layer, plan, comps, _links_of(weights[plan.name], plan, links))
            del weights[plan.name], comps  # its source form goes as soon as it is placed
        if writer is not None:
            for k in layer_plan.small_shapes:
                writer.add(small_key(layer, k), weights[k])
        return pieces

    def _write_layer(self, weights: dict, layer: int, writer: DiskStoreWriter) -> None:
        """The layer to the disk store, as _place_layer writes it (same names, same order)."""
        links, blocks = self._linked_extents(layer), self._blocks_to_link(weights, layer)
        self.linked[layer] = blocks  # what the streamer reads as blocks from now on
        for plan in self.plan.layer(layer).tensors:
            if plan.name in blocks:
                _link_blocks(writer, layer, plan.name, blocks[plan.name])
                continue
            _add_tensor(writer, layer, plan, _components(weights, plan, layer),
                        _links_of(weights[plan.name], plan, links))
        for k in self.plan.layer(layer).small_shapes:
            writer.add(small_key(layer, k), weights[k])

    def _block_plans(self, layer: int) -> dict[str, tuple[LinkedWeight, TensorPlan]]:
        """The source's block-linked weights of `layer` the plan can link: streamed, one row block,
        not in a kernel's layout."""
        plans = {p.name: p for p in self.plan.layer(layer).tensors}
        return {name: (w, plans[name]) for name, w in self._linked_blocks(layer).items() if name in plans
                and plans[name].blocks == 1 and not plans[name].resident and not plans[name].kernel_layout}

    def _blocks_to_link(self, weights: dict, layer: int) -> dict[str, LinkedWeight]:
        """Those the plan stores as the source gives them, their parts checksummed as read."""
        return {name: w for name, (w, plan) in self._block_plans(layer).items()
                if (name not in weights or _links_of(weights[name], plan, {name: w}))  # absent: skipped
                and all(p.crc32 is not None for p in w.parts)}

    def _link_only(self, layer: int) -> frozenset[str]:
        """Those wholly on the disk tier: nothing but their links is stored."""
        return frozenset(name for name, (_, plan) in self._block_plans(layer).items()
                         if all(piece.tier == "disk" for piece in plan.pieces))

    def _linked_in_store(self, layer: int, blocks: dict[str, LinkedWeight]) -> dict[str, LinkedWeight]:
        return {name: w for name, w in blocks.items() if self.store.has(linked_key(layer, name, 0))}

    def _read_from_store(self, layer: int) -> tuple[dict, Pieces]:
        """(small tensors, gpu- and cpu-tier pieces) of `layer`, read from the complete store."""
        store = self.store
        small = {k: store.read_tensor(small_key(layer, k)).to(self.device) for k in self.plan.layer(layer).small_shapes}
        pieces, finishes = {}, []
        with AllReads() as reads:
            for plan in self.plan.layer(layer).tensors:
                for i, piece in enumerate(plan.pieces):
                    if piece.tier == "disk":
                        continue
                    sliced = [aligned_empty((cm.numel(piece.rows),), cm.dtype, pin_memory=self.pin and piece.tier == "cpu")
                              for cm in plan.components]
                    linked = self.linked[layer].get(plan.name)
                    if linked is not None:  # the rows' blocks, split once read
                        staging = aligned_empty((linked.staging_bytes(piece.row_start, piece.row_end),), torch.uint8)
                        for future, finish in read_rows(store, layer, plan.name, linked, piece.row_start,
                                                        piece.row_end, staging, sliced):
                            reads.add(future)
                            finishes.append(finish)
                    else:
                        for cm, host in zip(plan.components, sliced):
                            key = store_key(layer, plan.name, cm)
                            reads.add(store.read_range_async(key, cm.numel(piece.row_start) * cm.dtype.itemsize, host))
                    pieces[(plan.name, i)] = (piece.tier, sliced)
        for finish in finishes:
            finish()
        return small, {key: [t.to(self.device) if tier == "gpu" else t for t in sliced]
                       for key, (tier, sliced) in pieces.items()}


def _components(weights: dict, plan: TensorPlan, layer: int) -> list[torch.Tensor]:
    """flat_components of the layer's weight `plan.name`; a weight whose group scales come out
    non-finite as it is quantized is an UnquantizableWeight naming it (the engine leaves that check
    of its source's values to this pass, which makes the scales anyway)."""
    try:
        return flat_components(weights[plan.name], plan)
    except UnrepresentableGroups as exc:
        raise UnquantizableWeight(layer, plan.name, str(exc)) from None


def _own_rows(component: torch.Tensor, lo: int, hi: int, target: torch.device) -> torch.Tensor:
    """Elements [lo, hi) of a flat component on `target` in memory of their own: the component
    itself where it is the whole of its own memory on `target` (the source gave it to the placement:
    no second copy of a weight while a layer is placed), else a copy (a slice must not keep the
    rest of the weight's memory alive)."""
    if component.device != target:
        return component[lo:hi].to(target)  # a copy of those elements alone
    whole = (lo == 0 and hi == component.numel() and component.is_contiguous()
             and component.storage_offset() == 0 and component.untyped_storage().nbytes() == component.nbytes)
    return component if whole else component[lo:hi].clone()


def _add_tensor(writer: DiskStoreWriter, layer: int, plan: TensorPlan, comps: list[torch.Tensor],
                links: dict[str, list]) -> None:
    for comp, cm in zip(comps, plan.components):
        if cm.suffix in links:
            writer.link(store_key(layer, plan.name, cm), comp, links[cm.suffix])
        else:
            writer.add(store_key(layer, plan.name, cm), comp)


def linked_bytes(plan: WeightPlan, linked_extents: Callable[[int], dict] | None,
                 linked_blocks: Callable[[int], dict] | None) -> int:
    """Bytes of the store that the source's links replace (from its headers: nothing is read)."""
    total = 0
    for layer in range(plan.num_layers):
        blocks = linked_blocks(layer) if linked_blocks else {}
        extents = linked_extents(layer) if linked_extents else {}
        for p in plan.layer(layer).tensors:
            if p.kernel_layout or p.resident:
                continue
            linked = [cm for cm in p.components if (p.name in blocks and p.blocks == 1) or cm.suffix in extents.get(p.name, {})]
            total += sum(cm.nbytes(p.shape[0]) for cm in linked)
    return total


def _link_blocks(writer: DiskStoreWriter, layer: int, name: str, weight: LinkedWeight) -> None:
    for i, part in enumerate(weight.parts):
        writer.link_bytes(linked_key(layer, name, i), [(part.path, part.offset, part.nbytes)], part.crc32)


def _links_of(weight, plan: TensorPlan, links: dict) -> dict[str, list]:
    """The source's linked components of `weight`, where the plan stores them as the source gives
    them (its QTensor's own buffers: same format, not repacked for a kernel)."""
    if not isinstance(weight, QTensor) or weight.config != plan.quant or plan.kernel_layout:
        return {}
    return links.get(plan.name, {})


class AllReads:
    """Collects read futures; leaving the block waits for every one, even after an error, so no
    reader thread still writes into a buffer (or reads a file about to be rewritten) when the
    caller moves on. Without an error in the block, the first failed read raises."""

    def __init__(self):
        self.futures: list[Future] = []

    def add(self, future: Future) -> Future:
        self.futures.append(future)
        return future

    def __enter__(self) -> AllReads:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        wait(self.futures)
        if exc_type is None:
            for future in self.futures:
                future.result()
