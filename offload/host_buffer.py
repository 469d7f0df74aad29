"""Host buffers the tiers allocate: 4096-aligned (for O_DIRECT), pinned, or mapped from a file."""
from __future__ import annotations

import os
import tempfile
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
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.from_numpy(aligned_bytes(nbytes)).view(dtype).reshape(tuple(shape))


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
        return torch.zeros(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
    return mapped_zeros(shape, dtype, folder)
