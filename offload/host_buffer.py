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
