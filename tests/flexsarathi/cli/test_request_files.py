"""flexsarathi/cli/request_files.py: a JSONL record's unknown field is refused with what it may have
meant: the record's own name for an OpenAI body field, the nearest name for a typo, else the list of
the fields a record takes; and the suggested record runs as the OpenAI line would."""
from __future__ import annotations

import json

import pytest

from flexsarathi.cli.request_files import JSONL_FIELDS, BatchRequest, error_record, read_requests


def _requests(tmp_path, lines: list[dict], fmt: str = "jsonl"):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return read_requests(str(path), fmt)[1]


@pytest.mark.parametrize("field, hint", [
    ("response_format", "'response_format' is an OpenAI request body's field: a JSONL record takes "
                        "'structured_outputs'"),
    ("max_completion_tokens", "a JSONL record takes 'max_tokens'"),
    ("max_token", "did you mean 'max_tokens' for 'max_token'?"),
    ("temprature", "did you mean 'temperature' for 'temprature'?"),
    ("colour", "; a record takes " + ", ".join(JSONL_FIELDS)),
])
def test_an_unknown_field_says_what_it_may_have_meant(tmp_path, field, hint):
    req, = _requests(tmp_path, [{"prompt": "Tom", field: 3}])
    assert req.error.startswith(f"line 1: unknown field(s) [{field!r}]; ") and hint in req.error


def test_the_suggested_record_asks_what_the_openai_line_asks(tmp_path):
    """{"type": "json_object"} under response_format (an OpenAI body) and the structured_outputs a
    JSONL record takes instead: the same sampling request."""
    openai, = _requests(tmp_path, [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": "Tom", "response_format": {"type": "json_object"}}}], "openai")
    record, = _requests(tmp_path, [{"prompt": "Tom", "structured_outputs": openai.sampling["structured_outputs"]}])
    assert openai.error is None and record.error is None
    assert record.sampling == openai.sampling


def _body(tmp_path, body: dict, url: str = "/v1/completions"):
    req, = _requests(tmp_path, [{"custom_id": "a", "method": "POST", "url": url, "body": body}], "openai")
    return req


@pytest.mark.parametrize("url, field, hint", [
    ("/v1/completions", "max_token", "did you mean 'max_tokens' for 'max_token'?"),
    ("/v1/completions", "temprature", "did you mean 'temperature' for 'temprature'?"),
    ("/v1/chat/completions", "max_completion_token", "did you mean 'max_completion_tokens' for "
                                                     "'max_completion_token'?"),
    ("/v1/completions", "top_logprobs", "'top_logprobs' belongs to a /v1/chat/completions body, and this line's "
                                        "url is /v1/completions"),
    ("/v1/chat/completions", "colour", "a /v1/chat/completions body takes add_generation_prompt, allowed_token_ids, "
                                       "bad_words, cache_salt, chat_template_kwargs, continue_final_message, "),
])
def test_an_unknown_body_field_is_the_lines_error(tmp_path, url, field, hint):
    """As a JSONL record's: an OpenAI body's field the engine does not know used to be dropped
    without a word (the request ran with another max_tokens or temperature than asked)."""
    prompt = {"prompt": "Tom"} if url == "/v1/completions" else {"messages": [{"role": "user", "content": "Tom"}]}
    req = _body(tmp_path, {**prompt, field: 3}, url)
    assert req.error.startswith(f"line 1: unknown body field(s) [{field!r}]; {hint}")
    assert req.error.endswith(hint) or field == "colour"


def test_openai_fields_that_change_nothing_are_taken(tmp_path):
    """OpenAI's fields about who asks and how the call is billed or stored, and the neutral values of
    those the engine cannot honour, ask the same request as a body without them."""
    plain = _body(tmp_path, {"prompt": "Tom", "max_tokens": 3})
    harmless = {"model": "m", "user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                "safety_identifier": "s", "prompt_cache_key": "p", "stream": False, "stream_options": None,
                "best_of": 1, "echo": False, "suffix": None}
    req = _body(tmp_path, {"prompt": "Tom", "max_tokens": 3, **harmless})
    assert req.error is None and req.sampling == plain.sampling and req.fingerprint == plain.fingerprint
    chat = {"messages": [{"role": "user", "content": "Tom"}], "parallel_tool_calls": True, "tool_choice": "none",
            "modalities": ["text"], "n": 2, "tools": [], "functions": []}  # empty lists offer no tool
    taken = _body(tmp_path, chat, "/v1/chat/completions")
    bare = _body(tmp_path, {"messages": chat["messages"], "n": 2}, "/v1/chat/completions")
    assert taken.error is None and taken.tools is None and taken.fingerprint == bare.fingerprint
    req = _body(tmp_path, {**chat, "modalities": ["audio"]}, "/v1/chat/completions")
    assert req.error == "line 1: body.modalities is not supported"
    req = _body(tmp_path, {**chat, "tool_choice": "auto"}, "/v1/chat/completions")  # with no tool to choose
    assert req.error == "line 1: body.tool_choice 'auto' needs tools to choose from, and none are given"
    offered = _body(tmp_path, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                    "/v1/chat/completions")
    assert offered.error is None and offered.tools.choice == "none" and offered.fingerprint != taken.fingerprint


def test_max_completion_tokens_is_max_tokens_on_both_urls(tmp_path):
    """It used to be dropped on /v1/completions (the request ran with the default max_tokens)."""
    for url, prompt in (("/v1/completions", {"prompt": "Tom"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tom"}]})):
        new, old = (_body(tmp_path, {**prompt, name: 3}, url) for name in ("max_completion_tokens", "max_tokens"))
        assert new.error is None and new.sampling == {"max_tokens": 3} and new.fingerprint == old.fingerprint


def test_an_error_message_utf8_cannot_write_is_escaped():
    """A message that quotes the request (and in it a lone surrogate) is escaped: the record is
    written, where json.dumps(..., ensure_ascii=False).encode() used to raise and end the job."""
    record = error_record("jsonl", BatchRequest(line=3, id="x"), "line 3: stop '\udc00' is bad")
    assert record["error"]["message"] == "line 3: stop '\\udc00' is bad"
    json.dumps(record, ensure_ascii=False).encode("utf-8")
