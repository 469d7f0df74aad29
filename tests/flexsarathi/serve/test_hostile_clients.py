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


@pytest.mark.parametrize("body, said", [
    (b"[" * 100_000 + b"]" * 100_000, "it nests deeper than the reader allows"),
    (b'{"input_file_id": ' + b"1" * 5000 + b"}", "Exceeds the limit (4300 digits) for integer string conversion")],
    ids=["deep", "long-number"])
def test_json_the_reader_gives_up_on_is_named(server, body, said):
    """Both were 'There was an error parsing the body': no what, no where."""
    status, answer = post(server, "/v1/batches", body)
    assert status == 400 and answer["error"]["message"].startswith("the request body is not JSON this server "
                                                                   "can read: " + said), answer


@pytest.mark.parametrize("authorization", ["", "Authorization: Bearer wrong-key\r\n"], ids=["none", "wrong"])
def test_an_upload_without_the_key_gets_401_before_its_body_is_read(server, authorization):
    """The key was checked by a route dependency, after FastAPI had read the body: an unauthenticated
    upload of --max-file-mib was received and spooled to disk whole before its 401."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\n{authorization}Content-Type: multipart/form-data; "
                     f"boundary=BB\r\nContent-Length: {4 << 20}\r\n\r\n--BB\r\n".encode())
        answer = http.client.HTTPResponse(conn)
        answer.begin()  # none of the body's 4 MiB sent: this waited for them
        assert answer.status == 401 and answer.getheader("WWW-Authenticate") == "Bearer"
        assert json.loads(answer.read())["error"]["code"] == "invalid_api_key"


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


SURROGATE = "\\udc00"  # as JSON writes it: the escape reaches the server, which json.loads turns into U+DC00


@pytest.mark.parametrize("field, value, param, said", [
    ("metadata", '{"k": "%s"}' % SURROGATE, "metadata", "the value of key 'k' holds a lone surrogate"),
    ("metadata", '{"k%s": "v"}' % SURROGATE, "metadata", "key 'k\\udc00' holds a lone surrogate"),
    ("endpoint", '"/v1/completions%s"' % SURROGATE, "endpoint", "the value holds a lone surrogate"),
    ("input_file_id", '"FILE%s"' % SURROGATE, "input_file_id", "the value holds a lone surrogate"),
    ("x%s" % SURROGATE, "1", None, "a field name of the request body holds a lone surrogate")],
    ids=["metadata-value", "metadata-key", "endpoint", "input_file_id", "field-name"])
def test_a_lone_surrogate_in_a_batch_create_is_refused_and_nothing_is_saved(server, client, field, value, param,
                                                                           said):
    """Metadata {"k": "\\udc00"} was a 500 with the batch saved and run, and every later GET
    /v1/batches (and GET of that batch) a 500: UTF-8 cannot hold the text."""
    file_id = client.files.create(file=("s.jsonl", (json.dumps(completion("s", "Hi")) + "\n").encode()),
                                  purpose="batch").id
    fields = {"input_file_id": f'"{file_id}"', "endpoint": '"/v1/completions"', "completion_window": '"24h"'}
    fields[field] = value.replace("FILE", file_id)
    body = "{" + ", ".join(f'"{name}": {text}' for name, text in fields.items()) + "}"
    status, answer = post(server, "/v1/batches", body.encode())
    assert status == 400 and answer["error"]["param"] == param, answer
    assert said in answer["error"]["message"] and "text must be valid Unicode" in answer["error"]["message"]
    assert file_id not in [b.input_file_id for b in client.batches.list(limit=100).data]  # the list answers


def multipart(disposition: bytes, data: bytes, charset: str = "") -> tuple[bytes, str]:
    """An upload's body as a client writes it, the file part's Content-Disposition parameters as given."""
    body = (b'--BB\r\nContent-Disposition: form-data; name="file"' + disposition + b"\r\n\r\n" + data +
            b'\r\n--BB\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--BB--\r\n')
    return body, f"multipart/form-data; {charset}boundary=BB"


@pytest.mark.parametrize("disposition, charset, name", [
    ('; filename="résumé.jsonl"'.encode(), "", "résumé.jsonl"),  # what curl -F file=@résumé.jsonl sends
    ('; filename="résumé.jsonl"'.encode(), "charset=latin-1; ", "résumé.jsonl"),
    (b"; filename=\"resume.jsonl\"; filename*=UTF-8''r%C3%A9sum%C3%A9.jsonl", "", "résumé.jsonl"),
    (b"; filename=\"r.jsonl\"; filename*=iso-8859-1'fr'r%E9sum%E9.jsonl", "", "résumé.jsonl"),
    (b'; filename="a; filename*=UTF-8\'\'b.jsonl"', "", "a; filename*=UTF-8''b.jsonl"),
    (b'; filename="a+3AA-.jsonl"', "charset=utf-7; ", "a+3AA-.jsonl")],
    ids=["utf8", "declared-latin1", "rfc5987-utf8", "rfc5987-latin1", "quoted-lookalike", "declared-utf7"])
def test_an_upload_keeps_its_name_as_the_client_wrote_it(server, client, disposition, charset, name):
    """The name was read in the charset the request declares (Latin-1 gave 'rÃ©sumÃ©.jsonl'; UTF-7 a
    lone surrogate that made every later GET /v1/files a 500), and filename*= was never read."""
    data = (json.dumps(completion("n", "Hi")) + "\n").encode()
    status, answer = post(server, "/v1/files", *multipart(disposition, data, charset))
    assert status == 200 and answer["filename"] == name, answer
    assert client.files.retrieve(answer["id"]).filename == name
    assert name in [f.filename for f in client.files.list().data]
    assert client.files.content(answer["id"]).content == data


@pytest.mark.parametrize("disposition, said", [
    (b"; filename*=UTF-8''r%C3%A9sum%C3%A9.jsonl", "file must be a file part: its Content-Disposition needs "
                                                    "filename=\"NAME\""),
    (b"", "file must be a file part"),
    (b'; filename="r\xe9sum\xe9.jsonl"', "the file name b'r\\xe9sum\\xe9.jsonl' is not UTF-8 (byte 1)"),
    (b"; filename=\"r.jsonl\"; filename*=UTF-8''r%E9sum%E9.jsonl", "is not RFC 5987's UTF-8''NAME"),
    (b"; filename=\"r.jsonl\"; filename*=UTF-8''%ED%B3%80.jsonl", "is not RFC 5987's UTF-8''NAME"),
    (b"; filename=\"r.jsonl\"; filename*=koi8-r''%C1.jsonl", "is not RFC 5987's UTF-8''NAME")],
    ids=["rfc5987-alone", "no-filename", "not-utf8", "rfc5987-not-utf8", "rfc5987-surrogate", "rfc5987-charset"])
def test_an_upload_whose_name_cannot_be_read_is_refused(server, client, disposition, said):
    """filename*= alone was 'file: Value error, Expected UploadFile, received: <class 'str'>'."""
    before = len(client.files.list().data)
    status, answer = post(server, "/v1/files", *multipart(disposition, b"{}\n"))
    assert status == 400 and answer["error"]["param"] == "file" and said in answer["error"]["message"], answer
    assert len(client.files.list().data) == before  # nothing kept


@pytest.mark.parametrize("body, content_type, said", [
    (b"hello world", "multipart/form-data; boundary=BB", "the request body is not valid multipart/form-data: "
                                                         "Expected boundary character 45, got 104 at index 2"),
    (b'--BB\r\nContent-Disposition form-data\r\n\r\nx\r\n--BB--\r\n', "multipart/form-data; boundary=BB",
     "not valid multipart/form-data: Found invalid character 32 in header at 25"),
    (b'--BB\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n',
     "multipart/form-data; boundary=BB", "file: Field required: the multipart body has no complete `file` part"),
    (b"purpose=batch", "application/x-www-form-urlencoded",
     "POST /v1/files takes multipart/form-data (a `file` part with a filename and a `purpose` field, as the "
     "openai client sends); got Content-Type 'application/x-www-form-urlencoded'"),
    (b"{}", "application/json", "takes multipart/form-data (a `file` part"),
], ids=["garbage", "bad-part-header", "cut-short", "urlencoded", "json"])
def test_an_upload_that_is_no_multipart_body_says_why(server, client, body, content_type, said):
    """Each was python-multipart's "Invalid multipart data." or "file: Field required"."""
    before = len(client.files.list().data)
    status, answer = post(server, "/v1/files", body, content_type)
    assert status == 400 and said in answer["error"]["message"], answer
    assert len(client.files.list().data) == before  # nothing kept


def test_a_custom_id_holding_a_lone_surrogate_is_its_lines_error_record(client, tmp_path):
    """Its record could not be written: the whole batch failed (1 of 3 completed), every other line lost."""
    lines = [completion("a", "Once upon a time"),
             json.dumps(completion("b", "Lily wanted to")).replace('"b"', '"b%s"' % SURROGATE),
             completion("c", "The little dog")]
    batch = wait_until_ended(client, submit(client, write_lines(tmp_path / "ids.jsonl", lines)).id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert sorted(r["custom_id"] for r in downloaded(client, batch.output_file_id)) == ["a", "c"]
    assert "line 2: \"custom_id\" 'b\\udc00' is not valid Unicode" in errors_by_line(client, batch)[2]
