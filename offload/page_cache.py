"""Dropping a file's page cache, so that the next read comes from the disk. No torch here: the
benchmarks' harness (scripts/harness.py) uses it in parents that must stay small."""
from __future__ import annotations

import os
import warnings


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to evict `path` from the page cache, so the next read comes from the disk.

    Cheaper than O_DIRECT for benchmarks that want one cold read. Dirty pages cannot be dropped, so
    they are written back first.
    """
    if not hasattr(os, "posix_fadvise"):
        warnings.warn("os.posix_fadvise is not available here: the page cache is not dropped",
                      RuntimeWarning, stacklevel=2)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
