"""Log-probabilities as vLLM returns them: per position a {token id: Logprob} dict holding the
chosen token (sampled, or the prompt's next token) and the `k` most likely ones, each with its
rank in the vocabulary (1 = most likely). They are of the model's own distribution (vLLM's
default "raw" logprobs): before penalties, bias, grammar masks and temperature."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: list[int]) -> list[dict[int, Logprob]]:
    """logits [R, vocab] (any device), chosen [R] token ids, top[i] alternatives for row i -> per
    row {token: Logprob} of the chosen token and row i's top[i] most likely (one top-k for all; -1: all)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    chosen = chosen.to(logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [R, 1]
    ranks = (logprobs > chosen_lp).sum(-1) + 1  # [R]
    top = [logprobs.shape[1] if t == -1 else t for t in top]  # -1: the whole vocabulary (vLLM's)
    k = min(max(top, default=0), logprobs.shape[1])
    values, ids = torch.topk(logprobs, k) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    values, ids = values.tolist(), ids.tolist()
    out = []
    for i, (token, lp, rank) in enumerate(zip(chosen.tolist(), chosen_lp[:, 0].tolist(), ranks.tolist())):
        row = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids[i][:top[i]], values[i][:top[i]]), 1)}
        row[token] = Logprob(lp, rank)
        out.append(row)
    return out


def decode_logprobs(steps: list[dict[int, Logprob]] | None, decode_token) -> None:
    """Fill each Logprob's decoded_token with decode_token(id)."""
    for step in steps or ():
        for token, lp in (step or {}).items():
            lp.decoded_token = decode_token(token)


def prompt_logprobs(rows: torch.Tensor, targets: list[int], top: int) -> list[dict[int, Logprob]]:
    """rows [T, vocab]: row i predicts targets[i] (the next prompt token) -> per row {token:
    Logprob} of that token and the `top` most likely."""
    return top_logprobs(rows, torch.tensor(targets), [top] * len(targets))
