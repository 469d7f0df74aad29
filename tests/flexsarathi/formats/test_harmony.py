"""gpt-oss's harmony replies read back as vLLM serves them: the final channel the content, the rest
the reasoning, messages to functions the tool calls; from a real tokenizer whose markers are special
tokens (the reply's text without them reads "analysis...assistantfinal..."), into OpenAI chat
completions the official client reads and JSONL records alike."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexsarathi.cli.request_files import BatchRequest, result_record
from flexsarathi.engine.llm_engine import CompletionOutput, RequestOutput
from flexsarathi.formats.harmony import read_harmony, speaks_harmony
from flexsarathi.formats.tokenizer import Tokenizer
from flexsarathi.formats.tool_calls import ToolCall, ToolRequest
from tests.conftest import with_chat_template
from tests.flexsarathi.cli.test_cli_generate import chat_dir  # noqa: F401 (fixture)

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Rome.<|return|>"
CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
        '{"city": "rome"}<|call|>')
# gpt-oss's template in miniature: a system message saying the reasoning effort, earlier replies on the final
# channel, the reply opened after <|start|>assistant
TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
            "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("text, content, reasoning, calls", [
    (THINK + ANSWER, "It is sunny in Rome.", "The user wants the weather.", []),
    (THINK + CALL, None, "The user wants the weather.", [ToolCall("get_weather", '{"city": "rome"}')]),
    (THINK + THINK.replace("<|channel|>", "<|start|>assistant<|channel|>") + ANSWER, "It is sunny in Rome.",
     "The user wants the weather.\nThe user wants the weather.", []),
    ("<|channel|>analysis<|message|>Cut short by max_tok", None, "Cut short by max_tok", []),
    (THINK + "<|start|>assistant<|channel|>fin", None, "The user wants the weather.", []),
    ("<|channel|>final<|message|>Straight to it.<|return|>", "Straight to it.", None, []),
], ids=["answer", "call", "two thoughts", "cut while thinking", "cut in a header", "no thinking"])
def test_a_reply_is_read_as_its_messages(text, content, reasoning, calls):
    reply = read_harmony(text)
    assert (reply.content, reply.reasoning, reply.calls) == (content, reasoning, calls)


def test_plain_text_is_not_harmony_and_calls_can_be_left_unread():
    assert read_harmony("Just text, no messages.") is None
    reply = read_harmony(THINK + CALL, read_calls=False)  # tool_choice "none": the call is not made
    assert reply.calls == [] and reply.reasoning == 'The user wants the weather.\n{"city": "rome"}'
    assert speaks_harmony(TEMPLATE) and not speaks_harmony("{{ messages }}") and not speaks_harmony(None)


@pytest.fixture(scope="module")
def harmony_tokenizer(stories_dir, tmp_path_factory):
    """stories260K's tokenizer with harmony's markers as special tokens (as o200k_harmony has them)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    folder = Path(with_chat_template(stories_dir, tmp_path_factory.mktemp("harmony") / "stories-harmony", TEMPLATE))
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer.from_folder(str(folder))


def _output(tok, text: str) -> RequestOutput:
    ids = tok.encode(text, add_special_tokens=False)
    completion = CompletionOutput(index=0, text=tok.decode(ids), token_ids=ids, finish_reason="stop")
    return RequestOutput(request_id=0, prompt=None, prompt_token_ids=[1, 2, 3], outputs=[completion])


@pytest.mark.parametrize("tools", [None, "auto", "none"])
def test_an_openai_chat_completion_holds_the_reply_as_read(harmony_tokenizer, tools):
    openai_types = pytest.importorskip("openai.types.chat")
    tok = harmony_tokenizer
    output = _output(tok, THINK + (CALL if tools else ANSWER))
    assert "analysis" in output.outputs[0].text and "<|channel|>" not in output.outputs[0].text  # markers gone
    offered = None if tools is None else ToolRequest.of([WEATHER], tools).with_parser(None, TEMPLATE)
    req = BatchRequest(line=1, id="h", chat=True, harmony=True, messages=[{"role": "user", "content": "hi"}],
                       tools=offered)
    body = result_record("openai", req, output, "gpt-oss", tok.decode)["response"]["body"]
    openai_types.ChatCompletion.model_validate(body)  # the client reads it
    message, finish = body["choices"][0]["message"], body["choices"][0]["finish_reason"]
    assert message["reasoning_content"].startswith("The user wants the weather.")
    if tools == "auto":
        assert message["content"] is None and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            ("get_weather", {"city": "rome"})]
    else:
        assert "tool_calls" not in message and finish == "stop"
        assert message["content"] == ("It is sunny in Rome." if tools is None else None)


def test_a_jsonl_record_gives_the_content_as_its_text(harmony_tokenizer):
    tok = harmony_tokenizer
    req = BatchRequest(line=1, id="h", harmony=True, messages=[{"role": "user", "content": "hi"}])
    record = result_record("jsonl", req, _output(tok, THINK + ANSWER), "gpt-oss", tok.decode)
    assert (record["text"], record["reasoning"]) == ("It is sunny in Rome.", "The user wants the weather.")
    plain = result_record("jsonl", BatchRequest(line=1, id="p", messages=req.messages),
                          _output(tok, THINK + ANSWER), "m", tok.decode)
    assert "reasoning" not in plain and plain["text"].startswith("analysis")  # another model's text as it is


def test_a_chat_request_is_read_as_harmony_where_the_template_writes_it(harmony_tokenizer, chat_dir):  # noqa: F811
    from flexsarathi.cli.generate import _prepare

    messages = [{"role": "user", "content": "hi"}]
    harmony, plain = BatchRequest(line=1, id="h", messages=messages), BatchRequest(line=2, id="p", messages=messages)
    assert _prepare(harmony, harmony_tokenizer, {"max_tokens": 4}, 0) is not None and harmony.harmony
    assert _prepare(plain, Tokenizer.from_folder(chat_dir), {"max_tokens": 4}, 0) is not None and not plain.harmony


def test_reasoning_effort_reaches_a_template_that_reads_it(harmony_tokenizer, chat_dir, tmp_path):  # noqa: F811
    """OpenAI's body.reasoning_effort goes to the chat template as vLLM hands it over; a template that
    does not read it, a value OpenAI does not have, a completions body or a clash are each the line's error."""
    from flexsarathi.cli.generate import _prepare
    from tests.flexsarathi.cli.test_request_files import _body

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    high = _body(tmp_path, {**chat, "reasoning_effort": "high"}, "/v1/chat/completions")
    plain = _body(tmp_path, chat, "/v1/chat/completions")
    assert high.error is None and high.fingerprint != plain.fingerprint
    assert _prepare(high, harmony_tokenizer, {"max_tokens": 4}, 0) is not None
    assert "Reasoning: high" in harmony_tokenizer.decode(high.prompt_token_ids, skip_special_tokens=False)
    elsewhere = _body(tmp_path, {**chat, "reasoning_effort": "high"}, "/v1/chat/completions")
    assert _prepare(elsewhere, Tokenizer.from_folder(chat_dir), {"max_tokens": 4}, 0) is None
    assert "this model's does not read it" in elsewhere.error
    for body, url, message in [
        ({**chat, "reasoning_effort": "max"}, "/v1/chat/completions", "must be one of minimal, low, medium, high"),
        ({"prompt": "hi", "reasoning_effort": "low"}, "/v1/completions", "belongs to a /v1/chat/completions body"),
        ({**chat, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
         "/v1/chat/completions", "differ"),
    ]:
        assert message in _body(tmp_path, body, url).error
