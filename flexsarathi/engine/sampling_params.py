"""`SamplingParams` and `StructuredOutputsParams`: what a request asks of the sampler, in vLLM's
names and with vLLM's meanings, each field checked where it is given (one error naming it)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from flexsarathi.errors import FlexSarathiError

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value (vLLM clamps to it too)
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
# The most completions one request asks: each is a sequence with its own blocks and host state (n of
# 100 million ran the host out of memory); OpenAI's API takes 128, HumanEval's pass@100 wants 200.
MAX_N = 1024


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion to a grammar (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a regular
    expression, a `choice` list of literal strings, or an EBNF `grammar` (GBNF, as xgrammar and
    llama.cpp read it). Compiled with xgrammar (flexsarathi/engine/structured_output.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON (json, json_object): False lets the model put whitespace between tokens, at most
    # structured_output.MAX_WHITESPACE_RUN characters in a row; True: compact JSON, none at all
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                self._bad("choice", "must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                self._bad("choice", "must be a non-empty list of non-empty strings")
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise FlexSarathiError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                                   f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            self._bad("json", "must be a JSON schema (an object, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                self._bad(name, "must be a non-empty string")
        if self.json_object not in (None, True, False):
            self._bad("json_object", "must be True or None")
        if not isinstance(self.disable_any_whitespace, bool):
            self._bad("disable_any_whitespace", "must be True or False")

    def _bad(self, field: str, rule: str):
        raise FlexSarathiError(f"StructuredOutputsParams.{field} {rule}, got {getattr(self, field)!r}")

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, compact): what identifies the compiled grammar (a schema compiles once per job)."""
        if self.json is not None:
            # as given, not sorted: the grammar writes properties in the schema's order
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text, self.disable_any_whitespace
        if self.json_object:
            return "json", '{"type": "object"}', self.disable_any_whitespace
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice)), False
        return ("regex", self.regex, False) if self.regex is not None else ("grammar", self.grammar, False)

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams":
        """From itself or its fields as a dict (a JSONL request's "structured_outputs")."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise FlexSarathiError("structured_outputs must be an object with one of json, regex, choice, "
                                   f"grammar, json_object; got {type(value).__name__}")
        unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"})
        if unknown:
            raise FlexSarathiError(f"structured_outputs: unknown field(s) {unknown}; use json, regex, choice, "
                                   "grammar or json_object")
        return cls(**value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until the model's context ends
    temperature: float = 1.0  # 0 (below SAMPLING_EPS) = greedy
    top_k: int = -1  # -1 (or 0, vLLM's spelling now) = whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # None: none (vLLM's default), as for stop and bad_words
    ignore_eos: bool = False
    # per prompt position after the first: the prompt token's log-probability and the top
    # `prompt_logprobs` candidates (vLLM's shape: RequestOutput.prompt_logprobs[0] is None)
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one generated
    include_stop_str_in_output: bool = False  # ... or just after it
    min_tokens: int = 0  # EOS, stop tokens and stop strings are ignored before this many tokens
    n: int = 1  # completions per prompt
    logprobs: int | None = None  # per generated token: its log-probability and the top `logprobs` (-1: all)
    # Penalties on tokens already seen (vLLM's): repetition divides a positive logit (multiplies a
    # negative one) of every token in the prompt or the output; presence and frequency subtract
    # from the logits of output tokens once / per occurrence (OpenAI's formula).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # {token id: added to its logit}, in [-100, 100]
    bad_words: tuple[str, ...] = ()  # words never generated (their last token barred after the rest)
    skip_special_tokens: bool = True  # special tokens left out of the text
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these can be generated (EOS too only if listed)
    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens are read (-1: the model's context)

    def __post_init__(self):
        if self.top_k == 0 and _is_int(self.top_k):  # vLLM's "off" since it changed its default from -1
            object.__setattr__(self, "top_k", -1)
        for name in ("stop", "stop_token_ids", "bad_words"):  # vLLM's defaults are None
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        self._check_numbers()
        self._check_penalties()
        object.__setattr__(self, "stop_token_ids", _as_tuple(self, "stop_token_ids", self.stop_token_ids))
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            self._bad("stop_token_ids", "must be non-negative integers")
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self, "allowed_token_ids", self.allowed_token_ids))
            if not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                self._bad("allowed_token_ids", "must be None or a non-empty list of token ids (integers >= 0)")
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, str) else _as_tuple(self, name, value)
            object.__setattr__(self, name, value)
            if any(not isinstance(s, str) or not (s.strip() if name == "bad_words" else s) for s in value):
                self._bad(name, "must be a non-empty string or a list of non-empty strings")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                self._bad(flag, "must be True or False")
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
            if self.ignore_eos:
                self._bad("ignore_eos", "cannot be set with structured_outputs: a structured output ends "
                                        "with EOS where its grammar is complete")

    def _bad(self, field: str, rule: str):
        raise FlexSarathiError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

    def _check_numbers(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            self._bad("max_tokens", "must be None (until the context ends) or an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            self._bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            self._bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            self._bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            self._bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            self._bad("seed", "must be None or an integer in [-2**63, 2**64) (what a torch generator takes)")
        most = math.inf if self.max_tokens is None else self.max_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            self._bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            self._bad("n", f"must be an integer in [1, {MAX_N}]")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            self._bad("truncate_prompt_tokens", "must be None, -1 (the model's context) or an integer >= 1")
        for name, what in (("logprobs", "top alternatives per token"),
                           ("prompt_logprobs", "top candidates per prompt position; 0 = the prompt token only")):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                self._bad(name, f"must be None, -1 (the whole vocabulary) or an integer >= 0 ({what})")

    def _check_penalties(self) -> None:
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            self._bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                self._bad(name, "must be in [-2, 2] (OpenAI's range; 0 = off)")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self, self.logit_bias))

    @property
    def greedy(self) -> bool:
        """The argmax: temperature 0, or below SAMPLING_EPS (vLLM's rule: logits / 1e-38 overflow)."""
        return self.temperature < SAMPLING_EPS

    def truncated(self, prompt_token_ids: list[int], context: int) -> list[int]:
        """The prompt as the request reads it: its last truncate_prompt_tokens tokens (-1: the last
        `context`, the model's), all of it when unset (vLLM's left truncation)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = context if k == -1 else k
        return prompt_token_ids[-k:]

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _logit_bias(params: SamplingParams, bias) -> dict[int, float]:
    """{token id: bias}; keys may be strings of token ids (OpenAI's JSON); values clamped to +-100."""
    if not isinstance(bias, dict):
        params._bad("logit_bias", "must be a {token id: bias} object")
    out = {}
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also takes '²' or '①', which int() refuses
        token = int(key) if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            params._bad("logit_bias", f"has key {key!r}: keys must be token ids (integers >= 0)")
        if not _is_number(value) or not math.isfinite(value):
            params._bad("logit_bias", f"has value {value!r} for token {key!r}: values must be finite numbers")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out


def _as_tuple(params: SamplingParams, field: str, value) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        params._bad(field, "must be a list")
    return tuple(value)
