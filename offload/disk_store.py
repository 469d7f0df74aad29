"""The disk tier for weights: tensors for one key, written once, read back in parallel chunks.

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
raises `StoreCorruptError`, which the weight placement (offload/tiered_weights.py) answers by
rebuilding the store from its source. Data shards are written under temporary names and renamed
into place, fsynced, only at commit, just before the manifest (offload/store_writer.py): a process
killed while writing leaves no file under a name a reader trusts.

Linked tensors: a tensor whose exact bytes a file outside the store already holds (a pre-quantized
checkpoint's codes) is recorded as byte ranges of that file instead of being copied
(`DiskStoreWriter.link`): loading such a checkpoint writes little more than the manifest, and the
store reads those ranges (aligned or not) like its own shards, crc32 included.

KV cache and activations that spill to disk do not use this store: they live in memory-mapped
files of the offload folder (offload/host_buffer.py, `tier_zeros`).
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import Future
from pathlib import Path

import torch

from offload.disk_reader import ChunkReader, when_all_done
from offload.errors import OffloadError, StoreCorruptError
from offload.host_buffer import ALIGNMENT, align_up, aligned_bytes, aligned_empty
from offload.page_cache import drop_page_cache
from offload.store_manifest import (MANIFEST_NAME, Manifest, InOrderCrc, TensorEntry,
                                    files_have_recorded_sizes, load_manifest, store_dir_name)
from offload.store_writer import (DEFAULT_SHARD_BYTES, DiskStoreWriter, byte_view, free_bytes, fsync_dir,
                                  out_of_space_message, remove_orphaned_temp_files, unlink_if_exists)

DEFAULT_CHUNK_BYTES = 8 << 20       # per read request: large enough for full disk bandwidth,
                                    # small enough that num_threads requests are in flight per tensor


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
                 pin_memory: bool = False, verify_reads: bool = True):
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
        # Buffers the store allocates itself are pinned when the engine computes on CUDA (its caller
        # says so), so the host->device copy that follows a read can run asynchronously. Not from
        # torch.cuda.is_available(): a CPU engine on a GPU machine would pin host memory and start
        # a CUDA context for nothing.
        self.pin_memory = pin_memory
        self._reader = ChunkReader(self.path, direct_io=direct_io, num_threads=num_threads,
                                   chunk_bytes=chunk_bytes)
        self._closed = False
        self._writer: DiskStoreWriter | None = None
        self._entries: dict[str, TensorEntry] | None = None
        # Committed tensors whose bytes were checked against the manifest in this process.
        self.verify_reads = verify_reads
        self._verified: set[str] = set()
        self.is_complete()  # loads the manifest when it can be trusted

    # ---- state of the store on disk -----------------------------------------------------------

    def is_complete(self) -> bool:
        """True when the manifest exists, is ours, and every data file has its recorded size.

        Cheap (one stat per shard); it does not read the data. Also (re)loads the entries, or
        forgets them when the store no longer checks out, so nothing is read from a stale store.
        """
        manifest = load_manifest(self.manifest_path, self.key)
        complete = manifest is not None and files_have_recorded_sizes(self.path, manifest)
        self._entries = manifest.entries if complete else None
        return complete

    def verify(self) -> bool:
        """Read every tensor back and compare its crc32 with the manifest's. Costs a full read."""
        manifest = load_manifest(self.manifest_path, self.key)
        if manifest is None or not files_have_recorded_sizes(self.path, manifest):
            return False
        futures = {name: self._reader.pool.submit(self._checksum_matches, entry)
                   for name, entry in manifest.entries.items()}
        good = {name for name, future in futures.items() if future.result()}
        self._verified |= good
        return len(good) == len(futures)

    def names(self) -> list[str]:
        return list(self._require_entries())

    def has(self, name: str) -> bool:
        return name in self._require_entries()

    def entry(self, name: str) -> TensorEntry:
        entries = self._require_entries()
        if name not in entries:
            raise KeyError(f"no tensor {name!r} in offload store {self.path}")
        return entries[name]

    def data_files(self) -> list[Path]:
        return sorted(self.path.glob("data-*.bin"))

    def drop_page_cache(self) -> None:
        """Evict this store's data files, and the files it links, from the page cache (for honest
        cold-read figures)."""
        linked = {e.file for entry in (self._entries or {}).values() if entry.linked for e in entry.extents}
        for path in [*self.data_files(), *sorted(linked)]:
            drop_page_cache(path)

    @property
    def direct_io_active(self) -> bool:
        """False when direct_io was asked for but the filesystem refused it."""
        return self._reader.direct_io_active

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
        try:
            self._discard_committed_content()
        except OSError as exc:  # e.g. a folder that became read-only since the store was written
            raise OffloadError(
                f"offload folder {self.folder} is not usable: cannot clear the old store in {self.path} "
                f"({exc.strerror or exc}); choose a writable folder") from exc
        if total_bytes is not None:
            free = free_bytes(self.path)
            if free is not None and total_bytes > free:
                raise OffloadError(out_of_space_message(self.path, total_bytes, free,
                                                        needed_is_lower_bound=False))
        self._writer = DiskStoreWriter(self.path, self.key, self._reader.pool, self._writer_finished,
                                       total_bytes, shard_bytes)
        return self._writer

    def _discard_committed_content(self) -> None:
        self._entries = None
        self._verified.clear()
        unlink_if_exists(self.manifest_path)
        fsync_dir(self.path)
        self._reader.close_fds()  # they point at files about to be deleted and rewritten
        for path in self.data_files():
            unlink_if_exists(path)
        unlink_if_exists(self.manifest_path.with_suffix(".json.tmp"))
        remove_orphaned_temp_files(self.path)

    def _writer_finished(self, manifest: Manifest | None) -> None:
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
        entry = self.entry(name)
        _check_destination(name, entry, out)
        return self._read_whole(name, entry, out)

    def _read_whole(self, name: str, entry: TensorEntry, out: torch.Tensor) -> Future:
        dest = byte_view(out)
        chunks = self._chunks(entry, 0, entry.nbytes)
        pieces = [dest[start:start + length] for _, _, start, length in chunks]
        crc = InOrderCrc(pieces) if self._needs_check(name) else None
        chunk_futures = []
        for i, ((file, offset, _, _), piece) in enumerate(zip(chunks, pieces)):
            chunk_futures.append(self._reader.submit(file, offset, piece))
            if crc is not None:
                chunk_futures[-1].add_done_callback(lambda future, i=i: crc.chunk_read(i, future))
        check = (lambda: self._check_crc(name, crc.value())) if crc is not None else None
        return when_all_done(chunk_futures, out, check)

    def _chunks(self, entry: TensorEntry, byte_start: int, nbytes: int) -> list[tuple[str, int, int, int]]:
        """(file, file offset, start in the destination, length) of each read that brings bytes
        [byte_start, byte_start + nbytes) of `entry`, over its extents in order.

        Chunk boundaries sit on aligned file offsets: a piece's first chunk runs from its (possibly
        unaligned) start to the first boundary that keeps it within the reader's bounce buffer, the
        others are whole chunk_bytes from aligned offsets. When the destination is as aligned as the
        file offset (a row range of an aligned working buffer, a whole tensor of a shard), every
        chunk but the first and last is then read straight into it by O_DIRECT, without the bounce."""
        chunks, at = [], 0  # at: the entry's byte where the extent starts
        for e in entry.extents:
            lo, hi = max(byte_start, at), min(byte_start + nbytes, at + e.nbytes)
            if lo < hi:
                file_start, n = e.offset + lo - at, hi - lo
                first = min(n, self.chunk_bytes - file_start % ALIGNMENT)
                for start in [0, *range(first, n, self.chunk_bytes)]:
                    end = first if start == 0 else min(n, start + self.chunk_bytes)
                    chunks.append((e.file, file_start + start, lo - byte_start + start, end - start))
            at += e.nbytes
        return chunks

    def read_range_async(self, name: str, byte_start: int, out: torch.Tensor) -> Future:
        """Start filling `out` with `out.nbytes` stored bytes of `name` from `byte_start` on (e.g.
        a range of rows of a row-major tensor). Same contract as `read_async` otherwise."""
        self._check_open()
        entry = self.entry(name)
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"read_range_async({name!r}): out must be a contiguous CPU tensor")
        nbytes = out.numel() * out.element_size()
        if byte_start < 0 or byte_start + nbytes > entry.nbytes:
            raise ValueError(f"read_range_async({name!r}): bytes [{byte_start}, {byte_start + nbytes}) "
                             f"are outside the stored {entry.nbytes} bytes")
        if byte_start == 0 and nbytes == entry.nbytes and self._needs_check(name):
            return self._read_whole(name, entry, out)
        if self._needs_check(name):
            self._check_whole(name)  # a part of a tensor cannot be checked alone: read it all once
        dest = byte_view(out)
        chunk_futures = [self._reader.submit(file, offset, dest[start:start + length])
                         for file, offset, start, length in self._chunks(entry, byte_start, nbytes)]
        return when_all_done(chunk_futures, out)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with the stored bytes and return it (blocking)."""
        return self.read_async(name, out).result()

    def read_tensor(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read a stored tensor into `out`, or into a new (aligned / pinned) one."""
        if out is None:
            entry = self.entry(name)
            out = aligned_empty(entry.shape, entry.dtype, pin_memory=self.pin_memory)
        return self.read_into(name, out)

    def drain(self) -> None:
        """Wait for every read in flight (after a caller was interrupted while waiting for one:
        the pool threads still write into its buffer)."""
        self._reader.drain()

    def _require_entries(self) -> dict[str, TensorEntry]:
        if self._entries is None and not self.is_complete():
            raise OffloadError(
                f"offload store {self.path} (key {self.key!r}) is missing, incomplete or stale; "
                f"it must be (re)written before it is read")
        return self._entries

    # ---- integrity ----------------------------------------------------------------------------

    def _needs_check(self, name: str) -> bool:
        return self.verify_reads and name not in self._verified

    def _check_crc(self, name: str, crc: int) -> None:
        """Runs once the whole of `name` was read, with the crc32 of what was read."""
        entry = self.entry(name)
        if crc != entry.crc32:
            where = entry.where() if entry.linked else f"{self.path / entry.file} (bytes {entry.offset}..{entry.offset + entry.nbytes})"
            damage = ("the linked file changed or is damaged since the store was written" if entry.linked
                      else "the file is damaged or torn")
            raise StoreCorruptError(
                f"offload store {self.path}: tensor {name!r} in {where} reads back with crc32 {crc:#010x}, "
                f"the manifest records {entry.crc32:#010x}: {damage}")
        self._verified.add(name)

    def _check_whole(self, name: str) -> None:
        entry = self.entry(name)
        self._read_whole(name, entry, torch.from_numpy(aligned_bytes(entry.nbytes))).result()

    def _checksum_matches(self, entry: TensorEntry) -> bool:
        buffer = aligned_bytes(min(self.chunk_bytes, align_up(max(entry.nbytes, 1))))  # no chunk is longer
        crc = 0
        for file, offset, _, length in self._chunks(entry, 0, entry.nbytes):
            piece = buffer[:length]
            try:
                self._reader.read_chunk(file, offset, piece)
            except (OffloadError, OSError):
                return False
            crc = zlib.crc32(piece, crc)
        return crc == entry.crc32

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
        self._reader.shutdown()
        self._closed = True

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.folder)!r}, {self.key!r}, direct_io={self.direct_io})"


def _check_destination(name: str, entry: TensorEntry, out: torch.Tensor) -> None:
    problems = []
    if out.device.type != "cpu":
        problems.append(f"it is on {out.device} (read into a CPU tensor, then copy to the device)")
    if not out.is_contiguous():
        problems.append("it is not contiguous")
    if out.dtype != entry.dtype or tuple(out.shape) != entry.shape:
        problems.append(f"it has dtype {out.dtype} and shape {tuple(out.shape)}, the store holds "
                        f"dtype {entry.dtype} and shape {entry.shape}")
    if problems:
        raise ValueError(f"cannot read {name!r} into the given tensor: {'; '.join(problems)}")
