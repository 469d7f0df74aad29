"""vLLM's sampling controls through LLM.generate, end to end: repetition_penalty and bad_words
against transformers' generate on the same checkpoint, logit_bias, include_stop_str_in_output and
skip_special_tokens against transformers' tokenizer; rows with different controls share passes."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from policy_search import Policy

PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog"]


@pytest.fixture(scope="module")
def stories(stories_dir):
    with LLM(stories_dir, dtype="float32", policy=Policy(gpu_batch_size=4, prefill_budget=8)) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


def hf_generate(model, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **kwargs)
    return out[0, len(ids):].tolist()


def test_repetition_penalty_greedy_equals_transformers_generate(stories, stories_hf):
    """Three requests with three penalties in one batch, each as transformers generates it alone."""
    penalties = [1.0, 1.3, 2.0]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=r) for r in penalties]
    outs = stories.generate(PROMPTS, params, use_tqdm=False)
    for out, r in zip(outs, penalties):
        assert out.token_ids == hf_generate(stories_hf, out.prompt_token_ids, 24, repetition_penalty=r)
    assert outs[0].token_ids != hf_generate(stories_hf, outs[0].prompt_token_ids, 24, repetition_penalty=2.0)


def test_bad_words_equal_transformers_bad_words_ids(stories, stories_hf):
    free = stories.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    word = "little"
    assert f" {word}" in free.text
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, bad_words=[word])
    out = stories.generate(PROMPTS[0], params, use_tqdm=False)[0]
    seq = stories.engine.make_sequence(out.prompt_token_ids, params)
    assert seq.bad_word_ids  # "little" at the start of a text and " little" after a space (one here)
    assert word not in out.text
    assert out.token_ids == hf_generate(stories_hf, out.prompt_token_ids, 30,
                                        bad_words_ids=[list(w) for w in seq.bad_word_ids])


def test_logit_bias_forces_and_bars_tokens(stories):
    free = stories.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    forced = stories.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                         logit_bias={"300": 100}), use_tqdm=False)[0]
    assert forced.token_ids == [300] * 8
    barred = stories.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                         logit_bias={free.token_ids[0]: -100}), use_tqdm=False)[0]
    assert barred.token_ids[0] != free.token_ids[0]


def test_include_stop_str_in_output_keeps_the_stop_string(stories):
    free = stories.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    word = " little"
    end = free.text.index(word) + len(word)
    out = stories.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, stop=[word],
                                                      include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out.text == free.text[:end] and out.outputs[0].stop_reason == word


def test_skip_special_tokens_false_keeps_eos_in_the_text(stories, hf_tokenizer):
    eos = hf_tokenizer.eos_token_id
    outs = stories.generate([PROMPTS[2]] * 2, [
        SamplingParams(max_tokens=4, temperature=0, min_tokens=2, logit_bias={eos: 100}, skip_special_tokens=skip)
        for skip in (True, False)], use_tqdm=False)
    for out, skip in zip(outs, (True, False)):
        assert out.token_ids[-1] == eos and len(out.token_ids) == 3 and out.finish_reason == "stop"
        prompt = hf_tokenizer.decode(out.prompt_token_ids, skip_special_tokens=skip)
        full = hf_tokenizer.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=skip)
        assert out.text == full[len(prompt):]
    assert outs[1].text.endswith(hf_tokenizer.eos_token) and not outs[0].text.endswith(hf_tokenizer.eos_token)


def test_penalized_and_plain_rows_in_one_batch_leave_the_plain_ones_alone(stories):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = stories.generate(PROMPTS, plain, use_tqdm=False)
    mixed = stories.generate(PROMPTS, [plain, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                             frequency_penalty=1.5, presence_penalty=1.0,
                                                             min_p=0.1, bad_words=["dog"],
                                                             logit_bias={alone[1].token_ids[0]: -100}), plain],
                              use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[2].token_ids]
    assert mixed[1].token_ids != alone[1].token_ids


def test_allowed_token_ids_keep_the_argmax_among_them(stories):
    """Greedy under allowed_token_ids takes, at every step, the most likely of the listed tokens by
    the model's own logits (prompt logits of the prompt and the output so far: the reference);
    sampled tokens stay among them; EOS, not listed, never ends the request."""
    from tests.prompt_logits import prompt_logits

    free = stories.generate(PROMPTS[2], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    allowed = sorted({*free.token_ids[1:], 300, 301, 302, 411} - {free.token_ids[0]})  # the free argmax left out
    out = stories.generate(PROMPTS[2], SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=allowed),
                           use_tqdm=False)[0]
    context = out.prompt_token_ids + out.token_ids
    logits = prompt_logits(stories, [context])[0]  # [len, vocab]: row j predicts token j + 1
    for step, token in enumerate(out.token_ids):
        row = logits[len(out.prompt_token_ids) - 1 + step]
        assert token == allowed[int(row[allowed].argmax())]
    sampled = stories.generate([PROMPTS[0]] * 3, SamplingParams(max_tokens=12, temperature=1.5, seed=5,
                                                                allowed_token_ids=[13, 300, 301]), use_tqdm=False)
    assert all(set(o.token_ids) <= {13, 300, 301} and o.finish_reason == "length" for o in sampled)


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens(stories, stories_dir):
    """The request runs as a prompt of its last k token ids would (vLLM's left truncation), and -1
    keeps the model's context: a text longer than the context is then read, not refused."""
    ids = stories.generate(PROMPTS[1], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cut = stories.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                      truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:] and cut.token_ids == stories.generate([ids[-3:]], params,
                                                                                  use_tqdm=False)[0].token_ids
    context = stories.engine.config.max_position_embeddings
    long_text = "Lily saw a big red ball in the park. " * context  # thousands of tokens past the context
    with pytest.raises(Exception, match="context"):
        stories.generate(long_text, params, use_tqdm=False)
    whole = stories.generate(long_text, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                       truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) == context and whole.finish_reason == "length"
    with pytest.raises(Exception, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("value,match", [([], "non-empty list"), ([3, -1], "integers >= 0"), ("13", "must be a list"),
                                         ([10 ** 6], r"outside the vocabulary \[0, 512\)")])
def test_bad_allowed_token_ids_are_one_clear_error(stories, value, match):
    with pytest.raises(Exception, match=f"allowed_token_ids.*{match}|{match}"):
        stories.generate(PROMPTS[0], SamplingParams(max_tokens=2, allowed_token_ids=value), use_tqdm=False)
