"""The output file of `flexsarathi generate`: append-only JSON lines, crash-safe and resumable.

- Every finished record is appended as one line and flushed at once (a killed process loses
  none); the file is fsynced at most once a second and when the job ends (a lost machine loses
  at most the last second).
- A sidecar `<output>.meta.json` records what produced the file (model, dtype, format, sampling
  defaults, seed). A rerun with the same configuration resumes: it skips the requests whose
  records are there; a different configuration is refused unless `overwrite`.
- A torn last line (the process died while writing it) is cut off and its request redone; a
  damaged line elsewhere is refused (the file is not one we wrote whole).
"""
from __future__ import annotations

import json
import os
import time

from flexsarathi.cli.request_files import is_error_record, record_key
from flexsarathi.errors import FlexSarathiError

FSYNC_INTERVAL_S = 1.0


class ResultFile:
    def __init__(self, path: str, fmt: str, meta: dict, overwrite: bool = False):
        self.path, self.fmt = path, fmt
        self.meta_path = path + ".meta.json"
        self.done: set[str] = set()  # keys of the records already in the file
        self.errors = 0  # error records already in the file
        self.torn = False  # a torn last line was cut off
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise FlexSarathiError(f"cannot create the folder of --output {path}: {exc.strerror}") from None
        if overwrite:
            _remove(path)
            _remove(self.meta_path)
        elif os.path.exists(path) and os.path.getsize(path) > 0:
            self._check_meta(meta)
            self._read_existing()
        self._write_meta(meta)
        try:
            self._file = open(path, "ab")
        except OSError as exc:
            raise FlexSarathiError(f"cannot write --output {path}: {exc.strerror}") from None
        self._last_sync = time.monotonic()

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

    def _read_existing(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1  # bytes up to the last complete line
        lines = data[:end].split(b"\n")[:-1]
        if lines and not _parses(lines[-1]):  # a damaged last line counts as torn too
            end -= len(lines.pop()) + 1
        if end < len(data):
            os.truncate(self.path, end)
            self.torn = True
        for number, raw in enumerate(lines, 1):
            record = _parse(raw)
            key = record_key(self.fmt, record) if record is not None else None
            if key is None:
                raise FlexSarathiError(f"--output {self.path} line {number} is not a record of this job; "
                                       "pass --overwrite to start it afresh")
            self.done.add(key)
            self.errors += is_error_record(record)

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
