"""Parallel chunked reads of a store's files into caller buffers, on a thread pool.

O_DIRECT where the filesystem allows it (an aligned bounce buffer for unaligned pieces), buffered
I/O otherwise."""
from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from offload.errors import OffloadError
from offload.host_buffer import ALIGNMENT, align_up, aligned_bytes


def pread_all(fd: int, dest: np.ndarray, offset: int) -> int:
    """Fill `dest` from `offset`; returns the bytes read, fewer than asked only at end of file."""
    view = memoryview(dest).cast("B")
    filled = 0
    while filled < len(view):
        count = os.preadv(fd, [view[filled:]], offset + filled)
        if count == 0:
            break
        filled += count
    return filled


class ChunkReader:
    """Reads byte ranges of the files in `folder` on `num_threads` pool threads.

    Descriptors are opened once per file and kept; the first refusal of O_DIRECT (EINVAL: tmpfs,
    some network filesystems) warns once and switches every later read to buffered I/O.
    """

    def __init__(self, folder: Path, *, direct_io: bool, num_threads: int, chunk_bytes: int):
        self.folder = folder
        self.chunk_bytes = chunk_bytes
        self.pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="disk-store")
        self._inflight: set[Future] = set()  # chunk reads submitted and not finished (see drain)
        self._inflight_lock = threading.Lock()
        self._thread_local = threading.local()
        self._fd_lock = threading.Lock()
        self._read_fds: dict[tuple[str, bool], int] = {}
        self._fallback_lock = threading.Lock()
        self._direct_io_active = direct_io
        if direct_io and not hasattr(os, "O_DIRECT"):
            self.fall_back_to_buffered("os.O_DIRECT does not exist on this platform")

    @property
    def direct_io_active(self) -> bool:
        return self._direct_io_active

    def submit(self, file: str, offset: int, dest: np.ndarray) -> Future:
        """Read `dest.nbytes` bytes at `offset` of `file` into `dest` on a pool thread."""
        future = self.pool.submit(self.read_chunk, file, offset, dest)
        with self._inflight_lock:
            self._inflight.add(future)
        future.add_done_callback(self._read_finished)
        return future

    def _read_finished(self, future: Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(future)

    def drain(self) -> None:
        """Cancel the reads not started and wait for the running ones."""
        with self._inflight_lock:
            pending = list(self._inflight)
        for future in pending:
            future.cancel()
        wait(pending)

    def read_chunk(self, file: str, offset: int, dest: np.ndarray) -> None:
        """Read `dest.nbytes` bytes at `offset` of `file` into `dest` (on the calling thread)."""
        fd, direct = self._read_fd(file)
        if direct:
            try:
                count = self._pread_direct(fd, dest, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.fall_back_to_buffered(f"an O_DIRECT read of {file} failed: {exc}")
                fd, direct = self._read_fd(file)
                count = pread_all(fd, dest, offset)
        else:
            count = pread_all(fd, dest, offset)
        if count < dest.nbytes:
            raise OffloadError(
                f"offload store {self.folder}: {file} ends {dest.nbytes - count} bytes early at "
                f"offset {offset + count}; the store is truncated and must be rewritten")

    def _pread_direct(self, fd: int, dest: np.ndarray, offset: int) -> int:
        # A shard's tensors start on aligned offsets (a range or a linked file's may not); the memory
        # address and the length may not be aligned either (arbitrary CPU tensors, the tail of a
        # tensor), and then the bytes go through an aligned bounce buffer with the range widened to
        # aligned ends (a shard is padded; past a linked file's end the read just comes back short).
        delta = offset % ALIGNMENT  # non-zero only for range reads
        if delta == 0 and dest.ctypes.data % ALIGNMENT == 0 and dest.nbytes % ALIGNMENT == 0:
            return pread_all(fd, dest, offset)
        bounce = self._bounce_buffer()[:align_up(dest.nbytes + delta)]
        count = min(pread_all(fd, bounce, offset - delta) - delta, dest.nbytes)
        dest[:count] = bounce[delta:delta + count]
        return count

    def _bounce_buffer(self) -> np.ndarray:
        # One per thread, so pool threads never share one; chunk_bytes each.
        bounce = getattr(self._thread_local, "bounce", None)
        if bounce is None:
            bounce = aligned_bytes(self.chunk_bytes)
            self._thread_local.bounce = bounce
        return bounce

    def _read_fd(self, file: str) -> tuple[int, bool]:
        """A cached file descriptor for reading `file`, and whether it bypasses the page cache."""
        with self._fd_lock:
            direct = self._direct_io_active
            fd = self._read_fds.get((file, direct))
            if fd is not None:
                return fd, direct
            path = self.folder / file
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError as exc:
                raise OffloadError(f"offload store {self.folder}: data file {file} is missing; "
                                   f"the store must be rewritten") from exc
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self.fall_back_to_buffered(f"opening {path} with O_DIRECT failed: {exc}")
                direct = False
                fd = self._read_fds.get((file, direct))
                if fd is None:
                    fd = os.open(path, os.O_RDONLY)
            self._read_fds[(file, direct)] = fd
            return fd, direct

    def fall_back_to_buffered(self, reason: str) -> None:
        with self._fallback_lock:
            warn = self._direct_io_active  # only the first refusal warns
            self._direct_io_active = False
        if warn:
            warnings.warn(f"offload store {self.folder}: direct I/O refused ({reason}); using "
                          f"buffered I/O, so disk figures include the page cache",
                          RuntimeWarning, stacklevel=3)

    def close_fds(self) -> None:
        """Close every cached descriptor (their files are about to be rewritten, or the store closes)."""
        with self._fd_lock:
            for fd in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()

    def shutdown(self) -> None:
        """Wait for reads in flight, stop the pool, close the descriptors."""
        self.pool.shutdown(wait=True)
        self.close_fds()


def when_all_done(futures: Iterable[Future], result: object, check=None) -> Future:
    """A Future that resolves to `result` once all `futures` are done, or to their first error;
    `check()`, when given, runs once all are in (on the last one's thread) and may raise instead.

    It waits for every chunk even after an error, so no pool thread is still writing into the
    caller's buffer when the caller sees the failure.
    """
    futures = list(futures)
    combined: Future = Future()
    combined.set_running_or_notify_cancel()
    if not futures:
        if check is not None:
            check()
        combined.set_result(result)
        return combined
    lock = threading.Lock()
    state = {"pending": len(futures), "error": None}

    def on_done(future: Future) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        with lock:
            state["pending"] -= 1
            if error is not None and state["error"] is None:
                state["error"] = error
            finished = state["pending"] == 0
        if finished:
            _finish(combined, state["error"], result, check)

    for future in futures:
        future.add_done_callback(on_done)
    return combined


def _finish(combined: Future, error: BaseException | None, result: object, check) -> None:
    if error is None and check is not None:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting reader
            error = exc
    if error is not None:
        combined.set_exception(error)
    else:
        combined.set_result(result)
