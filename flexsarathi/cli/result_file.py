"""The output file of `flexsarathi generate`: append-only JSON lines, crash-safe and resumable.

- Every finished record is appended as one line and flushed at once (a killed process loses
  none); the file is fsynced at most once a second and when the job ends (a lost machine loses
  at most the last second).
- A sidecar `<output>.meta.json` records what produced the file (model, dtype, format, sampling
  defaults, seed). A rerun with the same configuration resumes: it skips the requests whose
  records are there; a different configuration is refused unless `overwrite`.
- One writer at a time: the job holds an OS file lock on `<output>.lock` (output_lock.py) from
  before it reads the file until it ends; a second job on the same file fails at once. The lock,
  the meta and the rejected lines are named by the output's real path (a symbolic link to it is
  the same output).
- Each record carries the fingerprint of the request it answers (request_files.FINGERPRINT): a
  resume whose input asks another request under a recorded id is refused (its record would be
  kept as the answer to a request it does not answer). Records without one (written before
  fingerprints) are trusted, as they were.
- `retry_errors` takes the error records out of the file, so their requests run again.
- A torn last line (the process died while writing it, with or without its newline) is cut off
  and its request redone. A damaged line elsewhere is refused unless `repair`, which moves it to
  `<output>.rejected` and redoes its request, keeping every good record. A record whose id is
  already in the file (two writers before the lock existed, a file concatenated by hand) is moved
  there too: one record per id, the first.
"""
from __future__ import annotations

import fcntl
import json
import os
import time

from flexsarathi.cli.output_lock import OutputLock
from flexsarathi.cli.request_files import FINGERPRINT, BatchRequest, is_error_record, record_key
from flexsarathi.errors import FlexSarathiError

FSYNC_INTERVAL_S = 1.0


class ResultFile:
    def __init__(self, path: str, fmt: str, meta: dict, overwrite: bool = False, repair: bool = False,
                 requests: list[BatchRequest] | None = None, retry_errors: bool = False):
        """requests: the job's, whose fingerprints the records of their ids must carry (None: not
        checked); retry_errors: error records are taken out, their requests redone."""
        self.path, self.fmt = path, fmt
        # Files named by the real path: two names of one output share its lock and meta, and a
        # rewrite (os.replace) replaces the file, not a symbolic link to it.
        self.real_path = os.path.realpath(path)
        self.meta_path = self.real_path + ".meta.json"
        self.rejected_path = self.real_path + ".rejected"
        self.done: set[str] = set()  # keys of the records already in the file
        self.errors = 0  # error records already in the file
        self.torn = False  # a torn last line was cut off
        self.rejected = 0  # damaged or duplicate lines moved to rejected_path by this open
        self.retried = 0  # error records taken out by this open (retry_errors)
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise FlexSarathiError(f"cannot create the folder of --output {path}: {exc.strerror}") from None
        self._lock = OutputLock(path)  # before the file is read: what we read stays what we resume
        try:
            self._open(meta, overwrite, repair, requests, retry_errors)
        except BaseException:
            self._lock.release()
            raise
        self._last_sync = time.monotonic()

    def _open(self, meta: dict, overwrite: bool, repair: bool, requests, retry_errors: bool) -> None:
        if overwrite:
            _remove(self.real_path)
            _remove(self.meta_path)
        elif os.path.exists(self.real_path) and os.path.getsize(self.real_path) > 0:
            self._check_meta(meta)
            self._read_existing(repair, requests, retry_errors)
        self._write_meta(meta)
        try:
            self._file = open(self.real_path, "ab")
        except OSError as exc:
            raise FlexSarathiError(f"cannot write --output {self.path}: {exc.strerror}") from None
        self._hold_file()

    def _hold_file(self) -> None:
        """The file itself locked while it is appended to: a hard link names it under another path,
        whose lock file (OutputLock: the real path + .lock) is another, and two jobs appending to one
        file would interleave their records. (A rewrite replaces the file: the link then names the
        old one, no longer this output.) Dropped when the file is closed."""
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise FlexSarathiError(f"--output {self.path} is being written by another job under another name (a "
                                   "hard link to the same file); wait for it to end or give another --output") from None

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

    def _read_existing(self, repair: bool, requests: list[BatchRequest] | None, retry_errors: bool) -> None:
        """Reads the records there; refuses (touching nothing) damaged lines without `repair` and
        records whose id the input now gives another request; then cuts a torn last line and
        rewrites the file without the damaged, duplicate and retried lines."""
        with open(self.real_path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1  # bytes up to the last complete line
        lines = data[:end].split(b"\n")[:-1]
        if lines and not _parses(lines[-1]):  # a damaged last line counts as torn too
            end -= len(lines.pop()) + 1
        kept, damaged, duplicates, retried = self._sort_lines(lines, retry_errors)
        if damaged and not repair:
            more = f" (and {len(damaged) - 1} more such lines)" if len(damaged) > 1 else ""
            raise FlexSarathiError(f"--output {self.path} line {damaged[0]} is not a record of this job{more}; "
                                   f"rerun with --repair to move the damaged lines to {self.rejected_path} "
                                   f"and redo their requests, keeping its {len(kept)} good records, or --overwrite "
                                   "to start afresh")
        if requests is not None:
            self._check_fingerprints(kept, requests)
        if end < len(data):
            os.truncate(self.real_path, end)
            self.torn = True
        if damaged or duplicates or retried:
            self._set_aside(lines, [number for number, *_ in kept], sorted(damaged + duplicates))
        self.retried = len(retried)

    def _sort_lines(self, lines: list[bytes], retry_errors: bool):
        """(kept [(line number, key, fingerprint, is an error record)], damaged, duplicate, retried
        line numbers), filling done and errors from the kept. One record per key: the first (a
        retried one included)."""
        kept, damaged, duplicates, retried, seen = [], [], [], [], set()
        for number, raw in enumerate(lines, 1):
            record = _parse(raw)
            key = record_key(self.fmt, record) if record is not None else None
            if key is None:
                damaged.append(number)
            elif key in seen:
                duplicates.append(number)
            elif retry_errors and is_error_record(record):
                retried.append(number)
            else:
                kept.append((number, key, record.get(FINGERPRINT), is_error_record(record)))
                self.done.add(key)
                self.errors += is_error_record(record)
            seen.add(key)
        return kept, damaged, duplicates, retried

    def _check_fingerprints(self, kept: list, requests: list[BatchRequest]) -> None:
        """Refuses a resume where a request of the input has an id whose record answers another
        request (the input changed since it was written): keeping it would be a wrong answer."""
        asked = {r.key: r for r in requests}
        stale = [(asked[key], error) for _, key, fingerprint, error in kept
                 if key in asked and fingerprint not in (None, asked[key].fingerprint)]
        if not stale:
            return
        req = stale[0][0]
        more = f" (and {len(stale) - 1} more such records)" if len(stale) > 1 else ""
        if all(error for _, error in stale):
            fix = "rerun with --retry-errors to redo the error records (the finished ones are kept)"
        else:
            numbered = " (a text file's ids are its line numbers: add new prompts at its end)" if self.fmt == "text" \
                else ""
            fix = (f"an id must name the same request in every run: give a changed request a new id{numbered}, "
                   "or pass --overwrite to start afresh")
        which = f"id {req.id!r}" if req.id is not None else f"line {req.line}"
        raise FlexSarathiError(f"--output {self.path} holds a record for {which} that answers another request than "
                               f"line {req.line} of the input{more}: the input changed since it was written; {fix}")

    def _set_aside(self, lines: list[bytes], kept: list[int], moved: list[int]) -> None:
        """Moves lines (1-based numbers) to the rejected file and rewrites the output with the kept
        ones (the others, retried error records, are dropped), in this order and each fsynced, so a
        crash between the two loses no line."""
        try:
            if moved:
                with open(self.rejected_path, "ab") as f:
                    f.write(b"".join(lines[n - 1] + b"\n" for n in moved))
                    f.flush()
                    os.fsync(f.fileno())
            tmp = self.real_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(b"".join(lines[n - 1] + b"\n" for n in kept))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.real_path)
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
        """Flush, fsync, close; the file closed and the lock released even where the flush fails
        (a full disk), so that the job, or a server's retry of it, can open the file again."""
        try:
            if not self._file.closed:
                try:
                    self._file.flush()
                    self.sync()
                finally:
                    self._file.close()
        finally:
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
