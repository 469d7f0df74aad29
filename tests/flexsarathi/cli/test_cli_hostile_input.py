"""`flexsarathi generate` against hostile input and surroundings, on stories260K: an input changed
between runs (a record answers the request it was written for, or the resume is refused), error
records redone with --retry-errors, request mistakes coded `invalid_request`, a JSON array given as
input, ids UTF-8 cannot write, `max_tokens: null` under --policy auto, a stderr whose reader is gone
or that is closed, and a crash told apart from error records by its exit code."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.cli.main import EXIT_CRASH, main
from flexsarathi.cli.request_files import FINGERPRINT
from flexsarathi.engine.llm_engine import LLMEngine
from tests.conftest import REPO, on_call
from tests.flexsarathi.cli.test_cli_generate import GREEDY, cli, records, write_lines

A, B, C = "Once upon a time", "Lily wanted to", "Tom had a big dog"


def by_id(path) -> dict:
    return {r.get("id", r.get("line")): r for r in records(path)}


def test_a_changed_text_line_is_refused_not_answered_by_its_old_record(stories_dir, tmp_path, capsys):
    """Ids of a text file are its line numbers: a prompt put above the others gives each id another
    prompt. The rerun is refused before anything is touched (it used to keep the old records as the
    answers of the new lines); prompts added at the end resume; --overwrite starts afresh."""
    src, out = tmp_path / "in.txt", str(tmp_path / "o.jsonl")
    argv = ["generate", "--model", stories_dir, "--input", str(src), "--output", out, *GREEDY]
    write_lines(src, [A, B])
    assert main(argv) == 0
    write_lines(src, [A, B, C])  # one more at the end: the two records still answer lines 1 and 2
    assert main(argv) == 0
    before = (tmp_path / "o.jsonl").read_bytes()
    write_lines(src, [C, A, B])
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --output {out} holds a record for id 1 that answers another request than line 1 of the input "
        "(and 2 more such records): the input changed since it was written; an id must name the same request in "
        "every run: give a changed request a new id (a text file's ids are its line numbers: add new prompts at "
        "its end), or pass --overwrite to start afresh"]
    assert (tmp_path / "o.jsonl").read_bytes() == before  # refused: nothing touched
    assert main([*argv, "--overwrite"]) == 0
    assert {i: r["prompt"] for i, r in by_id(out).items()} == {1: C, 2: A, 3: B}


def test_a_jsonl_id_names_one_request(stories_dir, tmp_path, capsys):
    """The fingerprint is of what the request asks (its prompt and its own fields), not of how the
    line is written: the same requests rewritten resume; a field that changes the output under the
    same id is refused; a new id runs beside the old records. Records written before fingerprints
    existed are trusted, as they were."""
    src, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    argv = ["generate", "--model", stories_dir, "--input", str(src), "--output", out, *GREEDY]
    write_lines(src, [{"id": "a", "prompt": A}, {"id": "b", "prompt": B, "max_tokens": 4}])
    assert main(argv) == 0
    first = by_id(out)
    assert all(len(r[FINGERPRINT]) == 16 for r in first.values())
    src.write_text(f'{{"max_tokens":4, "prompt": "{B}","id":"b"}}\n\n{{ "id" : "a",  "prompt" : "{A}" }}\n')
    assert main(argv) == 0 and by_id(out) == first and len(records(out)) == 2  # nothing to run
    write_lines(src, [{"id": "a", "prompt": A}, {"id": "b", "prompt": B, "max_tokens": 5}])
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --output {out} holds a record for id 'b' that answers another request than line 2 of the input: "
        "the input changed since it was written; an id must name the same request in every run: give a changed "
        "request a new id, or pass --overwrite")
    write_lines(src, [{"id": "a", "prompt": A}, {"id": "b5", "prompt": B, "max_tokens": 5}])
    assert main(argv) == 0
    got = by_id(out)
    assert got["a"] == first["a"] and got["b"] == first["b"] and len(got["b5"]["token_ids"]) == 5
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != FINGERPRINT}) + "\n"
                                              for r in records(out)))
    write_lines(src, [{"id": "a", "prompt": C}])  # a record without a fingerprint: trusted as before
    assert main(argv) == 0 and by_id(out)["a"]["prompt"] == A


def test_retry_errors_redoes_the_error_records_and_keeps_the_rest(stories_dir, tmp_path, capsys):
    """Error records used to count as done forever: a fixed line was never redone and the exit code
    stayed 1. A changed line under an error record is refused with the way out; --retry-errors takes
    every error record out (one of a line no longer in the input too) and redoes their requests."""
    src, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    argv = ["generate", "--model", stories_dir, "--input", str(src), "--output", out, *GREEDY]
    write_lines(src, [{"id": "a", "prompt": A}, {"id": "t", "prompt": B, "temperature": -1}, "{not json"])
    assert main(argv) == 1
    first = by_id(out)
    assert main([*argv, "--retry-errors"]) == 1  # nothing fixed: the same records again, one per id
    assert by_id(out) == first and len(records(out)) == 3 and records(out)[0] == first["a"]
    write_lines(src, [{"id": "a", "prompt": A}, {"id": "t", "prompt": B, "temperature": 0},
                      {"id": "j", "prompt": C}])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --output {out} holds a record for id 't' that answers another request than line 2 of "
                   "the input: the input changed since it was written; rerun with --retry-errors to redo the error "
                   "records (the finished ones are kept)\n")
    assert main([*argv, "--retry-errors", "--overwrite"]) == 2
    assert "--retry-errors and --overwrite: pass one" in capsys.readouterr().err
    assert main([a for a in argv if a != "--quiet"] + ["--retry-errors"]) == 0
    assert f"3 requests (jsonl) in {src}: 1 already in {out} (2 error records taken out to be redone), 2 to run" \
        in capsys.readouterr().out
    got = by_id(out)
    assert sorted(got, key=str) == ["a", "j", "t"] and got["a"] == first["a"]
    assert all("error" not in r for r in got.values())


def test_request_mistakes_are_invalid_request(stories_dir, tmp_path):
    """Refused before any pass (the request's fault): `invalid_request`, as the docs say (they were
    `generation_failed`, the code of a pass that failed)."""
    lines = [{"id": "bias", "prompt": A, "logit_bias": {"99999": 1}},
             {"id": "stop", "prompt": A, "stop_token_ids": [99999]},
             {"id": "lp", "prompt": A, "logprobs": 30},
             {"id": "huge", "prompt": "a " * 2_000_000},  # refused before it is encoded (2 GB for tokenizers)
             {"id": "ok", "prompt": A}]
    if _has_xgrammar():
        lines.append({"id": "grammar", "prompt": A, "structured_outputs": {"grammar": "root ::= ("}})
    src = write_lines(tmp_path / "in.jsonl", lines)
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"),
                 *GREEDY]) == 1
    got = by_id(tmp_path / "o.jsonl")
    assert "error" not in got.pop("ok") and len(got) == len(lines) - 1
    assert {key: r["error"]["code"] for key, r in got.items()} == {key: "invalid_request" for key in got}
    assert got["huge"]["error"]["message"].startswith("line 4: the text is 4,000,000 characters, more than the "
                                                      "model's context of 512 tokens can hold")


def _has_xgrammar() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_json_array_is_one_error(stories_dir, tmp_path, capsys, fmt):
    """`[{...}, {...}]` over several lines used to run as plain text, a prompt per line of JSON."""
    src = tmp_path / "in.json"
    src.write_text(json.dumps([{"id": 1, "prompt": A}, {"id": 2, "prompt": B}], indent=2))
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", str(src), "--output", str(out),
                 "--input-format", fmt]) == 2
    hint = "; if its lines are plain-text prompts, pass --input-format text" if fmt == "auto" else ""
    assert capsys.readouterr().err.splitlines() == [
        f"error: --input {src} is a JSON array of 2 items: --input takes JSON lines (one JSON object per line) "
        f"or plain text (one prompt per line); convert it with `jq -c '.[]' FILE > FILE.jsonl`{hint}"]
    assert not out.exists()


def test_prompts_that_start_like_an_array_are_text(stories_dir, tmp_path):
    src = write_lines(tmp_path / "in.txt", ["[INST] Tell me a story [/INST]", B])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), *GREEDY]) == 0
    assert by_id(out)[1]["prompt"] == "[INST] Tell me a story [/INST]"


def test_an_id_utf8_cannot_write_is_that_lines_error(stories_dir, tmp_path):
    """A lone surrogate (a JSON escape can carry one) in an id or custom_id used to crash the job
    at the first append, and every rerun again; now it is that line's error record."""
    for fmt, bad, good in (
            ("jsonl", '{"id": "\\udc00", "prompt": "Lily went"}', {"id": "ok", "prompt": A}),
            ("openai", '{"custom_id": "\\udc00", "url": "/v1/completions", "body": {"prompt": "Lily went"}}',
             {"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": A}})):
        src = write_lines(tmp_path / f"{fmt}.jsonl", [bad, good])
        out = tmp_path / f"{fmt}.out"
        argv = ["generate", "--model", stories_dir, "--input", src, "--output", str(out), *GREEDY]
        assert main(argv) == 1 and main(argv) == 1  # the rerun has nothing to redo
        error, ok = records(out)
        name = "id" if fmt == "jsonl" else "custom_id"
        assert error["line"] == 1 and error["error"]["message"] == (
            f"line 1: \"{name}\" '\\udc00' is not valid Unicode (a lone surrogate at character 0): its record "
            "could not be written; give it an id of real characters")
        assert ok[name] == "ok" and ok.get("error") is None


def test_max_tokens_null_under_policy_auto(stories_dir, tmp_path):
    """null: until the context ends (or EOS); --policy auto plans it as the context's rest (it used
    to fail the job with a TypeError)."""
    src = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": A, "max_tokens": None, "ignore_eos": True}])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), "--policy", "auto",
                 "--hardware", "t4", *GREEDY]) == 0
    with LLM(stories_dir, dtype="float32") as llm:
        ref, = llm.generate([A], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)
    got = records(out)[0]
    assert got["token_ids"] == ref.token_ids and len(got["token_ids"]) == 512 - len(ref.prompt_token_ids)


@pytest.mark.parametrize("how", ["its reader is gone", "closed"])
def test_a_gone_stderr_ends_nothing(stories_dir, tmp_path, how):
    """The progress bar's first write used to raise BrokenPipeError and end the job with no record
    (`generate ... 2>&1 | head -1`); stderr now goes quiet and the job runs to its end."""
    src = write_lines(tmp_path / "in.txt", [A, B, C])
    argv = ["generate", "--model", stories_dir, "--input", src, "--temperature", "0", "--max-tokens", "6",
            "--dtype", "float32"]  # not --quiet: the bar is what writes
    ref = tmp_path / "ref.jsonl"
    cli(*argv, "--output", str(ref), "--quiet", check_rc=0)
    out = tmp_path / "o.jsonl"
    command = [sys.executable, "-m", "flexsarathi", *argv, "--output", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    if how == "closed":  # `2>&-`, stdout too
        proc = subprocess.run(["sh", "-c", 'exec "$@" >&- 2>&-', "sh", *command], cwd=REPO, env=env, timeout=300)
    else:
        read, write = os.pipe()
        os.close(read)  # every write to the pipe fails with EPIPE
        try:
            proc = subprocess.run(command, stdout=write, stderr=write, cwd=REPO, env=env, timeout=300)
        finally:
            os.close(write)
    assert proc.returncode == 0
    assert by_id(out) == by_id(ref)


def test_a_crash_exits_with_its_own_code(stories_dir, tmp_path, capsys):
    """A failure that is a bug exits EXIT_CRASH (70), not 1: 1 says the job ran to its end with
    some error records, which a script must not read into a job that stopped partway."""
    src = write_lines(tmp_path / "in.txt", [A, B])
    argv = ["generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), *GREEDY]

    def crash():
        raise RuntimeError("injected in the third pass")

    with on_call(LLMEngine, "forward", 3, crash):
        assert main(argv) == EXIT_CRASH == 70
    assert capsys.readouterr().err == ("error: unexpected RuntimeError: injected in the third pass (a bug: rerun "
                                       "with FLEXSARATHI_TRACEBACK=1 and report the traceback)\n")
    assert main(argv) == 0  # the rerun finishes the job


def test_openai_body_fields_as_the_docs_say(stories_dir, tmp_path):
    """A misspelled body field is that line's error record (it used to be dropped and the request run
    with the default); max_completion_tokens counts on /v1/completions (it used to be dropped)."""
    lines = [{"custom_id": "typo", "url": "/v1/completions", "body": {"prompt": A, "max_token": 3}},
             {"custom_id": "mct", "url": "/v1/completions", "body": {"prompt": A, "max_completion_tokens": 3,
                                                                    "user": "u1", "store": False}}]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), *GREEDY]) == 1
    got = {r["custom_id"]: r for r in records(out)}
    assert got["typo"]["error"]["message"] == ("line 1: unknown body field(s) ['max_token']; did you mean "
                                               "'max_tokens' for 'max_token'?")
    assert got["mct"]["response"]["body"]["usage"]["completion_tokens"] == 3
