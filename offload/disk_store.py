"""The disk tier: an offload folder of tensors, written once and streamed back by a thread pool.

Layout of one store, `folder/<store_dir_name(key)>/`:

    data-00000.bin, data-00001.bin, ...   tensor bytes, each tensor at a 4096-aligned offset
    manifest.json                         written LAST, atomically; the only thing a reader trusts

Why shards of about 1 GiB rather than one file per tensor or one file in all: a model has hundreds
to thousands of tensors (OPT-175B: ~1,200), so one file per tensor means as many files to stat and
file descriptors to keep; one huge file is awkward to clean up halfway and to drop from the page
cache piece by piece. Tensors are appended in the order they are added (layer by layer), so a
layer's weights sit next to each other in one or two shards, and a shard is fsynced and dropped
from the page cache as soon as it is full, which keeps the dirty memory of writing a model larger
than RAM bounded by one shard. A tensor never spans two shards.

Why 4096-aligned offsets: O_DIRECT reads need file offsets, lengths and buffer addresses aligned to
the logical block size (512 or 4096); aligning every tensor once at write time lets every read of
every tensor go through O_DIRECT without read-modify tricks. The padding costs < 4 KiB per tensor.

Integrity: every committed tensor carries the crc32 of its bytes in the manifest, and the first read
of a tensor in a process checks it (a read of the whole tensor checks the bytes as they land in the
caller's buffer; the first read of a row range reads the whole tensor once to check it). A mismatch
raises `StoreCorruptError`, which the weight placement (offload/placement.py) answers by rebuilding
the store from its source. Data shards are written under temporary names (`.data-00000.bin.tmp-
<pid>-<id>`) and renamed into place, fsynced, only at commit, just before the manifest: a process
killed while writing leaves no file under a name a reader trusts.

Small mutable entries (KV cache or activation spill) live in a scratch file of fixed-size slots:
`allocate(name, nbytes)` once, then `write_tensor` overwrites the slot in place and `read_tensor`
reads it back. The scratch file is unlinked right after it is opened, so it disappears with the
process even after a crash and never collides with another process using the same store.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
import uuid
import warnings
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from offload.memory import human_bytes

ALIGNMENT = 4096
DEFAULT_CHUNK_BYTES = 8 << 20       # per read request: large enough for full disk bandwidth,
                                    # small enough that num_threads requests are in flight per tensor
DEFAULT_SHARD_BYTES = 1 << 30
WRITE_PIECE_BYTES = 16 << 20        # bytes per pwrite call
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "flexsarathi-disk-store"
MANIFEST_VERSION = 1
SCRATCH = "<scratch>"               # file name used in locations of scratch slots
_OUT_OF_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}

# Checksum: zlib.crc32. It runs at 6.3 GB/s on one core here (xxh3_64: 31.7, blake2b: ~0.8), several
# times the O_DIRECT read rate (~1 GB/s) it rides on, it releases the GIL on large buffers, and reads
# check it once per tensor and process: xxhash would save little and add a dependency. It guards
# against truncation and bit rot, not against an adversary, so a cryptographic hash would only cost time.


class OffloadError(RuntimeError):
    """The disk tier cannot do what was asked (folder not writable, out of space, store damaged).

    A RuntimeError rather than an OSError: it describes the engine's situation (which folder, how
    many bytes needed vs free, what to do), and the OSError that caused it is chained as __cause__.
    """


class StoreCorruptError(OffloadError):
    """Bytes read from a committed store do not match the manifest's checksum (a torn or damaged
    file): the store must not be used; rebuild it from its source."""


# ---- small helpers ---------------------------------------------------------------------------


def store_dir_name(key: str) -> str:
    """Folder name of the store for `key`: readable prefix + hash of the whole key.

    The hash keeps two keys that sanitise alike ("a|b", "a/b") apart and bounds the length.
    """
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[:48] or "store"
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()
    return f"{readable}-{digest}"


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


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, *,
                  pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a 4096-byte boundary.

    O_DIRECT reads land straight in such a tensor; any other tensor gets its bytes through a bounce
    buffer (one extra memcpy). Pinned memory comes from cudaHostAlloc, which is page-aligned already.
    """
    if pin_memory:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = _numel(shape) * _element_size(dtype)
    return torch.from_numpy(_aligned_bytes(nbytes)).view(dtype).reshape(tuple(shape))


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _aligned_bytes(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


def _byte_view(tensor: torch.Tensor) -> np.ndarray:
    """uint8 numpy array sharing the memory of a contiguous CPU tensor.

    Through bytes because numpy has no bfloat16; reshape(-1) is a view for contiguous tensors and
    turns 0-dim tensors into 1-dim ones, which view(uint8) needs.
    """
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], offset + written)


def _pread_all(fd: int, dest: np.ndarray, offset: int) -> int:
    """Fill `dest` from `offset`; returns the bytes read, fewer than asked only at end of file."""
    view = memoryview(dest).cast("B")
    filled = 0
    while filled < len(view):
        count = os.preadv(fd, [view[filled:]], offset + filled)
        if count == 0:
            break
        filled += count
    return filled


def _fsync_dir(path: Path) -> None:
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


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _unlink_if_exists(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


_TEMP_MARK = ".tmp-"  # data shards are written as .data-00000.bin.tmp-<pid>-<id>, renamed at commit


def _remove_orphaned_temp_files(folder: Path) -> None:
    """Remove temporary shards left by writers that died (kill -9, power loss); a live process's
    are kept, so two processes writing the same store never delete each other's files."""
    for path in folder.glob(f".data-*{_TEMP_MARK}*"):
        pid = path.name.rpartition(_TEMP_MARK)[2].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and _process_alive(int(pid)):
            continue
        _unlink_if_exists(path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- what the manifest holds -----------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """Where one stored tensor lives and what it must read back as."""

    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: int

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes,
                "dtype": _dtype_name(self.dtype), "shape": list(self.shape), "crc32": self.crc32}

    @classmethod
    def from_json(cls, record: dict) -> TensorEntry:
        return cls(file=str(record["file"]), offset=int(record["offset"]),
                   nbytes=int(record["nbytes"]), dtype=_dtype_from_name(record["dtype"]),
                   shape=tuple(int(size) for size in record["shape"]), crc32=int(record["crc32"]))


@dataclass(frozen=True)
class _Manifest:
    key: str
    file_sizes: dict[str, int]
    entries: dict[str, TensorEntry]


@dataclass
class _Slot:
    """A fixed-size region of the scratch file; dtype/shape are those of the last write."""

    offset: int
    capacity: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Location:
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# ---- the store -------------------------------------------------------------------------------


class DiskStore:
    """Tensors for one `key` in `folder`; see the module docstring for the layout.

    Typical use:

        store = DiskStore(folder, key)
        if not store.is_complete():
            with store.begin_write(total_bytes=n) as writer:
                for name, tensor in tensors: writer.add(name, tensor)
                writer.commit()
        future = store.read_async(name, pinned_buffer)   # overlaps with compute
    """

    def __init__(self, folder: str | os.PathLike, key: str, *, direct_io: bool = False,
                 num_threads: int = 4, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 pin_memory: bool | None = None, verify_reads: bool = True):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if chunk_bytes < 2 * ALIGNMENT or chunk_bytes % ALIGNMENT:  # range reads need one spare unit
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGNMENT} of at least {2 * ALIGNMENT}, "
                             f"got {chunk_bytes}")
        self.folder = Path(folder)
        self.key = key
        self.path = self.folder / store_dir_name(key)
        self.manifest_path = self.path / MANIFEST_NAME
        self.direct_io = direct_io
        self.chunk_bytes = chunk_bytes
        # Buffers the store allocates itself are pinned when the compute device is CUDA, so the
        # host->device copy that follows a read can run asynchronously.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="disk-store")
        self._inflight: set[Future] = set()  # chunk reads submitted and not finished (see drain)
        self._inflight_lock = threading.Lock()
        self._closed = False
        self._writer: DiskStoreWriter | None = None
        self._entries: dict[str, TensorEntry] | None = None
        self._thread_local = threading.local()
        # Committed tensors whose bytes were checked against the manifest in this process.
        self.verify_reads = verify_reads
        self._verified: set[str] = set()

        self._fd_lock = threading.Lock()
        self._read_fds: dict[tuple[str, bool], int] = {}
        self._fallback_lock = threading.Lock()
        self._direct_io_active = direct_io
        if direct_io and not hasattr(os, "O_DIRECT"):
            self._fall_back_to_buffered("os.O_DIRECT does not exist on this platform")

        self._scratch_lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._scratch_fds: dict[bool, int] = {}
        self._scratch_end = 0

        self.is_complete()  # loads the manifest when it can be trusted

    # ---- state of the store on disk -----------------------------------------------------------

    def is_complete(self) -> bool:
        """True when the manifest exists, is ours, and every data file has its recorded size.

        Cheap (one stat per shard); it does not read the data. Also (re)loads the entries, or
        forgets them when the store no longer checks out, so nothing is read from a stale store.
        """
        manifest = self._load_manifest()
        complete = manifest is not None and self._files_have_recorded_sizes(manifest)
        self._entries = manifest.entries if complete else None
        return complete

    def verify(self) -> bool:
        """Read every tensor back and compare its crc32 with the manifest's. Costs a full read."""
        manifest = self._load_manifest()
        if manifest is None or not self._files_have_recorded_sizes(manifest):
            return False
        futures = {name: self._pool.submit(self._checksum_matches, entry)
                   for name, entry in manifest.entries.items()}
        good = {name for name, future in futures.items() if future.result()}
        self._verified |= good
        return len(good) == len(futures)

    def invalidate(self) -> None:
        """Remove the store from disk (manifest first, so a crash midway leaves nothing trusted)."""
        self._check_open()
        if self._writer is not None:
            self._writer.abort()
        self._close_read_fds()
        self._close_scratch()
        self._entries = None
        _unlink_if_exists(self.manifest_path)
        _fsync_dir(self.path)
        shutil.rmtree(self.path, ignore_errors=True)

    def names(self) -> list[str]:
        return list(self._require_entries())

    def entry(self, name: str) -> TensorEntry:
        entries = self._require_entries()
        if name not in entries:
            raise KeyError(f"no tensor {name!r} in offload store {self.path}")
        return entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self._slots or (self._entries is not None and name in self._entries)

    def data_files(self) -> list[Path]:
        return sorted(self.path.glob("data-*.bin"))

    def drop_page_cache(self) -> None:
        """Evict this store's data files from the page cache (for honest cold-read figures)."""
        for path in self.data_files():
            drop_page_cache(path)

    # ---- writing ------------------------------------------------------------------------------

    def begin_write(self, total_bytes: int | None = None, *,
                    shard_bytes: int = DEFAULT_SHARD_BYTES) -> DiskStoreWriter:
        """Start (re)writing the store; whatever was there is discarded, manifest first.

        `total_bytes`, when known, is checked against the free space before anything is written.
        Not to be called while reads of this store are in flight: their files are deleted.
        """
        self._check_open()
        if self._writer is not None:
            raise RuntimeError(f"a writer is already open on offload store {self.path}")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OffloadError(
                f"offload folder {self.folder} is not usable: cannot create {self.path} "
                f"({exc.strerror or exc}); choose a writable folder") from exc
        self._discard_committed_content()
        if total_bytes is not None:
            free = _free_bytes(self.path)
            if free is not None and total_bytes > free:
                raise OffloadError(_out_of_space_message(self.path, total_bytes, free,
                                                         needed_is_lower_bound=False))
        self._writer = DiskStoreWriter(self, total_bytes, shard_bytes)
        return self._writer

    def _discard_committed_content(self) -> None:
        self._entries = None
        self._verified.clear()
        _unlink_if_exists(self.manifest_path)
        _fsync_dir(self.path)
        self._close_read_fds()  # they point at files about to be deleted and rewritten
        for path in self.data_files():
            _unlink_if_exists(path)
        _unlink_if_exists(self.manifest_path.with_suffix(".json.tmp"))
        _remove_orphaned_temp_files(self.path)

    def _writer_finished(self, manifest: _Manifest | None) -> None:
        self._writer = None
        if manifest is not None:
            self._entries = manifest.entries

    # ---- reading ------------------------------------------------------------------------------

    def read_async(self, name: str, out: torch.Tensor) -> Future:
        """Start filling `out` (a contiguous CPU tensor, pinned or not) with the stored bytes.

        Returns a Future resolving to `out` once every chunk is in. The tensor is split into chunks
        of `chunk_bytes` read in parallel by the pool straight into `out`'s memory.
        """
        self._check_open()
        location = self._locate(name)
        _check_destination(name, location, out)
        return self._read_whole(name, location, out)

    def _read_whole(self, name: str, location: _Location, out: torch.Tensor) -> Future:
        dest = _byte_view(out)
        pieces = [dest[start:start + self.chunk_bytes] for start in range(0, location.nbytes, self.chunk_bytes)]
        crc = _InOrderCrc(pieces) if self._needs_check(name) else None
        chunk_futures = []
        for i, piece in enumerate(pieces):
            chunk_futures.append(self._submit_read(location.file, location.offset + i * self.chunk_bytes, piece))
            if crc is not None:
                chunk_futures[-1].add_done_callback(lambda future, i=i: crc.chunk_read(i, future))
        check = (lambda: self._check_crc(name, crc.value())) if crc is not None else None
        return _when_all_done(chunk_futures, out, check)

    def read_range_async(self, name: str, byte_start: int, out: torch.Tensor) -> Future:
        """Start filling `out` with `out.nbytes` stored bytes of `name` from `byte_start` on (e.g.
        a range of rows of a row-major tensor). Same contract as `read_async` otherwise."""
        self._check_open()
        location = self._locate(name)
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read_range_async({name!r}): out must be a contiguous CPU tensor")
        nbytes = out.numel() * out.element_size()
        if byte_start < 0 or byte_start + nbytes > location.nbytes:
            raise ValueError(f"read_range_async({name!r}): bytes [{byte_start}, {byte_start + nbytes}) "
                             f"are outside the stored {location.nbytes} bytes")
        if byte_start == 0 and nbytes == location.nbytes and self._needs_check(name):
            return self._read_whole(name, location, out)
        if self._needs_check(name):
            self._check_whole(name)  # a part of a tensor cannot be checked alone: read it all once
        dest = _byte_view(out)
        # Chunk boundaries sit on aligned file offsets: the first chunk runs from the (possibly
        # unaligned) start to the first boundary that keeps it within the bounce buffer, the others
        # are whole chunk_bytes from aligned offsets. When `out` is as aligned as the file offset
        # (a row range of an aligned working buffer), every chunk but the first and last is then
        # read straight into `out` by O_DIRECT, without the bounce copy.
        file_start = location.offset + byte_start
        first = min(nbytes, self.chunk_bytes - file_start % ALIGNMENT)
        starts = [0] + list(range(first, nbytes, self.chunk_bytes)) if nbytes else []
        chunk_futures = [
            self._submit_read(location.file, file_start + start,
                              dest[start:(first if start == 0 else start + self.chunk_bytes)])
            for start in starts
        ]
        return _when_all_done(chunk_futures, out)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with the stored bytes and return it (blocking)."""
        return self.read_async(name, out).result()

    def read_tensor(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read a stored tensor or a scratch slot into `out`, or into a new (aligned / pinned) one."""
        if out is None:
            location = self._locate(name)
            out = aligned_empty(location.shape, location.dtype, pin_memory=self.pin_memory)
        return self.read_into(name, out)

    def _locate(self, name: str) -> _Location:
        slot = self._slots.get(name)
        if slot is not None:
            if slot.dtype is None:
                raise KeyError(f"scratch slot {name!r} of offload store {self.path} "
                               f"was allocated but never written")
            nbytes = _numel(slot.shape) * _element_size(slot.dtype)
            return _Location(SCRATCH, slot.offset, nbytes, slot.dtype, slot.shape)
        entry = self.entry(name)
        return _Location(entry.file, entry.offset, entry.nbytes, entry.dtype, entry.shape)

    def _require_entries(self) -> dict[str, TensorEntry]:
        if self._entries is None and not self.is_complete():
            raise OffloadError(
                f"offload store {self.path} (key {self.key!r}) is missing, incomplete or stale; "
                f"it must be (re)written before it is read")
        return self._entries

    def _submit_read(self, file: str, offset: int, dest: np.ndarray) -> Future:
        future = self._pool.submit(self._read_chunk, file, offset, dest)
        with self._inflight_lock:
            self._inflight.add(future)
        future.add_done_callback(self._read_finished)
        return future

    def _read_finished(self, future: Future) -> None:
        with self._inflight_lock:
            self._inflight.discard(future)

    def drain(self) -> None:
        """Wait for every read in flight (after a caller was interrupted while waiting for one:
        the pool threads still write into its buffer)."""
        with self._inflight_lock:
            pending = list(self._inflight)
        for future in pending:
            future.cancel()
        wait(pending)

    def _read_chunk(self, file: str, offset: int, dest: np.ndarray) -> None:
        """Runs on a pool thread: read `dest.nbytes` bytes at `offset` of `file` into `dest`."""
        fd, direct = self._read_fd(file)
        if direct:
            try:
                count = self._pread_direct(fd, dest, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back_to_buffered(f"an O_DIRECT read of {file} failed: {exc}")
                fd, direct = self._read_fd(file)
                count = _pread_all(fd, dest, offset)
        else:
            count = _pread_all(fd, dest, offset)
        if count < dest.nbytes:
            raise OffloadError(
                f"offload store {self.path}: {file} ends {dest.nbytes - count} bytes early at "
                f"offset {offset + count}; the store is truncated and must be rewritten")

    def _pread_direct(self, fd: int, dest: np.ndarray, offset: int) -> int:
        # The file offset is aligned by construction; the memory address and the length may not be
        # (arbitrary CPU tensors, the tail of a tensor), and then the bytes go through an aligned
        # bounce buffer with the length rounded up (the data file is padded, so that stays inside).
        delta = offset % ALIGNMENT  # non-zero only for range reads
        if delta == 0 and dest.ctypes.data % ALIGNMENT == 0 and dest.nbytes % ALIGNMENT == 0:
            return _pread_all(fd, dest, offset)
        bounce = self._bounce_buffer()[:_align_up(dest.nbytes + delta)]
        count = min(_pread_all(fd, bounce, offset - delta) - delta, dest.nbytes)
        dest[:count] = bounce[delta:delta + count]
        return count

    def _bounce_buffer(self) -> np.ndarray:
        # One per thread, so pool threads never share one; chunk_bytes each.
        bounce = getattr(self._thread_local, "bounce", None)
        if bounce is None:
            bounce = _aligned_bytes(self.chunk_bytes)
            self._thread_local.bounce = bounce
        return bounce

    def _read_fd(self, file: str) -> tuple[int, bool]:
        """A cached file descriptor for reading `file`, and whether it bypasses the page cache."""
        if file == SCRATCH:
            with self._scratch_lock:
                direct = self._direct_io_active and True in self._scratch_fds
                return self._scratch_fds[direct], direct
        with self._fd_lock:
            direct = self._direct_io_active
            fd = self._read_fds.get((file, direct))
            if fd is not None:
                return fd, direct
            path = self.path / file
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError as exc:
                raise OffloadError(f"offload store {self.path}: data file {file} is missing; "
                                   f"the store must be rewritten") from exc
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self._fall_back_to_buffered(f"opening {path} with O_DIRECT failed: {exc}")
                direct = False
                fd = self._read_fds.get((file, direct))
                if fd is None:
                    fd = os.open(path, os.O_RDONLY)
            self._read_fds[(file, direct)] = fd
            return fd, direct

    def _fall_back_to_buffered(self, reason: str) -> None:
        with self._fallback_lock:
            warn = self._direct_io_active  # only the first refusal warns
            self._direct_io_active = False
        if warn:
            warnings.warn(f"offload store {self.path}: direct I/O refused ({reason}); using "
                          f"buffered I/O, so disk figures include the page cache",
                          RuntimeWarning, stacklevel=3)

    @property
    def direct_io_active(self) -> bool:
        """False when direct_io was asked for but the filesystem refused it."""
        return self._direct_io_active

    # ---- integrity ----------------------------------------------------------------------------

    def _needs_check(self, name: str) -> bool:
        return self.verify_reads and name not in self._slots and name not in self._verified

    def _check_crc(self, name: str, crc: int) -> None:
        """Runs once the whole of `name` was read, with the crc32 of what was read."""
        entry = self.entry(name)
        if crc != entry.crc32:
            raise StoreCorruptError(
                f"offload store {self.path}: tensor {name!r} in {self.path / entry.file} (bytes "
                f"{entry.offset}..{entry.offset + entry.nbytes}) reads back with crc32 {crc:#010x}, "
                f"the manifest records {entry.crc32:#010x}: the file is damaged or torn")
        self._verified.add(name)

    def _check_whole(self, name: str) -> None:
        location = self._locate(name)
        self._read_whole(name, location, torch.from_numpy(_aligned_bytes(location.nbytes))).result()

    def _checksum_matches(self, entry: TensorEntry) -> bool:
        buffer = _aligned_bytes(min(self.chunk_bytes, _align_up(max(entry.nbytes, 1))))
        crc = 0
        for start in range(0, entry.nbytes, len(buffer)):
            piece = buffer[:min(len(buffer), entry.nbytes - start)]
            try:
                self._read_chunk(entry.file, entry.offset + start, piece)
            except (OffloadError, OSError):
                return False
            crc = zlib.crc32(piece, crc)
        return crc == entry.crc32

    def _close_read_fds(self) -> None:
        with self._fd_lock:
            for fd in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()

    # ---- scratch slots: small mutable entries (KV cache / activation spill) -------------------

    def allocate(self, name: str, nbytes: int) -> None:
        """Reserve a fixed-size slot of `nbytes` for `name`; later writes overwrite it in place."""
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._entries is not None and name in self._entries:
            raise ValueError(f"{name!r} is a committed tensor of offload store {self.path}; "
                             f"scratch slots need names of their own")
        with self._scratch_lock:
            slot = self._slots.get(name)
            if slot is not None:
                if nbytes > slot.capacity:
                    raise ValueError(f"scratch slot {name!r} holds {slot.capacity} bytes; "
                                     f"cannot re-allocate it with {nbytes}")
                return
            self._open_scratch()
            # Slots start and end on 4096 boundaries, so O_DIRECT writes of a padded tail stay
            # inside the slot. The file grows sparsely: space is taken when a slot is written.
            capacity = _align_up(nbytes)
            self._slots[name] = _Slot(offset=self._scratch_end, capacity=capacity)
            self._scratch_end += capacity
            os.ftruncate(self._scratch_fds[False], self._scratch_end)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Overwrite the slot allocated for `name` with `tensor` (any dtype/shape that fits)."""
        self._check_open()
        slot = self._slots.get(name)
        if slot is None:
            raise KeyError(f"no scratch slot {name!r} in offload store {self.path}; "
                           f"allocate(name, nbytes) it first")
        host = _host_contiguous(tensor)
        data = _byte_view(host)
        if data.nbytes > slot.capacity:
            raise ValueError(f"tensor for scratch slot {name!r} has {data.nbytes} bytes, "
                             f"the slot holds {slot.capacity}")
        slot.dtype = slot.shape = None  # a write that fails halfway leaves a slot nobody may read
        try:
            for start in range(0, data.nbytes, self.chunk_bytes):
                self._write_scratch_chunk(data[start:start + self.chunk_bytes], slot.offset + start)
        except OSError as exc:
            raise _write_failure(self.path, exc, needed=data.nbytes,
                                 needed_is_lower_bound=True) from exc
        slot.dtype, slot.shape = host.dtype, tuple(host.shape)

    def _write_scratch_chunk(self, data: np.ndarray, offset: int) -> None:
        with self._scratch_lock:
            direct = self._direct_io_active and True in self._scratch_fds
            fd = self._scratch_fds[direct]
        if not direct:
            _pwrite_all(fd, data, offset)
            return
        if data.ctypes.data % ALIGNMENT == 0 and data.nbytes % ALIGNMENT == 0:
            source = data
        else:
            source = self._bounce_buffer()[:_align_up(data.nbytes)]
            source[:data.nbytes] = data
            source[data.nbytes:] = 0
        try:
            _pwrite_all(fd, source, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._fall_back_to_buffered(f"an O_DIRECT write to the scratch file failed: {exc}")
            _pwrite_all(self._scratch_fds[False], data, offset)

    def _open_scratch(self) -> None:
        if self._scratch_fds:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            path = self.path / f".scratch-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
            self._scratch_fds[False] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise OffloadError(f"offload folder {self.folder} is not usable for scratch space: "
                               f"{exc.strerror or exc}") from exc
        try:
            if self._direct_io_active:
                try:
                    self._scratch_fds[True] = os.open(path, os.O_RDWR | os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._fall_back_to_buffered(f"opening the scratch file with O_DIRECT: {exc}")
        finally:
            path.unlink()  # the open descriptors keep the file; nothing is left after a crash

    def _close_scratch(self) -> None:
        with self._scratch_lock:
            for fd in self._scratch_fds.values():
                os.close(fd)
            self._scratch_fds.clear()
            self._slots.clear()
            self._scratch_end = 0

    # ---- lifetime -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"offload store {self.path} is closed")

    def close(self) -> None:
        """Wait for reads in flight, stop the pool, close files. A writer still open is aborted."""
        if self._closed:
            return
        if self._writer is not None:
            self._writer.abort()
        self._pool.shutdown(wait=True)
        self._close_read_fds()
        self._close_scratch()
        self._closed = True

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.folder)!r}, {self.key!r}, direct_io={self.direct_io})"

    # ---- manifest -----------------------------------------------------------------------------

    def _load_manifest(self) -> _Manifest | None:
        """The manifest if it parses, has our format and our key; None otherwise (untrusted)."""
        try:
            record = json.loads(self.manifest_path.read_text(encoding="utf-8"))
            if record.get("format") != MANIFEST_FORMAT or record.get("version") != MANIFEST_VERSION:
                return None
            if record.get("key") != self.key:
                return None
            file_sizes = {str(name): int(size) for name, size in record["files"].items()}
            entries = {name: TensorEntry.from_json(item) for name, item in record["tensors"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        for entry in entries.values():
            size = file_sizes.get(entry.file)
            if size is None or entry.offset % ALIGNMENT or entry.offset + entry.nbytes > size:
                return None
        return _Manifest(self.key, file_sizes, entries)

    def _files_have_recorded_sizes(self, manifest: _Manifest) -> bool:
        for name, size in manifest.file_sizes.items():
            try:
                if (self.path / name).stat().st_size != size:
                    return False
            except OSError:
                return False
        return True


class DiskStoreWriter:
    """Streams tensors into the data shards; `commit()` makes them visible by writing the manifest.

    Leaving a `with` block without commit(), or with an exception, aborts: the partial data is
    removed and no manifest exists, so the next run rewrites the store.
    """

    def __init__(self, store: DiskStore, total_bytes: int | None, shard_bytes: int):
        self._store = store
        self._total_bytes = total_bytes
        self._shard_bytes = shard_bytes
        self._entries: dict[str, TensorEntry] = {}
        self._file_sizes: dict[str, int] = {}
        self._shard_fd: int | None = None
        self._shard_name: str | None = None
        self._temp_names: dict[str, str] = {}  # shard name -> the temporary name it is written under
        self._shard_end = 0          # aligned offset where the next tensor goes in the shard
        self._bytes_added = 0
        self._done = False

    @property
    def bytes_added(self) -> int:
        return self._bytes_added

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes now (it may be on any device); only its entry waits for commit."""
        self._check_active()
        if name in self._entries:
            raise ValueError(f"tensor {name!r} was already added to offload store {self._store.path}")
        host = _host_contiguous(tensor)
        data = _byte_view(host)
        try:
            if self._shard_fd is None or (self._shard_end > 0 and
                                          self._shard_end + data.nbytes > self._shard_bytes):
                self._start_shard()
            offset = self._shard_end
            crc = self._write_and_checksum(data, offset)
        except OSError as exc:
            raise self._failure(exc, needed=self._bytes_added + data.nbytes) from exc
        self._entries[name] = TensorEntry(file=self._shard_name, offset=offset,
                                          nbytes=data.nbytes, dtype=host.dtype,
                                          shape=tuple(host.shape), crc32=crc)
        self._shard_end = _align_up(offset + data.nbytes)
        self._bytes_added += data.nbytes

    def commit(self) -> None:
        """Make the data durable, then write the manifest atomically; after this readers trust it."""
        self._check_active()
        store = self._store
        try:
            self._finish_shard()
            for name, temp in self._temp_names.items():  # durable data under the final names first
                os.replace(store.path / temp, store.path / name)
            _fsync_dir(store.path)
            manifest = {
                "format": MANIFEST_FORMAT,
                "version": MANIFEST_VERSION,
                "key": store.key,
                "alignment": ALIGNMENT,
                "checksum": "crc32",
                "files": self._file_sizes,
                "tensors": {name: entry.to_json() for name, entry in self._entries.items()},
            }
            tmp_path = store.manifest_path.with_suffix(".json.tmp")
            with open(tmp_path, "w", encoding="utf-8") as tmp:
                json.dump(manifest, tmp)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_path, store.manifest_path)
            _fsync_dir(store.path)
        except OSError as exc:
            raise self._failure(exc, needed=self._bytes_added) from exc
        self._done = True
        store._writer_finished(_Manifest(store.key, dict(self._file_sizes), dict(self._entries)))

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
                _unlink_if_exists(self._store.path / name)
        _unlink_if_exists(self._store.manifest_path.with_suffix(".json.tmp"))
        self._store._writer_finished(None)

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
        temp = f".{self._shard_name}{_TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._temp_names[self._shard_name] = temp
        self._shard_fd = os.open(self._store.path / temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
        crc = self._store._pool.submit(zlib.crc32, data)
        for start in range(0, data.nbytes, WRITE_PIECE_BYTES):
            _pwrite_all(self._shard_fd, data[start:start + WRITE_PIECE_BYTES], offset + start)
        return crc.result()

    def _failure(self, exc: OSError, needed: int) -> OffloadError:
        """Abort, then describe the failure. Aborting first frees the partial data, so the free
        space reported is what a rerun would have."""
        self.abort()
        if self._total_bytes is not None:
            needed, lower_bound = max(needed, self._total_bytes), False
        else:
            lower_bound = True
        return _write_failure(self._store.path, exc, needed=needed,
                              needed_is_lower_bound=lower_bound)


# ---- error messages and futures --------------------------------------------------------------


def _out_of_space_message(path: Path, needed: int, free: int | None, *,
                          needed_is_lower_bound: bool) -> str:
    at_least = "at least " if needed_is_lower_bound else ""
    free_text = "unknown" if free is None else f"{human_bytes(free)} ({free} bytes)"
    return (f"not enough disk space for offload store {path}: needs {at_least}"
            f"{human_bytes(needed)} ({needed} bytes), free {free_text}; nothing was committed, "
            f"free some space or point the offload folder elsewhere, the next run rewrites it")


def _write_failure(path: Path, exc: OSError, *, needed: int,
                   needed_is_lower_bound: bool) -> OffloadError:
    if exc.errno in _OUT_OF_SPACE_ERRNOS:
        return OffloadError(_out_of_space_message(path, needed, _free_bytes(path),
                                                  needed_is_lower_bound=needed_is_lower_bound))
    return OffloadError(f"cannot write offload store {path}: {exc.strerror or exc}; "
                        f"nothing was committed, the next run rewrites it")


def _check_destination(name: str, location: _Location, out: torch.Tensor) -> None:
    problems = []
    if out.device.type != "cpu":
        problems.append(f"it is on {out.device} (read into a CPU tensor, then copy to the device)")
    if not out.is_contiguous():
        problems.append("it is not contiguous")
    if out.dtype != location.dtype or tuple(out.shape) != location.shape:
        problems.append(f"it has dtype {out.dtype} and shape {tuple(out.shape)}, the store holds "
                        f"dtype {location.dtype} and shape {location.shape}")
    if problems:
        raise ValueError(f"cannot read {name!r} into the given tensor: {'; '.join(problems)}")


def _when_all_done(futures: Iterable[Future], result: object, check=None) -> Future:
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
            if state["error"] is None and check is not None:
                try:
                    check()
                except Exception as exc:  # noqa: BLE001 - handed to the waiting reader
                    state["error"] = exc
            if state["error"] is not None:
                combined.set_exception(state["error"])
            else:
                combined.set_result(result)

    for future in futures:
        future.add_done_callback(on_done)
    return combined


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _InOrderCrc:
    """crc32 of a buffer read in chunks, folded in chunk order as the reads complete by whichever
    reader thread finished one (one thread at a time), so the check of a tensor runs alongside its
    reads instead of after them (crc32 cannot combine out-of-order pieces)."""

    def __init__(self, pieces: list[np.ndarray]):
        self._pieces = pieces
        self._read = [False] * len(pieces)
        self._next = 0  # first chunk not folded in yet
        self._crc = 0
        self._busy = False
        self._lock = threading.Lock()
        self._finished = threading.Event()
        if not pieces:
            self._finished.set()

    def chunk_read(self, index: int, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the read fails as a whole; value() is never asked for
        with self._lock:
            self._read[index] = True
            if self._busy:
                return  # the thread folding chunks in will reach this one
            self._busy = True
        while True:
            with self._lock:
                if self._next == len(self._pieces) or not self._read[self._next]:
                    self._busy = False
                    if self._next == len(self._pieces):
                        self._finished.set()
                    return
                piece = self._pieces[self._next]
            self._crc = zlib.crc32(piece, self._crc)
            with self._lock:
                self._next += 1

    def value(self) -> int:
        self._finished.wait()
        return self._crc
