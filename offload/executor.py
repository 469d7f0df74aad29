"""The pass executor: ONE loop, layer-major and micro-batch-minor (FlexGen's zig-zag order).

    for layer j:
        start loading layer j+1's weights (policy.weight_prefetch layers ahead; past the last
        layer, the next pass's first ones)                      (prefetch thread / CUDA stream)
        start loading hidden + KV context of micro-batch 0 (its KV: see below)
        for micro-batch k:
            start loading hidden + KV context of micro-batch k+1 (after the last: layer j+1's
                KV context of micro-batch 0, where that loads on the I/O thread: gathers_ahead)
            compute layer j on micro-batch k (attention next to where its KV lives)
            start storing micro-batch k's new KV and hidden
        wait for the stores; release layer j

Each layer's weights reach the compute device once per pass and serve every micro-batch. With
`overlap=False` the same loop runs every load and store inline. The KV context is gathered before
the micro-batch's new K/V exist; the pool turns context + new rows into the parts to attend
(KVPool.parts_to_attend: compressed KV is its business), whose attentions merge exactly. Decode
rows beside a compressed host pool gather nothing: the pool attends them from its codes
(KVPool.attend_decode).

The model is injected (offload/ never imports flexsarathi/): any object with `embed`, `qkv`,
`attend`, `merge_attention`, `post_attention` and `logits` as in flexsarathi.models.base (and its
`scale`, `window_of(layer)` and `config.windows`, which attention read from the pool's codes takes:
each layer attends within its own sliding window, gemma3's layers within one of two).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offload.activations import ActivationStore
from offload.micro_batch import AttentionGroup, KVWrite, MicroBatch, host_of
from offload.host_malloc import keep_freed_host_memory
from offload.interrupts import raise_if_interrupted
from offload.kv_cache import KVPool
from offload.streams import (IOStream, bind_thread, device_guard, indexed, record_event, to_device, to_host,
                             used_on, wait_for)
from offload.weights import LayerWeightStore, with_lora
from policy_search.working_set import POST_ATTENTION_ROWS
from quant.cpu_int8_matmul import cpu_matmul_mode

CPU = torch.device("cpu")
IN_POOL = "in pool"  # a part's context, not gathered: the pool attends it (KVPool.attend_decode)
# How a part is attended (PassExecutor._attend_kind), besides IN_POOL: in its compressed pool by the
# Triton kernel; in one fused call with the pass's mask (a decode alone, its context gathered beside its
# new rows); in one causal call (prompts attending their own rows); gathered and patched, then `attend`.
IN_POOL_TRITON, FUSED, CAUSAL, GENERAL = "in pool, triton", "fused", "causal", "general"


class PassExecutor:
    def __init__(self, model, weights: LayerWeightStore, kv_pools: dict[str, KVPool],
                 activations: ActivationStore, device: torch.device, dtype: torch.dtype, *,
                 overlap: bool = True, cpu_attention: bool = False, cpu_matmul: str = "dequantize",
                 head: str = "logits"):
        self.model, self.weights, self.kv_pools, self.acts = model, weights, kv_pools, activations
        # what a pass returns for its logit rows: "logits" (fp32 [R, vocab]) or "hidden" (the final
        # hidden states, fp32 [R, hidden]: an embedding engine's, flexsarathi/engine/pooling.py)
        self.head = head
        self.device, self.dtype = torch.device(device), dtype
        self.cpu_attention = cpu_attention
        self.cpu_matmul = cpu_matmul  # "int8x2", "int8" or "dequantize": 4-bit weights on the CPU (quant/fused.py)
        # LoRA adapters served per request: {adapter id: per layer {weight: (A, B)}} on the compute
        # device, filled by their owner (flexsarathi/engine/lora_requests.py) as requests name them
        self.lora_factors: dict[int, list[dict]] = {}
        self._io = (ThreadPoolExecutor(1, thread_name_prefix="kv-act-io", initializer=bind_thread,
                                       initargs=(indexed(self.device),)) if overlap else None)
        # CUDA: the I/O thread's copies run on their own stream, ordered by events (offload/streams.py).
        self._io_stream = IOStream(self.device if overlap else CPU)
        # per pass (run): id(part) -> its decode masks by window (_decode_biases); id(micro-batch) -> whether its
        # I/O runs on the thread (_io_worth_a_thread) and whether it writes its K/V first (writes_first)
        self._biases: dict[int, dict] = {}
        self._threaded: dict[int, bool] = {}
        self._first: dict[int, bool] = {}
        # per pass: id(write or part) -> its slots on its plain pool's device (uploaded once per pass,
        # not per layer: _pool_slots)
        self._slots: dict[int, torch.Tensor] = {}
        self._reads_back: dict[int, bool] = {}  # id(micro-batch) -> _reads_v_back
        self._v_first: dict[int, bool] = {}  # id(micro-batch) -> _writes_v_first
        self._routes: dict[int, object] = {}  # id(part) -> how its context reaches attention (_context_routes)
        self._order = PassOrder(threaded=(), compute_stream=None, gathers_ahead=False)  # per pass (_order_pass)
        # id(micro-batch) -> its groups' attention and its KV writes as decided for the pass
        self._groups: dict[int, tuple[GroupStep, ...]] = {}  # _group_steps
        self._writes: dict[int, tuple[WriteStep, ...]] = {}  # _write_steps
        self._v_pool: KVPool | None = None  # the pool that quantizes new V rows, if one is compressed
        # the next layer's first micro-batch's contexts, gathered on the I/O thread while this layer's
        # last micro-batch computes (gathers_ahead): (layer, id(micro-batch)) -> contexts, and its future
        self._gathered: dict[tuple[int, int], list] = {}
        self._ahead: "Future | None" = None
        # attention sinks (gpt-oss): every part's output with its lse, merged with the layer's sinks
        self.sinks = model.config.attention_sinks
        # where one fused call attends grouped whole prompts: plain pools (a causal call), compressed
        # ones (a masked call per block); _causal_calls_read_in_place
        self.causal_calls = _causal_calls_read_in_place(self.device, dtype, model.config, masked=False)
        self.masked_causal_calls = _causal_calls_read_in_place(self.device, dtype, model.config, masked=True)

    def _io_worth_a_thread(self, mb: MicroBatch) -> bool:
        """Whether the micro-batch's loads and stores leave the compute device's memory system.
        On a GPU they do (copies over the bus) unless it is resident (_resident: then nothing
        crosses, and a thread would only add futures and events to a pass bound by host time).
        On a CPU compute device, gathering KV from host memory and parking hidden states there are
        themselves compute on the same cores: a thread only adds a second OpenMP team competing
        for them (slower passes: docs/BENCHMARKS.md). Only the disk tier (KV or activations) is
        real I/O there."""
        if self.device.type != "cpu":
            return not self._resident(mb)
        return (self.acts.fractions[2] > 0 or any(part.tier == "disk" for g in mb.groups for part in g.parts)
                or any(write.tier == "disk" for write in mb.kv_writes))

    def _resident(self, mb: MicroBatch) -> bool:
        """Its hidden states stay on the compute device and every KV part it reads or writes is the
        gpu tier's (the compute device's memory)."""
        return (self.acts.all_on_device and all(part.tier == "gpu" for g in mb.groups for part in g.parts)
                and all(write.tier == "gpu" for write in mb.kv_writes))

    def writes_first(self, mb: MicroBatch) -> bool:
        """Whether the micro-batch's new K/V are written into the pool before attention, which then
        reads them from the pool with the rest of the context (no patching of gathered contexts):
        a resident micro-batch whose gpu-tier pool holds plain K/V. Its contexts are gathered on
        the compute stream, after the writes, instead of ahead by the I/O step."""
        pool = self.kv_pools.get("gpu")
        return self._resident(mb) and (not mb.kv_writes or (pool is not None and pool.compression is None))

    def _submit(self, fn, fence, *args, threaded: bool = True) -> "Future | _Done":
        """fn(*args) on the I/O thread (its stream waiting for `fence`), or inline on the compute
        stream; the future gives (result, event to wait for or None)."""
        if self._io is None or not threaded:
            return _Done((fn(*args), None))
        return self._io.submit(self._io_stream.run, fence, fn, *args)

    def reset(self) -> None:
        """After an exception inside `run` (KeyboardInterrupt included): wait for the KV /
        activation I/O still in flight (it writes into the KV pools), drop the parked hidden
        states and reset the weights' prefetching, so the next pass runs as on a fresh engine."""
        if self._io is not None:
            self._io.submit(int).result()  # one worker: every load and store submitted before is done
        self._gathered, self._ahead = {}, None
        self.acts.close()
        self.weights.reset()

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self._io_stream.stream is not None:  # its copies land before the pools and buffers are freed
            self._io_stream.stream.synchronize()

    @torch.inference_mode()
    def run(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Runs one pass; returns, per micro-batch, fp32 logits of its `logit_rows` [R, vocab] (with
        head "hidden": their final hidden states [R, hidden])."""
        if self.device.type == "cpu":
            keep_freed_host_memory()  # once per process; see offload/host_malloc.py
        with device_guard(self.device), cpu_matmul_mode(self.cpu_matmul):
            batches = [mb.to(self.device) for mb in micro_batches]
            self._routes = self._context_routes(batches)
            self._biases = self._decode_biases(batches)
            # per micro-batch, fixed for the pass: its I/O on the thread, its K/V written first
            self._threaded = {id(mb): self._io_worth_a_thread(mb) for mb in batches}
            self._first = {id(mb): self.writes_first(mb) for mb in batches}
            self._slots = self._pool_slots(batches)
            self._v_pool = next((p for p in self.kv_pools.values() if p.compression is not None), None)
            self._reads_back = {id(mb): self._reads_v_back(mb) for mb in batches}
            self._v_first = {id(mb): self._writes_v_first(mb) for mb in batches}
            self._order = self._order_pass(batches)
            self._groups = {id(mb): self._group_steps(mb) for mb in batches}
            self._writes = {id(mb): self._write_steps(mb) for mb in batches}
            self._gathered, self._ahead = {}, None
            g = self.weights.global_weights()
            for k, mb in enumerate(batches):
                self.acts.put(k, self.model.embed(g, mb.token_ids, mb.positions).to(self.dtype))
            # Loads see the parked embeddings and the pools as the steps between passes left them
            # (only threaded loads wait for it: a resident pass records no event).
            start = record_event(self.device) if any(self._threaded.values()) else None
            for layer in range(self.weights.num_layers):
                raise_if_interrupted()  # Ctrl-C lands here, between layers (offload/interrupts.py)
                self._run_layer(layer, batches, start)
            head = self.model.logits if self.head == "logits" else self._final_hidden
            return [head(g, self.acts.take(k)[mb.logit_rows]) for k, mb in enumerate(batches)]

    def _final_hidden(self, g, rows: torch.Tensor) -> torch.Tensor:
        return self.model.final_hidden(g, rows).float()  # [R, hidden]

    def _run_layer(self, layer: int, batches: list[MicroBatch], start) -> None:
        """Layer `layer` on every micro-batch: k computes while k + 1 loads and k - 1 stores. What is
        the same for every layer of the pass (threads, streams, gathering ahead) was decided in
        `run` (_order_pass): an all-resident decode pass on a GPU is host-bound."""
        order, num_layers = self._order, self.weights.num_layers
        w = self.weights.get(layer)
        # The next layers, wrapping to the next pass's first: their loads overlap this layer
        # (and after the last, the LM head and the scheduling between passes).
        for ahead in range(1, self.weights.prefetch_depth + 1):
            self.weights.prefetch((layer + ahead) % num_layers)
        loading = self._submit(self._load, start, layer, batches[0], 0, threaded=order.threaded[0])
        if self._ahead is not None:  # done before the load (one I/O worker); its error surfaces here
            wait_for(self._ahead.result()[1], self.device)
            self._ahead = None
        storing = []
        for k, mb in enumerate(batches):
            (hidden, contexts), loaded = loading.result()
            if loaded is not None:
                wait_for(loaded, self.device)
            if order.compute_stream is not None and order.threaded[k]:  # made on the I/O stream: used here too
                used_on([hidden, *(t for parts in contexts or () for kv in parts if kv is not None for t in kv)],
                        order.compute_stream)
            if k + 1 < len(batches):
                loading = self._submit(self._load, start, layer, batches[k + 1], k + 1, threaded=order.threaded[k + 1])
            elif order.gathers_ahead and layer + 1 < num_layers:
                # FlexGen's order: the next layer's first KV load overlaps this layer's last compute
                # (with one micro-batch, too: else its load and compute would add up)
                self._ahead = self._submit(self._gather_ahead, start, layer + 1, batches[0])
            hidden, new_k, new_v, v_codes = self._compute(layer, w, mb, hidden, contexts)
            if order.threaded[k]:
                codes = () if v_codes is None else (v_codes.data, v_codes.scale, v_codes.minimum)
                used_on([hidden, new_k, new_v, *codes], self._io_stream.stream)
                storing.append(self._submit(self._store, record_event(self.device), layer, mb, k, hidden, new_k, new_v,
                                            v_codes))
            else:
                self._store(layer, mb, k, hidden, new_k, new_v, v_codes)
        for future in storing:
            wait_for(future.result()[1], self.device)
        self.weights.release(layer)

    def _order_pass(self, batches: list[MicroBatch]) -> "PassOrder":
        """What _run_layer does the same in every layer of the pass (after _threaded and _first)."""
        return PassOrder(threaded=tuple(self._threaded[id(mb)] for mb in batches),
                         compute_stream=self._compute_stream(), gathers_ahead=self.gathers_ahead(batches))

    def _compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def one_causal_call(self, group: AttentionGroup, part) -> bool:
        """The group's prompts attend only their own new rows, in one part: one fused causal call
        (the model's attend_own_rows) serves them all, with no mask, no log-sum-exp and no score
        buffer (the engine's working set charges it nothing beyond its output); over a compressed
        pool, whose prompts see earlier blocks as stored, one masked call per block
        (attend_own_rows_by_block; charged as three K/V-sized tensors per key, as a gather)."""
        window = self.model.config.smallest_window  # the same call serves every layer
        plain = self.kv_pools[part.tier].compression is None
        return ((self.causal_calls if plain else self.masked_causal_calls) and not group.is_decode
                and len(group.parts) == 1 and part.new_rows == (0, group.num_queries)
                and (window is None or group.num_queries <= window))

    def attention_device(self, tier: str, group: AttentionGroup) -> torch.device:
        """Decode attention runs on the CPU where the KV cache lives off the compute device and
        cpu_attention is on: only q and the output cross, not the whole context."""
        if tier != "gpu" and self.cpu_attention and group.is_decode:
            return CPU
        return self.device

    # ---- the three steps of a micro-batch -----------------------------------------------------
    def gathers_ahead(self, batches: list[MicroBatch]) -> bool:
        """Whether the first micro-batch's contexts for layer j + 1 are gathered while layer j's last
        micro-batch computes: where its loads run on the I/O thread and it does not write first. The
        compute device then holds two micro-batches' contexts at once, the last and the first (the
        engine's working set charges it: LLMEngine._pass_tokens)."""
        mb = batches[0]
        threaded, first = self._threaded.get(id(mb)), self._first.get(id(mb))
        if threaded is None:  # asked before the pass (the engine's working set)
            threaded, first = self._io_worth_a_thread(mb), self.writes_first(mb)
        return threaded and not first

    def _gather_ahead(self, layer: int, mb: MicroBatch) -> None:
        """On the I/O thread, before the layer's load of `mb` (one worker: in order)."""
        self._gathered[(layer, id(mb))] = self._contexts(layer, mb)

    def _load(self, layer: int, mb: MicroBatch, k: int):
        """(hidden, contexts); contexts None where the micro-batch writes first (gathered in _compute)."""
        hidden = self.acts.take(k)
        if self._first[id(mb)]:
            return hidden, None
        gathered = self._gathered.pop((layer, id(mb)), None)
        return hidden, gathered if gathered is not None else self._contexts(layer, mb)

    def _contexts(self, layer: int, mb: MicroBatch) -> list[list]:
        """Per group and part, its context for this layer as its source says (_context_source)."""
        return [[source if source is None or source is IN_POOL else source[0](layer, *source[1])
                 for source in step.sources] for step in self._groups[id(mb)]]

    def _context_source(self, part):
        """Where the part's context comes from in every layer of the pass: its route where nothing is
        gathered (None: its own new rows; IN_POOL), else (the pool's gather, its arguments after the
        layer)."""
        device = self._routes[id(part)]
        if device is None or device is IN_POOL:
            return device
        pool, slots = self.kv_pools[part.tier], self._slots.get(id(part))
        if pool.compression is None and slots is not None:  # its K/V pairs at the slots uploaded for the pass
            return pool.gather_pairs, (slots, part.kv_slots.shape, device)
        return pool.gather_part, (part, device, slots)  # a compressed pool: slots is its plan

    def _context_routes(self, batches: list[MicroBatch]) -> dict:
        """id(part) -> how its context reaches attention, the same in every layer of the pass (decided
        once, not per layer-step; the pass's index uploads and V read-back follow it): None (its own
        new rows), IN_POOL (the pool attends it), or the device its context is gathered onto."""
        routes = {}
        for mb in batches:
            for group in mb.groups:
                for part in group.parts:
                    device = self.attention_device(part.tier, group)
                    if self._reads_new_rows(part):
                        routes[id(part)] = None
                    elif self.kv_pools[part.tier].attends_in_pool(group, part, device):
                        routes[id(part)] = IN_POOL
                    else:
                        routes[id(part)] = device
        return routes

    def _pool_slots(self, batches: list[MicroBatch]) -> dict:
        """id(write or part) -> what indexes its pool: a plain pool's slots on its device, a compressed
        pool's plan of a gather or of a decode read in the pool (offload/kv_plans.py). The same for
        every layer: on a GPU one upload per pass instead of one per layer and step."""
        slots = {}
        for mb in batches:
            for write in mb.kv_writes:
                pool = self.kv_pools[write.tier]
                slots[id(write)] = (to_device(write.slots, pool.device) if pool.compression is None
                                    else pool.plan_store(write.slots, write.residual_ids))
            for group in mb.groups:
                for part in group.parts:
                    pool, route = self.kv_pools[part.tier], self._routes[id(part)]
                    if route is None:
                        continue
                    if pool.compression is None:
                        slots[id(part)] = to_device(part.kv_slots.reshape(-1), pool.device)  # [B * L]
                    elif self._read_by_triton(part):
                        slots[id(part)] = pool.plan_decode(group, part, self.model.config.windows)
                    elif route is not IN_POOL:
                        slots[id(part)] = pool.plan_gather(part, route)
        return slots

    def _reads_new_rows(self, part) -> bool:
        """The part's whole context is this pass's own new K/V: the pool attends those rows
        directly, no gather from the pool, no patching."""
        return part.new_rows is not None

    def _compute(self, layer: int, w, mb: MicroBatch, hidden: torch.Tensor, contexts):
        """Layer `layer` on the micro-batch; contexts None: it writes first (writes_first), so its new
        K/V go into the pool here and the contexts are gathered from the pool after them. How each
        group and part is attended was decided for the pass (_group_steps)."""
        base, w = w, self._adapted(layer, w, mb.lora_rows)
        q, k, v = self.model.qkv(w, hidden, mb.positions, layer)  # [T, heads|kv_heads, head_dim]
        window = self.model.window_of(layer)
        if self._v_first[id(mb)]:  # V's codes straight into the pool, where attention reads them
            write = mb.kv_writes[0]
            self.kv_pools[write.tier].store_v_first(layer, v, self._slots[id(write)])
            v_codes, v_seen, read_back = None, v, False
        else:  # V's codes once: for attention and the store
            v_codes, v_seen, read_back = self._v_read_back(v, self._reads_back[id(mb)])
        written = contexts is None
        if written:
            self._store_kv(layer, mb, k, v, v_codes)
            contexts = self._contexts(layer, mb)
        steps = self._groups[id(mb)]
        whole = steps[0].rows is _EVERY_ROW  # one group of every row, in order: its output is the layer's
        attn = None if whole else torch.empty_like(q)
        for step, group_contexts in zip(steps, contexts):
            q_group = (q if whole else q[step.rows]).view(step.shape)  # [B, n, heads, d]
            if step.bias is not None:  # one part, gathered beside its new rows: one fused call, the pass's mask
                keys, values = group_contexts[0]
                merged = self.model.attend_decode(q_group, keys, values, step.bias[window])
            else:
                q_on = {q_group.device: q_group}  # q where each part is attended: one copy per device
                outs = [out for kind, part, context in zip(step.kinds, step.group.parts, group_contexts)
                        for out in self._attend_part(layer, window, kind, q_on, step.group, part, context, k,
                                                     v_seen, step.rows, written, read_back, v_codes)]
                # with attention sinks every output comes with its lse, merged with the layer's sinks
                merged = outs[0][0] if len(outs) == 1 and not self.sinks else self.model.merge_attention(outs, w)
            if whole:
                attn = merged.reshape(mb.num_tokens, -1)  # [T, heads * d]: a view where the layout allows
            else:
                attn[step.rows] = merged.flatten(0, 1)
        attn = attn if whole else attn.flatten(1)  # [T, heads * d]
        return self._post_attention(layer, base, w, mb, hidden, attn), k, v, v_codes  # hidden: [T, hidden]

    def _adapted(self, layer: int, w, lora_rows: dict):
        """The layer's weights with the updates of the LoRA adapters whose rows are in `lora_rows`."""
        if not lora_rows:
            return w
        return with_lora(w, {adapter: self.lora_factors[adapter][layer] for adapter in lora_rows}, lora_rows)

    def _group_steps(self, mb: MicroBatch) -> tuple["GroupStep", ...]:
        """Per group of the micro-batch, what its attention does in every layer of the pass: its rows,
        and per part the route _attend_part takes (_attend_kind); where the group is one decode part
        gathered beside its new rows (written first) with the pass's mask, one fused call (bias)."""
        whole, written = _one_group_of_every_row(mb), self._first[id(mb)]
        steps = []
        for group in mb.groups:
            rows = _EVERY_ROW if whole else _rows(group.row_start, group.num_seqs * group.num_queries, group.token_rows)
            kinds = tuple(self._attend_kind(group, part, written) for part in group.parts)
            bias = self._biases[id(group.parts[0])] if kinds == (FUSED,) else None
            sources = tuple(self._context_source(part) for part in group.parts)
            shape = (group.num_seqs, group.num_queries, self.model.config.num_heads, self.model.config.head_dim)
            steps.append(GroupStep(group, rows, shape, kinds, bias, sources))
        return tuple(steps)

    def _write_steps(self, mb: MicroBatch) -> tuple["WriteStep", ...]:
        """Per KV write of the micro-batch, its store in every layer of the pass (_store_kv)."""
        steps = []
        for write in mb.kv_writes:
            count = write.rows.shape[0]
            every_row = write.row_start == 0 and count == mb.num_tokens  # in order: no slicing
            rows = None if every_row else _rows(write.row_start, count, write.rows)
            pool, index = self.kv_pools[write.tier], self._slots.get(id(write))
            steps.append(WriteStep(write, pool, rows, write.slots if index is None and pool.compression is None
                                   else index, self._v_first.get(id(mb), False)))
        return tuple(steps)

    def _attend_kind(self, group: AttentionGroup, part, written: bool) -> str:
        """How the part is attended in every layer of the pass (after _context_routes and _decode_biases)."""
        route, pool = self._routes[id(part)], self.kv_pools[part.tier]
        if route is IN_POOL:
            return IN_POOL_TRITON if pool.attends_with_triton() else IN_POOL
        if written and route is not None and id(part) in self._biases:
            return FUSED  # a decode part alone on the compute device, its new rows in the gathered context
        return CAUSAL if self.one_causal_call(group, part) else GENERAL

    def _v_read_back(self, v: torch.Tensor, read_back: bool):
        """(codes, values, read back?) of the new V rows where the pools are compressed (one format for
        all: the first compressed pool makes them, its non-finite flag checked with the others' as the
        pass ends): the values as they read back where some part of the micro-batch reads them
        (read_back), else v as it is; where no pool is compressed (None, v, False)."""
        if self._v_pool is None:
            return None, v, False
        codes, back = self._v_pool.quantize_v(v, read_back)
        return codes, (v if back is None else back), back is not None

    def _writes_v_first(self, mb: MicroBatch) -> bool:
        """Whether the micro-batch's new V rows are quantized straight into their pool before attention
        (KVPool.store_v_first; the store after attention writes K only): one write of every row, in
        order, into a pool the Triton kernels serve on the compute device, every part of the
        micro-batch read by them (a decode micro-batch over a gpu-tier compressed pool)."""
        if len(mb.kv_writes) != 1 or self._reads_back[id(mb)]:
            return False
        write = mb.kv_writes[0]
        pool = self.kv_pools[write.tier]
        return (pool.attends_with_triton() and pool.device.type == self.device.type and write.row_start == 0
                and write.rows.shape[0] == mb.num_tokens)

    def _reads_v_back(self, mb: MicroBatch) -> bool:
        """Whether some part of the micro-batch reads its new V rows as they read back from a compressed
        pool: every part but a decode's read by the Triton kernel, which reads their codes."""
        return not all(self._read_by_triton(part) for g in mb.groups for part in g.parts)

    def _read_by_triton(self, part) -> bool:
        """The part's decode rows are attended in its pool by the Triton kernel (KVPool.attend_decode_codes)."""
        return self._routes[id(part)] is IN_POOL and self.kv_pools[part.tier].attends_with_triton()

    def _post_attention(self, layer: int, base, w, mb: MicroBatch, hidden: torch.Tensor,
                        attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention, in slices of POST_ATTENTION_ROWS rows where the micro-batch has
        more: every op there is row-wise, so the slices give the whole call's rows, and a long prompt
        pass holds one slice's MLP intermediates ([rows, ffn], the largest of a layer) instead of all
        (FlexGen's batch-72 x 512 prefill of OPT-6.7B: 1.2 GB of fc1 output at once otherwise).
        `w`: the layer's weights with the micro-batch's LoRA updates; a slice takes those of its own
        rows, around `base` (the weights without them)."""
        rows = hidden.shape[0]
        if rows <= POST_ATTENTION_ROWS:
            return self.model.post_attention(w, hidden, attn)
        out = torch.empty_like(hidden)  # [T, hidden]
        for start in range(0, rows, POST_ATTENTION_ROWS):
            stop = start + POST_ATTENTION_ROWS
            adapted = self._adapted(layer, base, _rows_within(mb.lora_rows, start, stop)) if mb.lora_rows else w
            out[start:stop] = self.model.post_attention(adapted, hidden[start:stop], attn[start:stop])
        return out

    def _attend_part(self, layer: int, window: int | None, kind: str, q_on: dict, group: AttentionGroup, part,
                     context, k, v, rows, written: bool, v_read_back: bool = False, v_codes=None):
        """(out, lse) pairs of the group's queries against one part's keys, on the compute device (lse None
        where the part is the group's only one: nothing to merge), within the layer's sliding `window`, the
        way `kind` (_attend_kind) says. k, v: the micro-batch's new K/V, the group's at `rows` (v_read_back:
        V as it reads back from a compressed pool); written: they are in the pool already, so a gathered
        context holds them; v_codes: the micro-batch's V codes (compressed pools)."""
        pool = self.kv_pools[part.tier]
        if kind is IN_POOL_TRITON:  # on the pool's device: the compute device
            new = None if written else (k, v_codes)  # every row of the micro-batch: the plan names each's
            q = self._q_on(q_on, self.attention_device(part.tier, group))  # the compute device's q, as it is
            return [pool.attend_decode_codes(layer, q, self._slots[id(part)], new, self.model.scale, window)]
        if kind is IN_POOL:  # new rows None where they are in the pool already
            q = self._q_on(q_on, CPU)
            new_k, new_v = (None, None) if written else (k[rows], v[rows])
            out, lse = pool.attend_decode(layer, group, part, q, new_k, new_v, self.model.scale, window, v_read_back)
            return [(to_device(out, self.device), to_device(lse, self.device))]
        if kind is CAUSAL:
            triples = pool.parts_to_attend(group, part, None, k[rows], v[rows], v_read_back)
            q = self._q_on(q_on, self.device)
            if len(triples) == 1:  # a plain pool: views of k, v
                return [(self.model.attend_own_rows(q, triples[0][0], triples[0][1]), None)]
            (before, values, _), (same, _, _) = triples  # keys as stored, and exact (parts_to_attend)
            return [(self.model.attend_own_rows_by_block(q, before, same, values, pool.block_size), None)]
        triples = ([(*context, None)] if written and context is not None
                   else pool.parts_to_attend(group, part, context, k[rows], v[rows], v_read_back))
        alone = len(triples) == 1 and len(group.parts) == 1
        return [self._attend(q_on, group, part, keys, values, key_rule, window, alone)
                for keys, values, key_rule in triples]

    @staticmethod
    def _q_on(q_on: dict, dev: torch.device) -> torch.Tensor:
        """The group's q on `dev`, copied there once per group (q_on caches it)."""
        if dev not in q_on:
            q = next(iter(q_on.values()))  # the compute device's q
            q_on[dev] = to_host(q) if dev.type == "cpu" else q.to(dev, non_blocking=True)  # no stream sync
        return q_on[dev]

    def _attend(self, q_on: dict, group: AttentionGroup, part, keys, values, key_rule, window: int | None,
                alone: bool = False):
        """Attention where the keys are (the CPU for delegated decodes); out [B, n, heads, d] and
        lse [B, n, heads] come back to the compute device for merging. On the CPU the positions
        and lengths are the batch builder's host tensors: only q crosses, once per group. alone:
        nothing is merged with this (lse not wanted): decode rows on the compute device then take
        one fused attention call with the pass's mask (no lse: None)."""
        dev = keys.device
        q = self._q_on(q_on, dev)
        if (alone and not self.sinks and group.is_decode and key_rule is None
                and dev.type == self.device.type):  # "cuda" is "cuda:0"
            bias = self._decode_bias(group, part, keys.shape[1], q.dtype, window)
            return self.model.attend_decode(q, keys, values, bias), None
        meta_group, meta_part = (host_of(group), host_of(part)) if dev.type == "cpu" else (group, part)
        out, lse = self.model.attend(q, keys, values, meta_group.q_pos, meta_part.kv_len, window,
                                    meta_part.kv_start, key_rule)
        return to_device(out, self.device), to_device(lse, self.device)

    def _decode_biases(self, batches: list[MicroBatch]) -> dict[int, dict]:
        """id(part) -> {sliding window: its attention mask}, for each decode group of one part attended
        on the compute device (_attend's fused call) and not read in its pool (the pass's routes,
        _context_routes): the same for every layer of a window, so built once per pass and window. None
        with attention sinks (that call gives no lse to merge them with)."""
        if self.sinks:
            return {}
        return {id(part): {window: self._new_bias(g, part, part.kv_slots.shape[1], self.dtype, window)
                           for window in self.model.config.windows}
                for mb in batches for g in mb.groups if g.is_decode and len(g.parts) == 1
                for part in g.parts if self.attention_device(part.tier, g).type == self.device.type
                and self._routes[id(part)] is not IN_POOL}

    def _decode_bias(self, group: AttentionGroup, part, length: int, dtype: torch.dtype,
                     window: int | None) -> torch.Tensor:
        """The part's mask from _decode_biases (built here for a part it did not foresee)."""
        masks = self._biases.setdefault(id(part), {})
        if window not in masks:
            masks[window] = self._new_bias(group, part, length, dtype, window)
        return masks[window]

    def _new_bias(self, group: AttentionGroup, part, length: int, dtype: torch.dtype,
                  window: int | None) -> torch.Tensor:
        return self.model.decode_bias(group.q_pos, part.kv_len, length, dtype, window, part.kv_start)

    def _store(self, layer: int, mb: MicroBatch, k: int, hidden, new_k, new_v, v_codes=None) -> None:
        if not self._first[id(mb)]:  # else _compute wrote them
            self._store_kv(layer, mb, new_k, new_v, v_codes)
        self.acts.put(k, hidden)

    def _store_kv(self, layer: int, mb: MicroBatch, new_k, new_v, v_codes=None) -> None:
        """v_codes: _v_read_back's codes of new_v (compressed pools), else None."""
        for step in self._writes[id(mb)]:
            k, v, codes, rows = new_k, new_v, v_codes, step.rows
            if rows is not None:
                k, v = new_k[rows], new_v[rows]
                if v_codes is not None:  # the codes' rows alike (QTensor: a view of a slice)
                    codes = v_codes.rows(rows.start, rows.stop) if isinstance(rows, slice) else v_codes.take_rows(rows)
            if step.pool.compression is None:
                step.pool.store(layer, step.index, k, v)
            else:
                write = step.write
                step.pool.store(layer, write.slots, k, v, write.residual_ids, v_codes=codes, plan=step.index,
                                v_stored=step.v_stored)


@dataclass(frozen=True)
class PassOrder:
    """Per micro-batch of a pass, whether its I/O runs on the thread; the compute stream (CUDA) whose
    use of loaded tensors is recorded, else None; whether layer j + 1's first contexts are gathered
    during layer j (PassExecutor.gathers_ahead)."""

    threaded: tuple[bool, ...]
    compute_stream: "torch.cuda.Stream | None"
    gathers_ahead: bool


@dataclass(frozen=True)
class GroupStep:
    """One attention group of a micro-batch as attended in every layer of a pass (_group_steps): its
    rows of the micro-batch (_EVERY_ROW: it is every row, in order; a slice where consecutive), its
    q's shape (B, n, heads, d), per part how it is attended (_attend_kind); bias: the pass's masks
    {sliding window: [B, 1, 1, L]} where the group is one FUSED part, else None."""

    group: AttentionGroup
    rows: "slice | torch.Tensor"
    shape: tuple[int, int, int, int]
    kinds: tuple[str, ...]
    bias: "dict | None"
    sources: tuple  # per part, where its context comes from (PassExecutor._context_source)


@dataclass(frozen=True)
class WriteStep:
    """One KV write of a micro-batch as stored in every layer of a pass (_write_steps): its rows of the
    micro-batch (None: every row, in order), its pool, what indexes it there (plain: slots on the
    pool's device; compressed: the store plan) and whether store_v_first put V in already."""

    write: KVWrite
    pool: KVPool
    rows: "slice | torch.Tensor | None"
    index: object
    v_stored: bool


class _Done:
    """A finished step run inline: what a Future's result() gives, without a Future's lock and
    condition (an all-resident pass makes two per layer and micro-batch)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


_EVERY_ROW = slice(None)  # a micro-batch's one group that is every row (_one_group_of_every_row)


def _causal_calls_read_in_place(device: torch.device, dtype: torch.dtype, config, masked: bool) -> bool:
    """Where scaled_dot_product_attention's causal (or masked) call runs a fused kernel (K and V read
    in place, no score buffer): the CPU's flash kernel in any dtype; CUDA's in half precision, with
    grouped-query heads only in the flash kernel (sm80 on), which takes no mask; elsewhere it would
    fall back to the math route, which builds the scores. Never for a model with attention sinks:
    their merge needs every part's log-sum-exp, which these calls do not give."""
    if config.attention_sinks:
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if config.num_heads == config.num_kv_heads:
        return True
    return not masked and torch.cuda.get_device_capability(device) >= (8, 0)


def _one_group_of_every_row(mb: MicroBatch) -> bool:
    """The micro-batch has one attention group and it is every row, in order: its attention output
    is the layer's, and its q needs no slicing."""
    group = mb.groups[0] if len(mb.groups) == 1 else None
    return group is not None and group.row_start == 0 and group.num_seqs * group.num_queries == mb.num_tokens


def _rows_within(lora_rows: dict, start: int, stop: int) -> dict:
    """Each adapter's rows among rows [start, stop), counted from start (adapters with none left out).
    A boolean mask (a host sync on a GPU): only prompt passes of over POST_ATTENTION_ROWS rows slice."""
    within = {}
    for adapter, rows in lora_rows.items():
        if rows is None:
            within[adapter] = None
            continue
        inside = rows[(rows >= start) & (rows < stop)] - start
        if inside.numel():
            within[adapter] = None if inside.numel() == stop - start else inside
    return within


def _rows(start: int | None, count: int, rows: torch.Tensor):
    """The micro-batch rows start..start+count-1 as a slice (a view: no gather, and the fused qkv
    output's K/V stay side by side), or `rows` where they are not consecutive."""
    return slice(start, start + count) if start is not None else rows
