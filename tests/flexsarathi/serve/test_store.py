"""The server's store on disk: one server per data folder, records that survive a restart, and a
folder holding something the server did not write refused with the file named."""
from __future__ import annotations

import errno
import io
import threading
import time

import pytest

pytest.importorskip("pydantic")

from flexsarathi.errors import FlexSarathiError  # noqa: E402
from flexsarathi.serve import store as store_module  # noqa: E402
from flexsarathi.serve.schemas import Batch, BatchList  # noqa: E402
from flexsarathi.serve.store import FileTooLarge, StorageFull, Store, disk_full  # noqa: E402
from tests.flexsarathi.serve.full_disk import full_disk_open  # noqa: E402


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


def _upload(store: Store, data: bytes, max_bytes: int = 1 << 20):
    return store.add_upload(io.BytesIO(data), "in.jsonl", "batch", max_bytes=max_bytes)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_the_storage_limit_counts_uploads_and_outputs_across_deletes_and_restarts(tmp_path):
    """An upload that would pass the limit is refused, nothing kept; a batch's output is always
    written (its work is done) and counted, a rewritten one once; a delete frees its bytes; a
    restart counts what is stored."""
    store = Store(str(tmp_path), max_stored_bytes=100)
    first = _upload(store, b"a" * 60)
    before = _names(tmp_path / "files")
    with pytest.raises(StorageFull) as refused:
        _upload(store, b"b" * 41)
    assert (refused.value.limit, refused.value.stored, refused.value.files, refused.value.needed) == (100, 60, 1, 41)
    assert _names(tmp_path / "files") == before and store.stored_bytes == 60 and store._reserved_bytes == 0
    second = _upload(store, b"b" * 40)  # exactly the limit
    store.add_output("batch_x", "output", b"c" * 30)  # past the limit: written all the same
    output = store.add_output("batch_x", "output", b"c" * 50)  # finalizing again replaces it
    assert store.stored_bytes == 150 and len(store.files) == 3
    with pytest.raises(StorageFull):
        _upload(store, b"d")
    store.delete_file(first.id)
    assert store.stored_bytes == 90
    third = _upload(store, b"d" * 10)
    store._lock_file.close()

    again = Store(str(tmp_path), max_stored_bytes=100)
    assert again.stored_bytes == 100 and set(again.files) == {second.id, output.id, third.id}
    with pytest.raises(StorageFull):
        _upload(again, b"e")
    again.delete_file(output.id)
    assert again.stored_bytes == 50 and _upload(again, b"e" * 50).bytes == 50


class _SlowSource:
    """An upload body that arrives in 50-byte chunks; before its last read it calls `meanwhile`."""

    def __init__(self, size: int, meanwhile=lambda: None):
        self.left, self.meanwhile = size, meanwhile

    def read(self, n: int) -> bytes:
        if self.left == 0:
            self.meanwhile()
            return b""
        chunk = min(50, self.left)
        self.left -= chunk
        return b"x" * chunk


def test_two_uploads_at_once_cannot_both_pass_the_limit(tmp_path):
    """A is streamed in whole (100 bytes reserved, not yet stored) when B starts: B's bytes count
    against what is stored and what A reserved, so B is refused at its second chunk. Counting only
    stored files, both passed and 200 bytes were kept under a limit of 150."""
    store = Store(str(tmp_path), max_stored_bytes=150)
    a_streamed, b_done, outcome = threading.Event(), threading.Event(), {}

    def upload_a():
        source = _SlowSource(100, meanwhile=lambda: (a_streamed.set(), b_done.wait(60)))
        outcome["a"] = store.add_upload(source, "a", "batch", 1 << 20)

    thread = threading.Thread(target=upload_a)
    thread.start()
    assert a_streamed.wait(60)
    try:
        with pytest.raises(StorageFull) as refused:
            store.add_upload(_SlowSource(100), "b", "batch", 1 << 20)
    finally:
        b_done.set()
        thread.join(60)
    assert (refused.value.pending, refused.value.needed, refused.value.stored) == (100, 100, 0)
    assert store.stored_bytes == 100 == outcome["a"].bytes and store._reserved_bytes == 0
    assert list(store.files) == [outcome["a"].id]


@pytest.mark.parametrize("where", [".data.tmp", ".json.tmp"], ids=["data", "record"])
def test_a_full_disk_in_an_upload_keeps_nothing(tmp_path, monkeypatch, where):
    """ENOSPC while the upload's data is written, or its record once the data is in place: the
    OSError goes on (the app answers 507), and nothing of the upload stays, on disk or counted."""
    store = Store(str(tmp_path), max_stored_bytes=1000)
    kept = _upload(store, b"k" * 10)
    before = _names(tmp_path / "files")
    full = [True]
    monkeypatch.setattr(store_module, "open", full_disk_open({where: lambda: full[0]}), raising=False)
    with pytest.raises(OSError) as caught:
        _upload(store, b"x" * 300)
    assert caught.value.errno == errno.ENOSPC and disk_full(caught.value) is caught.value
    assert _names(tmp_path / "files") == before and list(store.files) == [kept.id]
    assert (store.stored_bytes, store._reserved_bytes) == (10, 0)
    full[0] = False  # space again: the same upload is stored
    assert _upload(store, b"x" * 300).bytes == 300 and store.stored_bytes == 310


def test_a_restart_removes_what_a_killed_upload_left(tmp_path):
    """A kill -9 mid-upload leaves its `.tmp`, one between the data and its record an unlisted
    `.data`: both taken away on start, so what is on disk is what is counted."""
    store = Store(str(tmp_path))
    kept = _upload(store, b"k" * 10)
    store._lock_file.close()
    (tmp_path / "files" / "file-killed.data.tmp").write_bytes(b"x" * 100)
    (tmp_path / "files" / "file-orphan.data").write_bytes(b"x" * 100)
    again = Store(str(tmp_path))
    assert _names(tmp_path / "files") == [f"{kept.id}.data", f"{kept.id}.json"] and again.stored_bytes == 10


def test_disk_full_finds_the_error_behind_a_wrapped_one():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise FlexSarathiError("cannot write the meta file") from None
    except FlexSarathiError as wrapped:
        assert disk_full(wrapped).errno == errno.EDQUOT
    assert disk_full(OSError(errno.EIO, "I/O error")) is None and disk_full(ValueError()) is None
