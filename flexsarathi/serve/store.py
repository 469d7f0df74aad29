"""The server's files and batch records, on disk under --data-dir, so they survive a restart:

    DATA/server.lock                  held (flock) by the one server using DATA
    DATA/files/<id>.data, <id>.json   an uploaded or produced file, and its FileObject
    DATA/batches/<id>.json            a batch's Batch object
    DATA/batches/<id>/results.jsonl   its records as they finish (flexsarathi.cli.result_file)

Every JSON record is replaced atomically (written aside, fsynced, renamed), so a kill -9 leaves the
old record or the new one, never half of one. Request counts change in memory as requests finish
and are written with the batch's next status change: on a restart they are recounted from the
batch's result file, which is the truth about finished requests.

Storage: `stored_bytes` is the total size of the files (uploads and batch outputs), counted from the
records on start. With a limit (--max-storage-mib), an upload reserves its bytes chunk by chunk as
they stream in, under the lock, so two uploads at once cannot both pass it (StorageFull: nothing
kept); a batch's output files are always written (refusing them would lose finished work) and
counted, so they may take the total past the limit. A full disk (ENOSPC, EDQUOT) in an upload
leaves nothing behind: the OSError goes on to the caller (disk_full names it).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
import threading
import time
import uuid
from typing import BinaryIO

from flexsarathi.errors import FlexSarathiError, in_chain
from flexsarathi.serve.schemas import FINAL_STATUSES, Batch, FileObject

COPY_CHUNK = 1 << 20
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class FileTooLarge(Exception):
    """An upload over the server's limit (its bytes are not kept)."""


class StorageFull(Exception):
    """An upload that would take the stored files past the storage limit (its bytes are not kept)."""

    def __init__(self, limit: int, stored: int, files: int, pending: int, needed: int):
        super().__init__(f"{needed} bytes would pass the storage limit of {limit} ({stored} stored)")
        self.limit, self.stored, self.files, self.pending, self.needed = limit, stored, files, pending, needed


def disk_full(exc: BaseException | None) -> OSError | None:
    """The full-disk OSError (ENOSPC, EDQUOT) behind an exception, itself or one it was raised
    from or during (a FlexSarathiError raised `from None` in an `except OSError` keeps it as its
    context); None when no full disk is behind it."""
    return in_chain(exc, lambda e: isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS)


class Store:
    """Files and batches in memory and on disk; every method is safe to call from any thread (one
    lock, held only for dictionary work and small JSON writes, never across a pass)."""

    def __init__(self, data_dir: str, max_stored_bytes: int | None = None):
        """max_stored_bytes: the storage limit for uploads (None: none)."""
        self.data_dir = os.path.abspath(data_dir)
        self.files_dir = os.path.join(self.data_dir, "files")
        self.batches_dir = os.path.join(self.data_dir, "batches")
        for folder in (self.files_dir, self.batches_dir):
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise FlexSarathiError(f"--data-dir {data_dir}: cannot create {folder}: {exc.strerror}") from None
        self._lock_file = _hold_server_lock(self.data_dir)
        self.lock = threading.RLock()
        self.files: dict[str, FileObject] = {}
        self.batches: dict[str, Batch] = {}
        self._order: dict[str, int] = {}  # id -> creation order (created_at is whole seconds)
        self.max_stored_bytes = max_stored_bytes
        self.stored_bytes = 0  # the files' bytes (their records'), under the lock
        self._reserved_bytes = 0  # bytes of uploads in flight, under the lock
        self._load()

    # ---- files --------------------------------------------------------------------------------
    def add_upload(self, source: BinaryIO, filename: str, purpose: str, max_bytes: int) -> FileObject:
        """Copy an upload into the store; FileTooLarge past max_bytes, StorageFull past the storage
        limit, OSError where the disk fails (full: see disk_full). Nothing is kept but a whole file."""
        file_id = "file-" + uuid.uuid4().hex[:24]
        data_path = self.file_path(file_id)
        size = self._copy_in(source, data_path, max_bytes)
        try:
            return self._add_file(FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                                             filename=filename, purpose=purpose), reserved=size)
        except BaseException:  # its record not written (a full disk): the data goes, and its reservation
            _remove(data_path)
            self._reserve(-size)
            raise

    def _copy_in(self, source: BinaryIO, data_path: str, max_bytes: int) -> int:
        """The upload's bytes to data_path, each chunk reserved before it is written; its size (still
        reserved). On any failure nothing is written and nothing stays reserved."""
        size = 0
        try:
            with open(data_path + ".tmp", "wb") as out:
                while chunk := source.read(COPY_CHUNK):
                    if size + len(chunk) > max_bytes:
                        raise FileTooLarge(size + len(chunk))
                    self._reserve(len(chunk), size)
                    size += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(data_path + ".tmp", data_path)
            return size
        except BaseException:
            self._reserve(-size)
            raise
        finally:
            _remove(data_path + ".tmp")

    def _reserve(self, count: int, already: int = 0) -> None:
        """Reserve `count` more bytes for an upload that has `already` reserved (a negative count
        returns them); StorageFull, nothing reserved, where they would pass the limit."""
        with self.lock:
            total = self.stored_bytes + self._reserved_bytes + count
            if count > 0 and self.max_stored_bytes is not None and total > self.max_stored_bytes:
                raise StorageFull(self.max_stored_bytes, self.stored_bytes, len(self.files),
                                  self._reserved_bytes - already, already + count)
            self._reserved_bytes += count

    def add_output(self, batch_id: str, kind: str, data: bytes) -> FileObject:
        """A batch's output or error file. Its id is derived from the batch, so writing it again
        after a crash in the middle of finalizing replaces it instead of adding another."""
        file_id = "file-" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
        _write_atomically(self.file_path(file_id), data)
        return self._add_file(FileObject(id=file_id, bytes=len(data), created_at=int(time.time()),
                                         filename=f"{batch_id}_{kind}.jsonl", purpose="batch_output"))

    def _add_file(self, record: FileObject, reserved: int = 0) -> FileObject:
        """Write the file's record and count its bytes (those of the record it replaces, an output
        written again, no longer; `reserved` bytes of an upload, now stored, no longer reserved)."""
        with self.lock:
            self._order.setdefault(record.id, self._next_order())
            _write_json(self._file_record_path(record.id), {"order": self._order[record.id],
                                                            "file": record.model_dump()})
            replaced = self.files.get(record.id)
            self.stored_bytes += record.bytes - (replaced.bytes if replaced else 0)
            self._reserved_bytes -= reserved
            self.files[record.id] = record
            return record

    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.data")

    def _file_record_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.json")

    def get_file(self, file_id: str) -> FileObject | None:
        with self.lock:
            return self.files.get(file_id)

    def delete_file(self, file_id: str) -> None:
        with self.lock:
            self.stored_bytes -= self.files.pop(file_id).bytes
            _remove(self._file_record_path(file_id))  # the record first: a crash leaves no listed file without data
            _remove(self.file_path(file_id))

    def batch_using(self, file_id: str) -> Batch | None:
        """A batch not yet ended that reads this file (it must not be deleted under it)."""
        with self.lock:
            return next((b for b in self.batches.values()
                         if b.input_file_id == file_id and b.status not in FINAL_STATUSES), None)

    def list_files(self, purpose: str | None, order: str) -> list[FileObject]:
        with self.lock:
            chosen = [f for f in self.files.values() if purpose is None or f.purpose == purpose]
            return sorted(chosen, key=lambda f: self._order[f.id], reverse=order == "desc")

    # ---- batches ------------------------------------------------------------------------------
    def add_batch(self, batch: Batch) -> Batch:
        with self.lock:
            self._order[batch.id] = self._next_order()
            return self._save_batch(batch)

    def get_batch(self, batch_id: str) -> Batch | None:
        with self.lock:
            batch = self.batches.get(batch_id)
            return batch.model_copy(deep=True) if batch else None

    def update_batch(self, batch_id: str, **fields) -> Batch:
        """Set fields (a new status stamps its `<status>_at` time) and write the record."""
        with self.lock:
            batch = self.batches[batch_id]
            status = fields.get("status", batch.status)
            if status != batch.status and status != "validating":
                fields.setdefault(_stamp_field(status), int(time.time()))
            return self._save_batch(batch.model_copy(update=fields))

    def count_requests(self, batch_id: str, completed: int = 0, failed: int = 0) -> None:
        """Finished requests, in memory only (see the module's docstring)."""
        with self.lock:
            counts = self.batches[batch_id].request_counts
            counts.completed += completed
            counts.failed += failed

    def _save_batch(self, batch: Batch) -> Batch:
        _write_json(os.path.join(self.batches_dir, f"{batch.id}.json"),
                    {"order": self._order[batch.id], "batch": batch.model_dump()})
        self.batches[batch.id] = batch
        return batch.model_copy(deep=True)

    def list_batches(self) -> list[Batch]:
        """Newest first, as OpenAI lists them."""
        with self.lock:
            ordered = sorted(self.batches.values(), key=lambda b: self._order[b.id], reverse=True)
            return [b.model_copy(deep=True) for b in ordered]

    def next_batch(self, skip: set[str]) -> Batch | None:
        """The oldest batch that has not ended, leaving out `skip`: batches run in the order they
        were created."""
        with self.lock:
            waiting = [b for b in self.batches.values() if b.status not in FINAL_STATUSES and b.id not in skip]
            oldest = min(waiting, key=lambda b: self._order[b.id], default=None)
            return oldest.model_copy(deep=True) if oldest else None

    def results_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, batch_id, "results.jsonl")

    # ---- loading ------------------------------------------------------------------------------
    def _next_order(self) -> int:
        return max(self._order.values(), default=0) + 1

    def _load(self) -> None:
        for folder, key, model, target in ((self.files_dir, "file", FileObject, self.files),
                                           (self.batches_dir, "batch", Batch, self.batches)):
            for name in sorted(os.listdir(folder)):
                if not name.endswith(".json"):
                    continue
                path = os.path.join(folder, name)
                try:
                    with open(path, encoding="utf-8") as f:
                        saved = json.load(f)
                    record = model.model_validate(saved[key])
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise FlexSarathiError(f"--data-dir: {path} is not a record this server wrote ({exc}); "
                                           "move it away to start") from None
                if not _answerable(record, path):
                    continue
                target[record.id] = record
                self._order[record.id] = int(saved["order"])
        self.stored_bytes = sum(f.bytes for f in self.files.values())
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """What a server killed mid-write left in files/ (this one holds the folder's lock): an
        upload's partial `.tmp`, and data whose record was never written (an upload killed between
        the two, or an output, which its batch's finalizing writes again)."""
        names = set(os.listdir(self.files_dir))
        for name in names:
            orphan = name.endswith(".data") and name.removesuffix(".data") + ".json" not in names
            if name.endswith(".tmp") or orphan:
                _remove(os.path.join(self.files_dir, name))


def _answerable(record: FileObject | Batch, path: str) -> bool:
    """Whether a record can be answered. One a server before the check on every field kept with a
    client's lone surrogate in it (a batch's metadata; a file name sent with charset=utf-7) cannot
    be: left out, with a line on stderr, so that it makes no listing fail for every client (it stays
    on disk, and a batch of it that has not ended does not run)."""
    try:
        record.model_dump_json()
        return True
    except ValueError as exc:  # pydantic's serialization error
        print(f"--data-dir: {path} left out (not listed, not run): it holds text that is not valid Unicode, "
              f"which no answer can hold ({exc})", file=sys.stderr, flush=True)
        return False


def _stamp_field(status: str) -> str:
    """The Batch field that records when `status` began (OpenAI's names)."""
    return {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
            "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
            "cancelled": "cancelled_at"}[status]


def _hold_server_lock(data_dir: str):
    """One server per data folder: two would run the same batches into the same result files."""
    path = os.path.join(data_dir, "server.lock")
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise FlexSarathiError(f"--data-dir {data_dir} is in use by another flexsarathi serve (pid {holder}); "
                               "stop it or give another --data-dir") from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle  # kept open: the lock lasts as long as the process, kill -9 included


def _write_json(path: str, value) -> None:
    _write_atomically(path, json.dumps(value, indent=1).encode())


def _write_atomically(path: str, data: bytes) -> None:
    """The file at `path` replaced by `data` whole, or (a full disk) left as it was, no `.tmp` left."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
