"""The sampler: one step's logits [R, vocab] -> one token per row, batched on the compute device.

Order (vLLM's): grammar bitmask (structured outputs), stop tokens barred before min_tokens, bad
words, logit_bias, repetition / presence / frequency penalties; then greedy rows take the argmax
and the others are scaled by temperature, cut by min_p, top_k and top_p, and drawn.

Every sequence draws from its own generator (seeded by `seed`, or by the engine's seed and the
request's index), so a seeded request samples the same tokens whatever else shares its batch; the
`n` completions of one request draw from `sample_seed(seed, i)`. A draw takes one uniform from its
row's host generator; the cumulative sum and the search over it run where the probabilities are
(`draw`: inverse CDF).
"""
from __future__ import annotations

import math

import torch

from flexsarathi.engine.logits_processors import (add_logit_bias, apply_penalties, bad_word_bans, bar_stops, bar_tokens,
                                                 keep_allowed)
from flexsarathi.engine.sampling_params import SamplingParams, StructuredOutputsParams
from flexsarathi.engine.structured_output import apply_grammar_masks

__all__ = ["SamplingParams", "StructuredOutputsParams", "sample_seed", "process_logits", "filtered_logits", "sample",
           "draw", "inverse_cdf"]


TOP_CANDIDATES = 1024  # a top_k / top_p row is cut from its most likely this many first (filtered_logits)
WIDER = 8  # a row its candidates cannot decide is cut again from this many times as many (_cut_widening)


def sample_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a request seeded `seed` (index 0 keeps `seed` itself)."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (1 << 62)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R] bool: whether each row of logits [R, vocab] is all finite. A row's largest and smallest
    values are both finite exactly when all its values are (amax and amin propagate NaN; +inf is a
    row's largest, -inf its smallest): two reductions, not an [R, vocab] mask and its reduction
    (64 x 50272 fp32 on 2 Zen 5 cores: 0.18 ms against 2.6)."""
    return torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))


def process_logits(logits: torch.Tensor, seqs: list, grammar_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """What the requests' SamplingParams do to logits [R, vocab] before temperature (row i is
    seqs[i]'s): a new tensor on the same device. grammar_bitmask: the rows' structured-output
    masks if already filled (structured_output.fill_grammar_bitmask)."""
    logits = apply_grammar_masks(logits, seqs, grammar_bitmask)
    if any(s.params.allowed_token_ids is not None for s in seqs):
        logits = keep_allowed(logits, [s.params.allowed_token_ids for s in seqs])
    constrained = logits
    logits = bar_stops(logits, [s.stop_ids for s in seqs], [s.may_stop for s in seqs])
    if any(s.grammar is not None and not s.may_stop for s in seqs):
        # A grammar that is complete allows only EOS: there it wins over min_tokens.
        dead = ~torch.isfinite(logits).any(dim=-1, keepdim=True)
        logits = torch.where(dead, constrained, logits)
    if any(s.bad_word_ids for s in seqs):
        logits = bar_tokens(logits, *bad_word_bans([s.bad_word_ids for s in seqs],
                                                   [s.output_token_ids for s in seqs]))
    params = [s.params for s in seqs]
    logits = add_logit_bias(logits, params)
    if any(p.penalized for p in params):
        logits = apply_penalties(logits, params, [s.prompt_token_ids for s in seqs],
                                 [s.output_token_ids for s in seqs])
    return logits


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, vocab] / temperature with -inf where row i's min_p, top_k or top_p drops the
    token: min_p below min_p x the row's most likely probability; top_k outside the k most
    likely; top_p outside the smallest most-likely prefix (of what top_k keeps) whose probability
    reaches top_p. Rows must not be greedy (temperature 0)."""
    device, vocab = logits.device, logits.shape[1]
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=device)[:, None]  # noqa: E731
    scaled = logits / column([p.temperature for p in params])  # [R, vocab]
    if any(p.min_p > 0 for p in params):
        probs = scaled.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * column([p.min_p for p in params])
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    ks = [vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params]
    cut = [i for i, (k, p) in enumerate(zip(ks, params)) if k < vocab or p.top_p < 1.0]  # rows top_k / top_p cut
    if not cut:
        return scaled
    ks, top_p = [ks[i] for i in cut], column([params[i].top_p for i in cut])
    # Only a row's most likely tokens can be kept: cut first from its TOP_CANDIDATES most likely (a
    # top-k selection), from more only for the rows that keep more. Sampling 64 rows of a
    # 128256-token vocabulary with top_p 0.9: 63.6 ms, where sorting every row took 414 (2 Zen 4 cores).
    width = min(vocab, max([TOP_CANDIDATES] + [k for k in ks if k < vocab]))
    rows = scaled if len(cut) == len(params) else scaled[cut]
    kept = _cut_widening(rows, width, ks, top_p)
    if len(cut) == len(params):
        return kept
    scaled[cut] = kept
    return scaled


def _cut_widening(scaled: torch.Tensor, width: int, ks: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """_top_cut of every row, worked out on its `width` most likely tokens; the rows those cannot
    decide (a flat distribution's nucleus reaches past them) are cut again, alone, from WIDER times as
    many, or as many as the smallest of their nuclei holds at least, or (past a quarter of the row)
    from the whole row (a row still undecided goes on widening, alone): a top-k of a quarter of a
    50272-token row costs 0.29 of its sort (36.0 ms against 125.3 for 16 rows; of 128256: 86.3
    against 269.9), and a nucleus that reaches past it may well reach past the next width too."""
    kept, undecided, need = _top_cut(scaled, width, ks, top_p)
    if undecided:
        vocab = scaled.shape[1]
        wider = max(width * WIDER, need)
        kept[undecided] = _cut_widening(scaled[undecided], vocab if 4 * wider > vocab else wider,
                                        [ks[i] for i in undecided], top_p[undecided])
    return kept


def _top_cut(scaled: torch.Tensor, width: int, ks: list[int],
             top_p: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """(scaled [R, vocab] with -inf outside each row's top ks[i] and outside the smallest most-likely
    prefix of those whose probability reaches top_p[i], worked out on each row's `width` most likely
    tokens; the rows that cannot decide: each keeps more than `width` by top_k and its `width` most
    likely tokens hold less than top_p of its probability, so a token past them is kept (their rows
    of the first are not the cut); the fewest most-likely tokens that may decide any of them: no
    token past the `width` is likelier than the last of them, so the probability a row still misses
    takes at least that many more)."""
    device = scaled.device
    values, order = scaled.topk(width, dim=-1)  # [R, width], the most likely first
    top_k = torch.tensor(ks, device=device)[:, None]
    values = values.masked_fill(torch.arange(width, device=device) >= top_k, float("-inf"))
    # rows whose top_k keeps tokens past `width` (no top_k): normalised over the whole row
    wide = torch.tensor([k > width for k in ks], device=device) if max(ks) > width else None
    norm = values.logsumexp(-1, keepdim=True)
    if wide is not None:
        norm = torch.where(wide[:, None], scaled.logsumexp(-1, keepdim=True), norm)
    probs = (values - norm).exp()
    cumulative = probs.cumsum(-1)
    undecided, need = [], width
    if wide is not None:
        short = wide & (cumulative[:, -1] < top_p[:, 0])  # [R]
        undecided = short.nonzero().flatten().tolist()
        if undecided:  # the missing probability over the last candidate's (inf where that is 0: the whole row)
            more = ((top_p[:, 0] - cumulative[:, -1]) / probs[:, -1])[short].min().item()
            need = width + math.ceil(min(more, scaled.shape[1]))
    before = cumulative - probs  # probability of the more likely tokens kept
    # the smallest prefix whose probability reaches top_p, never empty (a tiny top_p is 0 in fp32)
    kept = values.masked_fill((before >= top_p) & (torch.arange(width, device=device) > 0), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, kept), undecided, need


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int | None]:
    """logits: [R, vocab] already processed (process_logits); one row, params and generator per
    sequence. Greedy rows: the argmax; others: a draw from their filtered distribution. None where
    the row allows no token at all (every logit -inf: a grammar whose tokens bad_words bar, say).
    The tokens and which rows allow one come to the host in one transfer (one wait on a GPU)."""
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if len(drawn) < len(params):  # one reduction: the greedy rows' tokens and each row's best
        best, tokens = logits.max(dim=-1)  # [R]
    else:  # amax alone: 0.46 ms for 64 rows of 128256 where max with indices took 3.5 (2 Zen 4 cores)
        best, tokens = logits.amax(dim=-1), None
    allowed = best > float("-inf")  # NaN: not allowed either
    if drawn:
        probs = filtered_logits(logits[drawn], [params[i] for i in drawn]).softmax(-1)  # [D, vocab]
        picks = draw_rows(probs, [generators[i] for i in drawn])  # [D]
        tokens = picks if tokens is None else tokens.index_copy(
            0, torch.tensor(drawn, device=tokens.device), picks)
    tokens, allowed = torch.stack([tokens, allowed.to(tokens.dtype)]).tolist()
    return [token if ok else None for token, ok in zip(tokens, allowed)]


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token per row of probs [D, vocab] (fp32, on any device; consumed: its rows become their
    cumulative sums), by the inverse of the cumulative distribution: row i takes one uniform u in
    [0, 1) from generators[i] (so a seeded request draws the same tokens whatever shares its batch)
    and the first token whose cumulative probability exceeds u x the row's total (inverse_cdf). One
    batched cumsum, in place, and one search, where torch.multinomial, a call per row, took 16.7 ms
    for 16 rows of a 50272-token vocabulary (this: 0.58) and 182.3 ms for 64 rows of 128256 (this:
    4.63) on 2 Zen 4 cores."""
    return draw_rows(probs, generators).tolist()


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """draw's tokens [D] (int64), left on probs' device."""
    u = torch.cat([torch.rand(1, generator=g) for g in generators])  # [D] fp32, on the host
    return inverse_cdf_rows(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, ordered_scan: bool | None = None) -> list[int]:
    """Per row of probs [D, vocab] (consumed), the first token whose cumulative probability exceeds
    u[i] x the row's total. A token of probability 0 is never drawn, and u x total < total in fp32
    (u <= 1 - 2**-24), so some token always is; both need sums that never fall and do not rise at a
    zero. The CPU's cumsum adds each row in order (ordered_scan; default: on the CPU), which gives
    both. CUDA's parallel scans sum a prefix in other orders than the prefix before it (CUB's, for a
    single row: a zero after a thread's boundary can come out an ulp above its predecessor, a sliver
    of u that would draw a token top_k, a grammar or min_tokens barred): there the sums are made flat
    at zeros and non-decreasing first (three cheap passes on a GPU)."""
    return inverse_cdf_rows(probs, u, ordered_scan).tolist()


def inverse_cdf_rows(probs: torch.Tensor, u: torch.Tensor, ordered_scan: bool | None = None) -> torch.Tensor:
    """inverse_cdf's tokens [D] (int64), left on probs' device."""
    cumulative = cumulative_sums(probs, ordered_scan)
    target = u.to(cumulative.device) * cumulative[:, -1]
    return torch.searchsorted(cumulative, target[:, None], right=True).flatten()


def cumulative_sums(probs: torch.Tensor, ordered_scan: bool | None = None) -> torch.Tensor:
    """probs [D, vocab] (consumed) -> each row's cumulative sums, non-decreasing and flat at zeros
    (inverse_cdf's ordered_scan)."""
    if ordered_scan is None:
        ordered_scan = probs.device.type == "cpu"
    zero = None if ordered_scan else probs == 0  # [D, vocab], before the scan overwrites probs
    cumulative = _scan(probs)  # [D, vocab]
    if zero is not None:
        cumulative = cumulative.masked_fill_(zero, 0.0).cummax(dim=-1).values
    return cumulative


def _scan(probs: torch.Tensor) -> torch.Tensor:
    """Each row's cumulative sums, in place."""
    return probs.cumsum_(dim=-1)
