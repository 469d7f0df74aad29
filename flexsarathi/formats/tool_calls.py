"""Tool calling in chat requests (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, as vLLM
serves them): the tools checked and handed to the chat template, a forced choice ("required" or one
named function) turned into a JSON schema the reply is constrained to, and the calls a model wrote
read back out of its text in the format its chat template teaches it.

Formats (vLLM's parser names), told from the chat template or named by the user:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, the text
  before the first block the message's content (Qwen2.5, Qwen3, QwQ, Hermes 2 Pro and later);
- llama3_json: the reply is one JSON object `{"name": ..., "parameters": {...}}`, or several joined
  by ";", optionally after `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling);
- mistral: `[TOOL_CALLS]` (a special token: read from the text with special tokens kept) and a JSON
  array of `{"name", "arguments"}` (Mistral 7B v0.3, Mixtral 8x22B, Mistral NeMo);
- harmony: gpt-oss's messages, a call one addressed `to=functions.NAME` (flexsarathi/formats/harmony.py).
A reply that does not hold well-formed calls is the message's content, as vLLM returns it: no call
is invented or half-read.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from flexsarathi.errors import FlexSarathiError

PARSERS = ("hermes", "llama3_json", "mistral", "harmony")  # harmony: gpt-oss's messages (formats/harmony.py)
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit: a "required" grammar over thousands of functions would compile for minutes
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_TOOL_FIELDS = {"type", "function"}
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments
# What a chat template writes when it teaches each format (a template that names none teaches none).
_TEMPLATE_MARKS = (("harmony", ("<|channel|>",)), ("hermes", ("<tool_call>",)), ("mistral", ("[TOOL_CALLS]",)),
                   ("llama3_json", ("<|python_tag|>", '{"name": function name, "parameters"')))
_HERMES_START, _PYTHON_TAG, _MISTRAL_START = "<tool_call>", "<|python_tag|>", "[TOOL_CALLS]"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call a reply makes: the function's name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request says of tools. choice: "none" (the tools are shown to the model, its
    reply is text), "auto" (the reply is read for calls in `parser`'s format), "required" (the reply
    is constrained to a JSON list of one or more calls), "function" (constrained to the arguments of
    `function`). parallel: more than one call allowed in a reply (OpenAI's parallel_tool_calls)."""

    tools: tuple  # the tool objects as given, checked by check_tools
    choice: str
    function: str | None = None
    parallel: bool = True
    parser: str | None = None  # the format "auto" reads; set once the chat template is known

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls=None, where: str = "") -> "ToolRequest":
        """From a request's fields; FlexSarathiError naming the field that is not right."""
        checked = check_tools(tools, f"{where}tools")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise FlexSarathiError(f"{where}parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
        choice, function = _check_choice(tool_choice, checked, f"{where}tool_choice")
        return cls(tuple(checked), choice, function, parallel_tool_calls is not False)

    def with_parser(self, parser: str | None, chat_template: str | None) -> "ToolRequest":
        """This request with the format its calls are read in: `parser` if named, else the one the
        chat template teaches; FlexSarathiError where "auto" is asked and neither gives one."""
        if parser is not None and parser not in PARSERS:
            raise FlexSarathiError(f"tool-call parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        found = parser or template_parser(chat_template)
        if self.choice == "auto" and found is None:
            raise FlexSarathiError(
                "tool_choice \"auto\" reads the calls a reply writes, and this chat template teaches no tool-call "
                f"format this engine reads ({', '.join(PARSERS)}): pass --tool-call-parser, or tool_choice "
                "\"required\" or a named function (the reply is then constrained to calls)")
        return ToolRequest(self.tools, self.choice, self.function, self.parallel, found)

    def structured_outputs(self) -> dict | None:
        """The JSON schema a forced choice constrains the reply to (compact, as response_format's);
        None where the reply is free text."""
        if self.choice == "function":
            return {"json": _parameters(self._tool(self.function)), "disable_any_whitespace": True}
        if self.choice == "required":
            return {"json": required_schema(self.tools, self.parallel), "disable_any_whitespace": True}
        return None

    def read(self, text: str, text_with_specials: str) -> tuple[str | None, list[ToolCall]]:
        """(the message's content, the calls) a reply holds. text_with_specials: the reply decoded
        with its special tokens kept (mistral's [TOOL_CALLS] is one)."""
        if self.choice == "none":
            return text, []
        if self.choice == "function":  # the reply is the arguments (cut short only where it hit max_tokens)
            return None, [ToolCall(self.function, text)]
        if self.choice == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        if self.parser in (None, "harmony"):  # not read (with_parser refuses "auto" without a format); harmony's
            return text, []  # replies are read as messages (formats/harmony.py), this only where one is not
        content, calls = read_tool_calls(text_with_specials if self.parser == "mistral" else text, self.parser)
        return content, calls if self.parallel else calls[:1]

    def _tool(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def check_tools(tools, where: str = "tools") -> list[dict]:
    """OpenAI's tools: a list of {"type": "function", "function": {"name", "description",
    "parameters", "strict"}}, names unique; FlexSarathiError naming the first that is not so."""
    if not isinstance(tools, list):
        raise FlexSarathiError(f"{where} must be a list of {{\"type\": \"function\", \"function\": {{...}}}} "
                               f"objects, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise FlexSarathiError(f"{where} offers {len(tools)} functions; a request offers at most {MAX_TOOLS} "
                               "(OpenAI's limit)")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"{where}[{i}]")
        if name in seen:
            raise FlexSarathiError(f"{where}[{i}].function.name {name!r} is also {where}[{seen[name]}]'s: "
                                   "a function is offered once")
        seen[name] = i
    return tools


def _check_tool(tool, where: str) -> str:
    if not isinstance(tool, dict):
        raise FlexSarathiError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, "
                               f"got {type(tool).__name__}")
    if unknown := sorted(set(tool) - _TOOL_FIELDS):
        raise FlexSarathiError(f"{where}: unknown field(s) {unknown}; a tool has type and function")
    if tool.get("type") != "function":
        raise FlexSarathiError(f"{where}.type must be \"function\" (the only kind of tool a chat model calls "
                               f"here), got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise FlexSarathiError(f"{where}.function must be an object with a name, got {type(function).__name__}")
    if unknown := sorted(set(function) - _FUNCTION_FIELDS):
        raise FlexSarathiError(f"{where}.function: unknown field(s) {unknown}; a function has "
                               f"{', '.join(sorted(_FUNCTION_FIELDS))}")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise FlexSarathiError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    for field, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                              ("strict", bool, "true or false")):
        if function.get(field) is not None and not isinstance(function[field], kind):
            raise FlexSarathiError(f"{where}.function.{field} must be {what}, got {function[field]!r:.60}")
    return name


def _check_choice(choice, tools: list[dict], where: str) -> tuple[str, str | None]:
    """(choice, forced function's name) of OpenAI's tool_choice: "none" / "auto" / "required" or
    {"type": "function", "function": {"name": ...}}; unset is "auto" with tools, else "none"."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in CHOICES:
        if choice != "none" and not tools:
            raise FlexSarathiError(f"{where} {choice!r} needs tools to choose from, and none are given")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise FlexSarathiError(f"{where} must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                               f"\"function\": {{\"name\": ...}}}}, got {choice!r:.80}")
    if name not in names:
        offered = f"it offers {', '.join(names)}" if names else "no tools are given"
        raise FlexSarathiError(f"{where} names function {name!r}, which tools does not offer ({offered})")
    return "function", name


def _parameters(function: dict) -> dict:
    params = function.get("parameters")
    return params if params is not None else _EMPTY_PARAMETERS


def required_schema(tools, parallel: bool = True) -> dict:
    """vLLM's schema for tool_choice "required": a JSON list of one or more {"name", "parameters"}
    objects, each name one of the tools' with that tool's parameters (at most one with parallel off).
    Each tool's "$defs" move to the root, where its "#/$defs/..." references point."""
    variants, defs = [], {}
    for tool in tools:
        function = tool["function"]
        params = copy.deepcopy(_parameters(function))
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise FlexSarathiError(f"tools: two functions define \"$defs\" {name!r} differently; with "
                                       "tool_choice \"required\" their definitions share one namespace")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                          "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches (the marks it writes), or None."""
    for parser, marks in _TEMPLATE_MARKS:
        if chat_template and any(mark in chat_template for mark in marks):
            return parser
    return None


def read_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply in `parser`'s format; a reply that does not hold well-formed
    calls is all content (None where it is blank) and no call."""
    reader = {"hermes": _hermes_calls, "llama3_json": _llama3_calls, "mistral": _mistral_calls}[parser]
    found = reader(text)
    if found is None:
        return text, []
    content, calls = found
    return (content if content.strip() else None), calls


def _hermes_calls(text: str):
    start = text.find(_HERMES_START)
    if start < 0:
        return None
    calls = [_call(_json_value(block.group(1).strip())) for block in _HERMES_BLOCK.finditer(text, start)]
    return None if None in calls else (text[:start], calls)


def _llama3_calls(text: str):
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return None
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        calls.append(_call(value))
        at = _skip(body, at, ";")
    return None if None in calls else ("", calls)


def _mistral_calls(text: str):
    start = text.find(_MISTRAL_START)
    if start < 0:
        return None
    try:  # the array, then whatever the decode kept after it (the end-of-text token)
        value, _ = json.JSONDecoder().raw_decode(text, _skip(text, start + len(_MISTRAL_START), ""))
    except ValueError:
        return None
    calls = [_call(v) for v in value] if isinstance(value, list) and value else [None]
    return None if None in calls else (text[:start], calls)


def _skip(text: str, at: int, separator: str) -> int:
    """The index past the blanks (and one `separator`) at `at`."""
    while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
        at += 1
    return at


def _json_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(value) -> ToolCall | None:
    """A call from {"name": ..., "arguments" | "parameters": {...}}; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON text already
        return ToolCall(value["name"], arguments) if isinstance(_json_value(arguments), dict) else None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def _required_calls(text: str) -> list[ToolCall]:
    value = _json_value(text)
    if not isinstance(value, list):
        return []
    calls = [_call({"name": v.get("name"), "arguments": v.get("parameters")}) if isinstance(v, dict) else None
             for v in value]
    return [] if None in calls else calls
