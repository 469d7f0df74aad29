"""What careless or hostile clients send `flexsarathi serve`, against the real server process: each
gets one clear error in OpenAI's shape (a line's error record, where it is a line of a batch file),
never a 500, a dropped connection or a batch made from a deleted file; the server stays up."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.flexsarathi.serve.serve_process import (API_KEY, completion, downloaded, submit,  # noqa: E402
                                                   wait_for_file, wait_until_ended, write_lines)


def post(server, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    """A plain HTTP POST (what the openai client would never send); (status, JSON answer)."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def errors_by_line(client, batch) -> dict[int | str, str]:
    return {r.get("line", r["custom_id"]): r["error"]["message"] for r in downloaded(client, batch.error_file_id)}


def test_a_line_nested_thousands_deep_is_its_error_record(client, tmp_path):
    """json's reader recurses per level: such a line was a RecursionError, the create call a 500."""
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": ' + "[" * 50_000 + \
        "]" * 50_000 + "}"
    batch = wait_until_ended(client, submit(client, write_lines(tmp_path / "deep.jsonl",
                                                                [completion("ok", "Once upon a time"), deep])).id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    assert "line 2 nests its JSON deeper than the reader allows" in errors_by_line(client, batch)[2]


def test_line_separators_inside_a_json_string_keep_the_line_whole(client, tmp_path):
    """U+2028, U+2029 and U+0085 may stand raw in a JSON string: they end no line (splitlines() split
    there, making a request two broken lines and every later line number wrong)."""
    lines = [json.dumps(completion("sep", "Once upon\u2028a\u2029time\u0085there"), ensure_ascii=False),
             "{not json"]
    batch = wait_until_ended(client, submit(client, write_lines(tmp_path / "sep.jsonl", lines)).id)
    assert batch.request_counts.total == 2 and batch.request_counts.completed == 1
    assert list(errors_by_line(client, batch)) == [2]


@pytest.mark.parametrize("declared", [(2 << 20) + 1, 10 ** 15], ids=["2MiB", "1PB"])
def test_a_body_declared_over_the_limit_gets_one_413_in_openai_shape(server, declared):
    """Content-Length over the limit was answered in plain text, which the openai client cannot read.
    The answer comes before any of the body is sent (none is read)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        conn.sendall(f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode())
        answer = http.client.HTTPResponse(conn)
        answer.begin()
        assert answer.status == 413
        error = json.loads(answer.read())["error"]
    assert error["code"] == "request_too_large" and "limit of 1048576 bytes" in error["message"]


def test_a_body_that_is_not_a_json_object_is_named(server):
    """Invalid JSON was '1: JSON decode error' with param '1' (the character offset)."""
    status, answer = post(server, "/v1/batches", b"{not json")
    assert status == 400 and answer["error"]["param"] is None
    assert answer["error"]["message"].startswith("the request body is not valid JSON: Expecting property name")
    for body, content_type in ((b"[1, 2]", "application/json"), (b'{"input_file_id": "x"}', "text/plain")):
        status, answer = post(server, "/v1/batches", body, content_type)
        assert status == 400 and "the request body must be a JSON object sent as application/json" in \
            answer["error"]["message"]


@pytest.mark.parametrize("filename", ["日本語.jsonl", "bell\x07.jsonl", "../../etc/passwd"],
                         ids=["cjk", "control", "traversal"])
def test_files_download_whatever_their_names(client, filename):
    """A name beyond Latin-1 made the download a 500; a control character, a dropped connection."""
    data = (json.dumps(completion("n", "Hi")) + "\n").encode()
    uploaded = client.files.create(file=(filename, data), purpose="batch")
    assert client.files.content(uploaded.id).content == data


@pytest.mark.parametrize("size", [1000, (1 << 20) + 1], ids=["one-read", "streamed"])
def test_a_file_deleted_between_a_downloads_lookup_and_its_read_is_404(server, client, size):
    """The download looked the file up, then read it from disk: a delete in between made it a 500."""
    file_id = client.files.create(file=("race.jsonl", b"x" * size), purpose="batch").id
    (server.data_dir / f"vanish-{file_id}").touch()  # the server deletes it right after the lookup
    with pytest.raises(openai.NotFoundError, match=f"No such File object: {file_id}"):
        client.files.content(file_id)
    assert not (server.data_dir / f"vanish-{file_id}").exists()  # the hook did run
    other = client.files.create(file=("kept.jsonl", b"y" * size), purpose="batch").id
    assert client.files.content(other).content == b"y" * size


def test_an_input_file_deleted_while_its_batch_is_created(server, client, tmp_path):
    """The create call reads the file, then adds the batch: a delete in between succeeded and left an
    in_progress batch on a file that no longer exists (it failed later, 'No such file or directory')."""
    src = write_lines(tmp_path / "gone.jsonl", [completion("g", "Once upon a time")])
    with open(src, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    (server.data_dir / "hold-create").touch()  # removed by the `server` fixture too, if this test fails
    created = []

    def create():
        try:
            created.append(client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                 completion_window="24h"))
        except openai.BadRequestError as error:
            created.append(error)

    thread = threading.Thread(target=create)
    thread.start()
    wait_for_file(server.data_dir / "held-create")  # the call has read the file
    assert client.files.delete(file_id).deleted
    (server.data_dir / "hold-create").unlink()
    thread.join(timeout=60)
    assert isinstance(created[0], openai.BadRequestError), created
    assert f"No such File object {file_id}" in created[0].message
    assert file_id not in [b.input_file_id for b in client.batches.list(limit=100).data]
