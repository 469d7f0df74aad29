"""Tool calling through `flexsarathi generate` on stories260K with a hermes-style chat template: an
OpenAI batch whose chat requests offer tools and choose among them every way OpenAI's API lets
them (a named function, "required" with and without parallel calls, "auto", "none"); every
response body is a chat.completion the official openai client reads, every call's arguments
validate against its function's schema, call ids are the same in a second run. Fields that
cannot run become that line's error record. JSONL records take the same fields; a template that
teaches no format refuses "auto" unless --tool-call-parser names one. Mistral's [TOOL_CALLS] is a
special token: its calls are read from the reply decoded with special tokens kept."""
from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from flexsarathi.cli.request_files import BatchRequest, tool_reply
from flexsarathi.engine.llm_engine import CompletionOutput
from flexsarathi.formats.tokenizer import Tokenizer
from flexsarathi.formats.tool_calls import ToolRequest
from tests.conftest import with_chat_template
from tests.flexsarathi.cli.test_cli_generate import chat_dir, cli, records, write_lines  # noqa: F401 (fixture)

pytest.importorskip("xgrammar")
openai_types = pytest.importorskip("openai.types.chat")

# Tools with short strings: a 260K-parameter model writes what the grammar lets it, so bounds keep
# its calls within max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = re.compile(r"[a-z]{1,8}")
# A hermes-style template that names the tools only: stories260K's context is 512 tokens of about a
# character each, too few for the tools' schemas written out and a reply.
TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>\nCall one of {% for t in tools %}{{ t.function.name }} "
                 "{% endfor %}as <tool_call>{...}</tool_call>\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
                 "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# A reply held to the hermes format by a regex: what a tool-using model writes, read back by "auto".
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "unit": "c"\}\}</tool_call>'


def chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": ASK, "tools": TOOLS, **body}}


LINES = [
    chat_line("named", tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    chat_line("required", tool_choice="required"),  # as many calls as it likes (this model lists on and on)
    chat_line("single", tool_choice="required", parallel_tool_calls=False),
    chat_line("auto-call", structured_outputs={"regex": HERMES_CALL}),
    chat_line("auto-text"),
    chat_line("none", tool_choice="none"),
    chat_line("unknown", tool_choice={"type": "function", "function": {"name": "fly"}}),
    chat_line("conflict", tool_choice="required", response_format={"type": "json_object"}),
    chat_line("functions", tools=None, functions=[WEATHER["function"]]),
]


@pytest.fixture(scope="module")
def tool_dir(stories_dir, tmp_path_factory):
    return with_chat_template(stories_dir, tmp_path_factory.mktemp("tools") / "stories-tools", TOOL_TEMPLATE)


def run(model: str, tmp_path, lines, name: str, *extra: str, check_rc: int = 1) -> dict:
    src = write_lines(tmp_path / f"{name}.in.jsonl", lines)
    out = tmp_path / f"{name}.jsonl"
    cli("generate", "--model", model, "--input", src, "--output", str(out), "--max-tokens", "120",
        "--dtype", "float32", "--quiet", *extra, check_rc=check_rc)
    return {r.get("custom_id", r.get("id")): r for r in records(out)}


def calls_of(record: dict) -> list[dict]:
    return record["response"]["body"]["choices"][0]["message"].get("tool_calls", [])


def test_every_tool_choice_in_an_openai_batch(tool_dir, tmp_path):
    got = run(tool_dir, tmp_path, LINES, "first")
    for key in ("named", "required", "single", "auto-call", "auto-text", "none"):
        assert got[key]["error"] is None, got[key]
        openai_types.ChatCompletion.model_validate(got[key]["response"]["body"])  # the client reads it
        if key not in ("required", "auto-text", "none"):  # these end where the model likes
            assert got[key]["response"]["body"]["choices"][0]["finish_reason"] != "length", key

    choice = got["named"]["response"]["body"]["choices"][0]
    [call] = calls_of(got["named"])
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"  # a forced function: stop
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])

    for key in ("required", "single"):
        choice = got[key]["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "length":  # the list cut short: no call is half-read, the text is the content
            assert key == "required" and not calls_of(got[key]) and choice["message"]["content"].startswith("[{")
            continue
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        for call in calls_of(got[key]):
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len(calls_of(got["single"])) == 1

    choice = got["auto-call"]["response"]["body"]["choices"][0]
    [call] = calls_of(got["auto-call"])
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and CITY.fullmatch(arguments["city"]) and arguments["unit"] == "c"

    for key in ("auto-text", "none"):  # no call written: the reply is the content, as generated
        choice = got[key]["response"]["body"]["choices"][0]
        assert "tool_calls" not in choice["message"] and "<tool_call>" not in choice["message"]["content"]

    assert "tool_choice names function 'fly'" in got["unknown"]["error"]["message"]
    assert "constrains the reply to tool calls, and body.response_format" in got["conflict"]["error"]["message"]
    assert "body.functions is not supported (OpenAI's deprecated name: use body.tools)" in \
        got["functions"]["error"]["message"]

    ids = [c["id"] for r in got.values() if r["error"] is None for c in calls_of(r)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    again = run(tool_dir, tmp_path, LINES, "second")  # a rerun (or a resume) writes the same ids
    assert ids == [c["id"] for r in again.values() if r["error"] is None for c in calls_of(r)]


def test_jsonl_records_take_the_same_fields(tool_dir, tmp_path):
    lines = [{"id": "named", "messages": ASK, "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "set_alarm"}}},
             {"id": "text", "messages": ASK, "tools": TOOLS, "tool_choice": "none"},
             {"id": "prompt", "prompt": "Once", "tools": TOOLS}]
    got = run(tool_dir, tmp_path, lines, "jsonl")
    [call] = got["named"]["tool_calls"]
    assert call["function"]["name"] == "set_alarm" and got["named"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["set_alarm"])
    assert call["function"]["arguments"] == got["named"]["text"]
    assert "tool_calls" not in got["text"] and "error" not in got["text"]
    assert 'tools apply to "messages" only' in got["prompt"]["error"]["message"]


def test_auto_needs_a_format_the_template_teaches_or_the_user_names(chat_dir, tmp_path):
    lines = [{"id": 0, "messages": ASK, "tools": TOOLS}]
    refused = run(chat_dir, tmp_path, lines, "plain")
    assert "teaches no tool-call format" in refused[0]["error"]["message"]
    named = run(chat_dir, tmp_path, lines, "named", "--tool-call-parser", "hermes", check_rc=0)
    assert "error" not in named[0] and named[0]["tool_calls"] == []
    meta = json.loads((tmp_path / "named.jsonl.meta.json").read_text())
    assert meta["tool_call_parser"] == "hermes" and "tool_call_parser" not in json.loads(
        (tmp_path / "plain.jsonl.meta.json").read_text())


def test_mistral_calls_are_read_with_the_special_token_kept(stories_dir, tmp_path):
    """[TOOL_CALLS] is a special token in Mistral's tokenizers: the reply's text (special tokens
    skipped) does not hold it, the reply decoded with them does; its calls get 9-character ids,
    which Mistral's templates require of the calls sent back."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    folder = tmp_path / "mistral-like"
    shutil.copytree(stories_dir, folder)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    hf.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_folder(str(folder))
    args = {"city": "rome", "unit": "c"}
    ids = tok.encode("[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": args}]),
                     add_special_tokens=False)
    text = tok.decode(ids)
    assert "[TOOL_CALLS]" not in text
    completion = CompletionOutput(index=0, text=text, token_ids=ids, finish_reason="stop")
    req = BatchRequest(line=1, id="m", tools=ToolRequest.of(TOOLS).with_parser("mistral", None))
    content, reasoning, calls, finish = tool_reply(req, completion, tok.decode)
    assert content is None and reasoning is None and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", args)]
    assert re.fullmatch(r"[0-9a-f]{9}", calls[0]["id"])
