"""The batch runner's thread (flexsarathi/serve/runner.py) against faults injected in its store."""
from __future__ import annotations

import io
import os
import time

import pytest

pytest.importorskip("pydantic")

from flexsarathi.serve.batch_job import ServeEngine  # noqa: E402
from flexsarathi.serve.runner import BatchRunner  # noqa: E402
from flexsarathi.serve.schemas import Batch  # noqa: E402
from flexsarathi.serve.store import Store  # noqa: E402


class FullDiskStore(Store):
    """A store whose every write of the `doomed` batch's failure fails, as on a full disk."""

    doomed: str | None = None

    def update_batch(self, batch_id: str, **fields) -> Batch:
        if batch_id == self.doomed and fields.get("status") == "failed":
            raise OSError(28, "No space left on device")
        return super().update_batch(batch_id, **fields)


def _batch(store: Store, file_id: str) -> Batch:
    return store.add_batch(Batch(id=f"batch_{time.perf_counter_ns()}", endpoint="/v1/completions", model="m",
                                 input_file_id=file_id, completion_window="24h", status="in_progress",
                                 created_at=int(time.time())))


def test_a_batch_whose_end_cannot_be_recorded_leaves_the_runner_running(tmp_path):
    """Two batches over an input file that cannot be read (gone from the disk): the first one's failure
    cannot be written (the store raises OSError, twice: the finalize and its fallback). The thread
    logs it and goes on: the second batch is failed as it should be; the first stays in_progress
    (a restart retries it). Before, the error left the thread and every later batch waited forever."""
    store = FullDiskStore(str(tmp_path))
    upload = store.add_upload(io.BytesIO(b'{"custom_id": "a"}\n'), "in.jsonl", "batch", max_bytes=100)
    os.remove(store.file_path(upload.id))
    first, second = _batch(store, upload.id), _batch(store, upload.id)
    store.doomed = first.id
    lines: list[str] = []
    engine = ServeEngine(llm=None, model_name="m", meta={}, sampling={}, seed=0)  # never reached: no request runs
    runner = BatchRunner(store, engine, log=lines.append)
    runner.start()
    try:
        deadline = time.monotonic() + 120  # a guard against a hang: the runner takes well under a second
        while store.get_batch(second.id).status != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get_batch(second.id).status == "failed"
        assert store.get_batch(second.id).errors.data[0].code == "invalid_file"
        assert runner._thread.is_alive()
        assert store.get_batch(first.id).status == "in_progress"
        assert any(f"batch {first.id}: its end could not be recorded" in line for line in lines)
    finally:
        runner.shutdown(10)
