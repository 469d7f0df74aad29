"""Each sampling control of SamplingParams against its reference on the same logits: transformers'
logits processors (RepetitionPenaltyLogitsProcessor, MinPLogitsWarper, SequenceBiasLogitsProcessor,
NoBadWordsLogitsProcessor), OpenAI's published formula for the presence and frequency penalties
(in float64), and the logprobs' top-k and ranks from a float64 sort. Rows with different
parameters share one batch, as the engine runs them."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (MinPLogitsWarper, NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from flexsarathi.engine.logprobs import top_logprobs
from flexsarathi.engine.sampling import SamplingParams, filtered_logits, process_logits, sample
from flexsarathi.engine.sequence import Sequence
from flexsarathi.errors import FlexSarathiError

VOCAB = 50


def logits_rows(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [R, vocab]


def make_seq(params: SamplingParams, prompt: list[int], output: list[int], bad_words=()) -> Sequence:
    seq = Sequence(0, list(prompt), params, max_len=len(prompt) + params.max_tokens, stop_ids=frozenset({VOCAB - 1}),
                   generator=torch.Generator().manual_seed(0), bad_word_ids=tuple(bad_words))
    seq.output_token_ids = list(output)
    return seq


def histories(count: int, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (6,), generator=g).tolist(), torch.randint(0, VOCAB, (9,), generator=g).tolist())
            for _ in range(count)]


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits, pairs = logits_rows(4), histories(4)
    seqs = [make_seq(SamplingParams(repetition_penalty=penalty), p, o) for p, o in pairs]
    ours = process_logits(logits, seqs)
    for row, (prompt, output), got in zip(logits, pairs, ours):
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), row[None].clone())[0]
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_presence_and_frequency_penalties_follow_openais_formula():
    """mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] counting token j in
    the output only (the prompt does not count), in float64."""
    logits, pairs = logits_rows(5, seed=3), histories(5, seed=4)
    settings = [(0.0, 0.0), (0.5, 0.0), (0.0, 1.2), (-0.7, 1.9), (2.0, -2.0)]
    seqs = [make_seq(SamplingParams(presence_penalty=pp, frequency_penalty=fp), p, o)
            for (pp, fp), (p, o) in zip(settings, pairs)]
    ours = process_logits(logits, seqs)
    for row, (pp, fp), (_, output), got in zip(logits, settings, pairs, ours):
        counts = Counter(output)
        ref = [float(row[j]) - counts[j] * fp - (counts[j] > 0) * pp for j in range(VOCAB)]
        torch.testing.assert_close(got.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=0)


def test_all_three_penalties_together_are_repetition_then_openai():
    logits, ((prompt, output),) = logits_rows(1, seed=5), histories(1, seed=6)
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)
    got = process_logits(logits, [make_seq(p, prompt, output)])[0]
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits.clone())[0]
    counts = Counter(output)
    ref = ref - torch.tensor([counts[j] * 0.4 + (counts[j] > 0) * 0.3 for j in range(VOCAB)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature):
    logits = logits_rows(6, seed=int(min_p * 100))
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 6
    ours = filtered_logits(logits, params)
    scaled = TemperatureLogitsWarper(temperature)(None, logits.clone())
    ref = MinPLogitsWarper(min_p)(None, scaled) if min_p > 0 else scaled
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)], atol=1e-6, rtol=0)


def test_min_p_with_different_values_per_row_in_one_batch():
    logits = logits_rows(3, seed=9)
    params = [SamplingParams(min_p=m) for m in (0.0, 0.1, 0.6)]
    ours = filtered_logits(logits, params)
    for row, p, got in zip(logits, params, ours):
        ref = MinPLogitsWarper(p.min_p)(None, row[None].clone())[0] if p.min_p else row
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref))


def test_logit_bias_equals_transformers_sequence_bias_and_accepts_openai_string_keys():
    logits = logits_rows(2, seed=7)
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    p = SamplingParams(logit_bias={str(t): b for t, b in bias.items()})  # OpenAI's JSON keys
    assert p.logit_bias == bias
    seqs = [make_seq(p, [1, 2], [4]), make_seq(SamplingParams(), [1, 2], [4])]
    ours = process_logits(logits, seqs)
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1, 2, 4]]), logits[:1].clone())
    torch.testing.assert_close(ours[:1], ref, atol=1e-6, rtol=0)
    assert torch.equal(ours[1], logits[1])  # its neighbour is untouched
    assert SamplingParams(logit_bias={5: 1e9}).logit_bias == {5: 100.0}  # clamped to OpenAI's range


def test_bad_words_equal_transformers_no_bad_words_over_the_output():
    logits = logits_rows(3, seed=8)
    words = ((7,), (11, 12), (20, 21, 22))
    outputs = [[5, 11], [20, 21], [3, 4]]  # 12 barred after 11; 22 after 20 21; only 7 in the last
    seqs = [make_seq(SamplingParams(bad_words=["x"]), [1], out, bad_words=words) for out in outputs]
    ours = process_logits(logits, seqs)
    for out, got, row in zip(outputs, ours, logits):
        ref = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=VOCAB - 1)(
            torch.tensor([out]), row[None].clone())[0]
        assert torch.equal(torch.isinf(got), torch.isinf(ref))


def test_penalties_steer_greedy_decoding_as_transformers_generate_does():
    """A greedy step with a repetition penalty picks transformers' processed argmax."""
    logits, pairs = logits_rows(4, seed=10), histories(4, seed=11)
    for (prompt, output), row in zip(pairs, logits):
        row[output[0]] = row.max() + 0.5  # the repeated token leads before the penalty
    params = SamplingParams(temperature=0, repetition_penalty=3.0)
    seqs = [make_seq(params, p, o) for p, o in pairs]
    tokens = sample(process_logits(logits, seqs), [params] * 4, [s.generator for s in seqs])
    for (prompt, output), row, token in zip(pairs, logits, tokens):
        ref = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([prompt + output]), row[None].clone())[0]
        assert token == int(ref.argmax())


def test_top_logprobs_are_vllms_shape_with_float64_ranks():
    logits = logits_rows(3, seed=12)
    chosen = torch.tensor([4, 0, 33])
    steps = top_logprobs(logits, chosen, [0, 2, 5])
    for row, token, k, step in zip(logits, chosen.tolist(), [0, 2, 5], steps):
        ref = torch.log_softmax(row.double(), -1)
        order = torch.argsort(ref, descending=True).tolist()
        assert set(step) == set(order[:k]) | {token}
        for t, lp in step.items():
            assert lp.rank == order.index(t) + 1 and abs(lp.logprob - float(ref[t])) < 1e-5


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0), ("presence_penalty", 2.5),
                                         ("frequency_penalty", -3), ("min_p", 1.5), ("logit_bias", {"a": 1}),
                                         ("logit_bias", {"\u00b2": 5}), ("logit_bias", {"\u2460": 1}),
                                         ("logit_bias", {1: float("nan")}), ("bad_words", [""]),
                                         ("prompt_logprobs", True), ("prompt_logprobs", -2),
                                         ("include_stop_str_in_output", 1), ("skip_special_tokens", "no"),
                                         ("n", 0), ("n", 1025), ("n", 100_000_000)])
def test_bad_values_are_one_error_naming_the_field(field, value):
    with pytest.raises(FlexSarathiError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_every_control_runs_on_the_logits_device():
    """On the 'meta' device (not the CPU, no data) a host tensor mixed into an elementwise op
    raises, so the per-row columns and masks must be made on the logits' device, as the GPU path
    needs. (Meta does not check indexing ops' index devices: those run on CUDA in the GPU suite.)"""
    logits = torch.zeros(3, VOCAB, device="meta")
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                             presence_penalty=0.5, frequency_penalty=0.3, logit_bias={3: 1.0}, min_tokens=2),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.3, top_p=0.5)]
    seqs = [make_seq(p, [1, 2, 3], [4, 5], bad_words=((7,), (4, 9))) for p in params]
    out = filtered_logits(process_logits(logits, seqs), params)
    assert out.device.type == "meta" and out.shape == (3, VOCAB)
