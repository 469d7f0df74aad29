"""`flexsarathi serve` as users run it: a real server process on 127.0.0.1, driven by the official
`openai` client. The reference for every record is `flexsarathi generate` on the same input file
(float32, greedy); kills and pauses happen at named points of the job (after a record is written),
never on a timer."""
from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flexsarathi.cli.main import main
from flexsarathi.serve.command import check_bind
from flexsarathi.errors import FlexSarathiError
from policy_search import Policy

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.flexsarathi.serve.serve_process import (API_KEY, Server, completion, downloaded, submit,  # noqa: E402
                                                   wait_for_file, wait_until_ended, write_lines)


def by_request(records: list[dict]) -> dict:
    """custom_id (or line, where it had none) -> record, the body's timestamp left out."""
    out = {}
    for r in records:
        r = json.loads(json.dumps(r))
        if r.get("response"):
            r["response"]["body"].pop("created", None)  # an embeddings body has none
        key = r["custom_id"] if r.get("custom_id") is not None else f"line {r['line']}"
        assert key not in out, f"{key} has two records"
        out[key] = r
    return out


def generated(stories_dir: str, src: str, tmp_path, *args: str) -> dict:
    """`flexsarathi generate` on the same file: the reference records."""
    out = tmp_path / "generate.jsonl"
    main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), "--dtype", "float32",
          "--quiet", "--overwrite", *args])
    return by_request([json.loads(ln) for ln in out.read_text().splitlines()])


def test_batch_records_equal_generate_with_error_records(server, client, stories_dir, tmp_path):
    good = [completion(f"ok-{i}", p) for i, p in enumerate(["Once upon a time", "Lily wanted to", "The little dog",
                                                           "One day, a bird"])]
    good.append(completion("stop", "Lily wanted to", max_tokens=12, stop=[" a"]))
    bad = ["{not json", {"custom_id": "nobody", "method": "POST", "url": "/v1/completions"},
           completion("penalty", "Hi", frequency_penalty=3.0), completion("long", [5] * 600),
           completion("hot", "Hi", temperature=-1)]
    src = write_lines(tmp_path / "batch.jsonl", good[:2] + bad[:2] + good[2:] + bad[2:])
    batch = submit(client, src)
    assert batch.status == "in_progress" and batch.request_counts.total == 10
    batch = wait_until_ended(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 5)
    outputs, errors = downloaded(client, batch.output_file_id), downloaded(client, batch.error_file_id)
    assert all(r["error"] is None for r in outputs) and all(r["response"] is None for r in errors)
    reference = generated(stories_dir, src, tmp_path)
    assert by_request(outputs + errors) == reference
    assert sorted(by_request(errors)) == sorted(["line 3", "nobody", "penalty", "long", "hot"])
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_wrong_or_missing_key_gets_401(server, client):
    other = server.client(api_key="wrong-key")
    for call in (other.models.list, other.files.list, other.batches.list,
                 lambda: other.batches.create(input_file_id="file-x", endpoint="/v1/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    # no key at all (the openai client refuses to send none): a plain request
    for path, headers in (("/v1/batches", {}), ("/v1/files", {"Authorization": f"Basic {API_KEY}"})):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{server.port}{path}",
                                                          headers=headers), timeout=30)
        assert caught.value.code == 401
        assert json.load(caught.value)["error"]["code"] == "invalid_api_key"
    assert client.models.list().data[0].id == "stories260K"


def test_two_queued_batches_complete_in_order(server, client, tmp_path):
    """A running batch (its runner paused), two more queued behind it: they run after it, the
    older first, each to its end before the next begins."""
    hold, held = server.data_dir / "hold", server.data_dir / "held"
    hold.touch()  # removed by the `server` fixture too, if the test fails while it holds
    running = submit(client, write_lines(tmp_path / "r.jsonl", [completion(f"r{i}", "Once upon a time")
                                                                for i in range(4)]))
    wait_for_file(held)  # the runner paused after a record of the running batch
    queued = [submit(client, write_lines(tmp_path / f"{name}.jsonl", [completion(f"{name}{i}", "The little dog")
                                                                      for i in range(4)]))
              for name in ("q", "p")]
    for batch in queued:
        waiting = client.batches.retrieve(batch.id)  # answered while the runner is busy
        assert waiting.status == "in_progress" and waiting.request_counts.completed == 0
        assert not (server.data_dir / "batches" / batch.id).exists()  # not started
    with pytest.raises(openai.ConflictError):  # the running batch's input is not deleted under it
        client.files.delete(running.input_file_id)
    page = client.batches.list(limit=1)  # newest first, a page of one
    assert [b.id for b in page.data] == [queued[1].id] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=queued[1].id).data] == [queued[0].id, running.id]
    hold.unlink()
    order = [running, *queued]
    assert all(wait_until_ended(client, b.id).status == "completed" for b in order)
    results = [server.data_dir / "batches" / b.id / "results.jsonl" for b in order]
    for before, after in zip(results, results[1:]):  # the last record of one before the next's file began
        assert before.stat().st_mtime_ns <= Path(f"{after}.meta.json").stat().st_mtime_ns
    assert client.files.delete(running.input_file_id).deleted
    assert running.input_file_id not in [f.id for f in client.files.list()]


def test_cancel_in_the_middle_keeps_finished_records(server, client, stories_dir, tmp_path):
    # lengths apart: a default server runs all 24 at once, so they finish in different passes
    lines = [completion(f"c{i}", f"Once upon a time, number {i}", max_tokens=2 + i) for i in range(24)]
    src = write_lines(tmp_path / "c.jsonl", lines)
    hold, held = server.data_dir / "hold", server.data_dir / "held"
    hold.touch()
    batch = submit(client, src)
    wait_for_file(held)
    assert client.batches.cancel(batch.id).status == "cancelling"
    hold.unlink()
    batch = wait_until_ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    outputs = by_request(downloaded(client, batch.output_file_id))
    assert 1 <= len(outputs) < 24 and batch.request_counts.completed == len(outputs)
    reference = generated(stories_dir, src, tmp_path)
    assert outputs == {key: reference[key] for key in outputs}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_upload_over_the_limit_gets_413_and_the_server_stays_up(server, client):
    files_before = {f.id for f in client.files.list()}
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (100 << 20)), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.code == "request_too_large"  # OpenAI's shape
    assert client.models.list().data[0].id == "stories260K"
    assert {f.id for f in client.files.list()} == files_before
    assert not [p for p in (server.data_dir / "files").iterdir() if p.name.endswith(".tmp")]


def test_input_files_that_cannot_make_a_batch(server, client, tmp_path):
    lines = [completion("x", "Hi"), {**completion("y", "Hi"), "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": "Hi"}]}},
             completion("x", "Hello")]
    batch = submit(client, write_lines(tmp_path / "dup.jsonl", lines))
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("mismatched_endpoint", 2), ("duplicate_custom_id", 3)]
    assert "custom_id 'x' on line 3 was used on line 1" in batch.errors.data[1].message
    empty = submit(client, write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"
    with pytest.raises(openai.BadRequestError, match="No such File object"):
        client.batches.create(input_file_id="file-none", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("f.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")


def test_kill_9_mid_batch_then_restart_completes_each_request_once(stories_dir, tmp_path):
    policy = str(tmp_path / "policy.json")
    Policy(gpu_batch_size=2).save(policy)  # two running at once: records come in small waves
    lines = [completion(f"k{i}", f"Once upon a time, number {i}", max_tokens=8) for i in range(16)]
    src = write_lines(tmp_path / "k.jsonl", lines)
    data = tmp_path / "data"
    srv = Server(data, "--model", stories_dir, "--dtype", "float32", "--policy", policy).start()
    (data / "kill").write_text("5")
    batch = submit(srv.client(), src)
    assert srv.proc.wait(timeout=120) == -signal.SIGKILL
    partial = (data / "batches" / batch.id / "results.jsonl").read_bytes().count(b"\n")
    assert 5 <= partial < 16, "the server was not killed partway"
    (data / "kill").unlink()
    try:
        client = srv.start().client()
        batch = wait_until_ended(client, batch.id)
        outputs = downloaded(client, batch.output_file_id)
    finally:
        srv.stop()
    assert batch.status == "completed" and batch.request_counts.completed == 16
    assert sorted(r["custom_id"] for r in outputs) == sorted(f"k{i}" for i in range(16))  # each exactly once
    reference = generated(stories_dir, src, tmp_path, "--policy", policy)
    assert by_request(outputs) == reference


def test_a_stopped_server_leaves_its_batch_to_resume_and_refuses_another_configuration(stories_dir, tmp_path):
    """SIGTERM mid-batch: the run stops at a pass boundary and the batch stays in_progress on disk;
    a restart with another --seed fails it, naming the setting, rather than mix two configurations."""
    data = tmp_path / "data"
    srv = Server(data, "--model", stories_dir, "--dtype", "float32").start()
    (data / "hold").touch()
    lines = [completion(f"s{i}", "Once upon a time", max_tokens=2 + i) for i in range(20)]  # they end apart
    batch = submit(srv.client(), write_lines(tmp_path / "s.jsonl", lines))
    wait_for_file(data / "held")
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while True:  # handled once the server stops listening (the runner was told to stop first)
        try:
            socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, srv.output()
        time.sleep(0.01)
    (data / "hold").unlink()
    assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    saved = json.loads((data / "batches" / f"{batch.id}.json").read_text())["batch"]
    assert saved["status"] == "in_progress"
    assert 1 <= (data / "batches" / batch.id / "results.jsonl").read_bytes().count(b"\n") < 20
    srv.args = (*srv.args, "--seed", "7")
    try:
        failed = wait_until_ended(srv.start().client(), batch.id)
    finally:
        srv.stop()
    assert failed.status == "failed" and "seed: 0 -> 7" in failed.errors.data[0].message


def test_only_loopback_binds_without_a_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_bind(host, None, allow_no_key=False)
    for host in ("0.0.0.0", "192.168.1.10", "::", "example.org"):
        with pytest.raises(FlexSarathiError, match="--allow-no-key"):
            check_bind(host, None, allow_no_key=False)
        check_bind(host, "k", allow_no_key=False)
        check_bind(host, None, allow_no_key=True)


def finished_batch(client, src: str, endpoint: str):
    """(the batch once it ended, its output and error records) of one input file."""
    batch = wait_until_ended(client, submit(client, src, endpoint).id)
    return batch, downloaded(client, batch.output_file_id) + downloaded(client, batch.error_file_id)


def test_a_batch_of_tool_calls_equals_generate_with_the_same_parser(stories_dir, tmp_path):
    """Chat requests with tools through the server (`--tool-call-parser` given, the template's
    format otherwise): the records `generate` writes with the same parser, calls and ids alike."""
    from tests.conftest import with_chat_template
    from tests.flexsarathi.cli.test_cli_tools import LINES, TOOL_TEMPLATE

    folder = with_chat_template(stories_dir, tmp_path / "stories-tools", TOOL_TEMPLATE)
    src = write_lines(tmp_path / "tools.jsonl", LINES)
    srv = Server(tmp_path / "data", "--model", folder, "--dtype", "float32", "--max-tokens", "120",
                 "--tool-call-parser", "hermes").start()
    try:
        batch, records = finished_batch(srv.client(), src, "/v1/chat/completions")
    finally:
        srv.stop()
    assert batch.status == "completed" and batch.request_counts.failed == 3
    assert by_request(records) == generated(folder, src, tmp_path, "--max-tokens", "120", "--tool-call-parser",
                                            "hermes")
    assert by_request(records)["auto-call"]["response"]["body"]["choices"][0]["message"]["tool_calls"]


def test_an_embedding_server_runs_embeddings_batches_as_generate_does(stories_dir, tmp_path):
    """`serve --task embed`: a /v1/embeddings batch gives the records `generate` writes for the same
    file; a file with a line for another url fails validation, naming it; a batch for another
    endpoint is refused (400 naming the endpoint) before it is queued."""
    from tests.flexsarathi.cli.test_cli_embeddings import LINES

    mixed = write_lines(tmp_path / "embed.jsonl", LINES)
    src = write_lines(tmp_path / "embed-only.jsonl", [ln for ln in LINES if ln["url"] == "/v1/embeddings"])
    srv = Server(tmp_path / "data", "--model", stories_dir, "--dtype", "float32", "--task", "embed").start()
    try:
        client = srv.client()
        refused, _ = finished_batch(client, mixed, "/v1/embeddings")
        batch, records = finished_batch(client, src, "/v1/embeddings")
        with open(src, "rb") as f:
            uploaded = client.files.create(file=f, purpose="batch")
        with pytest.raises(openai.BadRequestError, match="this server embeds .* its batches are for /v1/embeddings"):
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    finally:
        srv.stop()
    assert refused.status == "failed" and "line 5 is for /v1/completions" in refused.errors.data[0].message
    assert batch.status == "completed" and batch.request_counts.failed == 3
    assert by_request(records) == generated(stories_dir, src, tmp_path)


def test_a_server_with_lora_modules_runs_each_line_with_the_adapter_its_model_names(tiny_checkpoint, tmp_path):
    """`serve --lora-modules a=DIR b=DIR`: /v1/models lists the model and both adapters; a batch whose
    lines name a, b, the model and an unknown model gives the records `generate` writes with the same
    adapters (each line's tokens its adapter's, the unknown one an error record)."""
    pytest.importorskip("peft")
    from tests.flexsarathi.formats.test_lora_adapter import save_adapter

    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=1)
    save_adapter(folder, tmp_path / "b", ["k_proj", "up_proj"], seed=2)
    modules = ["--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]
    # logprobs: the tokens as the records name them (the checkpoint has no tokenizer to write text)
    lines = [{**completion(f"r{i}", [3, 17, 42, 9]), "body": {**completion("", [3, 17, 42, 9], logprobs=1)["body"],
                                                              "model": m}}
             for i, m in enumerate(["a", "b", Path(folder).name, "c"])]
    src = write_lines(tmp_path / "lora.jsonl", lines)
    srv = Server(tmp_path / "data", "--model", folder, "--dtype", "float32", *modules).start()
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == [Path(folder).name, "a", "b"]
        batch, records = finished_batch(client, src, "/v1/completions")
    finally:
        srv.stop()
    assert batch.status == "completed" and batch.request_counts.failed == 1
    got = by_request(records)
    assert got == generated(folder, src, tmp_path, *modules)
    assert [got[f"r{i}"]["response"]["body"]["model"] for i in range(3)] == ["a", "b", Path(folder).name]
    tokens = [json.dumps(got[f"r{i}"]["response"]["body"]["choices"][0]["logprobs"]["tokens"]) for i in range(3)]
    assert len(set(tokens)) == 3  # three models' tokens
