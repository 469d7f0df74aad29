"""The sampler against references computed independently: argmax for greedy, top-k / top-p masks
by sorting probabilities in float64, numpy's inverse CDF on the same generator state for seeded
draws (and draws whose frequencies are the probabilities), and the min_tokens rule on a Sequence
(stop tokens barred until it may stop)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexsarathi.engine import sampling
from flexsarathi.engine.logits_processors import apply_penalties, bar_stops
from flexsarathi.engine.sampling import (SamplingParams, draw, filtered_logits, finite_rows, inverse_cdf, sample,
                                          sample_seed)
from flexsarathi.engine.sequence import Sequence, SequenceStatus

VOCAB = 64


def rows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [R, vocab]


def reference_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Tokens top-k then top-p keep, by a float64 sort: the k most likely, then the smallest
    most-likely prefix of what is left whose renormalised probability reaches top_p."""
    x = logits.double().numpy() / temperature
    order = np.argsort(-x, kind="stable")
    if top_k != -1:
        order = order[:top_k]
    probs = np.exp(x[order] - x[order].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs  # probability of the more likely kept tokens
    return {int(t) for t, b in zip(order, before) if b < top_p}


def test_greedy_is_argmax_whatever_the_generator():
    logits = rows(8)
    params = [SamplingParams(temperature=0)] * 8
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (-1, 0.5), (-1, 0.9), (10, 0.7), (VOCAB, 0.3)])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_top_p_keep_the_float64_reference_set(top_k, top_p, temperature):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = rows(20, seed=top_k + int(top_p * 10))
    for row, kept in zip(batch, filtered_logits(batch, [p] * len(batch))):
        assert {int(t) for t in torch.isfinite(kept).nonzero().flatten()} == reference_kept(
            row, temperature, top_k, top_p)
        finite = torch.isfinite(kept)
        torch.testing.assert_close(kept[finite], row[finite] / temperature, atol=0, rtol=0)


@pytest.mark.parametrize("wider", [2, 8])
@pytest.mark.parametrize("candidates", [4, 12])
@pytest.mark.parametrize("which", ["peaked", "flat", "both"])
def test_cutting_from_the_most_likely_candidates_keeps_the_reference_set(monkeypatch, candidates, which, wider):
    """filtered_logits cuts top_k / top_p rows from their `TOP_CANDIDATES` most likely tokens, and the
    rows whose candidates hold less than top_p again, alone, from WIDER times as many or as many as
    the smallest of their nuclei holds at least (never more), or past a quarter of the row from all of it:
    peaked rows (their nucleus inside the candidates: cut from them), flatter ones (past them) and
    both in one batch, with top_k under and over the candidate count and rows nothing cuts (left as
    they are), each against the float64 reference set."""
    vocab = 512
    monkeypatch.setattr(sampling, "TOP_CANDIDATES", candidates)
    monkeypatch.setattr(sampling, "WIDER", wider)
    calls, top_cut = [], sampling._top_cut

    def observed(scaled, width, ks, top_p):
        kept, undecided, need = top_cut(scaled, width, ks, top_p)
        nuclei = [len(reference_kept(scaled[i], 1.0, ks[i], float(top_p[i]))) for i in undecided]
        calls.append((width, scaled.shape[0], need, nuclei))
        return kept, undecided, need

    monkeypatch.setattr(sampling, "_top_cut", observed)
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(21))
    spread = torch.tensor([12.0, 9, 7, 6, 8, 10, 1.5, 3, 0.4, 1.6, 0.9, 0.3])[:, None]  # peaked, then flatter
    batch = {"peaked": logits[:6] * spread[:6], "flat": logits[6:] * spread[6:]}
    batch["both"] = torch.cat([batch["peaked"], batch["flat"]])
    batch = batch[which]
    settings = [dict(top_p=0.5), dict(top_p=0.9), dict(top_k=3), dict(top_k=10, top_p=0.8), dict(), dict(top_p=0.95)]
    params = [SamplingParams(temperature=0.9, **kw) for kw in settings * (len(batch) // 6)]
    cut = filtered_logits(batch, params)
    assert calls[0][0] == max(candidates, 10) < vocab  # the candidates first
    assert (not calls[0][3]) == (which == "peaked") and not calls[-1][3]  # the last cut decides every row left
    for (width, _, need, nuclei), (wider_width, count, _, _) in zip(calls, calls[1:]):
        assert need <= min(nuclei)  # the least any undecided row's nucleus holds: a true lower bound
        step = max(width * wider, need)
        assert wider_width == (vocab if 4 * step > vocab else step) and count == len(nuclei)  # undecided rows alone
    for row, kept, p in zip(batch, cut, params):
        if p.top_k == -1 and p.top_p >= 1.0:
            torch.testing.assert_close(kept, row / 0.9, atol=0, rtol=0)
            continue
        assert {int(t) for t in torch.isfinite(kept).nonzero().flatten()} == reference_kept(row, 0.9, p.top_k, p.top_p)
        finite = torch.isfinite(kept)
        torch.testing.assert_close(kept[finite], row[finite] / 0.9, atol=0, rtol=0)


def test_draws_stay_inside_the_kept_set():
    row = rows(1, seed=5)[0] / 3
    p = SamplingParams(temperature=1.0, top_k=12, top_p=0.6)
    kept = reference_kept(row, 1.0, 12, 0.6)
    assert 2 < len(kept) < 12  # both filters bite
    gen = torch.Generator().manual_seed(0)
    draws = {sample(row[None], [p], [gen])[0] for _ in range(300)}
    assert draws == kept  # 300 draws reach every kept token (each over 10% likely here)


def test_seeded_sampling_follows_its_own_generator_whatever_shares_the_batch():
    logits = rows(4, seed=2)
    p = SamplingParams(temperature=0.8)
    alone = [sample(logits[i:i + 1], [p], [torch.Generator().manual_seed(100 + i)])[0] for i in range(4)]
    batch = sample(logits, [p] * 4, [torch.Generator().manual_seed(100 + i) for i in range(4)])
    assert batch == alone
    # The reference draw: the generator's uniform u, then the first token whose cumulative probability
    # (numpy's, in float64) exceeds u x the total, over the same softmax.
    ref = [_inverse_cdf((logits[i] / 0.8).softmax(-1), torch.Generator().manual_seed(100 + i)) for i in range(4)]
    assert batch == ref
    gen = torch.Generator().manual_seed(7)
    first = [sample(logits[:1], [p], [gen])[0] for _ in range(20)]
    gen = torch.Generator().manual_seed(7)
    assert [sample(logits[:1], [p], [gen])[0] for _ in range(20)] == first


def test_greedy_and_drawn_rows_in_one_batch_each_get_their_own_token():
    """Rows 0, 3 and 4 greedy, rows 1, 2 and 5 drawn (a different temperature each): every row's token
    is its own reference (the argmax; the float64 inverse CDF on its own generator), in its place."""
    logits = rows(6, seed=5)
    temperatures = [0, 0.7, 1.3, 0, 0, 0.9]
    params = [SamplingParams(temperature=t) for t in temperatures]
    tokens = sample(logits, params, [torch.Generator().manual_seed(200 + i) for i in range(6)])
    ref = [int(logits[i].argmax()) if t == 0 else
           _inverse_cdf((logits[i] / t).softmax(-1), torch.Generator().manual_seed(200 + i))
           for i, t in enumerate(temperatures)]
    assert tokens == ref


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> int:
    u = torch.rand(1, generator=generator).item()
    cumulative = np.cumsum(probs.double().numpy())
    return int(np.argmax(cumulative > u * cumulative[-1]))


def test_draw_frequencies_are_the_probabilities_and_zeros_are_never_drawn():
    """20,000 draws of one row over 64 tokens, a quarter of them at probability 0 (first, last and
    between: where the cumulative sum is flat): each token's frequency within 0.01 of its
    probability (the binomial's standard deviation is at most 0.0036), the zeros never drawn."""
    probs = torch.rand(VOCAB, generator=torch.Generator().manual_seed(3))
    zero = torch.arange(VOCAB) % 4 == 0
    zero[-1] = True
    probs[zero] = 0
    probs /= probs.sum()
    gens = [torch.Generator().manual_seed(11)] * 100  # one generator, drawn from 100 times a call
    counts = np.zeros(VOCAB)
    for _ in range(200):
        np.add.at(counts, draw(probs.expand(100, VOCAB).clone(), gens), 1)
    assert counts[zero.numpy()].sum() == 0
    assert np.abs(counts / counts.sum() - probs.numpy()).max() < 0.01


def test_the_unordered_scan_route_draws_what_the_ordered_scan_draws():
    """inverse_cdf as it runs off the CPU (ordered_scan=False: sums made flat at zeros and
    non-decreasing) gives the CPU route's tokens where the scan is exact: rows with zeros first,
    last and between, and every u from 0 up to the largest below 1."""
    probs = torch.rand(6, VOCAB, generator=torch.Generator().manual_seed(5))
    probs[:, ::3] = 0
    probs[:, -1] = 0
    probs /= probs.sum(-1, keepdim=True)
    for u in (torch.zeros(6), torch.rand(6, generator=torch.Generator().manual_seed(6)),
              torch.full((6,), 1 - 2 ** -24)):
        assert (inverse_cdf(probs.clone(), u, ordered_scan=False)
                == inverse_cdf(probs.clone(), u, ordered_scan=True))


def test_a_scan_that_rises_at_a_zero_never_draws_that_token(monkeypatch):
    """The fault a parallel scan can make (CUDA's, one row): a zero-probability token's sum an ulp
    above its predecessor's, and a token's sum an ulp below its predecessor's. Injected here: off
    the CPU the draw still never lands on the zero (nor past the total); the ordered route, which
    trusts its scan, would (the fault is real)."""
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    ulp = float(np.spacing(np.float32(0.5)))

    def parallel_scan(p):  # exact sums, then the fault at the zero (index 1)
        out = torch.cumsum(p, dim=-1)
        out[0, 1] += ulp
        return out

    monkeypatch.setattr(sampling, "_scan", parallel_scan)
    u = torch.tensor([0.5])  # target 0.5 x total: inside the zero's false sliver (0.5, 0.5 + ulp]
    assert inverse_cdf(probs.clone(), u, ordered_scan=True) == [1]  # the fault, trusted
    assert inverse_cdf(probs.clone(), u, ordered_scan=False) == [2]

    def dipping_scan(p):  # a token's sum below its predecessor's (non-monotone)
        out = torch.cumsum(p, dim=-1)
        out[0, 2] = out[0, 0] - ulp
        return out

    monkeypatch.setattr(sampling, "_scan", dipping_scan)
    for v in (0.0, 0.4999, 0.5, 0.74, 0.75, 1 - 2 ** -24):
        token = inverse_cdf(probs.clone(), torch.tensor([v]), ordered_scan=False)[0]
        assert token in (0, 2, 3) and token != 1


def test_sample_seed_keeps_index_zero_and_differs_per_index():
    for seed in (0, 1, 12345, 2**61):
        seeds = [sample_seed(seed, i) for i in range(1000)]
        assert seeds[0] == seed and len(set(seeds)) == 1000
        assert all(0 <= s < 2**62 for s in seeds[1:])


def test_min_tokens_bars_stop_tokens_until_the_sequence_may_stop():
    stop, runner_up = 5, 9
    row = torch.zeros(VOCAB)
    row[stop], row[runner_up] = 10.0, 5.0  # the stop token is the greedy choice
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=3)
    seq = Sequence(0, [1, 2], params, max_len=12, stop_ids=frozenset({stop}), generator=torch.Generator())
    while not seq.status.finished:
        masked = bar_stops(row[None], [seq.stop_ids], [seq.may_stop])[0]
        assert math.isinf(masked[stop]) == (len(seq.output_token_ids) < 3)
        seq.append(sample(masked[None], [params], [seq.generator])[0])
    assert seq.output_token_ids == [runner_up] * 3 + [stop]
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == stop
    assert bar_stops(row[None], [frozenset()], [False]).equal(row[None])  # nothing to bar


def test_rows_with_different_filters_in_one_batch_each_keep_their_own_set():
    """One filtered_logits call over rows whose temperature, top_k and top_p all differ gives each
    row the float64 reference set of its own parameters."""
    batch = rows(6, seed=11)
    params = [SamplingParams(temperature=t, top_k=k, top_p=q)
              for t, k, q in [(0.5, 3, 1.0), (1.0, -1, 0.6), (2.0, 10, 0.8), (1.0, -1, 1.0), (0.7, 1, 1.0), (1.3, 20, 0.3)]]
    for row, p, kept in zip(batch, params, filtered_logits(batch, params)):
        assert {int(t) for t in torch.isfinite(kept).nonzero().flatten()} == reference_kept(
            row, p.temperature, p.top_k, p.top_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_rows_is_isfinite_all_per_row(dtype):
    """finite_rows (two reductions) says what isfinite(...).all(dim=1) says, for a NaN, +inf or
    -inf anywhere in a row, alone or together, and for rows at the dtype's finite extremes."""
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 257, generator=gen).to(dtype)
    logits[1, 0], logits[2, 256], logits[3, 100] = math.nan, math.inf, -math.inf
    logits[4, 7], logits[4, 9] = math.inf, -math.inf
    logits[5, 3], logits[5, 4] = math.nan, math.inf
    logits[6] = math.nan
    logits[7, 5], logits[7, 6] = info.max, info.min  # finite extremes: a sum would overflow, not this
    logits[8] = info.max
    assert finite_rows(logits).tolist() == torch.isfinite(logits).all(dim=1).tolist()
    assert finite_rows(logits).tolist() == [True, False, False, False, False, False, False, True, True,
                                            True, True, True]


def test_controls_at_the_edges_of_float_still_draw_a_token_they_allow():
    """A top_p below fp32's smallest number (0 there) keeps the most likely token; a temperature
    below SAMPLING_EPS is greedy (logits / 1e-38 overflow); each row, 200 draws: always the argmax."""
    logits = rows(4, seed=9)
    argmax = logits.argmax(-1).tolist()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for params in (SamplingParams(top_p=1e-300), SamplingParams(temperature=1e-38),
                   SamplingParams(temperature=1e-6, top_k=3)):
        assert params.greedy == (params.temperature < 1e-5)
        for _ in range(50):
            assert sample(logits, [params] * 4, gens) == argmax
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_repetition_penalty_that_overflows_draws_among_the_overflowed_tokens():
    """repetition_penalty 1e-300 (0 in fp32, held to its smallest normal) sends seen tokens' large
    positive logits to +inf: the limit is uniform over those tokens (no NaN, no token outside the
    vocabulary); 1e300 (inf in fp32, held to its largest) keeps a seen logit of exactly 0 at 0, not
    NaN, and sends negative ones to -3.4e38."""
    logits = rows(1, seed=4).clamp(-3, 3)  # unseen tokens: finite after any penalty
    seen = [i for i in range(VOCAB) if i % 5 == 0]
    logits[0, seen] = -1.0
    logits[0, seen[0]] = 0.0
    logits[0, seen[1:4]] = torch.tensor([5.0, 6.0, 7.0])  # / fp32's smallest normal (1.2e-38): over 3.4e38
    overflowed = set(seen[1:4])
    gen = torch.Generator().manual_seed(1)
    tiny = SamplingParams(repetition_penalty=1e-300, seed=1)
    processed = apply_penalties(logits, [tiny], [seen], [[]])
    assert set(torch.isfinite(processed[0]).nonzero().flatten().tolist()) == overflowed
    drawn = [sample(processed, [tiny], [gen])[0] for _ in range(300)]
    assert set(drawn) == overflowed  # each about equally likely: 300 draws of 3
    huge = SamplingParams(repetition_penalty=1e300)
    processed = apply_penalties(logits, [huge], [seen], [[]])
    assert not processed.isnan().any() and processed[0, seen[0]] == 0
    assert all(processed[0, i] <= -1e38 for i in seen if logits[0, i] < 0)  # x fp32's largest
    assert 0 <= sample(processed, [huge], [gen])[0] < VOCAB


def test_a_row_that_allows_no_token_samples_none_and_the_others_are_untouched():
    """Every logit -inf (a grammar whose last tokens bad_words bar): None for that row, greedy or
    drawn; the other rows sample what they sample alone."""
    logits = rows(3, seed=6)
    dead = logits.clone()
    dead[1] = -math.inf
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7)):
        alone = [sample(logits[i:i + 1], [params], [torch.Generator().manual_seed(i)])[0] for i in (0, 2)]
        got = sample(dead, [params] * 3, [torch.Generator().manual_seed(i) for i in range(3)])
        assert got[1] is None and [got[0], got[2]] == alone
