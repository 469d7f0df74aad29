"""Thread pools for the array work of reading weights (drawing a dummy layer's tensors, decoding a
GGUF tensor's chunks of rows): numpy's and torch's array operations release the GIL, so the pieces
run on the cores side by side. One pool per purpose, made on first use and kept for the process;
a task never waits on its own pool (that could deadlock it)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

MAX_WORKERS = 8

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def worker_pool(name: str) -> ThreadPoolExecutor:
    """The process's pool called `name` (its threads' name prefix), as many threads as the cores, up
    to MAX_WORKERS."""
    with _LOCK:
        if name not in _POOLS:
            _POOLS[name] = ThreadPoolExecutor(min(MAX_WORKERS, os.cpu_count() or 1), thread_name_prefix=name)
        return _POOLS[name]
