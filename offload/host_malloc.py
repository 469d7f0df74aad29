"""Host allocator policy for passes computed on the CPU: freed memory is kept for reuse.

A pass allocates and frees the same megabyte-sized activations layer after layer; with glibc's
defaults they come back as fresh mappings whose pages fault in on first touch (numbers: docs/DESIGN.md,
"The pass loop"). The fix is glibc's own knobs (mallopt), set once, the first time a pass runs on
the CPU:
- M_MMAP_THRESHOLD = 32 MiB, glibc's maximum: blocks below it come from the heap, where freed
  blocks are reused (larger ones, e.g. the KV pool, stay separate mappings);
- M_TRIM_THRESHOLD = 2 GiB - 1: the heap top is not handed back between layers and passes.
The cost: resident memory stays at the pass's peak, which the engine's working-set budget already
counts. It is process-wide (one malloc policy per process), so only an engine that computes on the
CPU applies it, FLEXSARATHI_HOST_MALLOC=default turns it off, and elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
ENV = "FLEXSARATHI_HOST_MALLOC"

_lock = threading.Lock()
_state: str | None = None  # None: not tried yet; else what keep_freed_host_memory() returned


def _glibc():
    """The C library if it is glibc (has mallopt and gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def keep_freed_host_memory() -> str:
    """Applies the policy above once per process; returns what happened: "applied", "disabled"
    (FLEXSARATHI_HOST_MALLOC=default), "unsupported" (not glibc) or "refused" (mallopt failed)."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        setting = os.environ.get(ENV, "reuse").strip().lower()
        if setting not in ("reuse", "default"):
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 'reuse' (keep freed host memory "
                             "for reuse, the default) or 'default' (leave malloc as it is)")
        if setting == "default":
            _state = "disabled"
            return _state
        libc = _glibc()
        if libc is None:
            _state = "unsupported"
            return _state
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
        _state = "applied" if ok else "refused"
        return _state


def host_malloc_state() -> str:
    """What keep_freed_host_memory() did in this process ("untouched" before it ran)."""
    return _state or "untouched"


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim(0), every arena): what a
    load frees between layers. Why: tensors below glibc's dynamic mmap threshold (it rises to the
    largest block freed so far, up to 32 MiB: a layer's matrices) come from the heaps, where the
    blocks a layer's conversion frees sit between ones it keeps and are never given back; loading
    the llama-3-8b Q4_0 GGUF left 0.3-0.5 GB of them resident beside the 5.0 GB the engine holds.
    Returns whether it ran (False: not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
