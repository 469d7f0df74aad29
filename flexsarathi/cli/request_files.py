"""Batch files for `flexsarathi generate`: reading the three input formats into requests and
turning outputs into the records of the matching output format.

Formats, detected from the content (the first non-blank line starting with `{` means JSON lines):
- text: one prompt per line; blank lines are skipped; a request's id is its line number;
- jsonl: `{"id", "prompt" | "prompt_token_ids" | "messages", sampling fields...}`;
- openai: OpenAI Batch API requests `{"custom_id", "method", "url", "body"}` for
  `/v1/completions` (body.prompt) and `/v1/chat/completions` (body.messages).
A line that cannot become a request keeps its error; it becomes an error record, not a failed job.
A JSON array (`[{...}, ...]`) is refused as a whole. Every request gets a fingerprint of what it
asks, and its record carries it (`request_fingerprint`): a resume tells a changed line from the one
a record answers (result_file.py).
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
import time
from dataclasses import dataclass, field

from flexsarathi.cli.file_checks import read_text_file
from flexsarathi.cli.embedding_requests import (EMBEDDING_BODY_FIELDS, EMBEDDINGS_URL, EmbeddingAsk, embedding_body,
                                                read_embedding_body)
from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats.harmony import read_harmony
from flexsarathi.formats.tool_calls import ToolRequest

FORMATS = ("text", "jsonl", "openai")
# Request fields passed to SamplingParams as they are (JSONL records and OpenAI bodies).
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "min_tokens", "n", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "bad_words", "include_stop_str_in_output", "skip_special_tokens",
                   "prompt_logprobs", "structured_outputs", "allowed_token_ids", "truncate_prompt_tokens")
# vLLM's chat options (LLM.chat's and its server's): how the chat template renders the messages.
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# OpenAI's tool calling fields of a chat request (flexsarathi/formats/tool_calls.py).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
JSONL_FIELDS = ("id", "prompt", "prompt_token_ids", "messages", "logprobs", *SAMPLING_FIELDS, *CHAT_OPTIONS,
                *TOOL_FIELDS, "cache_salt", "model")
JSONL_EMBEDDING_FIELDS = ("id", "input", "dimensions", "normalize", "model")  # a record with "input": embeddings
# What an OpenAI request body names otherwise, as a JSONL record names it.
_OPENAI_NAMES = {"response_format": "structured_outputs", "max_completion_tokens": "max_tokens",
                 "top_logprobs": "logprobs"}
COMPLETIONS_URL, CHAT_URL = "/v1/completions", "/v1/chat/completions"
# Line ends: \n, \r\n or \r only. str.splitlines() also splits at U+2028, U+2029 and U+0085, which
# JSON allows raw inside a string (json.dumps(..., ensure_ascii=False) writes them): one request
# would become two broken lines and every later line number would be off.
_LINE_END = re.compile(r"\r\n|\r|\n")
# OpenAI body fields we cannot honour: refused when set to anything but their neutral value.
_UNSUPPORTED_OPENAI = {"best_of": 1, "echo": False, "suffix": None, "stream": False, "functions": None,
                       "function_call": "none", "modalities": ["text"],
                       "audio": None, "prediction": None, "web_search_options": None, "verbosity": None}
# OpenAI's reasoning_effort, as vLLM passes it: to the chat template (gpt-oss's reads it), where it reads it
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# OpenAI's body fields that do not change what is generated (who asks, how it is billed or stored):
# accepted and ignored. `stream_options` only acts with streaming.
_IGNORED_OPENAI = ("model", "user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                   "prompt_cache_retention", "stream_options")
# What a deprecated body field became in OpenAI's API.
_SUCCESSORS = {"functions": "tools", "function_call": "tool_choice"}
# The fields each url's body takes (SAMPLING_FIELDS: vLLM's extras, as vLLM's server takes them).
OPENAI_BODY_FIELDS = {
    url: frozenset((prompt, "logprobs", *extra, "max_completion_tokens", "response_format", *SAMPLING_FIELDS,
                    "cache_salt", *_UNSUPPORTED_OPENAI, *_IGNORED_OPENAI))
    for url, prompt, extra in ((COMPLETIONS_URL, "prompt", ()),
                               (CHAT_URL, "messages", ("top_logprobs", "reasoning_effort", *CHAT_OPTIONS,
                                                        *TOOL_FIELDS)))}
OPENAI_BODY_FIELDS[EMBEDDINGS_URL] = EMBEDDING_BODY_FIELDS
URLS = (COMPLETIONS_URL, CHAT_URL, EMBEDDINGS_URL)
# The record's "request_fingerprint": a hash of the request it answers, so a resume can tell a
# changed input line from the one its record answers.
FINGERPRINT = "request_fingerprint"


@dataclass
class BatchRequest:
    """One input line. `error` is set (and the prompt fields may be empty) when it cannot run."""

    line: int  # 1-based line number in the input file
    id: object = None  # JSONL id / OpenAI custom_id / text line number; None when unreadable
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None
    chat_options: dict = field(default_factory=dict)  # CHAT_OPTIONS given with messages
    tools: ToolRequest | None = None  # what it says of tools, where it offers some
    tool_fields: dict = field(default_factory=dict)  # TOOL_FIELDS as given (with tools offered)
    embedding: EmbeddingAsk | None = None  # a /v1/embeddings line's ask (then no prompt fields)
    input_token_ids: list | None = None  # an embedding line's inputs as token ids, once prepared
    sampling: dict = field(default_factory=dict)  # per-request SamplingParams fields
    cache_salt: str | None = None  # vLLM's: its prefix-cache blocks shared with requests of this salt only
    model: str | None = None  # the model it names (a --lora-modules name selects that adapter)
    lora: str | None = None  # the --lora-modules adapter it runs with (set by the job from `model`)
    chat: bool = False  # OpenAI chat completion (the output is a chat.completion object)
    harmony: bool = False  # its chat template writes harmony messages: replies read as such (formats/harmony.py)
    reasoning_effort: str | None = None  # OpenAI's, handed to the chat template (which must read it)
    logprobs_style: str | None = None  # "completions" / "chat" when OpenAI logprobs were asked
    error: str | None = None
    fingerprint: str | None = None  # of what it asks (request_fingerprint): set by read_requests

    @property
    def key(self) -> str:
        """What identifies this request's record in the output (resume, duplicates)."""
        return record_key_of(self.id, self.line)


def record_key_of(request_id, line: int | None) -> str:
    return f"id:{json.dumps(request_id, sort_keys=True)}" if request_id is not None else f"line:{line}"


def detect_format(lines: list[str]) -> str:
    first = next((ln for ln in lines if ln.strip()), "")
    if not first.lstrip().startswith("{"):
        return "text"
    for ln in lines:  # the first record that parses tells JSONL from OpenAI Batch
        try:
            obj = json.loads(ln)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            return "openai" if "custom_id" in obj or "body" in obj else "jsonl"
    return "jsonl"


def read_requests(path: str, fmt: str = "auto") -> tuple[str, list[BatchRequest]]:
    """(format, one request per non-blank line). Raises FlexSarathiError when the file cannot be read."""
    text = read_text_file(path, "--input")
    if fmt != "text":
        _refuse_json_array(path, text, fmt)
    lines = _LINE_END.split(text)
    fmt = detect_format(lines) if fmt == "auto" else fmt
    parse = {"text": _text_request, "jsonl": _jsonl_request, "openai": _openai_request}[fmt]
    requests = []
    for number, ln in enumerate(lines, 1):
        if ln.strip():
            req = parse(number, ln)
            req.fingerprint = request_fingerprint(req, ln)
            requests.append(req)
    return fmt, requests


def _refuse_json_array(path: str, text: str, fmt: str) -> None:
    """A JSON array of requests (`[{...}, {...}]`, often pretty-printed over many lines) is no batch
    file: read as lines it would become prompts like `  {"id": 1,` (plain text) or broken lines."""
    first = next((ln.strip() for ln in _LINE_END.split(text) if ln.strip()), "")
    if not first.startswith("["):
        return
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, list) and first != "[" and not re.match(r"\[\s*\{", first):
        return
    what = f"a JSON array of {len(value)} items" if isinstance(value, list) else "a JSON array"
    forced = "; if its lines are plain-text prompts, pass --input-format text" if fmt == "auto" else ""
    # The path once, where the server puts its file id instead (flexsarathi/serve/batch_job.py).
    raise FlexSarathiError(f"--input {path} is {what}: --input takes JSON lines (one JSON object per line) or "
                           f"plain text (one prompt per line); convert it with `jq -c '.[]' FILE > FILE.jsonl`"
                           f"{forced}")


def request_fingerprint(req: BatchRequest, line: str) -> str:
    """A short hash of what the request asks: its prompt and every field of its own that changes
    the output, as read (so an OpenAI body's max_completion_tokens and max_tokens hash alike); a
    line that cannot become a request hashes its text. The command's defaults are not in it: the
    output's meta.json holds those."""
    if req.error is not None:
        basis = json.dumps(["line", line.strip()])
    elif req.embedding is not None:
        basis = json.dumps(req.embedding.fingerprint_basis(), sort_keys=True)
    else:
        asked = [req.prompt, req.prompt_token_ids, req.messages, req.sampling, req.chat, req.logprobs_style]
        # chat options only where given: the fingerprints of records written before they existed stay
        basis = json.dumps(asked + ([req.chat_options] if req.chat_options else [])
                           + (["tools", req.tool_fields] if req.tool_fields else []), sort_keys=True)
    return hashlib.sha256(basis.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def check_unique_ids(requests: list[BatchRequest]) -> None:
    seen: dict[str, int] = {}
    for req in requests:
        if req.id is None:
            continue
        if req.key in seen:
            raise FlexSarathiError(f"duplicate id {req.id!r} on lines {seen[req.key]} and {req.line} "
                                   "of the input: ids must be unique")
        seen[req.key] = req.line


# ---- parsing --------------------------------------------------------------------------------
def _text_request(line: int, text: str) -> BatchRequest:
    return BatchRequest(line=line, id=line, prompt=text)


def _json_object(line: int, text: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return None, f"line {line} is not valid JSON: {exc}"
    except RecursionError:  # json's decoder recurses once per level: [[[[...]]]] thousands deep
        return None, f"line {line} nests its JSON deeper than the reader allows (about 1,000 levels)"
    if not isinstance(obj, dict):
        return None, f"line {line} is a JSON {type(obj).__name__}, not an object"
    return obj, None


def _readable_id(value) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _not_unicode(line: int, name: str, value: str) -> str | None:
    """Why `value` (a string the request's record repeats) cannot be written as UTF-8: a lone
    surrogate, which a JSON escape such as "\\udc00" can carry; None when it can."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"line {line}: {name} {value!r} is not valid Unicode (a lone surrogate at character {exc.start}): "
                "its record could not be written; give it an id of real characters")
    return None


def _jsonl_request(line: int, text: str) -> BatchRequest:
    obj, error = _json_object(line, text)
    if error:
        return BatchRequest(line=line, error=error)
    request_id = obj.get("id", line)
    if not _readable_id(request_id):
        return BatchRequest(line=line, error=f"line {line}: \"id\" must be a string or an integer, "
                                             f"got {request_id!r}")
    if isinstance(request_id, str) and (error := _not_unicode(line, '"id"', request_id)):
        return BatchRequest(line=line, error=error)
    req = BatchRequest(line=line, id=request_id)
    if "input" in obj:  # an embedding record
        return _jsonl_embedding(req, obj)
    unknown = set(obj) - set(JSONL_FIELDS)
    if unknown:
        req.error = f"line {line}: unknown field(s) {sorted(unknown)}{_unknown_hint(sorted(unknown))}"
        return req
    req.sampling = {k: obj[k] for k in (*SAMPLING_FIELDS, "logprobs") if k in obj}
    req.error = _set_salt_and_model(req, obj, "") or _set_prompt(req, obj, ("prompt", "prompt_token_ids", "messages"))
    return req


def route_to_adapters(requests: list[BatchRequest], modules: dict[str, str], base_names: set[str]) -> None:
    """--lora-modules ({name: folder}): each request whose "model" names one runs with that adapter
    (its `lora`); one naming neither an adapter nor the base model (any of `base_names`) gets its
    error. Without modules "model" is not read (OpenAI's lines name any model)."""
    if not modules:
        return
    for req in requests:
        if req.error or req.model is None or req.model in base_names:
            continue
        if req.model not in modules:
            req.error = (f"line {req.line}: model {req.model!r} is neither the base model nor one of the "
                         f"--lora-modules ({', '.join(modules)})")
        else:
            req.lora = req.model


def adapter_fingerprints(modules: dict[str, str]) -> dict[str, str]:
    """{name: its adapter's fingerprint} (a result file's meta), each folder read and checked now."""
    from flexsarathi.formats.lora_adapter import open_adapter  # noqa: PLC0415 - the CLI's cold start

    return {name: open_adapter(folder).fingerprint for name, folder in modules.items()}


def _set_model(req: BatchRequest, obj: dict, where: str) -> str | None:
    """The model the request names (route_to_adapters reads it); an error message where it is no
    non-empty string."""
    model = obj.get("model")
    if model is not None and not (isinstance(model, str) and model):
        return f"line {req.line}: {where}model must be a non-empty string, got {model!r}"
    req.model = model
    return None


def _set_salt_and_model(req: BatchRequest, obj: dict, where: str) -> str | None:
    """The request's cache_salt (vLLM's request field) and the model it names; an error message where
    either is no non-empty string."""
    if error := _set_model(req, obj, where):
        return error
    salt = obj.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and salt):
        return f"line {req.line}: {where}cache_salt must be a non-empty string, got {salt!r}"
    req.cache_salt = salt
    return None


def _jsonl_embedding(req: BatchRequest, obj: dict) -> BatchRequest:
    """{"id", "input", "dimensions", "normalize", "model"}: the input's embeddings (cli/embedding_requests.py)."""
    unknown = sorted(set(obj) - set(JSONL_EMBEDDING_FIELDS))
    if unknown:
        req.error = (f"line {req.line}: an embedding record (it has \"input\") takes {', '.join(JSONL_EMBEDDING_FIELDS)}; "
                     f"it also has {unknown}")
        return req
    try:
        req.embedding = read_embedding_body(obj, where="")
    except FlexSarathiError as exc:
        req.error = f"line {req.line}: {exc}"
        return req
    req.error = _set_model(req, obj, "")
    return req


def _unknown_hint(unknown: list[str]) -> str:
    """What an unknown field of a JSONL record may have meant: the record's name for an OpenAI body
    field, or the nearest field name (a typo); else the fields a record takes."""
    hints = []
    for name in unknown:
        if name in _OPENAI_NAMES:
            hints.append(f"{name!r} is an OpenAI request body's field: a JSONL record takes {_OPENAI_NAMES[name]!r} "
                         "(or write the file in OpenAI's Batch format)")
        elif close := difflib.get_close_matches(name, JSONL_FIELDS, n=1):
            hints.append(f"did you mean {close[0]!r} for {name!r}?")
    if hints:
        return "; " + "; ".join(hints)
    return f"; a record takes {', '.join(JSONL_FIELDS)}"


def _set_prompt(req: BatchRequest, obj: dict, allowed: tuple[str, ...]) -> str | None:
    """Fill the request's prompt from the one prompt field in `obj`; an error message otherwise."""
    given = [k for k in allowed if k in obj]
    if len(given) != 1:
        return f"line {req.line}: needs exactly one of {', '.join(repr(k) for k in allowed)}"
    value = obj[given[0]]
    req.chat_options = {k: obj[k] for k in CHAT_OPTIONS if k in obj}
    tool_fields = [k for k in TOOL_FIELDS if k in obj]
    if given[0] == "messages":
        req.messages = value
        if not isinstance(value, list) or not value:
            return f"line {req.line}: \"messages\" must be a non-empty list"
        return _set_tools(req, obj, "body." if req.chat else "")
    if req.chat_options or tool_fields:
        return f"line {req.line}: {', '.join([*req.chat_options, *tool_fields])} apply to \"messages\" only"
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # OpenAI allows a list of prompts; one per request is what a batch line means
    if isinstance(value, str):
        req.prompt = value
        return None if value else f"line {req.line}: the prompt is empty"
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        req.prompt_token_ids = value
        return None
    return f"line {req.line}: {given[0]!r} must be a non-empty string or list of token ids"


def _set_tools(req: BatchRequest, obj: dict, where: str) -> str | None:
    """The request's tools (None where it offers none: an empty or absent list, no choice but
    "none"); a forced choice becomes its structured output. An error message where they are wrong."""
    given = {k: obj[k] for k in TOOL_FIELDS if k in obj and obj[k] is not None}
    if not given.get("tools") and given.get("tool_choice", "none") == "none":
        return None
    try:
        req.tools = ToolRequest.of(given.get("tools", []), given.get("tool_choice"),
                                   given.get("parallel_tool_calls"), where)
    except FlexSarathiError as exc:
        return f"line {req.line}: {exc}"
    req.tool_fields = given
    forced = req.tools.structured_outputs()
    if forced is not None:
        if req.sampling.get("structured_outputs") is not None:
            other = "body.response_format" if where else "structured_outputs"
            return (f"line {req.line}: {where}tool_choice {given['tool_choice']!r:.60} constrains the reply to tool "
                    f"calls, and {other} constrains it too: give one of them")
        req.sampling["structured_outputs"] = forced
    return None


def _openai_request(line: int, text: str) -> BatchRequest:
    obj, error = _json_object(line, text)
    if error:
        return BatchRequest(line=line, error=error)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchRequest(line=line, error=f"line {line}: \"custom_id\" must be a non-empty string")
    if error := _not_unicode(line, '"custom_id"', custom_id):
        return BatchRequest(line=line, error=error)
    req = BatchRequest(line=line, id=custom_id)
    req.error = _openai_body(req, obj)
    return req


def _openai_body(req: BatchRequest, obj: dict) -> str | None:
    where = f"line {req.line}"
    if obj.get("method", "POST") != "POST":
        return f"{where}: method must be POST, got {obj.get('method')!r}"
    url = obj.get("url")
    if url not in URLS:
        return f"{where}: url must be {', '.join(URLS[:-1])} or {URLS[-1]}, got {url!r}"
    req.chat = url == CHAT_URL
    body = obj.get("body")
    if not isinstance(body, dict):
        return f"{where}: \"body\" must be an object"
    if url == EMBEDDINGS_URL:
        return _embedding_body(req, body)
    if error := _unknown_body_fields(req, body):
        return error
    for name, neutral in _UNSUPPORTED_OPENAI.items():
        value = body.get(name, neutral)
        if value not in (neutral, None) and value != []:  # an empty list of functions offers none
            successor = f" (OpenAI's deprecated name: use body.{_SUCCESSORS[name]})" if name in _SUCCESSORS else ""
            return f"{where}: body.{name} is not supported{successor}"
    req.sampling = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    if "max_completion_tokens" in body:  # chat's name for max_tokens (vLLM takes it on both urls)
        req.sampling["max_tokens"] = body["max_completion_tokens"]
    error = _openai_logprobs(req, body) or _openai_response_format(req, body) or _set_salt_and_model(req, body, "body.")
    return error or _set_prompt(req, body, ("messages",) if req.chat else ("prompt",)) or _reasoning_effort(req, body)


def _reasoning_effort(req: BatchRequest, body: dict) -> str | None:
    """body.reasoning_effort as the chat template's `reasoning_effort` (whether the template reads it is
    checked once it is known: generate._prepare); an error message where it cannot be."""
    effort = body.get("reasoning_effort")
    if effort is None:  # (a /v1/completions body has no such field: _unknown_body_fields says so)
        return None
    if effort not in REASONING_EFFORTS:
        return f"line {req.line}: body.reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"
    kwargs = req.chat_options.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or kwargs.get("reasoning_effort", effort) != effort:
        return f"line {req.line}: body.reasoning_effort and chat_template_kwargs.reasoning_effort differ"
    req.chat_options["chat_template_kwargs"] = {**kwargs, "reasoning_effort": effort}
    req.reasoning_effort = effort
    return None


def _embedding_body(req: BatchRequest, body: dict) -> str | None:
    unknown = sorted(set(body) - EMBEDDING_BODY_FIELDS)
    if unknown:
        return (f"line {req.line}: unknown body field(s) {unknown}; a {EMBEDDINGS_URL} body takes "
                f"{', '.join(sorted(EMBEDDING_BODY_FIELDS))}")
    try:
        req.embedding = read_embedding_body(body)
    except FlexSarathiError as exc:
        return f"line {req.line}: {exc}"
    return _set_model(req, body, "body.")


def request_url(req: BatchRequest) -> str:
    """The url an OpenAI line asked (of a line that parsed)."""
    return EMBEDDINGS_URL if req.embedding is not None else CHAT_URL if req.chat else COMPLETIONS_URL


def _unknown_body_fields(req: BatchRequest, body: dict) -> str | None:
    """An error naming the body's fields that its url's requests do not take, with what each may
    have meant: the other url's field (`messages` in a completion), the nearest name (a typo)."""
    url, other = (CHAT_URL, COMPLETIONS_URL) if req.chat else (COMPLETIONS_URL, CHAT_URL)
    known = OPENAI_BODY_FIELDS[url]
    unknown = sorted(set(body) - known)
    if not unknown:
        return None
    hints = []
    for name in unknown:
        if name in OPENAI_BODY_FIELDS[other]:
            hints.append(f"{name!r} belongs to a {other} body, and this line's url is {url}")
        elif close := difflib.get_close_matches(name, sorted(known), n=1):
            hints.append(f"did you mean {close[0]!r} for {name!r}?")
    honoured = sorted(known - set(_UNSUPPORTED_OPENAI) - set(_IGNORED_OPENAI))
    hint = "; ".join(hints) or (f"a {url} body takes {', '.join(honoured)} (and OpenAI's fields that change "
                                "nothing, such as user or metadata)")
    return f"line {req.line}: unknown body field(s) {unknown}; {hint}"


def _openai_response_format(req: BatchRequest, body: dict) -> str | None:
    """response_format -> structured_outputs: {"type": "json_schema", "json_schema": {"schema":
    ...}} (OpenAI's), {"type": "json_object"}, or {"type": "text"} (no constraint). The JSON is
    compact (no whitespace between tokens), as OpenAI's API returns it: a model free to put blanks
    anywhere can spend its max_tokens on them (small ones do) and leave the JSON unclosed."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        req.sampling["structured_outputs"] = {"json_object": True, "disable_any_whitespace": True}
        return None
    schema = fmt.get("json_schema") if kind == "json_schema" else None
    if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
        req.sampling["structured_outputs"] = {"json": schema["schema"], "disable_any_whitespace": True}
        return None
    return (f"line {req.line}: body.response_format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} "
            f"or {{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, got {fmt!r}")


def _openai_logprobs(req: BatchRequest, body: dict) -> str | None:
    """Completions: logprobs = top alternatives (int); chat: logprobs (bool) + top_logprobs (int)."""
    if req.chat:
        if body.get("logprobs"):
            req.sampling["logprobs"] = body.get("top_logprobs") or 0
            req.logprobs_style = "chat"
    elif body.get("logprobs") is not None:
        req.sampling["logprobs"] = body["logprobs"]
        req.logprobs_style = "completions"
    return None


# ---- output records -------------------------------------------------------------------------
def usage(output) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache
    held (RequestOutput.num_cached_tokens), as OpenAI reports its own prompt caching."""
    completion = sum(len(c.token_ids) for c in output.outputs)
    prompt = len(output.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens or 0}}


def result_record(fmt: str, req: BatchRequest, output, model: str, decode) -> dict:
    """The record of a finished request. decode(ids) -> text: the tokenizer's (OpenAI logprobs'
    token strings), None for a model without one."""
    if fmt == "openai":
        return _openai_result(req, output, model, decode)
    if req.embedding is not None:  # output: the record's EmbeddingRequestOutputs, in input order
        tokens = sum(len(o.prompt_token_ids) for o in output)
        return _fingerprinted({"id": req.id, "embeddings": [o.outputs.embedding for o in output],
                               "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, req)
    first = output.outputs[0]
    record = {"id": req.id, "prompt": req.prompt if req.prompt is not None else output.prompt,
              "text": first.text, "token_ids": first.token_ids, "finish_reason": first.finish_reason,
              "usage": usage(output)}
    if req.prompt is None:
        record["prompt_token_ids"] = output.prompt_token_ids
    if first.logprobs is not None:
        record["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in first.logprobs]
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [step and {str(t): lp.logprob for t, lp in step.items()}
                                     for step in output.prompt_logprobs]
    _read_reply(record, req, first, decode)
    if len(output.outputs) > 1:
        record["outputs"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason} for c in output.outputs]
        for entry, c in zip(record["outputs"], output.outputs):
            _read_reply(entry, req, c, decode)
    return _fingerprinted(record, req)


def _read_reply(entry: dict, req: BatchRequest, completion, decode) -> None:
    """A JSONL record's (or one of its outputs') reply as read: its tool calls where tools were offered,
    a harmony reply's content as its text and the rest as its reasoning."""
    if not req.harmony and (req.tools is None or req.tools.choice == "none"):
        return
    content, reasoning, calls, finish = tool_reply(req, completion, decode)
    if req.harmony:
        entry["text"], entry["reasoning"] = content, reasoning
    if req.tools is not None and req.tools.choice != "none":
        entry["tool_calls"], entry["finish_reason"] = calls, finish


def tool_reply(req: BatchRequest, completion, decode) -> tuple[str | None, str | None, list[dict], str]:
    """(the message's content, its reasoning, its tool calls in OpenAI's shape, the finish reason) of a
    completion: "tool_calls" where a reply free to call ("auto", "required") ended by calling, as vLLM
    and OpenAI say it; a forced function's reply keeps "stop". A harmony reply is read as its messages
    (reasoning: what it wrote outside the final channel); other replies have none. Call ids are
    derived from the request, so a resumed file reads like an uninterrupted one; mistral's templates
    take 9-character ids."""
    tools, reasoning = req.tools, None
    free = tools is None or tools.choice in ("none", "auto")  # a forced choice's reply is JSON, not messages
    specials = (decode(list(completion.token_ids), skip_special_tokens=False)
                if decode and (req.harmony and free or tools is not None and tools.parser == "mistral")
                else completion.text)
    reply = read_harmony(specials, read_calls=tools is not None and tools.choice == "auto") \
        if req.harmony and free else None
    if reply is not None:
        content, reasoning, calls = reply.content, reply.reasoning, reply.calls
        calls = calls if tools is None or tools.parallel else calls[:1]
    elif tools is None or tools.choice == "none":
        return completion.text, None, [], completion.finish_reason
    else:
        content, calls = tools.read(completion.text, specials)
    finish = completion.finish_reason
    if calls and finish == "stop" and tools.choice in ("auto", "required"):
        finish = "tool_calls"
    length = 9 if tools is not None and tools.parser == "mistral" else 24
    listed = [{"id": ("" if length == 9 else "call_") + _stable_id("", f"{req.key}/{completion.index}/{k}")[:length],
               "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
              for k, call in enumerate(calls)]
    return content, reasoning, listed, finish


def error_record(fmt: str, req: BatchRequest, message: str, code: str = "invalid_request") -> dict:
    # A message may quote the request (a stop string, a word) and with it a lone surrogate that
    # UTF-8 cannot write: escaped, so the record is written and the job goes on.
    error = {"code": code, "message": message.encode("utf-8", "backslashreplace").decode("utf-8")}
    ident = {"line": req.line} if req.id is None else {}
    if fmt == "openai":
        return _fingerprinted({"id": _stable_id("batch_req_", req.key), "custom_id": req.id, **ident,
                               "response": None, "error": error}, req)
    return _fingerprinted({**({"id": req.id} if req.id is not None else ident), "error": error}, req)


def _fingerprinted(record: dict, req: BatchRequest) -> dict:
    if req.fingerprint is not None:
        record[FINGERPRINT] = req.fingerprint
    return record


def record_key(fmt: str, record: dict) -> str | None:
    """The key of a record read back from an output file (None: not one of ours)."""
    request_id = record.get("custom_id" if fmt == "openai" else "id")
    if request_id is None and "line" not in record:
        return None
    return record_key_of(request_id, record.get("line"))


def is_error_record(record: dict) -> bool:
    return record.get("error") is not None


def _stable_id(prefix: str, key: str) -> str:
    """OpenAI ids derived from the request, so a resumed file reads like an uninterrupted one."""
    return prefix + hashlib.sha256(key.encode()).hexdigest()[:24]


def _openai_result(req: BatchRequest, output, model: str, decode) -> dict:
    if req.embedding is not None:  # output: the line's EmbeddingRequestOutputs, in input order
        return _openai_line(req, None, embedding_body(output, model, req.embedding.encoding_format))
    choices = []
    for c in output.outputs:
        content, reasoning, calls, finish = tool_reply(req, c, decode)
        choice = {"index": c.index, "logprobs": _openai_choice_logprobs(req, output, c, decode),
                  "finish_reason": finish}
        if req.chat:  # reasoning_content: vLLM's field for a reasoning model's thinking
            choice["message"] = {"role": "assistant", "content": content,
                                 **({"reasoning_content": reasoning} if req.harmony else {}),
                                 **({"tool_calls": calls} if calls else {})}
        else:
            choice["text"] = c.text
        choices.append(choice)
    body = {"id": _stable_id("chatcmpl-" if req.chat else "cmpl-", req.key),
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage(output)}
    return _openai_line(req, None, body)


def _openai_line(req: BatchRequest, id_prefix: str | None, body: dict) -> dict:
    """The output line of a finished request: its response body (with an id of its own where the
    body has none: OpenAI's embeddings list has none)."""
    if id_prefix is not None:
        body = {"id": _stable_id(id_prefix, req.key), **body}
    return _fingerprinted({"id": _stable_id("batch_req_", req.key), "custom_id": req.id,
                           "response": {"status_code": 200, "request_id": _stable_id("req_", req.key),
                                        "body": body}, "error": None}, req)


CONTEXT_TOKENS = 8  # tokens before a token that decide how it reads (a leading space, a multi-byte character)


def token_text(decode, context: list[int], token: int) -> str:
    """The text `token` adds after `context` (its leading space kept: "was" reads " was" after
    "there"), as decoding the whole sequence shows it; without a tokenizer, its id."""
    if decode is None:
        return str(token)
    window = context[-CONTEXT_TOKENS:]
    before, after = decode(window), decode(window + [token])
    return after[len(before):] if after.startswith(before) else decode([token])


def _openai_choice_logprobs(req: BatchRequest, output, completion, decode) -> dict | None:
    """OpenAI's logprobs of a completion: every token and top alternative as it reads in its
    place; completions also give text_offset, each token's character offset from the start of
    the prompt (the first one at the prompt's length, as OpenAI counts without echo)."""
    if req.logprobs_style is None or completion.logprobs is None:
        return None
    top = req.sampling.get("logprobs") or 0
    ids = list(output.prompt_token_ids) + list(completion.token_ids)
    start = len(output.prompt_token_ids)
    steps = []  # (its text, its logprob, [(alternative's text, logprob)] best first)
    for i, (t, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
        context = ids[:start + i]
        best = sorted(((a, v.logprob) for a, v in lp.items()), key=lambda kv: -kv[1])[:top]
        steps.append((token_text(decode, context, t), lp[t].logprob,
                      [(token_text(decode, context, a), v) for a, v in best]))
    if req.logprobs_style == "chat":
        return {"content": [{"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
                             "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))}
                                              for a, v in best]}
                            for text, lp, best in steps]}
    prompt = req.prompt if req.prompt is not None else (decode(list(output.prompt_token_ids)) if decode else "")
    offsets, at = [], len(prompt)
    for text, _, _ in steps:
        offsets.append(at)
        at += len(text) if decode else 0
    return {"tokens": [text for text, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
            "top_logprobs": [dict(best) for _, _, best in steps], "text_offset": offsets}
