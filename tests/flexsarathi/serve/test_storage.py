"""`flexsarathi serve`'s storage, against the real server process: the --max-storage-mib quota, and a
full disk (ENOSPC, emulated by the process's hooks: serve_process.py, full_disk.py) under an upload,
a batch's creation and a batch's result writing. Each gets one clear answer; nothing half-written
stays; finished results are kept; the server stays up."""
from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.flexsarathi.serve.serve_process import (Server, completion, downloaded, submit,  # noqa: E402
                                                   wait_for_file, wait_until_ended, write_lines)
from tests.flexsarathi.serve.test_serve import by_request, generated  # noqa: E402

LIMIT = 1 << 20  # --max-storage-mib 1
MARKERS = ("hold", "enospc-upload", "enospc-record", "enospc-results", "enospc-spool")


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("storage") / "data", "--model", stories_dir, "--dtype", "float32",
                 "--max-storage-mib", "1").start()
    yield srv
    for marker in MARKERS:
        (srv.data_dir / marker).unlink(missing_ok=True)
    srv.stop()


def _upload(client, size: int):
    return client.files.create(file=("in.jsonl", b"x" * size), purpose="batch")


def _data_files(server) -> list[str]:
    return sorted(p.name for p in (server.data_dir / "files").iterdir())


def _refused(client, size: int, status: int):
    with pytest.raises(openai.APIStatusError) as caught:
        _upload(client, size)
    assert caught.value.status_code == status, caught.value
    return caught.value


def test_an_upload_past_the_storage_limit_gets_413_until_files_are_deleted(server):
    """413 in OpenAI's shape (a client's to fix, as the openai client does not retry it): it names the
    limit, what is stored and how to free space; nothing kept. A delete makes room; a restart counts
    the files already stored."""
    client = server.client()
    first = _upload(client, 600_000)
    stored, files = sum(f.bytes for f in client.files.list()), _data_files(server)
    error = _refused(client, 600_000, 413)
    assert error.code == "storage_limit_exceeded" and error.body["type"] == "invalid_request_error"
    assert f"storage limit is {LIMIT} bytes (--max-storage-mib): {stored} bytes are stored" in error.body["message"]
    assert "DELETE /v1/files/{file_id}" in error.body["message"]
    assert _data_files(server) == files
    client.files.delete(first.id)
    second = _upload(client, 600_000)

    server.stop()
    client = server.start().client()  # the files stored are counted at start-up
    assert f"{sum(f.bytes for f in client.files.list())} bytes stored, limit {LIMIT}" in server.output()
    assert _refused(client, 600_000, 413).code == "storage_limit_exceeded"
    client.files.delete(second.id)
    client.files.delete(_upload(client, 600_000).id)


@pytest.mark.parametrize("marker", ["enospc-upload", "enospc-record", "enospc-spool"])
def test_a_full_disk_under_an_upload_gets_507_and_keeps_nothing(server, marker):
    """ENOSPC while the upload's data is written, or its record, or while the request's body is
    spooled to a temporary file (before: a 400 "error parsing the body"): one 507 saying the disk
    is full (not a 500 calling it a bug), the partial file removed; with space again the upload
    works. A batch created while records cannot be written gets the same 507, and no batch is made."""
    client = server.client()
    kept = _upload(client, 100)
    files, batches = _data_files(server), client.batches.list().data
    (server.data_dir / marker).touch()
    try:
        error = _refused(client, 3000, 507)
        assert error.code == "disk_full" and error.body["type"] == "server_error"
        assert error.body["message"].startswith("the server's disk is full: No space left on device")
        assert _data_files(server) == files
        if marker == "enospc-record":
            with pytest.raises(openai.InternalServerError) as caught:
                client.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h")
            assert caught.value.status_code == 507 and caught.value.code == "disk_full"
            assert client.batches.list().data == batches
            assert not [p for p in (server.data_dir / "batches").iterdir() if p.name.endswith(".tmp")]
    finally:
        (server.data_dir / marker).unlink()
    assert client.models.list().data and _upload(client, 3000).bytes == 3000


def _wait_for_log(server, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.output():
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.02)


def test_a_full_disk_while_a_batch_writes_results_pauses_it_and_it_resumes(server, stories_dir, tmp_path):
    """The first record is written; the disk fills as the second is (half of its line lands). The
    batch is paused, not failed: it stays in_progress, its written record intact, while the server
    answers. A delete (space freed) resumes it: the torn line is cut off and redone, and the
    records equal `generate`'s, each request once."""
    client = server.client()
    src = write_lines(tmp_path / "batch.jsonl", [completion(f"r{i}", p) for i, p in enumerate(
        ["Once upon a time", "Lily wanted to", "The little dog", "One day, a bird"])])
    (server.data_dir / "hold").touch()
    try:
        batch = submit(client, src)
        wait_for_file(server.data_dir / "held")  # the first record is written
        (server.data_dir / "enospc-results").touch()
    finally:
        (server.data_dir / "hold").unlink()
    try:
        _wait_for_log(server, f"batch {batch.id}: paused: the server's disk is full")
        results = (server.data_dir / "batches" / batch.id / "results.jsonl").read_bytes()
        first, torn = results.split(b"\n", 1)
        assert json.loads(first)["custom_id"] == "r0" and torn and b"\n" not in torn  # half a line
        assert client.batches.retrieve(batch.id).status == "in_progress" and client.models.list().data
    finally:
        (server.data_dir / "enospc-results").unlink()
    client.files.delete(_upload(client, 10).id)  # space freed: the paused batch goes on (not in 60 s)
    batch = wait_until_ended(client, batch.id, timeout=30)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    output = client.files.content(batch.output_file_id).content
    assert output.startswith(first + b"\n")  # the record written before the disk filled, as it was
    assert by_request(downloaded(client, batch.output_file_id)) == generated(stories_dir, src, tmp_path)
