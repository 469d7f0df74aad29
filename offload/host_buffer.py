"""Host buffers the tiers allocate: 4096-aligned (for O_DIRECT), pinned, or mapped from a file.

Long-lived pinned buffers (cpu-tier weights and KV, staging, parked activations) are page-locked
with cudaHostRegister on 4096-aligned memory (`pinned_empty`): exactly the bytes the tracker
counts. torch's pinned allocator (`pin_memory=True`) rounds every request up to a power of two and
keeps freed blocks cached, so the same buffers took up to ~2x what was counted, and a dropped KV
pool stayed pinned; it is left to short-lived copies (offload/streams.py), which it reuses safely.
"""
from __future__ import annotations

import os
import tempfile
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

ALIGNMENT = 4096  # O_DIRECT's unit: file offsets, lengths and buffer addresses are multiples of it


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def aligned_bytes(nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes whose first one sits on a 4096-byte boundary."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, *,
                  pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a 4096-byte boundary.

    O_DIRECT reads land straight in such a tensor; any other tensor gets its bytes through a bounce
    buffer (one extra memcpy). Pinned memory comes from cudaHostAlloc, which is page-aligned already.
    """
    if pin_memory:
        return pinned_empty(shape, dtype)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.from_numpy(aligned_bytes(nbytes)).view(dtype).reshape(tuple(shape))


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised, 4096-aligned CPU tensor page-locked for CUDA (cudaHostRegister) at exactly
    its size, unregistered when its memory is freed."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)  # owns the memory; the tensor keeps it alive
    start = (-raw.ctypes.data) % ALIGNMENT
    if nbytes:
        ptr, cudart = raw.ctypes.data + start, torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(ptr, nbytes, 0))
        if code != 0:
            raise RuntimeError(f"pinning {nbytes} bytes of host memory failed (cudaHostRegister error {code})")
        weakref.finalize(raw, cudart.cudaHostUnregister, ptr)  # before numpy frees the memory
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).reshape(tuple(shape))


def mapped_zeros(shape: Sequence[int], dtype: torch.dtype, folder: str) -> torch.Tensor:
    """A zeroed CPU tensor backed by a file in `folder` mapped into memory (the disk tier).

    The file is unlinked at once, so nothing outlives the process, even after a crash.
    """
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    fd, path = tempfile.mkstemp(prefix="mapped-", suffix=".bin", dir=folder)
    try:
        os.ftruncate(fd, max(nbytes, 1))  # a mapping needs at least one byte
        flat = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    return flat[:nbytes].view(dtype).view(tuple(shape))


def tier_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device, *,
               pin_memory: bool = False, folder: str | None = None) -> torch.Tensor:
    """A zeroed tensor on `device` (pinned when asked), or mapped from a file in `folder` (disk tier)."""
    if folder is None:
        if pin_memory and torch.device(device).type == "cpu":
            return pinned_empty(shape, dtype).zero_()
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return mapped_zeros(shape, dtype, folder)


# How many holders (tensors, storage objects) share a storage; absent from a torch build, nothing is
# recycled (RecycledBuffers then allocates every time, as torch.empty would).
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class RecycledBuffers:
    """Grow-only host buffers, each handed out again once nothing uses it.

    Why: a gathered KV context is tens of MB, above glibc's largest mmap threshold
    (offload/host_malloc.py), so a fresh one is a new mapping whose pages fault in on first touch:
    34 of the 56 ms of gathering a 4-bit llama-2-7b context (32 sequences x 144 tokens, 2 cores).
    A buffer is free when no tensor shares its storage (torch's storage use count is 1: only this
    object holds it), so a context that a later micro-batch or a caller still holds is never
    overwritten, whatever the order of use. How many exist is the most ever alive at once: the
    peak the pass's working set already counts; they are freed with their owner (the KV pool)."""

    def __init__(self, min_bytes: int = 0):
        """min_bytes: smaller takes are fresh tensors (below glibc's mmap threshold malloc's own free
        lists reuse the memory, and a fresh tensor costs less host time than the search here)."""
        self.min_bytes = min_bytes
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._storages)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype`."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if _STORAGE_USE_COUNT is None or nbytes < self.min_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            free = [s for s in self._storages if _STORAGE_USE_COUNT(s._cdata) == 1]
            fits = [s for s in free if s.nbytes() >= nbytes]
            if fits:
                storage = min(fits, key=lambda s: s.nbytes())
            else:
                if free:  # replace the largest free one that is too small: the count stays bounded
                    self._storages.remove(max(free, key=lambda s: s.nbytes()))
                storage = torch.UntypedStorage(max(nbytes, 1))
                self._storages.append(storage)
            return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()
