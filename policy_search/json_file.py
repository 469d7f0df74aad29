"""Reading the small JSON files users hand the planner (policies, hardware profiles) and naming
their unknown keys. Stdlib only: policy.py, a leaf, uses it.

Every way such a file can be unusable is one error of the caller's class naming the file: missing,
a folder, unreadable, far too large (a checkpoint passed by mistake is not read into memory),
not UTF-8, not JSON, or nested past what the json module can parse.
"""
from __future__ import annotations

import difflib
import json
import os

# A policy or hardware profile is a few KB; a file this large is something else (a checkpoint,
# a log) and is refused before it is read.
MAX_JSON_BYTES = 1 << 20


def read_json_file(path: str | os.PathLike, what: str, error: type[Exception]):
    """The parsed JSON of the file `what` (e.g. "policy file") at `path`; `error` naming it otherwise."""
    where = f"{what} {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_JSON_BYTES:
                raise error(f"{where} is {os.fstat(f.fileno()).st_size} bytes, larger than any {what} "
                            f"({MAX_JSON_BYTES} at most): is it the right file?")
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise error(f"{where} does not exist") from None
    except IsADirectoryError:
        raise error(f"{where} is a folder, not a JSON file") from None
    except OSError as exc:
        raise error(f"{where} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_JSON_BYTES:  # a pipe or special file that fstat gives no size for
        raise error(f"{where} holds more than {MAX_JSON_BYTES} bytes, more than any {what}: is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:  # json's decoder recurses once per level: [[[[...]]]] thousands deep
        raise error(f"{where} is not valid JSON: nested too deeply") from None


def unknown_keys(unknown: list[str], known) -> str:
    """"['gpu_batchsize']; did you mean 'gpu_batch_size' for 'gpu_batchsize'?": the unknown keys,
    then the nearest known key of each that has a close one (request_files.py's wording)."""
    hints = [f"did you mean {close[0]!r} for {key!r}?" for key in unknown
             if (close := difflib.get_close_matches(str(key), sorted(known), n=1))]
    return "; ".join([str(unknown)] + hints)
