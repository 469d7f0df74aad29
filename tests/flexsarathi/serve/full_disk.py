"""A full disk where a real one is not at hand: files whose writes fail as the kernel fails them once
the disk fills. Used in-process (monkeypatched) and by the server process's hooks (serve_process.py)."""
from __future__ import annotations

import builtins
import errno
import io
from typing import Callable


class FullDiskRaw(io.FileIO):
    """A file on a disk that is full while `full()` is true: the first write then stores half of
    what it is given (a write the disk fills during returns short), every later one stores nothing
    and raises ENOSPC, as write(2) does. A buffered writer over it keeps what was not written."""

    def __init__(self, path: str, mode: str, full: Callable[[], bool]):
        super().__init__(path, mode)
        self.full, self.torn = full, False

    def write(self, data) -> int:
        if not self.full():
            return super().write(data)
        if not self.torn and len(data) > 1:
            self.torn = True
            return super().write(bytes(data)[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def full_disk_writer(path: str, mode: str, full: Callable[[], bool]) -> io.BufferedWriter:
    """What open(path, "wb" or "ab") returns, on a disk full while full() is true."""
    return io.BufferedWriter(FullDiskRaw(path, mode, full))


def full_disk_open(rules: dict[str, Callable[[], bool]]):
    """An open() for a module's globals (flexsarathi.serve.store.open): a binary write to a path
    ending with one of `rules`' suffixes goes to a disk full while that rule's function is true."""

    def open_on_full_disk(path, mode="r", *args, **kwargs):
        full = next((f for suffix, f in rules.items() if str(path).endswith(suffix)), None)
        if full is not None and "b" in mode and mode[0] in "wa" and not args and not kwargs:
            return full_disk_writer(path, mode, full)
        return builtins.open(path, mode, *args, **kwargs)

    return open_on_full_disk
