"""`SamplingParams` (vLLM's vocabulary) and the sampler.

Every sequence draws from its own generator (seeded by `seed`, or by the engine's seed and the
request's index), so a seeded request samples the same tokens whatever else shares its batch; the
`n` completions of one request draw from `sample_seed(seed, i)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexsarathi.errors import FlexSarathiError


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # log-probability of every prompt token after the first
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one generated
    min_tokens: int = 0  # EOS, stop tokens and stop strings are ignored before this many tokens
    n: int = 1  # completions per prompt
    logprobs: int | None = None  # per generated token: its log-probability and the top `logprobs`

    def __post_init__(self):
        self._check_numbers()
        object.__setattr__(self, "stop_token_ids", _as_tuple(self, "stop_token_ids", self.stop_token_ids))
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            self._bad("stop_token_ids", "must be non-negative integers")
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self, "stop", self.stop)
        object.__setattr__(self, "stop", stop)
        if any(not isinstance(s, str) or not s for s in stop):
            self._bad("stop", "must be a non-empty string or a list of non-empty strings")
        for flag in ("ignore_eos", "prompt_logprobs"):
            if not isinstance(getattr(self, flag), bool):
                self._bad(flag, "must be True or False")

    def _bad(self, field: str, rule: str):
        raise FlexSarathiError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

    def _check_numbers(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            self._bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            self._bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            self._bad("top_k", "must be -1 (off) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            self._bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            self._bad("seed", "must be an integer or None")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            self._bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_int(self.n) or self.n < 1:
            self._bad("n", "must be an integer >= 1")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            self._bad("logprobs", "must be None or an integer >= 0 (top alternatives per token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tuple(params: SamplingParams, field: str, value) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        params._bad(field, "must be a list")
    return tuple(value)


def sample_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded `seed` (index 0 keeps `seed` itself)."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 62)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [R, vocab] fp32 (CPU); one row, params and generator per sequence."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def token_logprobs(row: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """{token: log-probability} for the sampled token and the `top` most likely ones. row: [vocab]."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    result = {}
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        result = dict(zip(ids.tolist(), values.tolist()))
    result[token] = float(logprobs[token])
    return result


def mask_stops(row: torch.Tensor, stop_ids, may_stop: bool) -> torch.Tensor:
    """Before min_tokens (`may_stop` False), EOS and stop tokens cannot be sampled (vLLM's
    min_tokens). row: [vocab]; returns it, or a copy with those tokens at -inf."""
    if may_stop or not stop_ids:
        return row
    row = row.clone()
    row[list(stop_ids)] = float("-inf")
    return row


def filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits / temperature with -inf outside the top_k most likely tokens and outside the
    smallest most-likely prefix whose probability reaches top_p. logits: [vocab]."""
    scaled = logits / p.temperature  # [vocab]
    if p.top_k != -1 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix >= top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = filtered_logits(logits, p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
