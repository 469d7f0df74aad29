"""`tokenizer.json` through the `tokenizers` library, with BOS/EOS as the checkpoint asks; chat
templates (`tokenizer_config.json`'s `chat_template`) rendered with jinja2; incremental
detokenization of generated tokens."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer

from flexsarathi.errors import CheckpointError, FlexSarathiError


class Tokenizer:
    def __init__(self, path: str | HFTokenizer, add_bos: bool | None, add_eos: bool, bos_id: int | None,
                 eos_id: int | None, chat_template: str | None = None, special_tokens: dict | None = None):
        """path: a tokenizer.json, or a built `tokenizers.Tokenizer` (a GGUF file's: formats/gguf_tokenizer.py)."""
        try:
            self._tok = path if isinstance(path, HFTokenizer) else HFTokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"cannot read tokenizer {path}: {exc}") from None
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_token_id, self.eos_token_id = bos_id, eos_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token, eos_token, ... as strings
        self._compiled_template = None

    @classmethod
    def from_folder(cls, folder: str, bos_id: int | None = None,
                    eos_id: int | None = None) -> "Tokenizer | None":
        """None when the folder has no tokenizer.json (prompts must then be token ids)."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen_cfg = _read_json(os.path.join(folder, "generation_config.json"))
        bos = gen_cfg.get("bos_token_id", bos_id)
        eos = gen_cfg.get("eos_token_id", eos_id)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        # None: follow tokenizer.json's own post-processor.
        add_bos = tok_cfg.get("add_bos_token") if "add_bos_token" in tok_cfg else None
        specials = {key: _token_text(tok_cfg[key]) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if tok_cfg.get(key) is not None}
        return cls(path, add_bos, bool(tok_cfg.get("add_eos_token", False)), bos, eos,
                   _chat_template(folder, tok_cfg), specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in JSON): tokenizers' TypeError otherwise
            raise FlexSarathiError(f"the text is not valid Unicode ({exc.reason} at character {exc.start})") from None
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the checkpoint's chat template (as transformers'
        apply_chat_template: the template writes the special tokens, so none are added)."""
        if not self.chat_template:
            raise FlexSarathiError("this checkpoint has no chat template (no chat_template in "
                                   "tokenizer_config.json): give a prompt instead of messages")
        _check_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        try:
            text = self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **self.special_tokens)
        except FlexSarathiError:
            raise
        except Exception as exc:  # jinja2's errors: a template that cannot render these messages
            raise FlexSarathiError(f"the chat template cannot render these messages: {exc}") from None
        return self.encode(text, add_special_tokens=False)


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


def _chat_template(folder: str, tok_cfg: dict) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return template if isinstance(template, str) and template else None


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise FlexSarathiError(f"the chat template refused these messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise FlexSarathiError(f"the checkpoint's chat template is not valid jinja2: {exc}") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise FlexSarathiError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise FlexSarathiError(f"messages[{i}] must be an object with string \"role\" and \"content\"")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def load_tokenizer(model: str, config) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder (None for dummy models and folders without one);
    config (a ModelConfig) gives the BOS/EOS ids where the tokenizer's files do not."""
    if not os.path.isdir(model):
        return None
    return Tokenizer.from_folder(model, config.bos_token_id, (config.eos_token_ids or (None,))[0])
