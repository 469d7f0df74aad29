"""What a request's SamplingParams do to its logits before the draw, batched over the rows of a
step on the compute device: allowed_token_ids, stop tokens barred before min_tokens, bad words,
logit_bias, and the repetition / presence / frequency penalties (vLLM's order). Each function takes logits [R, vocab]
and returns them changed (a new tensor or the same one); per-row values travel as tensors, and
Python loops only over rows or their few listed tokens, never over the vocabulary."""
from __future__ import annotations

import torch

from flexsarathi.engine.sampling_params import SamplingParams


def bar_tokens(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """logits[rows[i], tokens[i]] = -inf for every i (one indexed write)."""
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def keep_allowed(logits: torch.Tensor, allowed: list[tuple[int, ...] | None]) -> torch.Tensor:
    """Row i keeps only the logits of allowed[i]'s tokens (-inf elsewhere); None: the row as it is."""
    rows = [(i, list(ids)) for i, ids in enumerate(allowed) if ids is not None]
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor([i for i, ids in rows for _ in ids], device=device),
             torch.tensor([t for _, ids in rows for t in ids], device=device))
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[[i for i, _ in rows]] = False
    keep = keep.index_put(index, torch.tensor(True, device=device))
    return logits.masked_fill(~keep, float("-inf"))


def bar_stops(logits: torch.Tensor, stop_ids: list, may_stop: list[bool]) -> torch.Tensor:
    """Before min_tokens (`may_stop[i]` False), row i's EOS and stop tokens cannot be sampled
    (vLLM's min_tokens). stop_ids[i]: row i's stop token ids."""
    pairs = [(i, t) for i, (ids, ok) in enumerate(zip(stop_ids, may_stop)) if not ok for t in ids]
    return bar_tokens(logits, [i for i, _ in pairs], [t for _, t in pairs])


def bad_word_bans(bad_word_ids: list[tuple[tuple[int, ...], ...]], outputs: list[list[int]]
                  ) -> tuple[list[int], list[int]]:
    """(rows, tokens) to bar: a bad word's last token wherever the output so far ends with the
    word's other tokens (a one-token word always). bad_word_ids[i]: row i's words as token ids."""
    rows, tokens = [], []
    for i, (words, out) in enumerate(zip(bad_word_ids, outputs)):
        for word in words:
            head = list(word[:-1])
            if not head or out[len(out) - len(head):] == head:
                rows.append(i)
                tokens.append(word[-1])
    return rows, tokens


def add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits[i, t] += params[i].logit_bias[t] (OpenAI's logit_bias, before the penalties)."""
    pairs = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if not pairs:
        return logits
    device = logits.device
    rows, tokens, bias = (torch.tensor(col, device=device) for col in zip(*pairs))
    return logits.index_put((rows, tokens), bias.to(logits.dtype), accumulate=True)


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] int: how often each token occurs in each row's list (padding lands in a column
    past the vocabulary, dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """vLLM's penalties on logits [R, vocab]: repetition (a token seen in the prompt or the output
    has a positive logit divided, a negative one multiplied, by the penalty: CTRL's rule as
    transformers' RepetitionPenaltyLogitsProcessor), then OpenAI's
    `logit - count * frequency_penalty - (count > 0) * presence_penalty` over the output's counts."""
    device, vocab = logits.device, logits.shape[1]
    column = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype,  # noqa: E731
                                       device=device)[:, None]
    output_counts = token_counts(outputs, vocab, device)  # [R, vocab]
    seen = (token_counts(prompts, vocab, device) > 0) | (output_counts > 0)
    # a penalty at the edges of float (1e-300 is 0 in fp32; 1e300 is inf) held to its finite range:
    # no 0 * inf (NaN); a logit that overflows to +inf is taken to its limit below
    finite = torch.finfo(logits.dtype)
    repetition = column("repetition_penalty").clamp(finite.tiny, finite.max)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = (logits - column("frequency_penalty") * output_counts
              - column("presence_penalty") * (output_counts > 0).to(logits.dtype))
    return at_infinity(logits)


def at_infinity(logits: torch.Tensor) -> torch.Tensor:
    """Rows of logits [R, vocab] holding +inf (a penalty's overflow) as their limit: every +inf
    token equally likely (0), every other impossible (-inf); other rows as they are."""
    top = logits == float("inf")
    return torch.where(top.any(dim=-1, keepdim=True), top.to(logits.dtype).log(), logits)
