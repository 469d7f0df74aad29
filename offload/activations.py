"""Where hidden states wait between layers: split by rows over tiers per `act_*` fractions.

Between layer j and j+1 of a micro-batch, its hidden states [T, hidden] are parked: the first
`act_gpu` of the rows stay on the compute device, the next `act_cpu` go to host memory, the rest to
a memory-mapped file in the offload folder. They are brought back before the next layer (the
executor prefetches micro-batch k+1 while k computes).
"""
from __future__ import annotations

import torch

from offload.host_buffer import tier_zeros


class ActivationStore:
    def __init__(self, fractions: tuple[float, float, float], device: torch.device,
                 pin_memory: bool = False, folder: str | None = None):
        self.fractions, self.device = fractions, torch.device(device)
        self.pin, self.folder = pin_memory, folder
        self._parked: dict[int, list[tuple[str, torch.Tensor, int]]] = {}
        self._spill: dict[int, torch.Tensor] = {}  # key -> reusable disk buffer (bytes)

    def close(self) -> None:
        """Drop parked states and the disk spill buffers (their mapped files are already unlinked)."""
        self._parked.clear()
        self._spill.clear()

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
            host = torch.empty((cpu - gpu, hidden.shape[1]), dtype=hidden.dtype, pin_memory=self.pin)
            parked.append(("cpu", host.copy_(hidden[gpu:cpu], non_blocking=True), cpu - gpu))
        if hidden.shape[0] > cpu:
            rows = hidden.shape[0] - cpu
            nbytes = rows * hidden.shape[1] * hidden.dtype.itemsize
            spill = self._spill.get(key)
            if spill is None or spill.numel() < nbytes:
                spill = self._spill[key] = tier_zeros((nbytes,), torch.uint8, torch.device("cpu"), folder=self.folder)
            disk = spill[:nbytes].view(hidden.dtype).view(rows, hidden.shape[1])
            parked.append(("disk", disk.copy_(hidden[cpu:]), rows))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host copies complete
        self._parked[key] = parked

    def take(self, key: int) -> torch.Tensor:
        parked = self._parked.pop(key)
        parts = [t if tier == "gpu" else t.to(self.device, non_blocking=True) for tier, t, _ in parked]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
