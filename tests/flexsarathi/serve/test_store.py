"""The server's store on disk: one server per data folder, records that survive a restart, and a
folder holding something the server did not write refused with the file named."""
from __future__ import annotations

import io
import time

import pytest

pytest.importorskip("pydantic")

from flexsarathi.errors import FlexSarathiError  # noqa: E402
from flexsarathi.serve.schemas import Batch, BatchList  # noqa: E402
from flexsarathi.serve.store import FileTooLarge, Store  # noqa: E402


def _batch(store: Store, file_id: str, status: str = "in_progress") -> Batch:
    return store.add_batch(Batch(id=f"batch_{time.perf_counter_ns()}", endpoint="/v1/completions", model="m",
                                 input_file_id=file_id, completion_window="24h", status=status,
                                 created_at=int(time.time())))


def test_one_server_per_data_dir(tmp_path):
    first = Store(str(tmp_path))
    with pytest.raises(FlexSarathiError, match="in use by another flexsarathi serve"):
        Store(str(tmp_path))
    first._lock_file.close()  # what the process's exit (kill -9 included) does
    Store(str(tmp_path))


def test_records_survive_a_restart_and_batches_keep_their_order(tmp_path):
    store = Store(str(tmp_path))
    upload = store.add_upload(io.BytesIO(b'{"a": 1}\n'), "in.jsonl", "batch", max_bytes=100)
    with pytest.raises(FileTooLarge):
        store.add_upload(io.BytesIO(b"x" * 101), "big.jsonl", "batch", max_bytes=100)
    batches = [_batch(store, upload.id) for _ in range(3)]
    store.update_batch(batches[0].id, status="completed")
    store.count_requests(batches[1].id, completed=2)  # in memory only: recounted from results on a restart
    store._lock_file.close()

    again = Store(str(tmp_path))
    assert list(again.files) == [upload.id] and again.get_file(upload.id) == upload
    assert again.get_batch(batches[0].id).status == "completed" and again.get_batch(batches[0].id).completed_at
    assert again.next_batch(skip=set()).id == batches[1].id  # the oldest that has not ended
    assert again.next_batch(skip={batches[1].id}).id == batches[2].id
    assert [b.id for b in again.list_batches()] == [b.id for b in reversed(batches)]
    assert not [p for p in (tmp_path / "files").iterdir() if p.name.endswith(".tmp")]


def test_a_record_not_written_by_the_server_is_named(tmp_path):
    Store(str(tmp_path))._lock_file.close()
    (tmp_path / "batches" / "batch_x.json").write_text("{not json")
    with pytest.raises(FlexSarathiError, match="batch_x.json is not a record this server wrote"):
        Store(str(tmp_path))


def test_a_record_holding_a_lone_surrogate_is_left_out_and_the_rest_listed(tmp_path, capsys):
    """A server before the check kept metadata {"k": "\\udc00"} (json writes it as that escape): every
    GET /v1/batches was a 500 from then on, restarts included. Now that record is left out, said on
    stderr, and the others are listed and answerable."""
    store = Store(str(tmp_path))
    upload = store.add_upload(io.BytesIO(b'{"a": 1}\n'), "in.jsonl", "batch", max_bytes=100)
    kept, bad = _batch(store, upload.id), _batch(store, upload.id)
    store._save_batch(store.batches[bad.id].model_copy(update={"metadata": {"k": "\udc00"}}))
    store._lock_file.close()
    assert '"\\udc00"' in (tmp_path / "batches" / f"{bad.id}.json").read_text()

    again = Store(str(tmp_path))
    assert [b.id for b in again.list_batches()] == [kept.id] and again.get_batch(bad.id) is None
    BatchList(data=again.list_batches()).model_dump_json()  # what GET /v1/batches answers
    assert f"{bad.id}.json left out (not listed, not run): it holds text that is not valid Unicode" in \
        capsys.readouterr().err
    assert again.next_batch(skip=set()).id == kept.id
