"""The output file of `flexsarathi generate`: append-only JSON lines, crash-safe and resumable.

- Every finished record is appended as one line and flushed at once (a killed process loses
  none); the file is fsynced at most once a second and when the job ends (a lost machine loses
  at most the last second).
- A sidecar `<output>.meta.json` records what produced the file (model, dtype, format, sampling
  defaults, seed). A rerun with the same configuration resumes: it skips the requests whose
  records are there; a different configuration is refused unless `overwrite`.
- One writer at a time: the job holds an OS file lock on `<output>.lock` (output_lock.py) from
  before it reads the file until it ends; a second job on the same file fails at once.
- A torn last line (the process died while writing it, with or without its newline) is cut off
  and its request redone. A damaged line elsewhere is refused unless `repair`, which moves it to
  `<output>.rejected` and redoes its request, keeping every good record. A record whose id is
  already in the file (two writers before the lock existed, a file concatenated by hand) is moved
  there too: one record per id, the first.
"""
from __future__ import annotations

import json
import os
import time

from flexsarathi.cli.output_lock import OutputLock
from flexsarathi.cli.request_files import is_error_record, record_key
from flexsarathi.errors import FlexSarathiError

FSYNC_INTERVAL_S = 1.0


class ResultFile:
    def __init__(self, path: str, fmt: str, meta: dict, overwrite: bool = False, repair: bool = False):
        self.path, self.fmt = path, fmt
        self.meta_path = path + ".meta.json"
        self.rejected_path = path + ".rejected"
        self.done: set[str] = set()  # keys of the records already in the file
        self.errors = 0  # error records already in the file
        self.torn = False  # a torn last line was cut off
        self.rejected = 0  # damaged or duplicate lines moved to rejected_path by this open
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise FlexSarathiError(f"cannot create the folder of --output {path}: {exc.strerror}") from None
        self._lock = OutputLock(path)  # before the file is read: what we read stays what we resume
        try:
            self._open(meta, overwrite, repair)
        except BaseException:
            self._lock.release()
            raise
        self._last_sync = time.monotonic()

    def _open(self, meta: dict, overwrite: bool, repair: bool) -> None:
        if overwrite:
            _remove(self.path)
            _remove(self.meta_path)
        elif os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            self._check_meta(meta)
            self._read_existing(repair)
        self._write_meta(meta)
        try:
            self._file = open(self.path, "ab")
        except OSError as exc:
            raise FlexSarathiError(f"cannot write --output {self.path}: {exc.strerror}") from None

    def _check_meta(self, meta: dict) -> None:
        try:
            with open(self.meta_path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError):
            raise FlexSarathiError(f"--output {self.path} exists but {self.meta_path} (what produced it) is "
                                   "missing or unreadable; pass --overwrite to start it afresh") from None
        changed = sorted(k for k in set(meta) | set(old) if meta.get(k) != old.get(k))
        if changed:
            diffs = "; ".join(f"{k}: {old.get(k)!r} -> {meta.get(k)!r}" for k in changed)
            raise FlexSarathiError(f"--output {self.path} was written with another configuration ({diffs}); "
                                   "rerun with the same settings to resume, or pass --overwrite")

    def _read_existing(self, repair: bool) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1  # bytes up to the last complete line
        lines = data[:end].split(b"\n")[:-1]
        if lines and not _parses(lines[-1]):  # a damaged last line counts as torn too
            end -= len(lines.pop()) + 1
        if end < len(data):
            os.truncate(self.path, end)
            self.torn = True
        kept, damaged, duplicates = [], [], []
        for number, raw in enumerate(lines, 1):
            record = _parse(raw)
            key = record_key(self.fmt, record) if record is not None else None
            if key is None:
                damaged.append(number)
            elif key in self.done:
                duplicates.append(number)
            else:
                kept.append(number)
                self.done.add(key)
                self.errors += is_error_record(record)
        if damaged and not repair:
            more = f" (and {len(damaged) - 1} more such lines)" if len(damaged) > 1 else ""
            raise FlexSarathiError(f"--output {self.path} line {damaged[0]} is not a record of this job{more}; "
                                   f"rerun with --repair to move the damaged lines to {self.rejected_path} "
                                   f"and redo their requests, keeping its {len(kept)} good records, or --overwrite "
                                   "to start afresh")
        if damaged or duplicates:
            self._set_aside(lines, kept, sorted(damaged + duplicates))

    def _set_aside(self, lines: list[bytes], kept: list[int], moved: list[int]) -> None:
        """Moves lines (1-based numbers) to the rejected file and rewrites the output with the kept
        ones, in this order and each fsynced, so a crash between the two loses no line."""
        try:
            with open(self.rejected_path, "ab") as f:
                f.write(b"".join(lines[n - 1] + b"\n" for n in moved))
                f.flush()
                os.fsync(f.fileno())
            tmp = self.path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(b"".join(lines[n - 1] + b"\n" for n in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise FlexSarathiError(f"cannot set aside the damaged or duplicate lines of --output {self.path}: "
                                   f"{exc.strerror}") from None
        self.rejected = len(moved)

    def _write_meta(self, meta: dict) -> None:
        tmp = self.meta_path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.meta_path)
        except OSError as exc:
            raise FlexSarathiError(f"cannot write {self.meta_path}: {exc.strerror}") from None

    def append(self, record: dict) -> None:
        """One record as one line: written and flushed now (fsynced at most once a second)."""
        self._file.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        self._file.flush()
        if time.monotonic() - self._last_sync >= FSYNC_INTERVAL_S:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self.sync()
            self._file.close()
        self._lock.release()


def _parse(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _parses(raw: bytes) -> bool:
    return _parse(raw) is not None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
