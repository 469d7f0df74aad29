"""The batch runner's thread (flexsarathi/serve/runner.py) against faults injected in its store."""
from __future__ import annotations

import errno
import io
import json
import os
import time

import pytest

pytest.importorskip("pydantic")

from flexsarathi.cli.result_file import ResultFile  # noqa: E402
from flexsarathi.serve import store as store_module  # noqa: E402
from flexsarathi.serve.batch_job import ServeEngine  # noqa: E402
from flexsarathi.serve.runner import BatchRunner  # noqa: E402
from flexsarathi.serve.schemas import Batch  # noqa: E402
from flexsarathi.serve.store import Store  # noqa: E402
from tests.flexsarathi.serve.full_disk import full_disk_open  # noqa: E402


class FailingStore(Store):
    """A store whose every write of the `doomed` batch's failure fails (an I/O error)."""

    doomed: str | None = None

    def update_batch(self, batch_id: str, **fields) -> Batch:
        if batch_id == self.doomed and fields.get("status") == "failed":
            raise OSError(errno.EIO, "Input/output error")
        return super().update_batch(batch_id, **fields)


def _batch(store: Store, file_id: str, status: str = "in_progress") -> Batch:
    return store.add_batch(Batch(id=f"batch_{time.perf_counter_ns()}", endpoint="/v1/completions", model="m",
                                 input_file_id=file_id, completion_window="24h", status=status,
                                 created_at=int(time.time())))


def _wait(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout  # a guard against a hang: the runner takes well under a second
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_batch_whose_end_cannot_be_recorded_leaves_the_runner_running(tmp_path):
    """Two batches over an input file that cannot be read (gone from the disk): the first one's failure
    cannot be written (the store raises OSError, twice: the finalize and its fallback). The thread
    logs it and goes on: the second batch is failed as it should be; the first stays in_progress
    (a restart retries it). Before, the error left the thread and every later batch waited forever."""
    store = FailingStore(str(tmp_path))
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


RECORDS = [{"id": "r1", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None},
           {"id": "r2", "custom_id": "b", "response": None, "error": {"code": "x", "message": "no"}}]


def _finalizing_on_a_full_disk(tmp_path, monkeypatch, rule: str = ".data.tmp"):
    """A store with a batch finalizing (as a restart finds one: its records written) and a disk
    that is full for the files matched by `rule` while full[0] (at first not); (store, engine,
    batch, full)."""
    full = [False]
    monkeypatch.setattr(store_module, "open", full_disk_open({rule: lambda: full[0]}), raising=False)
    store = Store(str(tmp_path))
    upload = store.add_upload(io.BytesIO(b'{"custom_id": "a"}\n'), "in.jsonl", "batch", max_bytes=100)
    engine = ServeEngine(llm=None, model_name="m", meta={"job": "test"}, sampling={}, seed=0)
    batch = _batch(store, upload.id, status="finalizing")
    out = ResultFile(store.results_path(batch.id), "openai", {**engine.meta, "batch": batch.id})
    for record in RECORDS:
        out.append(record)
    out.close()
    return store, engine, batch, full


def _paused(store, engine, batch_id: str, retry_s: float) -> tuple[BatchRunner, list[str]]:
    """A runner started on the store, once it has paused the batch."""
    lines: list[str] = []
    runner = BatchRunner(store, engine, log=lines.append)
    runner.DISK_RETRY_S = retry_s
    runner.start()
    _wait(lambda: any(f"batch {batch_id}: paused: the server's disk is full" in ln for ln in lines))
    assert any(f"batch {batch_id}: paused: the server's disk is full" in ln for ln in lines), lines
    return runner, lines


def test_a_full_disk_while_a_batch_finalizes_pauses_it_until_there_is_space(tmp_path, monkeypatch):
    """A batch finalizing on a full disk: writing its output file fails with ENOSPC. It is paused,
    not failed (before: failed, its finished records in no file a client can get): it stays
    finalizing, its result file untouched, nothing half-written is left; another batch meanwhile
    fails as it should (the thread goes on). Once the disk has space, the periodic retry completes
    it with every record in its files."""
    store, engine, paused, full = _finalizing_on_a_full_disk(tmp_path, monkeypatch)
    gone = store.add_upload(io.BytesIO(b'{"custom_id": "a"}\n'), "gone.jsonl", "batch", max_bytes=100)
    os.remove(store.file_path(gone.id))
    other = _batch(store, gone.id)
    results = open(store.results_path(paused.id), "rb").read()
    full[0] = True
    runner, lines = _paused(store, engine, paused.id, retry_s=0.5)
    try:
        _wait(lambda: store.get_batch(other.id).status == "failed")
        assert store.get_batch(other.id).status == "failed" and runner._thread.is_alive()
        batch = store.get_batch(paused.id)
        assert batch.status == "finalizing" and batch.output_file_id is None, lines
        assert open(store.results_path(paused.id), "rb").read() == results
        names = os.listdir(tmp_path / "files")  # no output file, not even a half-written one
        assert {n.split(".")[0] for n in names} == {paused.input_file_id, gone.id} and ".tmp" not in str(names)
        full[0] = False
        _wait(lambda: store.get_batch(paused.id).status == "completed", timeout=30)
        batch = store.get_batch(paused.id)
        assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        for file_id, record in ((batch.output_file_id, RECORDS[0]), (batch.error_file_id, RECORDS[1])):
            assert [json.loads(ln) for ln in open(store.file_path(file_id), "rb")] == [record]
        assert store.stored_bytes == sum(f.bytes for f in store.files.values())
    finally:
        runner.shutdown(10)


def test_a_batch_paused_by_a_full_disk_is_cancelled_at_once_once_there_is_space(tmp_path, monkeypatch):
    """A cancel while the disk is still full: its record cannot be written either, so the call
    fails (a 507) and nothing changes. With space, the cancel hands the paused batch to the
    thread at once (not at the next periodic retry): cancelled, its records in its files."""
    store, engine, paused, full = _finalizing_on_a_full_disk(tmp_path, monkeypatch, rule=".tmp")
    full[0] = True
    runner, _ = _paused(store, engine, paused.id, retry_s=1000)
    try:
        with pytest.raises(OSError) as caught:
            runner.cancel(paused.id)
        assert caught.value.errno == errno.ENOSPC and store.get_batch(paused.id).status == "finalizing"
        full[0] = False
        assert runner.cancel(paused.id).status == "cancelling"
        _wait(lambda: store.get_batch(paused.id).status == "cancelled", timeout=30)
        batch = store.get_batch(paused.id)
        assert batch.status == "cancelled" and batch.output_file_id and batch.error_file_id
    finally:
        runner.shutdown(10)
