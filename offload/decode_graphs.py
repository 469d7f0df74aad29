"""Decode passes replayed from CUDA graphs (vLLM, SGLang and gpt-fast capture theirs the same way).

A decode pass of a resident micro-batch (weights, KV cache and hidden states all on the compute
device, the KV plain) issues the same kernels on the same addresses every step once its shapes are
fixed, so the host can launch it as one graph instead of a dozen kernels per layer:

- the batch is padded to a bucket of 1, 2, 4, 8, ... sequences; a padding row reads and writes one
  scratch slot of the gpu-tier pool that no sequence owns (the engine keeps a block for it);
- each row's context is padded to a bucket of keys (a power of two, as the batch builder groups
  decodes); its slots and length are data in a device buffer, not part of any shape;
- every input (token ids, positions, context slots, lengths, write slots) lives in ONE int64 device
  buffer, refilled by one copy from a pinned host buffer per step.

What is captured is the executor's own pass (PassExecutor.run on a micro-batch of views into that
buffer): the model's loop exists once. A bucket is captured the first time a pass of its shape runs,
after one eager run on a side stream (library handles, workspaces, lazily built tables); every
bucket's graph allocates from one memory pool. On the CPU nothing is captured: the same static
micro-batch runs eagerly, so tests check padding and buckets against the eager engine anywhere.
"""
from __future__ import annotations

import time

import torch

from offload.micro_batch import AttentionGroup, KVPart, KVWrite, MicroBatch

MIN_KEYS = 16  # the smallest context bucket


def bucket_of(batch: int, keys: int) -> tuple[int, int]:
    """(padded batch, padded keys): the next powers of two (keys at least MIN_KEYS)."""
    return 1 << (batch - 1).bit_length(), max(MIN_KEYS, 1 << (keys - 1).bit_length())


class _Bucket:
    """The static inputs of one (batch, keys) shape, its graph and its output."""

    def __init__(self, batch: int, keys: int, device: torch.device):
        self.batch, self.keys = batch, keys
        sizes = {"token_ids": batch, "positions": batch, "kv_slots": batch * keys, "kv_len": batch, "write_slots": batch}
        self._offsets, start = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (start, start + size)
            start += size
        cuda = device.type == "cuda"
        self.host = torch.zeros(start, dtype=torch.long, pin_memory=cuda)
        self.inputs = torch.zeros(start, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)  # every row: its own group row, write row and logit row
        self.zeros = torch.zeros(batch, dtype=torch.long, device=device)
        self.no_rows = torch.zeros(0, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output [batch, vocab]
        self._uploaded: torch.cuda.Event | None = None  # CUDA: recorded after the last copy up from `host`

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        start, stop = self._offsets[name]
        return buffer[start:stop]

    def fill(self, token_ids: list[int], positions: list[int], context_slots: torch.Tensor, scratch_slot: int) -> None:
        """This step's rows into the host buffer, padding rows onto the scratch slot, then one copy up.
        context_slots: [rows, keys] gpu-pool slots of positions 0..keys-1 of each row (int64, host)."""
        rows = len(token_ids)
        host = self.host
        if self._uploaded is not None:
            # the last step's copy up may still be reading `host` (non-blocking, from pinned memory):
            # nothing else orders it before this rewrite (a step whose rows all finish without
            # sampling makes no host sync between two fills)
            self._uploaded.synchronize()
        self.view(host, "token_ids").zero_()[:rows] = torch.tensor(token_ids)
        position = self.view(host, "positions").zero_()
        position[:rows] = torch.tensor(positions)
        slots = self.view(host, "kv_slots").view(self.batch, self.keys).fill_(scratch_slot)
        slots[:rows] = context_slots
        self.view(host, "kv_len").copy_(position + 1)  # a decode sees every key up to its own
        write = self.view(host, "write_slots").fill_(scratch_slot)
        write[:rows] = slots[:rows].gather(1, position[:rows, None]).squeeze(1)
        self.inputs.copy_(host, non_blocking=True)
        if self.inputs.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.inputs.device))

    def micro_batch(self) -> MicroBatch:
        """A micro-batch of fresh views into the device buffer (fresh objects: a table cached by a
        tensor's identity, such as LLaMA's RoPE, is rebuilt inside the captured pass)."""
        buf = self.inputs
        positions = self.view(buf, "positions")
        part = KVPart("gpu", self.view(buf, "kv_slots").view(self.batch, self.keys), kv_start=self.zeros,
                      kv_len=self.view(buf, "kv_len"), patch_src=self.no_rows, patch_seq=self.no_rows,
                      patch_pos=self.no_rows, residual_ids=self.zeros, complete_len=self.zeros)
        group = AttentionGroup(token_rows=self.rows, num_queries=1, q_pos=positions.view(self.batch, 1), parts=[part],
                               row_start=0)
        write = KVWrite("gpu", rows=self.rows, slots=self.view(buf, "write_slots"), residual_ids=self.zeros, row_start=0)
        return MicroBatch(self.view(buf, "token_ids"), positions, [group], [write], logit_rows=self.rows)


class DecodeGraphs:
    """One captured decode pass per (batch, keys) bucket over a PassExecutor whose gpu-tier pool and
    weights stay where they are while the graphs live (drop them with `clear` when a pool is
    replaced). capture: record CUDA graphs (default: on a CUDA device); without, the static
    micro-batch runs eagerly."""

    def __init__(self, executor, device: torch.device, capture: bool | None = None):
        self.executor, self.device = executor, torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._stream: torch.cuda.Stream | None = None  # where buckets are warmed up and captured
        self.capture_seconds = 0.0  # host time spent capturing, all buckets

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._buckets

    def clear(self) -> None:
        """Forget every captured graph and its buffers (their memory pool goes with them)."""
        self._buckets.clear()
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    def run(self, token_ids: list[int], positions: list[int], context_slots: torch.Tensor,
            scratch_slot: int) -> torch.Tensor:
        """Logits [rows, vocab] (fp32, compute device; valid until the next run) of one decode pass.
        context_slots: [rows, keys] host int64, each row the gpu-pool slots of its positions
        0..keys-1 (slots past its position are never read); keys must be a bucket's."""
        key = bucket_of(len(token_ids), context_slots.shape[1])
        if key[1] != context_slots.shape[1]:
            raise ValueError(f"DecodeGraphs.run: {context_slots.shape[1]} keys is not a bucket (use bucket_of)")
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(*key, self.device)
        bucket.fill(token_ids, positions, context_slots, scratch_slot)
        if not self.capture:
            return self.executor.run([bucket.micro_batch()])[0][:len(token_ids)]
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.logits[:len(token_ids)]

    def _capture(self, bucket: _Bucket) -> None:
        """One eager run on the side stream (library handles and workspaces for it; it writes the same
        K/V the replay writes), then the capture on the same stream. Not `torch.cuda.graph(...)`: its
        entry collects Python garbage and empties the allocator's cache, costing each capture more
        than the pass itself."""
        started = time.perf_counter()
        compute = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(compute)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            self.executor.run([bucket.micro_batch()])
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                logits = self.executor.run([bucket.micro_batch()])[0]
            finally:
                graph.capture_end()
        compute.wait_stream(self._stream)
        bucket.graph, bucket.logits = graph, logits
        self.capture_seconds += time.perf_counter() - started
