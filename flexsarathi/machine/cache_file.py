"""The per-machine measurement caches (the CPU dtype choice, this machine's hardware profile): a
small JSON file of entries, one per machine key, in `$FLEXSARATHI_CACHE_DIR` or ~/.cache/flexsarathi.
A file that cannot be read or parsed counts as empty (measured again and rewritten); one that
cannot be written costs a measurement next time, never the run."""
from __future__ import annotations

import json
import logging
import os
import tempfile

log = logging.getLogger(__name__)


def cache_path(name: str) -> str:
    folder = os.environ.get("FLEXSARATHI_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                      "flexsarathi")
    return os.path.join(folder, name)


def read_entries(path: str) -> list[dict]:
    """The cache's entries; [] for a missing, unreadable or malformed file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return []
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return []
    return entries


def write_entries(path: str, entries: list[dict], what: str) -> None:
    """Replace the cache atomically (warned, not raised, where it cannot be written)."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not write the %s cache %s: %s (measured again next run)", what, path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def keep_others(entries: list[dict], key: dict, most: int) -> list[dict]:
    """The newest entries of other keys, at most `most` - 1 of them: room for this key's."""
    return [e for e in entries if e.get("key") != key][-(most - 1):]
