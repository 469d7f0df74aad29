"""Where hidden states wait between layers: split by rows over tiers per `act_*` fractions.

Between layer j and j+1 of a micro-batch, its hidden states [T, hidden] are parked: the first
`act_gpu` of the rows stay on the compute device, the next `act_cpu` go to host memory, the rest to
a memory-mapped file in the offload folder. They are brought back before the next layer (the
executor prefetches micro-batch k+1 while k computes).

On CUDA, `put` and `take` only enqueue copies on the caller's current stream (pinned host buffers,
one per micro-batch, reused pass after pass): the caller orders them (the executor's I/O stream
and events, offload/streams.py); nothing here waits for a stream.
"""
from __future__ import annotations

import torch

from offload.host_buffer import pinned_empty, tier_zeros
from offload.streams import to_host


class ActivationStore:
    def __init__(self, fractions: tuple[float, float, float], device: torch.device,
                 pin_memory: bool = False, folder: str | None = None):
        self.fractions, self.device = fractions, torch.device(device)
        self.pin, self.folder = pin_memory, folder
        self._parked: dict[int, list[tuple[str, torch.Tensor, int]]] = {}
        self._spill: dict[int, torch.Tensor] = {}  # key -> reusable disk buffer (bytes)
        self._pinned: dict[int, torch.Tensor] = {}  # key -> reusable pinned host buffer (bytes, CUDA)

    def close(self) -> None:
        """Drop parked states and the disk spill buffers (their mapped files are already unlinked)."""
        self._parked.clear()
        self._spill.clear()
        self._pinned.clear()

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held for parked rows (CUDA)."""
        return sum(t.numel() for t in self._pinned.values())

    @property
    def all_on_device(self) -> bool:
        return self.fractions[0] >= 1.0

    def _cuts(self, rows: int) -> tuple[int, int]:
        gpu = round(self.fractions[0] * rows)
        cpu = max(gpu, round((self.fractions[0] + self.fractions[1]) * rows))
        return gpu, cpu

    def put(self, key: int, hidden: torch.Tensor) -> None:
        if self.all_on_device:
            self._parked[key] = [("gpu", hidden, hidden.shape[0])]
            return
        gpu, cpu = self._cuts(hidden.shape[0])
        parked = []
        if gpu:
            # A slice of fewer rows is cloned: a view would keep the whole micro-batch alive.
            kept = hidden if gpu == hidden.shape[0] else hidden[:gpu].clone()
            parked.append(("gpu", kept, gpu))
        if cpu > gpu:
            host = self._host_rows(key, cpu - gpu, hidden)
            parked.append(("cpu", host.copy_(hidden[gpu:cpu], non_blocking=True), cpu - gpu))
        if hidden.shape[0] > cpu:
            rows = hidden.shape[0] - cpu
            nbytes = rows * hidden.shape[1] * hidden.dtype.itemsize
            spill = self._spill.get(key)
            if spill is None or spill.numel() < nbytes:
                spill = self._spill[key] = tier_zeros((nbytes,), torch.uint8, torch.device("cpu"), folder=self.folder)
            disk = spill[:nbytes].view(hidden.dtype).view(rows, hidden.shape[1])
            parked.append(("disk", disk.copy_(to_host(hidden[cpu:])), rows))  # an event wait, no stream sync
        self._parked[key] = parked

    def _host_rows(self, key: int, rows: int, hidden: torch.Tensor) -> torch.Tensor:
        """Host memory for `rows` rows of `hidden`: on CUDA a pinned buffer per key, reused (the
        next put of a key is ordered after the take that read it, on the caller's streams); on the
        CPU a fresh tensor, because take hands it to compute as it is."""
        shape = (rows, hidden.shape[1])
        if not self.pin:
            return torch.empty(shape, dtype=hidden.dtype)
        nbytes = rows * hidden.shape[1] * hidden.dtype.itemsize
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < nbytes:
            self._pinned.pop(key, None)
            buf = self._pinned[key] = pinned_empty((nbytes,), torch.uint8)
        return buf[:nbytes].view(hidden.dtype).view(shape)

    def take(self, key: int) -> torch.Tensor:
        parked = self._parked.pop(key)
        if len(parked) == 1 and parked[0][0] == "gpu":  # kept on the compute device: as it is
            return parked[0][1]
        parts = [t if tier == "gpu" else t.to(self.device, non_blocking=True) for tier, t, _ in parked]
        if len(parts) == 1:
            return parts[0]
        if self.device.type == "cuda":
            # The kept rows may come from another stream than this one (a pass's embeddings are
            # parked on the compute stream, then taken on the I/O stream while the compute stream
            # runs the previous micro-batch): they are freed as soon as the concatenation is
            # queued, so the allocator must not hand their memory out before this stream has read
            # it (it did, to the other stream's next tensor: one token in three changed on an H100
            # with the activations split and two micro-batches).
            stream = torch.cuda.current_stream(self.device)
            for tier, t, _ in parked:
                if tier == "gpu":
                    t.record_stream(stream)
        return torch.cat(parts)
