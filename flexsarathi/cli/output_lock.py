"""One writer per result file: an exclusive OS file lock (flock) on `<output>.lock`, beside it,
where `<output>` is the file's real path (symbolic links resolved: two names of one file are one
output).

The kernel drops a flock when its holder exits in any way (kill -9 included), so a crashed job
never leaves a stale lock; a second job on the same output fails at once with one line naming
the file and the process that holds it (its pid is written in the lock file). The lock lives in
a file of its own, not the output, because resuming may replace the output (os.replace) and a
lock on a replaced file guards nothing.
"""
from __future__ import annotations

import fcntl
import os

from flexsarathi.errors import FlexSarathiError


class OutputLock:
    def __init__(self, output: str):
        self.path = os.path.realpath(output) + ".lock"
        self._fd = self._acquire(output)

    def _acquire(self, output: str) -> int:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise FlexSarathiError(f"cannot create the lock file {self.path} of --output {output}: "
                                       f"{exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise FlexSarathiError(f"--output {output} is being written by another job ({holder}, holding "
                                       f"{self.path}); wait for it to end or give another --output") from None
            # A holder that was ending unlinked the file between our open and our flock: the lock we
            # hold is on a file no one else will open. Take the one now at the path instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order: a waiter that opened the old
        file sees it is gone and retries with a fresh one). Idempotent."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = -1


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "a process that has not yet written its pid"
