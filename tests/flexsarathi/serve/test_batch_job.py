"""serve/batch_job.py: creates reading input files whole, at most READING_AT_ONCE at once."""
from __future__ import annotations

import json
import threading
import time

from flexsarathi.cli.request_files import COMPLETIONS_URL
from flexsarathi.serve import batch_job


def test_parallel_creates_read_their_input_files_two_at_a_time(tmp_path, monkeypatch):
    """Eight creates at once (FastAPI's thread pool runs 40): the real reader runs for at most
    READING_AT_ONCE of them at a time (each holds ~4x its file's bytes of parsed requests); every
    create still counts its file's requests."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": COMPLETIONS_URL,
              "body": {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}} for i in range(5)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read, lock, gate = batch_job.read_batch_requests, threading.Lock(), threading.Event()
    state = {"inside": 0, "most": 0, "arrived": 0}

    def reading(*args):  # the real reader, held until every create has arrived
        with lock:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        gate.wait(timeout=60)
        try:
            return read(*args)
        finally:
            with lock:
                state["inside"] -= 1

    monkeypatch.setattr(batch_job, "read_batch_requests", reading)
    counts = []

    def create():
        with lock:
            state["arrived"] += 1
        counts.append(batch_job.validate_input(str(path), "file-x", COMPLETIONS_URL))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    # every create has arrived and READING_AT_ONCE are reading; the others wait at the semaphore
    # (without it they would be reading too: a second lets them show it)
    arrived = threading.Event()
    for _ in range(200):
        with lock:
            if state["arrived"] == 8 and state["inside"] == batch_job.READING_AT_ONCE:
                arrived.set()
                break
        time.sleep(0.01)
    time.sleep(1.0)
    most = state["most"]
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert arrived.is_set() and most == batch_job.READING_AT_ONCE == 2
    assert counts == [5] * 8
