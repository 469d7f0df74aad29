"""Paged KV-cache pools (as in vLLM), one per tier: fixed-size token blocks, a block table per
sequence (kept by the scheduler's block manager; the pool only stores and gathers).

A pool holds, per layer, K and V for `num_slots` token slots (slot = block * block_size + offset).
It lives in compute-device memory (gpu tier), host memory (cpu tier, pinned on CUDA) or a
memory-mapped file in the offload folder (disk tier).

Compressed pools (`KVCompression`) store 4-bit codes, chosen by measurement on stories260K
(scripts/bench_quant.py): grouping K per token along the head dimension costs +42% perplexity,
because a few K channels carry outliers that swamp the others' step size; grouping K per channel
along the tokens of a block costs about +1%. So:

- V: per token, groups along the head dimension (no more than one head per group);
- K: per channel, one group per block (block_size tokens). A block can only be quantized once all
  its tokens exist, so each sequence's block being filled is kept in full precision in a small
  "residual" buffer (one block per running sequence), quantized when its last token is stored.

Semantics that do not depend on chunking or timing: a query at position p sees the keys of
earlier blocks as quantized and the keys of its own block in full precision, and every value as
quantized. `KVPool.parts_to_attend` is the one place that turns this rule into attention inputs
(docs/DESIGN.md, "Compressed KV cache").
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import threading
from dataclasses import dataclass

import torch

from offload.micro_batch import AttentionGroup, KVPart, host_of
from offload.host_buffer import RecycledBuffers, tier_zeros
from offload.kv_plans import DecodePlan, GatherPlan, StorePlan, plan_decode, plan_gather, plan_store, visible_range
from offload.streams import to_device, to_host, to_host_all
from policy_search.policy import TIERS
from policy_search.quant_format import KV_FORMAT
from quant import QTensor, QuantConfig, cpu_kv_attention, cpu_kv_dequant, dequantize, quantize


# Plain pools in memory are attended in place by decodes on the CPU (KVPool.attends_in_pool); off
# inside gathered_plain_decodes(). Every pool's in-place decodes (plain and compressed, CPU and GPU
# kernels): off inside gathered_decodes().
_plain_in_place = [True]
_in_place = [True]
# Compressed pools on the CPU attend decodes with the Triton kernel (in Triton's interpreter) inside
# triton_decodes_on_cpu(): the code path a GPU's pool takes, tested and counted on the CPU.
_triton_on_cpu = [False]


@contextlib.contextmanager
def gathered_plain_decodes():
    """Inside: decodes gather a plain pool's context and attend it with SDPA on the CPU too, the code
    path a GPU's pool takes, so that its launches can be counted on the CPU (scripts/count_launches.py,
    tests/offload/test_launch_count.py). Process-wide: the executor's I/O thread gathers too."""
    before = _plain_in_place[0]
    _plain_in_place[0] = False
    try:
        yield
    finally:
        _plain_in_place[0] = before


@contextlib.contextmanager
def gathered_decodes():
    """Inside: every decode gathers its context and attends it with SDPA (the route a GPU without
    Triton takes), whatever kernels could read its pool in place: the reference the in-place routes
    are tested against, and scripts/count_launches.py --gather-kv. Process-wide, like
    gathered_plain_decodes."""
    before = _in_place[0]
    _in_place[0] = False
    try:
        yield
    finally:
        _in_place[0] = before


@contextlib.contextmanager
def triton_decodes_on_cpu():
    """Inside: a compressed pool on the CPU attends decode rows with the Triton kernel a GPU's pool
    uses (quant/triton_kv_attention.py), run by Triton's interpreter, which needs TRITON_INTERPRET=1
    in the environment before triton is first imported. Process-wide, like gathered_plain_decodes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton_decodes_on_cpu: set TRITON_INTERPRET=1 before starting Python (Triton reads "
                           "it at import) to run the GPU's decode kernel on the CPU")
    before = _triton_on_cpu[0]
    _triton_on_cpu[0] = True
    try:
        yield
    finally:
        _triton_on_cpu[0] = before


@functools.cache
def _triton(module: str):
    """quant.<module> (triton_kv_attention, triton_quantize), or None where triton is not installed
    (imported on first use: it imports triton, ~1 s, which a CPU engine never needs)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module(f"quant.{module}")


def _triton_runs_on(device: torch.device) -> bool:
    """The KV cache's Triton kernels serve this device: a GPU, or the CPU inside triton_decodes_on_cpu."""
    return device.type == "cuda" or _triton_on_cpu[0]


@functools.cache
def _triton_covers(compression: "KVCompression", head_dim: int) -> bool:
    """Both Triton kernels (the decode attention and V's quantize) cover this format and head size."""
    k_config, v_config = compression.k_config(), compression.v_config(head_dim)
    kernel, quantizer = _triton("triton_kv_attention"), _triton("triton_quantize")
    return (kernel is not None and kernel.covers(k_config, v_config, head_dim)
            and quantizer.covers(v_config, head_dim))


def decode_in_pool_tiers(device: torch.device, dtype: torch.dtype, head_dim: int,
                         compression: "KVCompression | None") -> tuple[str, ...]:
    """The tiers whose pools attend a decode row in place when attention runs on `device` (the
    compute device, or the CPU for delegated decodes): no context is gathered for them (the working
    set charges their slot indices, not K/V copies: policy_search/working_set.py). A plain pool in
    memory on the CPU (quant/cpu_kv_attention.py; not on disk: gathered ahead by the I/O thread); a
    compressed pool on the CPU (the C kernel, or Triton's interpreter inside triton_decodes_on_cpu)
    in any tier; on a GPU, the gpu tier's compressed pool (quant/triton_kv_attention.py): a pool on
    another device than attention's is gathered there. None inside gathered_decodes()."""
    if not _in_place[0]:
        return ()
    if compression is None:
        covered = device.type == "cpu" and _plain_in_place[0] and cpu_kv_attention.covers_plain(dtype, head_dim)
        return ("gpu", "cpu") if covered else ()
    if _triton_runs_on(device) and _triton_covers(compression, head_dim):
        return TIERS if device.type == "cpu" else ("gpu",)
    if device.type != "cpu":
        return ()
    covered = cpu_kv_attention.covers(compression.k_config(), compression.v_config(head_dim), head_dim, dtype)
    return TIERS if covered else ()


# (block_size, "before" | "same"): attend only keys in blocks before each query's own block, or in
# its own block (flexsarathi.models.attention.attend's key_blocks); None: every visible key.
KeyRule = tuple[int, str] | None


@dataclass(frozen=True)
class KVCompression:
    bits: int = KV_FORMAT.bits  # the format: policy_search/quant_format.py
    block_size: int = KV_FORMAT.block_size  # K group: one block of tokens per channel
    value_group: int = KV_FORMAT.value_group  # V group along the head dimension (capped at the head size)

    def k_config(self) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=self.block_size, group_dim=-1)

    def v_config(self, head_dim: int) -> QuantConfig:
        return QuantConfig(bits=self.bits, group_size=min(self.value_group, head_dim + head_dim % 2),
                           group_dim=-1)


def _qtensor_shapes(config: QuantConfig, values_per_row: int) -> dict[str, tuple[int, torch.dtype]]:
    groups = values_per_row // config.group_size
    return {"data": (groups * config.bytes_per_group, torch.uint8), "scale": (groups, torch.float16),
            "minimum": (groups, torch.float16)}


def kv_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v [T, kv_heads, head_dim] as one [T, 2, kv_heads, head_dim] view where each token's v
    follows its k in memory (the fused qkv projection's output), else None. The cheap tests first,
    and few attribute reads: every decode layer-step asks, and on a GPU it is host-bound."""
    if k.dim() != 3:
        return None
    tokens, heads, dim = k.shape
    width = heads * dim
    if v.data_ptr() - k.data_ptr() != width * k.element_size():
        return None  # v does not start where k's first row ends
    stride = k.stride()
    if stride[2] != 1 or stride[1] != dim or stride != v.stride() or k.shape != v.shape or k.dtype != v.dtype \
            or k.device != v.device:
        return None
    return k.as_strided((tokens, 2, heads, dim), (stride[0], width, dim, 1))


class KVPool:
    def __init__(self, tier: str, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, *, block_size: int = 16,
                 compression: KVCompression | None = None, num_residual: int = 0,
                 pin_memory: bool = False, folder: str | None = None):
        self.tier, self.num_slots, self.dtype = tier, num_slots, dtype
        self.device = torch.device(device)
        self.kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.compression = compression
        self._contexts = RecycledBuffers(min_bytes=1 << 20)  # what gathers onto the CPU return (see _context_buffer)
        # CUDA: "a value quantized here was not finite", one flag per (device, thread), set without a
        # host sync and checked by check_finite() after the pass (quantize's `nonfinite`).
        self._nonfinite: dict[tuple[torch.device, int], torch.Tensor] = {}
        if num_slots % block_size:
            raise ValueError(f"KVPool: {num_slots} slots is not a whole number of {block_size}-token blocks")

        def alloc(shape, dt):
            return tier_zeros(shape, dt, self.device, pin_memory=pin_memory, folder=folder)

        if compression is None:
            # K and V of a slot side by side: one write stores a token's pair (the fused qkv output
            # holds k and v adjacent: store_pair) and one gather reads a context's (gather).
            self.kv = alloc((num_layers, num_slots, 2, num_kv_heads, head_dim), dtype)
            self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]  # [layers, slots, kv_heads, head_dim] views
            # each layer's [slots, 2, kv_heads, head_dim] view, made once: a decode step writes and
            # gathers every layer, and a view costs as much host time as a small kernel's launch
            self.kv_layers = self.kv.unbind(0)
            return
        if compression.block_size != block_size:
            raise ValueError(f"K is grouped by KV block: compression.block_size={compression.block_size} "
                             f"must equal the pool's block_size={block_size}")
        self.k_config, self.v_config = compression.k_config(), compression.v_config(head_dim)
        v_width = num_kv_heads * -(-head_dim // self.v_config.group_size) * self.v_config.group_size
        num_blocks = num_slots // block_size
        self.k_codes = {n: alloc((num_layers, num_blocks, size), dt) for n, (size, dt) in
                        _qtensor_shapes(self.k_config, num_kv_heads * head_dim * block_size).items()}
        self.v_codes = {n: alloc((num_layers, num_slots, size), dt) for n, (size, dt) in
                        _qtensor_shapes(self.v_config, v_width).items()}
        # [layers, residual rows, block_size, kv_heads, head_dim]: blocks being filled, full precision.
        self.k_residual = alloc((num_layers, max(num_residual, 1), block_size, num_kv_heads, head_dim), dtype)

    @property
    def nbytes(self) -> int:
        if self.compression is None:
            return self.kv.nbytes
        tensors = list(self.k_codes.values()) + list(self.v_codes.values()) + [self.k_residual]
        return sum(t.nbytes for t in tensors)

    @staticmethod
    def nbytes_for(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   compression: KVCompression | None, num_residual: int = 0) -> int:
        """Bytes a pool of this shape allocates (for budgets, before allocating)."""
        if compression is None:
            return 2 * num_layers * num_slots * num_kv_heads * head_dim * dtype.itemsize
        k, v = compression.k_config(), compression.v_config(head_dim)
        k_groups = num_kv_heads * head_dim  # per block
        v_groups = num_kv_heads * -(-head_dim // v.group_size)  # per slot
        num_blocks = num_slots // compression.block_size
        residual = max(num_residual, 1) * compression.block_size * num_kv_heads * head_dim * dtype.itemsize
        return num_layers * (num_blocks * k_groups * (k.bytes_per_group + 4)
                             + num_slots * v_groups * (v.bytes_per_group + 4) + residual)

    # ---- compression helpers (pure functions of values: what a stored value reads back as) ---
    def _flag(self, device: torch.device) -> torch.Tensor | None:
        if not _triton_runs_on(device):
            return None  # quantize checks at once on the CPU (inside triton_decodes_on_cpu: as on a GPU)
        key = (device, threading.get_ident())
        if key not in self._nonfinite:
            self._nonfinite[key] = torch.zeros((), dtype=torch.bool, device=device)
        return self._nonfinite[key]

    def check_finite(self) -> None:
        """Raise if a value quantized on CUDA since the last check was inf, NaN or beyond fp16 (the
        CPU raises inside quantize); one host sync, made where the caller syncs anyway."""
        flags, self._nonfinite = list(self._nonfinite.values()), {}
        if any(bool(flag) for flag in flags):
            raise ValueError(f"KV cache ({self.tier} tier): a key or value to quantize was inf, NaN or "
                             "beyond fp16's range")

    def round_trip_v(self, v: torch.Tensor) -> torch.Tensor:
        """V rows [T, kv_heads, head_dim] as they read back from the pool."""
        return v if self.compression is None else self.quantize_v(v)[1]

    def quantize_v(self, v: torch.Tensor, read_back: bool = True) -> tuple[QTensor, torch.Tensor | None]:
        """New V rows [T, kv_heads, head_dim] of a compressed pool: their codes and (read_back) the values
        they read back as, else None. The executor makes them once per micro-batch and layer, for its
        attention and its store. Where the Triton kernels run (a GPU; the CPU inside
        triton_decodes_on_cpu) one launch (quant/triton_quantize.py, the same bits) instead of ~30."""
        kernel = _triton("triton_quantize") if _triton_runs_on(v.device) else None
        if kernel is not None and kernel.covers(self.v_config, self.head_dim):
            q = kernel.quantize_lines(v, self.v_config, nonfinite=self._flag(v.device))
        else:
            q = quantize(v, self.v_config, nonfinite=self._flag(v.device))
        return q, dequantize(q, v.dtype) if read_back else None

    def _as_read_back(self, v: torch.Tensor, read_back: bool) -> torch.Tensor:
        return v if read_back else self.round_trip_v(v)

    def round_trip_k_blocks(self, k: torch.Tensor) -> torch.Tensor:
        """Whole K blocks [num_blocks * block_size, kv_heads, head_dim] as they read back."""
        bs = self.block_size
        blocks = k.unflatten(0, (-1, bs)).permute(0, 2, 3, 1)  # [nb, kvh, d, bs]
        back = dequantize(quantize(blocks, self.k_config, nonfinite=self._flag(k.device)), k.dtype)
        return back.permute(0, 3, 1, 2).reshape(k.shape)

    def copy_slots(self, dst: "KVPool", src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   src_row: int = -1, dst_row: int = -1) -> None:
        """Copy the K/V of every layer at `src_slots` [T] into `dst` (this pool or another tier's:
        the layouts are the same) at `dst_slots` [T]. Compressed pools: the slots are tokens of a
        block being filled, so V codes are copied per slot and K as residual row src_row -> dst_row."""
        src_slots, dst_slots = src_slots.to(self.device), dst_slots.to(dst.device)
        if self.compression is None:
            dst.kv[:, dst_slots] = self.kv[:, src_slots].to(dst.device)
            return
        for name, codes in self.v_codes.items():
            dst.v_codes[name][:, dst_slots] = codes[:, src_slots].to(dst.device)
        dst.k_residual[:, dst_row] = self.k_residual[:, src_row].to(dst.device)

    # ---- store / gather -------------------------------------------------------------------
    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              residual_ids: torch.Tensor | None = None, v_codes: QTensor | None = None,
              plan: StorePlan | None = None, v_stored: bool = False) -> None:
        """slots: [T] (best a host tensor: the batch builder's); k, v: [T, kv_heads, head_dim] on any
        device; residual_ids: [T] the residual row of each token's sequence (compressed pools); v_codes:
        quantize_v's codes of v, used where they are on this pool's device (else v is quantized here);
        plan: plan_store's of slots and residual_ids for this pool (the executor's, made once per pass;
        else made here); v_stored: store_v_first put V in already (K only here). A host pool takes k
        and v through pinned memory and an event wait (no stream sync); index arithmetic runs on the host."""
        if self.compression is None:
            pair = kv_pair(k, v)
            if pair is not None and self.device.type == pair.device.type and pair.dtype == self.dtype:
                self.store_pair(layer, slots, pair)
                return
        if self.device.type == "cpu":
            if self.compression is not None and v_codes is not None and v_codes.device.type == "cuda":
                # The executor's codes of v (what its attention read back) come down with k, one event
                # wait for all: the host does not quantize v a second time.
                k, data, scale, minimum = to_host_all(k, v_codes.data, v_codes.scale, v_codes.minimum)
                v_codes = dataclasses.replace(v_codes, data=data, scale=scale, minimum=minimum)
            else:
                k, v = to_host_all(k, v)  # one event wait for both
        if self.compression is None:
            slots = to_device(slots, self.device)
            self.k[layer].index_copy_(0, slots, k.to(self.device, self.dtype))
            self.v[layer].index_copy_(0, slots, v.to(self.device, self.dtype))
            return
        plan = plan or self.plan_store(slots, residual_ids)
        if not v_stored:
            same_device = v_codes is not None and v_codes.device.type == self.device.type
            q = v_codes if same_device else quantize(v, self.v_config, nonfinite=self._flag(v.device))
            for name, part in (("data", q.data), ("scale", q.scale), ("minimum", q.minimum)):
                self.v_codes[name][layer].index_copy_(0, plan.slots, part.view(v.shape[0], -1).to(self.device))
        self._store_keys(layer, plan, k.to(self.device, self.dtype))

    def store_v_first(self, layer: int, v: torch.Tensor, plan: StorePlan) -> None:
        """New V rows [T, kv_heads, head_dim] on this pool's device, quantized straight into their slots
        (plan.slots) in one Triton launch, before attention reads them there (a pool that
        attends_with_triton); the store after attention then writes K only (store's v_stored)."""
        tables = {n: t[layer] for n, t in self.v_codes.items()}
        _triton("triton_quantize").quantize_lines(v, self.v_config, nonfinite=self._flag(v.device),
                                                  into=(tables, plan.slots))

    def plan_store(self, slots: torch.Tensor, residual_ids: torch.Tensor) -> StorePlan:
        """Where a store of these slots puts its K and V in this (compressed) pool: offload/kv_plans.py."""
        return plan_store(slots, residual_ids, self.block_size, self.device)

    def plan_gather(self, part: KVPart, device: torch.device) -> GatherPlan:
        """What a gather of this part onto `device` reads from this (compressed) pool."""
        at = host_of(part)
        return plan_gather(at.kv_slots, at.residual_ids, at.complete_len, self.block_size, self.device, device)

    def store_pair(self, layer: int, slots: torch.Tensor, pair: torch.Tensor) -> None:
        """pair: [T, 2, kv_heads, head_dim] (K then V of each token) on the pool's device, in its
        dtype, into `slots` [T]: one write (a plain pool's)."""
        if slots.device != self.device:  # the executor's are uploaded once per pass already
            slots = to_device(slots, self.device)
        self.kv_layers[layer].index_copy_(0, slots, pair)

    def _store_keys(self, layer: int, plan: StorePlan, k: torch.Tensor) -> None:
        """K of a compressed pool: into each sequence's residual (open) block; a block completed
        here is assembled from its residual row (tokens stored by earlier passes) and this call's
        tokens of that block, then quantized. The row is not written first: later tokens of the
        same sequence in this call reuse it for the next block."""
        residual = self.k_residual[layer]
        if plan.done_blocks is not None:
            full = residual[plan.done_rows]  # [nb, bs, kvh, d]: a copy (advanced indexing)
            full[plan.into_block, plan.into_offset] = k[plan.from_row]
            # groups: the block's tokens of one channel
            q = quantize(full.permute(0, 2, 3, 1), self.k_config, nonfinite=self._flag(k.device))
            for name, part in (("data", q.data), ("scale", q.scale), ("minimum", q.minimum)):
                self.k_codes[name][layer].index_copy_(0, plan.done_blocks, part.view(plan.done_blocks.shape[0], -1))
        if plan.keep_rows.numel():
            residual[plan.keep_rows, plan.keep_offsets] = k if plan.keep_src is None else k[plan.keep_src]

    def gather(self, layer: int, slots: torch.Tensor, device: torch.device,
               residual_ids: torch.Tensor | None = None, complete_len: torch.Tensor | None = None,
               plan: GatherPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [B, L] (block-aligned: position j of a row is in the row's block j // block_size)
        -> fresh k, v [B, L, kv_heads, head_dim] in the pool dtype on `device`. For compressed
        pools, the first complete_len[b] positions come from quantized blocks, the rest from the
        sequence's residual block. Host pools gather into pinned memory when `device` is CUDA, so
        the copy up is an asynchronous DMA. plan: plan_gather's for these tensors (compressed pools;
        else made here)."""
        if self.compression is None:
            slots = to_device(slots, self.device)  # the batch builder's host tensor: a no-op here
            return self.gather_pairs(layer, slots.reshape(-1), slots.shape, device)
        plan = plan or plan_gather(slots, residual_ids, complete_len, self.block_size, self.device, device)
        return self._gather_compressed(layer, plan, tuple(slots.shape), device)

    def gather_pairs(self, layer: int, flat_slots: torch.Tensor, shape: torch.Size,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A plain pool's gather: flat_slots [B * L] on the pool's device (the executor uploads them
        once per pass), shape (B, L) -> k, v [B, L, kv_heads, head_dim] on `device`."""
        # index_select, not advanced indexing: 4x faster on the CPU for this shape. K and V of a slot
        # lie side by side: one select reads both, returned as views of the one result.
        pairs = self._select(self.kv_layers[layer], flat_slots, device)  # [B * L, 2, kv_heads, head_dim]
        return pairs.view(*shape, 2, self.kv_heads, self.head_dim).unbind(-3)

    def _select(self, table: torch.Tensor, flat: torch.Tensor, device: torch.device) -> torch.Tensor:
        """table[flat] on `device` (rows of one layer's K/V pairs, or of a code table)."""
        here, there = table.device.type, device.type
        if here == there:
            if here == "cpu" and flat.numel() * table.stride(0) * table.element_size() >= self._contexts.min_bytes:
                return torch.index_select(table, 0, flat, out=self._context_buffer((flat.numel(), *table.shape[1:]),
                                                                                   table.dtype))
            return torch.index_select(table, 0, flat)
        if here == "cpu" and there == "cuda":
            # Pinned memory from torch's caching host allocator: a block freed after its copy up is
            # handed out again once that copy's event has passed (reused, not allocated per layer).
            staged = torch.empty((flat.numel(), *table.shape[1:]), dtype=table.dtype, pin_memory=True)
            return torch.index_select(table, 0, flat, out=staged).to(device, non_blocking=True)
        return table.index_select(0, flat).to(device, non_blocking=True)

    def _context_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A gathered context's memory on the CPU: recycled once nothing uses it, so a decode step
        does not fault in tens of fresh MB per layer (offload/host_buffer.py, RecycledBuffers)."""
        return self._contexts.take(shape, dtype)

    def _gather_compressed(self, layer: int, plan: GatherPlan, shape: tuple[int, int], device: torch.device):
        """K then V, each written once into its result: at most two K/V-sized tensors exist at a
        time (the dequantized blocks and K; then K and V), which working_set's charge of three per
        gathered slot covers (docs/DESIGN.md, "Working set")."""
        (batch, length), (kvh, d, bs) = shape, (self.kv_heads, self.head_dim, self.block_size)
        num_blocks, full = -(-length // bs), length // bs
        if self.device.type == "cpu" and cpu_kv_dequant.covers(self.k_config, self.dtype, device):
            # One C pass per tensor (quant/cpu_kv_dequant.py): the same values as below, 5-10x sooner.
            out = (batch, length, kvh, d)
            k = cpu_kv_dequant.keys({n: t[layer] for n, t in self.k_codes.items()}, plan.blocks, length, kvh, d, bs,
                                    out=self._context_buffer(out, torch.float32))
            self._fill_open_blocks(k, layer, plan)
            v = cpu_kv_dequant.values({n: t[layer] for n, t in self.v_codes.items()}, plan.slots.view(batch, length),
                                      kvh, d, self.v_config, out=self._context_buffer(out, torch.float32))
            return k, v
        # a host pool's codes are selected straight into pinned memory for the copy up (_select)
        parts = {n: self._select(t[layer], plan.blocks.reshape(-1), device).reshape(-1) for n, t in self.k_codes.items()}
        by_block = dequantize(QTensor(data=parts["data"], scale=parts["scale"], minimum=parts["minimum"],
                                      shape=(batch * num_blocks, kvh, d, bs), dtype=self.dtype, config=self.k_config))
        by_block = by_block.view(batch, num_blocks, kvh, d, bs).permute(0, 1, 4, 2, 3)  # [B, nb, bs, kvh, d]
        k = torch.empty(batch, length, kvh, d, dtype=self.dtype, device=device)
        if full:
            k[:, :full * bs].view(batch, full, bs, kvh, d).copy_(by_block[:, :full])
        if length > full * bs:
            k[:, full * bs:].copy_(by_block[:, full, :length - full * bs])
        del by_block
        self._fill_open_blocks(k, layer, plan)
        parts = {n: self._select(t[layer], plan.slots, device).reshape(-1) for n, t in self.v_codes.items()}
        v = dequantize(QTensor(data=parts["data"], scale=parts["scale"], minimum=parts["minimum"],
                               shape=(batch * length, kvh, d), dtype=self.dtype, config=self.v_config))
        return k, v.view(batch, length, kvh, d)

    def _fill_open_blocks(self, k: torch.Tensor, layer: int, plan: GatherPlan) -> None:
        """k [B, L, kv_heads, d]: the positions that read a sequence's residual (open) block, in place
        (only those positions, not whole residual rows: those are block_size x larger)."""
        if plan.open_seq.numel():
            open_keys = self.k_residual[layer][plan.open_rows, plan.open_offsets]
            k[plan.open_seq, plan.open_pos] = to_device(open_keys, k.device)

    # ---- decode attention read in the pool (its codes, or a plain pool's slots) -------------------
    def attends_in_pool(self, group: AttentionGroup, part: KVPart, device: torch.device) -> bool:
        """Whether the group's decode rows attend this part straight from the pool (attend_decode,
        attend_decode_codes), with no gathered context: where its tier is one decode_in_pool_tiers
        names for a pass attending on `device` (the pool's device type)."""
        return (group.is_decode and device.type == self.device.type and part.new_rows is None
                and self.tier in decode_in_pool_tiers(device, self.dtype, self.head_dim, self.compression))

    def attends_with_triton(self) -> bool:
        """Decode rows over this compressed pool take the Triton kernel: on a GPU, or on the CPU
        inside triton_decodes_on_cpu()."""
        return (self.compression is not None and _triton_runs_on(self.device)
                and _triton_covers(self.compression, self.head_dim))

    def plan_decode(self, group: AttentionGroup, part: KVPart, windows: tuple[int | None, ...]) -> DecodePlan:
        """What attend_decode_codes reads for this part within each of the model's sliding windows, on
        the pool's device (made once per pass)."""
        at = host_of(group)
        return plan_decode(at.q_pos[:, 0], at.token_rows, host_of(part), self.block_size, windows, self.device)

    def attend_decode(self, layer: int, group: AttentionGroup, part: KVPart, q: torch.Tensor, new_k: torch.Tensor,
                      new_v: torch.Tensor, scale: float, sliding_window: int | None, v_read_back: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention.attend gives over the context gather_part + parts_to_attend build (earlier
        blocks as quantized, the open block in full precision, the pass's new row with V as it will
        read back), computed from the codes on the CPU, or from a plain pool's slots. q [B, 1, heads, d]
        on the CPU; new_k, new_v: the group's new rows [B, kv_heads, d] on any device, or None where they
        are in the pool already (the executor wrote them first). out [B, 1, heads, d] in q's dtype,
        lse [B, 1, heads] fp32. (A pool that attends_with_triton: attend_decode_codes.)"""
        at, bs = host_of(part), self.block_size  # host tensors: the batch builder's, no sync
        q_pos = host_of(group).q_pos[:, 0]
        lo, hi = visible_range(q_pos, at, sliding_window)
        new = self._new_rows(part, new_k, new_v, q.shape[0], v_read_back)
        if self.compression is None:
            out, lse = cpu_kv_attention.plain_decode_attention(self.kv_layers[layer], at.kv_slots, q[:, 0], (lo, hi),
                                                               new, scale)
            return out.to(q.dtype).unsqueeze(1), lse.unsqueeze(1)
        out, lse = cpu_kv_attention.decode_attention(
            {n: t[layer] for n, t in self.k_codes.items()}, at.kv_slots[:, ::bs] // bs, at.complete_len,
            self.k_residual[layer], at.residual_ids, {n: t[layer] for n, t in self.v_codes.items()}, at.kv_slots,
            self.v_config.group_size, q[:, 0], (lo, hi), new, scale)
        return out.to(q.dtype).unsqueeze(1), lse.unsqueeze(1)

    def attend_decode_codes(self, layer: int, q: torch.Tensor, plan: DecodePlan,
                            new: tuple[torch.Tensor, QTensor | None] | None, scale: float, window: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """attend_decode where the pool attends_with_triton: one launch on the pool's device. q
        [B, 1, heads, d] there; plan: plan_decode's (every index, uploaded once per pass); new: the
        micro-batch's new K [T, kv_heads, d] and its V codes (quantize_v's; None: store_v_first wrote
        them into the pool), the rows the plan names read in place, or None (both in the pool
        already); window: the layer's sliding window (one the plan was made for). out [B, 1, heads, d] in
        q's dtype, lse [B, 1, heads] fp32."""
        new_rows = None
        if new is not None:  # codes None: store_v_first put them in the pool
            k, codes = new
            tables = None if codes is None else {n: getattr(codes, n).view(codes.shape[0], -1)
                                                 for n in ("data", "scale", "minimum")}
            new_rows = (k, tables, plan.new_src, plan.new_pos)
        out, lse = _triton("triton_kv_attention").decode_attention(
            {n: t[layer] for n, t in self.k_codes.items()}, plan.blocks, plan.complete_len, self.k_residual[layer],
            plan.residual_ids, {n: t[layer] for n, t in self.v_codes.items()}, plan.slots, self.v_config.group_size,
            q[:, 0], (plan.lo_of(window), plan.hi), new_rows, scale, out_dtype=q.dtype)
        return out.unsqueeze(1), lse.unsqueeze(1)

    def _new_rows(self, part: KVPart, new_k: torch.Tensor, new_v: torch.Tensor, batch: int, v_read_back: bool):
        """(k [B, kv_heads, d], v, position [B]) fp32 on the host: each decoding sequence's new row
        as it reads back from the pool, at its position (-1: none, its row is in the pool already
        or it has none)."""
        at = host_of(part)
        # the kernels read a sequence's row only at its position: rows at -1 need no filling
        k_new = torch.empty(batch, self.kv_heads, self.head_dim, dtype=torch.float32)
        v_new, new_pos = torch.empty_like(k_new), torch.full((batch,), -1, dtype=torch.long)
        if new_k is not None and part.patch_src.numel():  # one new row per decoding sequence, over its slot
            src = part.patch_src
            k_new[at.patch_seq] = to_host(new_k[src]).to(self.dtype).float()
            v_new[at.patch_seq] = to_host(self._as_read_back(new_v[src], v_read_back)).to(self.dtype).float()
            new_pos[at.patch_seq] = at.patch_pos
        return k_new, v_new, new_pos

    # ---- what a group's queries attend ---------------------------------------------------------
    def gather_part(self, layer: int, part: KVPart, device: torch.device,
                    plan: GatherPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored context of one attention part, gathered onto `device` (see gather)."""
        return self.gather(layer, part.kv_slots, device, part.residual_ids, part.complete_len, plan)

    def parts_to_attend(self, group: AttentionGroup, part: KVPart, context, new_k: torch.Tensor,
                        new_v: torch.Tensor, v_read_back: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, KeyRule]]:
        """What the group's queries attend in this part, as (keys, values, key rule) triples whose
        attentions merge exactly. context: gather_part's k, v [B, L, kv_heads, d], or None when the
        part's keys are all this pass's new rows (part.new_rows); new_k, new_v: the group's new
        rows [B * n, kv_heads, d] (v_read_back: new_v as it reads back already, quantize_v's). New rows
        read as they will read back from the pool."""
        k, v = self._with_new_rows(group, part, context, new_k, new_v, v_read_back)  # [B, L, kv_heads, d]
        if self.compression is None or group.is_decode:
            # A decode's keys already read as its query sees them (earlier blocks dequantized from
            # the pool, its own block from the full-precision residual and the new row): one
            # attention over them is the union of the two parts below, and reads K and V once
            # instead of twice (each part's call streams the whole context: ~20 ms per layer and
            # decode step for llama-2-7b's 32 x 133 tokens on 2 cores).
            return [(k, v, None)]
        # Earlier blocks as stored (quantized); the query's own block in full precision.
        bs = self.block_size
        return [(self._keys_as_stored(group, part, k), v, (bs, "before")), (k, v, (bs, "same"))]

    def _with_new_rows(self, group: AttentionGroup, part: KVPart, context, new_k: torch.Tensor, new_v: torch.Tensor,
                       v_read_back: bool):
        if context is None:  # [B, L, kv_heads, d]: each sequence's own rows, in order (views)
            lo, hi = part.new_rows
            k = new_k.unflatten(0, (group.num_seqs, -1))[:, lo:hi]
            v = new_v.unflatten(0, (group.num_seqs, -1))[:, lo:hi]
            if self.compression is None or v_read_back:
                return k, v
            return k, self.round_trip_v(v.flatten(0, 1)).unflatten(0, v.shape[:2])
        k, v = context  # fresh tensors from gather: patched in place
        if part.patch_src.numel():
            dev, src = k.device, part.patch_src  # src: rows of new_k (the compute device)
            # On the CPU (delegated attention) the positions are the batch builder's host tensors
            # and the new rows come down through pinned memory: no stream sync.
            at = host_of(part) if dev.type == "cpu" else part
            seq, pos = at.patch_seq, at.patch_pos
            k[seq, pos] = to_host(new_k[src]).to(k.dtype) if dev.type == "cpu" else new_k[src].to(dev, k.dtype)
            v_back = self._as_read_back(new_v[src], v_read_back)  # K of the open block stays exact, V as stored
            v[seq, pos] = to_host(v_back).to(v.dtype) if dev.type == "cpu" else v_back.to(dev, v.dtype)
        return k, v

    def _keys_as_stored(self, group: AttentionGroup, part: KVPart, k: torch.Tensor) -> torch.Tensor:
        """Keys as queries of later blocks see them: blocks completed inside this pass are
        round-tripped through the block quantization they are stored with (earlier blocks already
        come dequantized from the pool). Prompt rows only: decodes attend one part."""
        bs = self.block_size
        lengths = host_of(part)  # host tensors: int() of a device tensor would be a sync per sequence
        spans: dict[tuple[int, int], list[int]] = {}  # (lo, hi) -> the sequences with those blocks to round-trip
        for b, (lo, length) in enumerate(zip(lengths.complete_len.tolist(), lengths.kv_len.tolist())):
            if length // bs * bs > lo:
                spans.setdefault((lo, length // bs * bs), []).append(b)
        if not spans:
            return k
        k_prior = k.clone()
        for (lo, hi), members in spans.items():  # one round trip per span (grouped prompts: one in all)
            seqs = slice(None) if len(members) == group.num_seqs else to_device(torch.tensor(members), k.device)
            stored = self.round_trip_k_blocks(k[seqs, lo:hi].flatten(0, 1))  # whole blocks of each sequence
            k_prior[seqs, lo:hi] = stored.unflatten(0, (-1, hi - lo))
        return k_prior
