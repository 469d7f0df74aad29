"""`SamplingParams` (vLLM's vocabulary) and the sampler.

Every request draws from its own generator (seeded by `seed`, or by the engine's seed and the
request's index), so a seeded request samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexsarathi.errors import FlexSarathiError


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

    def __post_init__(self):
        def bad(field: str, rule: str):
            raise FlexSarathiError(f"SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 (off) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be an integer or None")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [R, vocab] fp32 (CPU); one row, params and generator per sequence."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scaled = logits / p.temperature  # [vocab]
    if p.top_k != -1 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix >= top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
