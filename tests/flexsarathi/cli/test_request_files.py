"""flexsarathi/cli/request_files.py: a JSONL record's unknown field is refused with what it may have
meant: the record's own name for an OpenAI body field, the nearest name for a typo, else the list of
the fields a record takes; and the suggested record runs as the OpenAI line would."""
from __future__ import annotations

import json

import pytest

from flexsarathi.cli.request_files import JSONL_FIELDS, read_requests


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
