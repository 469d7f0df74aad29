"""A disk store's manifest (where each tensor lies, its dtype, shape and crc32) and its checks.

The manifest is written last and atomically; a reader trusts a store only when the manifest parses,
names our key and format, and every data file has its recorded size (the crc32s are checked as
tensors are first read).

A tensor lies in one of the store's data shards, or (linked) in byte ranges of files outside the
store that already hold exactly its bytes: a pre-quantized checkpoint's codes kept as they are
(offload/store_writer.py `link`). A linked file's size is recorded and checked like a shard's, and
its bytes are checked against the crc32 on their first read like any other tensor's.

Checksum: zlib.crc32. It guards against truncation and bit rot, not against an adversary, and runs
several times faster than the O_DIRECT reads it rides on (measurements: docs/DESIGN.md, "Tried").
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from offload.host_buffer import ALIGNMENT

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "flexsarathi-disk-store"
MANIFEST_VERSION = 2  # 2: linked tensors ("extents", "linked_files"); a version-1 manifest reads as before
_READABLE_VERSIONS = (1, 2)


def store_dir_name(key: str) -> str:
    """Folder name of the store for `key`: readable prefix + hash of the whole key.

    The hash keeps two keys that sanitise alike ("a|b", "a/b") apart and bounds the length.
    """
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[:48] or "store"
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()
    return f"{readable}-{digest}"


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Extent:
    """`nbytes` bytes at `offset` of `file`: a data shard's name in the store folder, or the
    absolute path of a linked file outside it."""

    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorEntry:
    """Where one stored tensor lives (its bytes: the extents one after the other) and what it must
    read back as."""

    extents: tuple[Extent, ...]
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: int

    @property
    def linked(self) -> bool:
        return any(os.path.isabs(e.file) for e in self.extents)

    @property
    def file(self) -> str:  # where a tensor of the store's own shards lies (one extent)
        return self.extents[0].file

    @property
    def offset(self) -> int:
        return self.extents[0].offset

    def where(self) -> str:
        """For messages: the file(s) and byte ranges."""
        return ", ".join(f"{e.file} bytes {e.offset}..{e.offset + e.nbytes}" for e in self.extents)

    def to_json(self) -> dict:
        place = ({"extents": [[e.file, e.offset, e.nbytes] for e in self.extents]} if self.linked
                 else {"file": self.file, "offset": self.offset})
        return {**place, "nbytes": self.nbytes, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape), "crc32": self.crc32}

    @classmethod
    def from_json(cls, record: dict) -> TensorEntry:
        nbytes = int(record["nbytes"])
        if "extents" in record:
            extents = tuple(Extent(str(f), int(o), int(n)) for f, o, n in record["extents"])
        else:
            extents = (Extent(str(record["file"]), int(record["offset"]), nbytes),)
        return cls(extents=extents, nbytes=nbytes, dtype=_dtype_from_name(record["dtype"]),
                   shape=tuple(int(size) for size in record["shape"]), crc32=int(record["crc32"]))


@dataclass(frozen=True)
class Manifest:
    key: str
    file_sizes: dict[str, int]  # the store's data shards
    entries: dict[str, TensorEntry]
    linked_files: dict[str, int] = field(default_factory=dict)  # absolute path -> size, never ours to delete


def load_manifest(path: Path, key: str) -> Manifest | None:
    """The manifest at `path` if it parses, has our format and `key`; None otherwise (untrusted)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("format") != MANIFEST_FORMAT or record.get("version") not in _READABLE_VERSIONS:
            return None
        if record.get("key") != key:
            return None
        file_sizes = {str(name): int(size) for name, size in record["files"].items()}
        linked = {str(name): int(size) for name, size in record.get("linked_files", {}).items()}
        entries = {name: TensorEntry.from_json(item) for name, item in record["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if any(not os.path.isabs(path) for path in linked) or any(os.path.isabs(name) for name in file_sizes):
        return None
    for entry in entries.values():
        kinds = {os.path.isabs(e.file) for e in entry.extents}  # one extent in a shard, or linked ones only
        if sum(e.nbytes for e in entry.extents) != entry.nbytes or kinds not in ({False}, {True}) or (
                kinds == {False} and len(entry.extents) != 1):
            return None
        for e in entry.extents:
            size = (linked if os.path.isabs(e.file) else file_sizes).get(e.file)
            aligned = os.path.isabs(e.file) or e.offset % ALIGNMENT == 0  # a linked file is as it is
            if size is None or not aligned or e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > size:
                return None
    return Manifest(key, file_sizes, entries, linked)


def files_have_recorded_sizes(folder: Path, manifest: Manifest) -> bool:
    for name, size in [*manifest.file_sizes.items(), *manifest.linked_files.items()]:
        try:
            if (folder / name).stat().st_size != size:  # an absolute name stays itself
                return False
        except OSError:
            return False
    return True


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write `manifest` to `path` atomically (temporary file, fsync, rename); the caller fsyncs
    the folder."""
    record = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "key": manifest.key,
        "alignment": ALIGNMENT,
        "checksum": "crc32",
        "files": manifest.file_sizes,
        "linked_files": manifest.linked_files,
        "tensors": {name: entry.to_json() for name, entry in manifest.entries.items()},
    }
    tmp_path = path.with_suffix(".json.tmp")
    with open(tmp_path, "w", encoding="utf-8") as tmp:
        json.dump(record, tmp)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp_path, path)


class InOrderCrc:
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
