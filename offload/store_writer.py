"""Writing a disk store: aligned shards under temporary names, made durable and named at commit.

Tensors are appended to ~1 GiB shards at 4096-aligned offsets; commit fsyncs and renames the
shards, then writes the manifest; an abort (or a writer that dies) leaves nothing a reader trusts.
A tensor whose bytes a file outside the store already holds is linked to it instead of written."""
from __future__ import annotations

import errno
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from offload.errors import OffloadError
from offload.host_buffer import align_up
from offload.memory import human_bytes
from offload.store_manifest import MANIFEST_NAME, Extent, Manifest, TensorEntry, write_manifest

DEFAULT_SHARD_BYTES = 1 << 30
WRITE_PIECE_BYTES = 16 << 20        # bytes per pwrite call
TEMP_MARK = ".tmp-"  # data shards are written as .data-00000.bin.tmp-<pid>-<id>, renamed at commit
_OUT_OF_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class DiskStoreWriter:
    """Streams tensors into the data shards; `commit()` makes them visible by writing the manifest.

    Leaving a `with` block without commit(), or with an exception, aborts: the partial data is
    removed and no manifest exists, so the next run rewrites the store.
    """

    def __init__(self, folder: Path, key: str, pool: ThreadPoolExecutor,
                 on_finished: Callable[[Manifest | None], None], total_bytes: int | None,
                 shard_bytes: int):
        self._folder, self._key, self._pool, self._on_finished = folder, key, pool, on_finished
        self._manifest_path = folder / MANIFEST_NAME
        self._total_bytes = total_bytes
        self._shard_bytes = shard_bytes
        self._entries: dict[str, TensorEntry] = {}
        self._file_sizes: dict[str, int] = {}  # the shards written (an abort removes them)
        self._linked_sizes: dict[str, int] = {}  # linked files outside the store (never removed)
        self._shard_fd: int | None = None
        self._shard_name: str | None = None
        self._temp_names: dict[str, str] = {}  # shard name -> the temporary name it is written under
        self._shard_end = 0          # aligned offset where the next tensor goes in the shard
        self._bytes_written = 0
        self._done = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes now (it may be on any device); only its entry waits for commit."""
        self._check_active()
        if name in self._entries:
            raise ValueError(f"tensor {name!r} was already added to offload store {self._folder}")
        host = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
        data = byte_view(host)
        try:
            if self._shard_fd is None or (self._shard_end > 0 and
                                          self._shard_end + data.nbytes > self._shard_bytes):
                self._start_shard()
            offset = self._shard_end
            crc = self._write_and_checksum(data, offset)
        except OSError as exc:
            raise self._failure(exc, needed=self._bytes_written + data.nbytes) from exc
        self._entries[name] = TensorEntry(extents=(Extent(self._shard_name, offset, data.nbytes),),
                                          nbytes=data.nbytes, dtype=host.dtype,
                                          shape=tuple(host.shape), crc32=crc)
        self._shard_end = align_up(offset + data.nbytes)
        self._bytes_written += data.nbytes

    def link(self, name: str, tensor: torch.Tensor, extents: list[tuple[str, int, int]]) -> None:
        """Record `tensor` as the bytes of `extents` (path, offset, nbytes), one after the other, of
        files outside the store that hold exactly its bytes (a checkpoint's codes, just read from
        them): nothing is written. Its crc32, of `tensor`, is checked against those files when the
        store first reads them, like any tensor's; the files are never modified or removed."""
        host = tensor.detach().to("cpu").contiguous()
        data = byte_view(host)
        self._link(name, extents, data.nbytes, host.dtype, tuple(host.shape), lambda: self._pool.submit(zlib.crc32, data).result())

    def link_bytes(self, name: str, extents: list[tuple[str, int, int]], crc32: int) -> None:
        """`link` for bytes the caller has checksummed as it read them (a uint8 tensor of their length)."""
        nbytes = sum(int(n) for _, _, n in extents)
        self._link(name, extents, nbytes, torch.uint8, (nbytes,), lambda: crc32)

    def _link(self, name: str, extents, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], crc) -> None:
        self._check_active()
        if name in self._entries:
            raise ValueError(f"tensor {name!r} was already added to offload store {self._folder}")
        linked = tuple(Extent(os.path.abspath(path), int(offset), int(nbytes)) for path, offset, nbytes in extents)
        try:
            sizes = {e.file: os.stat(e.file).st_size for e in linked}
        except OSError as exc:
            raise ValueError(f"cannot link {name!r}: {exc}") from exc
        bad = [e for e in linked if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > sizes[e.file]]
        if not linked or bad or sum(e.nbytes for e in linked) != nbytes:
            raise ValueError(f"cannot link {name!r} ({nbytes} bytes) to {', '.join(map(str, extents)) or 'nothing'}: "
                             f"the ranges must lie inside their files and hold exactly its bytes")
        self._linked_sizes.update(sizes)
        self._entries[name] = TensorEntry(extents=linked, nbytes=nbytes, dtype=dtype, shape=shape, crc32=crc())

    def commit(self) -> None:
        """Make the data durable, then write the manifest atomically; after this readers trust it."""
        self._check_active()
        try:
            self._finish_shard()
            manifest = Manifest(self._key, dict(self._file_sizes), dict(self._entries), dict(self._linked_sizes))
            for name, temp in self._temp_names.items():  # durable data under the final names first
                os.replace(self._folder / temp, self._folder / name)
            fsync_dir(self._folder)
            write_manifest(self._manifest_path, manifest)
            fsync_dir(self._folder)
        except OSError as exc:
            raise self._failure(exc, needed=self._bytes_written) from exc
        self._done = True
        self._on_finished(manifest)

    def abort(self) -> None:
        """Drop everything written so far (idempotent)."""
        if self._done:
            return
        self._done = True
        if self._shard_fd is not None:
            os.close(self._shard_fd)
            self._shard_fd = None
        for name in [*self._file_sizes, self._shard_name, *self._temp_names.values()]:
            if name is not None:
                unlink_if_exists(self._folder / name)
        unlink_if_exists(self._manifest_path.with_suffix(".json.tmp"))
        self._on_finished(None)

    def __enter__(self) -> DiskStoreWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.abort()  # no-op after commit()

    # ---- internals ----------------------------------------------------------------------------

    def _check_active(self) -> None:
        if self._done:
            raise RuntimeError("this writer was already committed or aborted")

    def _start_shard(self) -> None:
        self._finish_shard()
        self._shard_name = f"data-{len(self._file_sizes):05d}.bin"
        temp = f".{self._shard_name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._temp_names[self._shard_name] = temp
        self._shard_fd = os.open(self._folder / temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._shard_end = 0

    def _finish_shard(self) -> None:
        if self._shard_fd is None:
            return
        fd = self._shard_fd
        # Pad the file to a 4096 multiple (an O_DIRECT read of a tensor's tail is rounded up and
        # must stay inside the file), make it durable before any manifest can name it, and drop it
        # from the page cache: it is not read again while the rest of the model is written.
        os.ftruncate(fd, self._shard_end)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        self._shard_fd = None
        self._file_sizes[self._shard_name] = self._shard_end

    def _write_and_checksum(self, data: np.ndarray, offset: int) -> int:
        # The checksum runs on a pool thread while this one writes: both release the GIL, so the
        # crc32 (about a quarter of the time of a buffered write here) is hidden.
        crc = self._pool.submit(zlib.crc32, data)
        for start in range(0, data.nbytes, WRITE_PIECE_BYTES):
            _pwrite_all(self._shard_fd, data[start:start + WRITE_PIECE_BYTES], offset + start)
        if hasattr(os, "posix_fadvise"):
            # Start writing these pages back now (Linux starts writeback of a dirty range asked to
            # be dropped), so the disk works while the next layer is read and converted, and the
            # shard's fsync waits only for the last of them.
            os.posix_fadvise(self._shard_fd, offset, data.nbytes, os.POSIX_FADV_DONTNEED)
        return crc.result()

    def _failure(self, exc: OSError, needed: int) -> OffloadError:
        """Abort, then describe the failure. Aborting first frees the partial data, so the free
        space reported is what a rerun would have."""
        self.abort()
        if self._total_bytes is not None:
            needed, lower_bound = max(needed, self._total_bytes), False
        else:
            lower_bound = True
        if exc.errno in _OUT_OF_SPACE_ERRNOS:
            return OffloadError(out_of_space_message(self._folder, needed, free_bytes(self._folder),
                                                     needed_is_lower_bound=lower_bound))
        return OffloadError(f"cannot write offload store {self._folder}: {exc.strerror or exc}; "
                            f"nothing was committed, the next run rewrites it")


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """uint8 numpy array sharing the memory of a contiguous CPU tensor.

    Through bytes because numpy has no bfloat16; reshape(-1) is a view for contiguous tensors and
    turns 0-dim tensors into 1-dim ones, which view(uint8) needs.
    """
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def out_of_space_message(path: Path, needed: int, free: int | None, *,
                         needed_is_lower_bound: bool) -> str:
    at_least = "at least " if needed_is_lower_bound else ""
    free_text = "unknown" if free is None else f"{human_bytes(free)} ({free} bytes)"
    return (f"not enough disk space for offload store {path}: needs {at_least}"
            f"{human_bytes(needed)} ({needed} bytes), free {free_text}; nothing was committed, "
            f"free some space or point the offload folder elsewhere, the next run rewrites it")


def free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def fsync_dir(path: Path) -> None:
    # Makes a rename or unlink in `path` durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unlink_if_exists(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def remove_orphaned_temp_files(folder: Path) -> None:
    """Remove temporary shards left by writers that died (kill -9, power loss); a live process's
    are kept, so two processes writing the same store never delete each other's files."""
    for path in folder.glob(f".data-*{TEMP_MARK}*"):
        pid = path.name.rpartition(TEMP_MARK)[2].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _process_alive(int(pid)):
            continue
        unlink_if_exists(path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
