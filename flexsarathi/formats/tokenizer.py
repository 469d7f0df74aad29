"""`tokenizer.json` through the `tokenizers` library, with BOS/EOS as the checkpoint asks; chat
templates (`tokenizer_config.json`'s `chat_template`) rendered with jinja2; incremental
detokenization of generated tokens."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer

from flexsarathi.errors import CheckpointError, FlexSarathiError
from flexsarathi.formats.chat_template import compile_template, render
from flexsarathi.formats.tool_calls import check_tools
from policy_search.errors import SpecError
from policy_search.hf_config import typed_value


# Characters a normalizer may compose into one (NFC: a Hangul syllable from three jamo; with
# margin): what check_fits allows per token character besides the longest token's length.
COMPOSED_MAX = 4


class Tokenizer:
    def __init__(self, path: str | HFTokenizer, add_bos: bool | None, add_eos: bool, bos_id: int | None,
                 eos_id: int | None, chat_template: str | None = None, special_tokens: dict | None = None,
                 eos_ids: tuple[int, ...] = ()):
        """path: a tokenizer.json, or a built `tokenizers.Tokenizer` (a GGUF file's: formats/gguf_tokenizer.py).
        eos_id: the EOS that add_eos appends; eos_ids: the other ids that end generation too."""
        try:
            self._tok = path if isinstance(path, HFTokenizer) else HFTokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"cannot read tokenizer {path}: {exc}") from None
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_token_id, self.eos_token_id = bos_id, eos_id
        # every id generation stops at (generation_config.json's list: Llama-3-Instruct's <|eot_id|> too)
        self.eos_token_ids = tuple(dict.fromkeys(([] if eos_id is None else [eos_id]) + list(eos_ids)))
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token, eos_token, ... as strings
        self._compiled_template = None
        self._given_template: tuple = (None, None)  # (source, compiled) of the last template a call gave
        # The model's context in tokens (open_model sets it): encode refuses a text too long to fit
        # it before the tokenizers library holds ~100 bytes per character of it (a 200 MB line: 20 GB).
        self.context_tokens: int | None = None
        self._longest_token: int | None = None

    @classmethod
    def from_folder(cls, folder: str, bos_id: int | None = None,
                    eos_id: int | tuple[int, ...] | None = None) -> "Tokenizer | None":
        """None when the folder has no tokenizer.json (prompts must then be token ids). bos_id / eos_id
        (config.json's: one id or several) where generation_config.json names none."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        tok_path = os.path.join(folder, "tokenizer_config.json")
        gen_path = os.path.join(folder, "generation_config.json")
        tok_cfg, gen_cfg = _read_json(tok_path), _read_json(gen_path)
        bos = _token_ids(gen_cfg, "bos_token_id", gen_path, bos_id, single=True)
        eos = _token_ids(gen_cfg, "eos_token_id", gen_path, eos_id)
        # None: follow tokenizer.json's own post-processor.
        add_bos = _flag(tok_cfg, "add_bos_token", tok_path, None)
        specials = {key: _token_text(tok_cfg[key]) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if tok_cfg.get(key) is not None}
        return cls(path, add_bos, _flag(tok_cfg, "add_eos_token", tok_path, False), bos, eos[0] if eos else None,
                   _chat_template(folder, tok_cfg, tok_path), specials, eos_ids=eos)

    def encode(self, text: str, add_special_tokens: bool = True, whole: bool = False) -> list[int]:
        """Token ids of `text`. whole: a text longer than the model's context (a document read in
        windows) is encoded too; otherwise one that cannot fit the context is refused (check_fits)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in JSON): tokenizers' TypeError otherwise
            raise FlexSarathiError(f"the text is not valid Unicode ({exc.reason} at character {exc.start})") from None
        if not whole:
            self.check_fits(text)
        if not add_special_tokens:
            return self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def check_fits(self, text: str) -> None:
        """FlexSarathiError where `text` has more characters than the model's context could hold as
        tokens: each token stands for at most the vocabulary's longest token's characters, and a
        normalizer may compose a few characters into one (COMPOSED_MAX), so longer is too long."""
        if self.context_tokens is None or len(text) <= self.context_tokens:  # a token is a character or more
            return
        if self._longest_token is None:  # byte-level tokens are a character per byte: an upper bound
            self._longest_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        most = COMPOSED_MAX * self.context_tokens * self._longest_token
        if len(text) > most:
            raise FlexSarathiError(f"the text is {len(text):,} characters, more than the model's context of "
                                   f"{self.context_tokens} tokens can hold (at most {most:,}: each token "
                                   f"is at most {self._longest_token} characters)")

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` itself (for libraries that read a vocabulary: xgrammar)."""
        return self._tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def completion_text(self, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True) -> str:
        """What decoding prompt + output gives after the prompt's own text (leading space kept)."""
        prompt_text = self.decode(prompt_ids, skip_special_tokens)
        full = self.decode(list(prompt_ids) + list(output_ids), skip_special_tokens)
        if full.startswith(prompt_text):
            return full[len(prompt_text):]
        return self.decode(output_ids, skip_special_tokens)  # the prompt's last bytes merged with the output's: rare

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` rendered with the checkpoint's chat template (as transformers'
        apply_chat_template: the template writes the special tokens, so none are added); the
        options as render_chat takes them."""
        return self.encode(self.render_chat(messages, add_generation_prompt, continue_final_message,
                                            chat_template_kwargs, tools=tools), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    template: str | None = None, tools: list[dict] | None = None) -> str:
        """`messages` as the chat template writes them (vLLM's and transformers' options):
        add_generation_prompt opens the assistant's turn; continue_final_message leaves the last
        message open, its text the end of the prompt (a reply to continue); chat_template_kwargs: more
        variables the template reads (enable_thinking, ...); template: a jinja2 chat template to
        use instead of the checkpoint's; tools: OpenAI's tool objects, the template's `tools`."""
        if template is None and not self.chat_template:
            raise FlexSarathiError("this checkpoint has no chat template (no chat_template in "
                                   "tokenizer_config.json): give a prompt instead of messages")
        messages = chat_messages(messages)
        variables = self._template_variables(add_generation_prompt, continue_final_message, chat_template_kwargs)
        if tools is not None:
            if "tools" in variables:
                raise FlexSarathiError("tools are given twice: as tools and in chat_template_kwargs")
            variables["tools"] = check_tools(tools)
        try:
            text = render(self._compiled(template), {"messages": messages, **variables})
        except FlexSarathiError:
            raise
        except Exception as exc:  # jinja2's errors: a template that cannot render these messages
            raise FlexSarathiError(f"the chat template cannot render these messages: {exc}") from None
        return _cut_after_final(text, messages[-1]["content"]) if continue_final_message else text

    def _compiled(self, template: str | None):
        """The checkpoint's template compiled once, or `template` (the last one given kept compiled:
        LLM.chat renders every conversation of a call with it)."""
        if template is not None:
            if not isinstance(template, str) or not template:
                raise FlexSarathiError(f"chat_template must be a non-empty jinja2 string, got {template!r}")
            if self._given_template[0] != template:
                self._given_template = (template, compile_template(template, "chat_template"))
            return self._given_template[1]
        if self._compiled_template is None:
            self._compiled_template = compile_template(self.chat_template)
        return self._compiled_template

    def _template_variables(self, add_generation_prompt, continue_final_message, chat_template_kwargs) -> dict:
        """What the template is rendered with besides the messages; FlexSarathiError for options it cannot take."""
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise FlexSarathiError(f"{name} must be true or false, got {value!r}")
        if add_generation_prompt and continue_final_message:
            raise FlexSarathiError("continue_final_message continues the last message, add_generation_prompt opens "
                                   "a new one: set add_generation_prompt to false to continue")
        given = {} if chat_template_kwargs is None else chat_template_kwargs
        if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
            raise FlexSarathiError(f"chat_template_kwargs must be an object of named values, got {given!r}")
        own = {"add_generation_prompt": add_generation_prompt, **self.special_tokens}
        taken = sorted(set(given) & ({"messages"} | set(own)))
        if taken:
            raise FlexSarathiError(f"chat_template_kwargs may not set {taken}: the engine passes them itself")
        return {**own, **given}


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's content, as transformers cuts it for
    continue_final_message (the template's end-of-turn after it dropped)."""
    if not final.strip():
        raise FlexSarathiError("continue_final_message: the final message is empty, so there is nothing to continue")
    for content in (final, final.strip()):
        at = text.rfind(content)
        if at >= 0:
            return text[:at + len(content)]
    raise FlexSarathiError("continue_final_message: the chat template does not write the final message's content "
                           "as it is given, so the prompt cannot end inside it")


class IncrementalDetokenizer:
    """Text of generated tokens as they come (vLLM's window scheme): decode a few tokens before
    the new ones and keep what the new ones add, so a word's leading space (which a decoder strips
    at the start of a text) is kept, and hold back a partial UTF-8 character until it completes."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # generated text so far

    def add(self, token: int) -> str:
        """Append a token; returns the text it completes (possibly empty)."""
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        current = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(current) <= len(prefix) or current.endswith("\ufffd"):
            return ""
        new = current[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _chat_template(folder: str, tok_cfg: dict, tok_path: str) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        template = _read_text(jinja_file)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{tok_path}: chat_template must be a string or a list of named templates, "
                              f"got {type(template).__name__}")
    return template if isinstance(template, str) and template else None


def chat_messages(messages) -> list[dict]:
    """The messages as a template reads them (vLLM's "string" content format): a content that is a
    list of text parts becomes their texts joined by newlines, an assistant's null content (a
    message of tool calls) the empty string; other fields (name, tool_calls, ...) pass as they are.
    FlexSarathiError naming the first message, and the field of it, that is not so."""
    if not isinstance(messages, list) or not messages:
        raise FlexSarathiError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(message, i: int) -> dict:
    if not isinstance(message, dict):
        raise FlexSarathiError(f"messages[{i}] must be an object with \"role\" and \"content\", "
                               f"got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise FlexSarathiError(f"messages[{i}].role must be a non-empty string, got {role!r}")
    if content is None and role == "assistant":  # OpenAI's assistant message of tool calls
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise FlexSarathiError(f"messages[{i}].content must be a string or a list of text parts, "
                               f"got {'null' if content is None else type(content).__name__}")
    if message.get("tool_calls") is not None:
        return {**message, "content": content, "tool_calls": _template_tool_calls(message["tool_calls"], i)}
    return {**message, "content": content}


def _template_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls as templates read them (as vLLM hands them over): each
    function's `arguments`, a JSON text in OpenAI's messages, parsed into the object it holds."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise FlexSarathiError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FlexSarathiError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                   f"\"arguments\"}}}}, got {call!r:.80}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise FlexSarathiError(f"{where}[{j}].function.arguments is not a JSON text: "
                                       f"{function['arguments']!r:.80}") from None
        read.append({**call, "function": {**function, "arguments": arguments}})
    return read


def _text_part(part, where: str) -> str:
    """The text of an OpenAI content part {"type": "text", "text": ...}; this engine reads no images or audio."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        got = f"a part of type {kind!r}" if isinstance(kind, str) else f"{part!r:.60}"
        raise FlexSarathiError(f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}} "
                               f"(this engine reads text only), got {got}")
    if not isinstance(part.get("text"), str):
        raise FlexSarathiError(f"{where}.text must be a string, got {type(part.get('text')).__name__}")
    return part["text"]


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                              f"at offset {exc.start})") from None


def _read_json(path: str) -> dict:
    """The JSON object in `path` ({} when there is no such file); CheckpointError naming the file."""
    if not os.path.isfile(path):
        return {}
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def _flag(cfg: dict, key: str, path: str, default):
    value = cfg.get(key)
    if value is None:  # absent, or null as some tokenizer_config.json files write it: the default
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: {key} must be true or false, got {value!r}")
    return value


def _token_ids(cfg: dict, key: str, path: str, default, single: bool = False):
    """cfg[key] (else `default`) as one token id (single) or a tuple of them; CheckpointError naming the field."""
    value = cfg[key] if cfg.get(key) is not None else default
    try:
        if value is None:
            return None if single else ()
        if single or not isinstance(value, (list, tuple)):
            ids = (typed_value(value, key, path, int, low=0),)
        else:
            ids = tuple(typed_value(v, f"{key}[{i}]", path, int, low=0) for i, v in enumerate(value))
    except SpecError as exc:
        raise CheckpointError(str(exc)) from None
    return ids[0] if single else ids


def load_tokenizer(model: str, config) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder (None for dummy models and folders without one);
    config (a ModelConfig) gives the BOS/EOS ids where the tokenizer's files do not."""
    if not os.path.isdir(model):
        return None
    tokenizer = Tokenizer.from_folder(model, config.bos_token_id, tuple(config.eos_token_ids))
    if tokenizer is not None:
        check_vocab_fits(tokenizer, config.vocab_size, os.path.join(model, "tokenizer.json"))
    return tokenizer


def check_vocab_fits(tokenizer: Tokenizer, vocab_size: int, where: str, field: str = "config.json vocab_size") -> None:
    """CheckpointError when the tokenizer has ids the model has no embedding row for."""
    top = max(tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has token id {top}, outside the model's vocabulary "
                              f"({field}={vocab_size})")
