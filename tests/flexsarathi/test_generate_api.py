"""vLLM-shaped generation API: outputs, text, stop strings, min_tokens, n, logprobs, chat templates,
on_error and argument misuse. References: transformers (model, tokenizer, chat template) and the
engine's own single-request runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from flexsarathi import LLM, FlexSarathiError, SamplingParams
from flexsarathi.engine.sampling import sample_seed
from flexsarathi.formats.tokenizer import IncrementalDetokenizer
from policy_search import Policy, Workload

PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog", "One day, a big bird"]
# A ChatML-style template as checkpoints ship them (rendered by transformers for the reference).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def stories(stories_dir):
    with LLM(stories_dir, policy=Policy(gpu_batch_size=4, prefill_budget=8)) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    folder, hf = tiny_checkpoint("llama_gqa_untied")
    # no cap on logprobs: tests here ask for the whole vocabulary
    with LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=4, prefill_budget=8), max_logprobs=-1) as llm:
        yield llm, hf


def test_text_is_the_decode_after_the_prompt_also_when_sampling(stories, stories_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(stories_dir)
    outs = stories.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=1.0, seed=11), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        prompt_text = ref.decode(ids, skip_special_tokens=True)
        full = ref.decode(ids + out.token_ids, skip_special_tokens=True)
        assert out.text == full[len(prompt_text):] and prompt + out.text == full
        detok = IncrementalDetokenizer(stories.tokenizer, ids)  # the incremental text agrees
        for token in out.token_ids:
            detok.add(token)
        assert full.startswith(prompt_text + detok.text)
        assert out.outputs[0].text == out.text and out.outputs[0].token_ids == out.token_ids


def test_stop_string_ends_the_text_before_it(stories):
    free = stories.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    word = " little"
    assert word in free.text
    out = stories.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, stop=[" zebra", word]),
                           use_tqdm=False)[0]
    assert out.text == free.text[:free.text.index(word)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == word
    n = len(out.token_ids)  # generation stopped at the token completing the stop string
    assert out.token_ids == free.token_ids[:n] and word in stories.tokenizer.completion_text(
        out.prompt_token_ids, out.token_ids) and word not in stories.tokenizer.completion_text(
        out.prompt_token_ids, out.token_ids[:-1])


def test_min_tokens_suppresses_stops_like_transformers(tiny):
    llm, hf = tiny
    ids = [5, 6, 7, 8]
    free = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop = free.token_ids[0]
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                                             min_tokens=3), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=3, do_sample=False,
                          eos_token_id=stop, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref and len(out.token_ids) >= 3 and stop not in out.token_ids[:3]
    assert out.finish_reason == ("stop" if ref[-1] == stop else "length")


def test_n_completions_are_seeded_single_runs(tiny):
    llm, _ = tiny
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        alone = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True,
                                                         seed=sample_seed(5, i)), use_tqdm=False)[0]
        assert completion.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    assert out.token_ids == out.outputs[0].token_ids


def test_logprobs_match_transformers(tiny):
    llm, hf = tiny
    ids = [3, 9, 27, 81]
    out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]  # [5, vocab]
    ref = torch.log_softmax(logits.float(), -1)
    completion = out.outputs[0]
    for step, (token, lp) in enumerate(zip(out.token_ids, completion.logprobs)):
        top2 = set(torch.topk(ref[step], 2).indices.tolist())
        assert set(lp) == top2 | {token}
        for t, value in lp.items():  # vLLM's Logprob: the value, its rank and its text
            assert value.logprob == pytest.approx(ref[step, t].item(), abs=1e-4)
            assert value.rank == int((ref[step] > ref[step, t]).sum()) + 1
    assert completion.cumulative_logprob == pytest.approx(sum(ref[i, t].item() for i, t in enumerate(out.token_ids)),
                                                          abs=1e-3)


def test_chat_template_renders_like_transformers(stories_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(stories_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A dog and a cat"}]
    ref = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    with LLM(str(folder)) as llm:
        assert llm.tokenizer.apply_chat_template(messages) == list(ref)
    with LLM(stories_dir) as plain, pytest.raises(FlexSarathiError, match="no chat template"):
        plain.tokenizer.apply_chat_template(messages)


def test_on_error_record_keeps_the_batch_going(tiny):
    llm, _ = tiny
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([[1, 2], [], [1] * 65, "text", [3, 4]], params, use_tqdm=False, on_error="record")
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert [o.refused for o in outs] == [False, True, True, True, False]  # turned away before any pass
    assert "prompt 1 is empty" in outs[1].error and "context of 64" in outs[2].error
    assert "no tokenizer.json" in outs[3].error and outs[1].outputs == [] and outs[1].text == ""
    assert llm.last_stats["requests"] == 2 and llm.last_stats["failed"] == 3
    alone = llm.generate([[1, 2], [3, 4]], params, use_tqdm=False)
    assert [o.token_ids for o in (outs[0], outs[4])] == [o.token_ids for o in alone]
    with pytest.raises(FlexSarathiError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []], params, use_tqdm=False)


@pytest.mark.parametrize("call,message", [
    (lambda llm: llm.generate([[1, 2]], {"max_tokens": 5}), r"sampling_params=\.\.\.\) must be a SamplingParams"),
    (lambda llm: llm.generate([[1, 2]], [{"max_tokens": 5}]), r"sampling_params=.*holds a dict"),
    (lambda llm: llm.generate(None), r"prompts=\.\.\.\) must be a string"),
    (lambda llm: llm.generate(7), r"prompts=\.\.\.\) must be a string"),
    (lambda llm: llm.generate([[1, 2.0]]), r"prompt 0: 2\.0 \(float\) is not an integer token id"),
    (lambda llm: llm.generate([[1], [True]]), r"prompt 1: True \(bool\) is not an integer token id"),
    (lambda llm: llm.generate({"prompt_token_ids": [1], "prompt": "a"}), r"prompt 0 is a dict: it takes exactly one"),
    (lambda llm: llm.generate([{"prompt_token_ids": [1], "multi_modal_data": {}}]), r"got keys \['multi_modal_data'"),
    (lambda llm: llm.generate({"prompt_token_ids": "1 2"}), r"prompt 0: 'prompt_token_ids' must be a list of token ids"),
    (lambda llm: llm.generate([[1]], on_error="skip"), r"on_error"),
    (lambda llm: llm.generate([[1]], SamplingParams(stop_token_ids=[500])), r"stop_token_ids .*outside the vocabulary"),
    (lambda llm: llm.generate([[1]], SamplingParams(stop=["x"])), r"stop strings need .*tokenizer.json"),
])
def test_api_misuse_names_the_argument(tiny, call, message):
    with pytest.raises(FlexSarathiError, match=message):
        call(tiny[0])


@pytest.mark.parametrize("fields,message", [
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop": 5}, "stop must be a list"),
    ({"stop": [""]}, "stop must be a non-empty string"),
    ({"n": 0}, r"n must be an integer in \[1, 1024\]"),
    ({"min_tokens": 20, "max_tokens": 16}, r"min_tokens must be an integer in \[0, max_tokens=16\]"),
    ({"logprobs": -2}, r"logprobs must be None, -1 \(the whole vocabulary\) or an integer >= 0"),
    ({"seed": 1 << 64}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\)"),
    ({"seed": -(1 << 63) - 1}, "seed must be None or an integer in"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ({"max_tokens": True}, r"max_tokens must be None \(until the context ends\) or an integer"),
])
def test_sampling_params_types(fields, message):
    with pytest.raises(FlexSarathiError, match=f"SamplingParams.{message}"):
        SamplingParams(**fields)


def test_vllms_prompt_dicts_and_numpy_token_ids_are_the_prompts_they_hold(stories):
    """vLLM's TextPrompt / TokensPrompt dicts and a tokenizer's numpy ids give what the plain string
    and list give; text that is not valid Unicode is one error naming the prompt."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    text, ids = "Once upon a time", [1, 300, 301, 302]
    plain = stories.generate([text, ids], greedy, use_tqdm=False)
    as_dicts = stories.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.token_ids for o in as_dicts] == [o.token_ids for o in plain]
    assert as_dicts[0].prompt == text and as_dicts[0].prompt_token_ids == plain[0].prompt_token_ids
    numpy_ids = stories.generate(list(np.array(ids, dtype=np.int64)), greedy, use_tqdm=False)[0]
    assert numpy_ids.token_ids == plain[1].token_ids
    assert stories.generate({"prompt": text}, greedy, use_tqdm=False)[0].token_ids == plain[0].token_ids
    with pytest.raises(FlexSarathiError, match=r"prompt 1 is not valid Unicode text \(surrogates not allowed at character 4\)"):
        stories.generate(["fine", "bad \ud800"], greedy, use_tqdm=False)


def test_logprobs_beyond_max_logprobs_are_refused_by_name(stories):
    """By default (max_logprobs=20, vLLM's) a request may ask 20 alternatives per token, not 21, and
    not the whole vocabulary (-1); prompt_logprobs likewise. A refused request names the field and
    the option that lifts it; within the cap the outputs carry what was asked."""
    assert stories.engine.engine_config.max_logprobs == 20
    ok = stories.generate(["Once"], SamplingParams(max_tokens=2, temperature=0, logprobs=20, prompt_logprobs=20),
                          use_tqdm=False)[0]
    assert [len(step) for step in ok.outputs[0].logprobs] == [20, 20]  # greedy: the sampled token is in the top 20
    assert ok.prompt_logprobs[0] is None and 20 <= len(ok.prompt_logprobs[1]) <= 21  # + the prompt token
    for field, asked, count in (("logprobs", 21, 21), ("prompt_logprobs", 21, 21), ("logprobs", -1, 512)):
        with pytest.raises(FlexSarathiError, match=(
                rf"prompt 0: SamplingParams\.{field}={asked} asks for {count} alternatives per token, more than "
                r"this engine's max_logprobs=20 \(LLM\(max_logprobs=\.\.\.\), --max-logprobs; -1: no limit\)")):
            stories.generate(["Once"], SamplingParams(max_tokens=2, **{field: asked}), use_tqdm=False)
    with pytest.raises(FlexSarathiError, match=r"LLM\(max_logprobs=\.\.\.\) must be an integer >= -1"):
        LLM("dummy:opt-125m-1l", max_logprobs=-2)


def test_vllms_other_spellings_mean_what_they_mean_there(tiny):
    """vLLM's defaults and "off" values as vLLM code passes them: top_k 0, stop / stop_token_ids /
    bad_words None, max_tokens None (until the context ends), logprobs -1 (the whole vocabulary),
    each giving what the spelling that was already accepted gives."""
    llm, hf = tiny
    ids = [3, 9, 27, 81]
    sampled = dict(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    assert (llm.generate([ids], SamplingParams(top_k=0, stop=None, stop_token_ids=None, bad_words=None, **sampled),
                         use_tqdm=False)[0].token_ids
            == llm.generate([ids], SamplingParams(top_k=-1, **sampled), use_tqdm=False)[0].token_ids)
    context = hf.config.max_position_embeddings
    rest = llm.generate([ids], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(rest.token_ids) == context - len(ids) and rest.finish_reason == "length"
    vocab = hf.config.vocab_size
    every = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1),
                         use_tqdm=False)[0]
    named = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, logprobs=vocab, prompt_logprobs=vocab),
                         use_tqdm=False)[0]
    assert [len(step) for step in every.outputs[0].logprobs] == [vocab, vocab]
    assert every.outputs[0].logprobs == named.outputs[0].logprobs
    assert every.prompt_logprobs == named.prompt_logprobs and len(every.prompt_logprobs[1]) == vocab


@pytest.mark.parametrize("options,message", [
    ({"model": None}, r"LLM\(model=\.\.\.\) must be a checkpoint folder.*got NoneType"),
    ({"policy": 5}, r'LLM\(policy=\.\.\.\) must be a Policy, a policy JSON file, "auto" or None; got int'),
    ({"hardware": {"gpu_memory": 1}}, r"LLM\(hardware=\.\.\.\) must be a HardwareSpec.*got dict"),
    ({"seed": "a"}, r"LLM\(seed=\.\.\.\) must be an integer, got 'a'"),
    ({"kv_block_size": 0}, r"LLM\(kv_block_size=\.\.\.\) must be None or an integer >= 1, got 0"),
    ({"kv_blocksize": 16}, r"LLM\(\) got unknown option\(s\) \['kv_blocksize'\]"),
    # a string flag read as true ("no" turned O_DIRECT on), and options that failed deep or were ignored
    ({"direct_io": "no"}, r"^EngineConfig.direct_io must be True or False, got 'no'$"),
    ({"cuda_graphs": "off"}, r"^EngineConfig.cuda_graphs must be True, False or None, got 'off'$"),
    ({"offload_dir": 5}, r"^EngineConfig.offload_dir must be a folder path or None, got 5$"),
    ({"kv_bits": 3}, r"^EngineConfig.kv_bits must be one of \(4, 8\), got 3$"),
    ({"kv_value_group": 0}, r"^EngineConfig.kv_value_group must be a positive integer, got 0$"),
    ({"weight_quant": "q4"}, r"^EngineConfig.weight_quant must be a quant.QuantConfig, got 'q4'$"),
    ({"dtype": torch.int8}, r"^LLM\(dtype=\.\.\.\): unsupported dtype torch.int8; use float32"),
    ({"budget": 5}, r"^LLM\(\) takes no budget=: the tier budgets are hardware='s"),
    ({"hardware": "t4x"}, r"^hardware= 't4x' is neither a preset \(t4, "),  # not "--hardware", a flag
    ({"workload": 5, "policy": "auto", "hardware": "t4"},
     r"^LLM\(workload=\.\.\.\) must be a policy_search.Workload or None, got int$"),
    ({"workload": Workload(prompt_len=8, gen_len=4)}, r'^LLM\(workload=\.\.\.\) is what policy="auto" searches'),
    ({"policy": Policy(weight_prefetch=10**6)}, r"^Policy.weight_prefetch=1000000 loads more layers ahead than "),
])
def test_llm_arguments_of_the_wrong_kind_are_one_error_naming_them(tiny_checkpoint, options, message):
    """Each used to fail deeper with an AttributeError or TypeError (or, for seed and kv_block_size 0,
    to be taken silently)."""
    with pytest.raises(FlexSarathiError, match=message):
        LLM(**{"model": tiny_checkpoint("opt")[0], **options})


def test_paths_may_be_pathlib_paths(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("opt")[0]
    policy = Policy(gpu_batch_size=2, prefill_budget=4)
    policy.save(str(tmp_path / "policy.json"))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(folder, dtype="float32", policy=policy) as as_strings:
        expected = as_strings.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].token_ids
    with LLM(Path(folder), dtype="float32", policy=tmp_path / "policy.json") as as_paths:
        assert as_paths.engine.policy == policy
        assert as_paths.generate([[3, 4, 5]], greedy, use_tqdm=False)[0].token_ids == expected


def test_empty_generate_resets_last_stats(tiny):
    llm, _ = tiny
    llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.last_stats["requests"] == 1
    assert llm.generate([], use_tqdm=False) == []
    assert llm.last_stats["requests"] == 0 and llm.last_stats["generated_tokens"] == 0


@pytest.fixture(scope="module")
def chat_llm(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat") / "stories"
    shutil.copytree(stories_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with LLM(str(folder), dtype="float32", policy=Policy(gpu_batch_size=4, prefill_budget=64)) as llm:
        yield llm


def test_chat_generates_what_generate_gives_the_rendered_conversation(chat_llm):
    """LLM.chat (vLLM's): one conversation or several, one SamplingParams or one each, the options
    of the template (continue_final_message: the last message left open): the tokens generate gives
    the token ids the template renders, each output's prompt the rendered text."""
    story = [{"role": "user", "content": "Tell a story"}]
    open_reply = [*story, {"role": "assistant", "content": "Once upon a time"}]
    greedy, sampled = SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    one = chat_llm.chat(story, greedy, use_tqdm=False)
    many = chat_llm.chat([story, open_reply], [greedy, sampled], use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)
    tok = chat_llm.tokenizer
    expected = [(story, greedy, True, False), (story, greedy, False, True), (open_reply, sampled, False, True)]
    for out, (messages, params, add, cont) in zip([*one, *many], expected):
        ids = tok.apply_chat_template(messages, add, cont)
        ref = chat_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and out.token_ids == ref.token_ids and out.error is None
        assert out.prompt == tok.render_chat(messages, add, cont) and out.text == ref.text
    assert many[1].prompt.endswith("Once upon a time")  # open: no end-of-turn after it


def test_chat_records_or_raises_for_a_conversation_that_cannot_render(chat_llm):
    story = [{"role": "user", "content": "Tell a story"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    params = SamplingParams(max_tokens=4, temperature=0)
    huge = [{"role": "user", "content": "a " * 1_000_000}]  # more than the context holds: refused unencoded
    outs = chat_llm.chat([story, image, story, huge], params, use_tqdm=False, on_error="record")
    assert [o.refused for o in outs] == [False, True, False, True] and "must be a text part" in outs[1].error
    assert "more than the model's context of 512 tokens can hold" in outs[3].error
    alone = chat_llm.chat(story, params, use_tqdm=False)[0]
    assert outs[0].token_ids == outs[2].token_ids == alone.token_ids
    with pytest.raises(FlexSarathiError, match=r"^conversation 1: messages\[0\]\.content\[0\] must be a text part"):
        chat_llm.chat([story, image], params, use_tqdm=False)
    with pytest.raises(FlexSarathiError, match=r"holds 1 entries for 2 conversations"):
        chat_llm.chat([story, story], [params], use_tqdm=False)


def test_chat_with_a_template_of_its_own_renders_as_transformers(chat_llm, stories_dir):
    """LLM.chat(chat_template=...) (vLLM's): that template instead of the checkpoint's, as
    transformers' apply_chat_template(chat_template=...) renders it; the checkpoint's one after it."""
    from transformers import AutoTokenizer

    other = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
    story = [{"role": "user", "content": "Tell a story"}]
    ref = AutoTokenizer.from_pretrained(stories_dir).apply_chat_template(story, chat_template=other, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    params = SamplingParams(max_tokens=4, temperature=0)
    given = chat_llm.chat(story, params, use_tqdm=False, chat_template=other)[0]
    assert given.prompt_token_ids == list(ref) and given.prompt.endswith("[ASSISTANT]")
    assert chat_llm.chat(story, params, use_tqdm=False)[0].prompt == chat_llm.tokenizer.render_chat(story)
    with pytest.raises(FlexSarathiError, match="chat_template must be a non-empty jinja2 string"):
        chat_llm.chat(story, params, use_tqdm=False, chat_template="")
