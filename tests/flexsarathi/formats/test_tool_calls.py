"""flexsarathi/formats/tool_calls.py: OpenAI's tools checked, each format's calls read back out of the
texts a model writes (built here from the calls with json.dumps, so the expected calls are the ones
written), vLLM's "required" schema judged by jsonschema, the format a chat template teaches, and
tools rendered by a chat template as transformers renders them."""
from __future__ import annotations

import json

import jsonschema
import pytest

from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats.tokenizer import Tokenizer
from flexsarathi.formats.tool_calls import (PARSERS, ToolCall, ToolRequest, read_tool_calls, required_schema,
                                            template_parser)
from tests.conftest import with_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}  # no parameters
TOOLS = [WEATHER, CLOCK]
# A hermes-style chat template written for these tests: the tools listed, earlier calls and tool
# replies written back the way the model is taught to write them.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nFunctions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{{ m.content }}"
    "{% for call in m.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<|tool|>\n<tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CALLS = [ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"})), ToolCall("now", json.dumps({}))]


def hermes(calls, before="") -> str:
    return before + "".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)})}"
                            "\n</tool_call>" for c in calls)


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", hermes(CALLS, "Let me look. "), "Let me look. "),
    ("hermes", hermes(CALLS)[:-len("\n</tool_call>")], None),  # the last block cut at the end of the text
    ("llama3_json", "<|python_tag|>" + "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)})
                                                 for c in CALLS), None),
    ("mistral", "Sure.[TOOL_CALLS] " + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)}
                                                    for c in CALLS]) + "</s>", "Sure."),
])
def test_each_format_reads_back_the_calls_written(parser, text, content):
    got_content, calls = read_tool_calls(text, parser)
    assert calls == CALLS and got_content == content
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris", "unit": "c"}, {}]


@pytest.mark.parametrize("parser, text", [
    ("hermes", "No call here, just words."),
    ("hermes", "Calling <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>"),  # cut JSON
    ("hermes", hermes(CALLS) + "<tool_call>[1, 2]</tool_call>"),  # one block is no call: none is read
    ("hermes", "<tool_call>{\"name\": \"now\", \"arguments\": [1]}</tool_call>"),  # arguments not an object
    ("llama3_json", "{\"weather\": \"sunny\"}"),  # a JSON object that names no function
    ("llama3_json", "The answer is 4."),
    ("llama3_json", json.dumps({"name": "now", "parameters": {}}) + " and then some words"),
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", "[TOOL_CALLS] []"),
])
def test_a_reply_without_well_formed_calls_is_all_content(parser, text):
    assert read_tool_calls(text, parser) == (text, [])


def test_arguments_written_as_a_json_text_are_taken_as_they_are():
    args = json.dumps({"city": "Oslo"})
    text = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": args}) + "</tool_call>"
    assert read_tool_calls(text, "hermes") == (None, [ToolCall("get_weather", args)])


@pytest.mark.parametrize("fields, message", [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, r"tools\[0\]\.function\.name must be"),
    ({"tools": [{"type": "retrieval"}]}, r"tools\[0\]\.type must be \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     r"tools\[0\]\.function\.parameters must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     r"tools\[0\]\.function: unknown field\(s\) \['returns'\]"),
    ({"tools": [WEATHER, WEATHER]}, r"body\.tools\[1\]\.function\.name 'get_weather' is also body\.tools\[0\]'s"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     r"tool_choice names function 'fly', which tools does not offer \(it offers get_weather, now\)"),
    ({"tools": TOOLS, "tool_choice": "always"}, r"tool_choice must be \"none\", \"auto\", \"required\""),
    ({"tools": [], "tool_choice": "required"}, r"tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls must be true or false"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "body.tools offers 129 functions; a request offers at most 128"),
])
def test_wrong_tool_fields_are_refused_by_name(fields, message):
    with pytest.raises(FlexSarathiError, match=message):
        ToolRequest.of(fields["tools"], fields.get("tool_choice"), fields.get("parallel_tool_calls"), "body.")


def test_choices_and_their_constraints():
    assert ToolRequest.of(TOOLS).choice == "auto" and ToolRequest.of([], None).choice == "none"
    named = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert named.structured_outputs() == {"json": {"type": "object", "properties": {}}, "disable_any_whitespace": True}
    assert named.read("{}", "{}") == (None, [ToolCall("now", "{}")])
    weather = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert weather.structured_outputs()["json"] == WEATHER["function"]["parameters"]
    assert ToolRequest.of(TOOLS, "none").read("text", "text") == ("text", [])
    assert ToolRequest.of(TOOLS, "auto").structured_outputs() is None


def test_required_schema_takes_lists_of_the_tools_calls_only():
    schema = required_schema(TOOLS)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "fly", "parameters": {}}], [{"name": "get_weather", "parameters": {"town": "x"}}],
                [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_schema(TOOLS, parallel=False)
    jsonschema.validate(good[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    request = ToolRequest.of(TOOLS, "required")
    assert request.structured_outputs()["json"] == schema
    assert request.read(json.dumps(good), "") == (None, [ToolCall("get_weather", json.dumps({"city": "Rome"})),
                                                         ToolCall("now", "{}")])
    assert request.read('[{"name": "now", "param', "") == ('[{"name": "now", "param', [])  # cut by max_tokens


def test_defs_move_to_the_root_where_their_references_point():
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    trip = {"type": "function", "function": {"name": "trip", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/place"}}, "required": ["to"],
        "$defs": {"place": place}}}}
    schema = required_schema([trip, CLOCK])
    assert schema["$defs"] == {"place": place} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "trip", "parameters": {"to": {"city": "Kyoto"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "trip", "parameters": {"to": {"town": "Kyoto"}}}], schema)
    clash = {"type": "function", "function": {"name": "back", "parameters": {"$defs": {"place": {"type": "integer"}}}}}
    with pytest.raises(FlexSarathiError, match="define \"\\$defs\" 'place' differently"):
        required_schema([trip, clash])
    assert trip["function"]["parameters"]["$defs"] == {"place": place}  # the request's own schema is left as given


def test_the_format_comes_from_the_chat_template_or_the_user():
    assert template_parser(TOOL_TEMPLATE) == "hermes"
    assert template_parser("{{ '[TOOL_CALLS] ' + (m.tool_calls | tojson) }}") == "mistral"
    assert template_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert template_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None and template_parser(None) is None
    auto = ToolRequest.of(TOOLS)
    assert auto.with_parser(None, TOOL_TEMPLATE).parser == "hermes"
    assert auto.with_parser("mistral", TOOL_TEMPLATE).parser == "mistral"
    with pytest.raises(FlexSarathiError, match="teaches no tool-call format .* pass --tool-call-parser"):
        auto.with_parser(None, "{{ messages[0].content }}")
    with pytest.raises(FlexSarathiError, match=f"must be one of {', '.join(PARSERS)}"):
        auto.with_parser("pythonic", TOOL_TEMPLATE)
    assert ToolRequest.of(TOOLS, "required").with_parser(None, None).parser is None  # forced: nothing to read


@pytest.fixture(scope="module")
def tool_chat_dir(stories_dir, tmp_path_factory):
    return with_chat_template(stories_dir, tmp_path_factory.mktemp("tools") / "stories-tools", TOOL_TEMPLATE)


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_tools_and_earlier_calls_render_as_transformers_renders_them(tool_chat_dir):
    """The template's `tools` are the request's tool objects, and an earlier call's arguments (a
    JSON text in OpenAI's messages) reach the template as the object they hold, as vLLM hands them
    over; transformers renders the same messages to the same tokens."""
    from transformers import AutoTokenizer

    tok = Tokenizer.from_folder(tool_chat_dir)
    ref = AutoTokenizer.from_pretrained(tool_chat_dir)
    as_objects = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY]
    as_objects[1]["content"] = ""
    expected = ref.apply_chat_template(as_objects, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # transformers 5: an encoding
    assert tok.apply_chat_template(HISTORY, tools=TOOLS) == list(expected)
    text = tok.render_chat(HISTORY, tools=TOOLS)
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    without = tok.render_chat(HISTORY)
    assert "Functions:" not in without and without == tok.render_chat(HISTORY, chat_template_kwargs={"tools": None})
    assert tok.render_chat(HISTORY, chat_template_kwargs={"tools": TOOLS}) == text  # the old way still works


@pytest.mark.parametrize("change, message", [
    (lambda h: h[1]["tool_calls"][0]["function"].update(arguments="{city: Paris}"),
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not a JSON text"),
    (lambda h: h[1].update(tool_calls=[{"type": "function"}]), r"messages\[1\]\.tool_calls\[0\] must be"),
    (lambda h: h[1].update(tool_calls="get_weather"), r"messages\[1\]\.tool_calls must be a list"),
])
def test_wrong_earlier_calls_are_refused_by_name(tool_chat_dir, change, message):
    history = json.loads(json.dumps(HISTORY))
    change(history)
    with pytest.raises(FlexSarathiError, match=message):
        Tokenizer.from_folder(tool_chat_dir).render_chat(history, tools=TOOLS)


def test_tools_given_twice_or_wrong_are_refused(tool_chat_dir):
    tok = Tokenizer.from_folder(tool_chat_dir)
    with pytest.raises(FlexSarathiError, match="tools are given twice"):
        tok.render_chat(HISTORY, tools=TOOLS, chat_template_kwargs={"tools": TOOLS})
    with pytest.raises(FlexSarathiError, match=r"tools\[1\]\.type must be"):
        tok.render_chat(HISTORY, tools=[WEATHER, {"type": "web"}])


def test_llm_chat_shows_the_tools_and_a_forced_reply_reads_back_as_a_call(tool_chat_dir):
    """LLM.chat(tools=...) (vLLM's): the prompt the template renders with the tools; a named
    function's schema as the request's structured output gives a reply that reads back as one call
    whose arguments validate against that function's parameters."""
    pytest.importorskip("xgrammar")
    from flexsarathi import LLM, SamplingParams
    from flexsarathi.engine.sampling import StructuredOutputsParams

    ask = HISTORY[:1]
    named = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=StructuredOutputsParams(**named.structured_outputs()))
    with LLM(tool_chat_dir, dtype="float32") as llm:
        [out] = llm.chat(ask, params, use_tqdm=False, tools=TOOLS)
        assert out.prompt == llm.tokenizer.render_chat(ask, tools=TOOLS) and "Functions:" in out.prompt
        assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(ask, tools=TOOLS)
    content, [call] = named.read(out.text, out.text)
    assert content is None and call.name == "get_weather" and out.finish_reason == "stop"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
