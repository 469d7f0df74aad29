"""Engine math against transformers (the reference) on tiny random-weight models of every
supported family, and the invariants of the pass: chunking, mixing and micro-batching change
nothing but float rounding."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from policy_search import Policy
from tests.prompt_logits import prompt_logits

KINDS = ["opt", "opt350m", "llama_gqa_untied", "llama_tied_headdim", "qwen2", "mistral", "gemma3", "gemma3_softcap",
         "phi3", "phi3_window", "phi3_partial_rotary", "granite", "granite_untied", "qwen3_yarn", "llama_yarn_mscale",
         "olmo2", "olmo3"]


def _prompts(vocab: int, lengths=(5, 11, 17), seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, one full forward per token (no EOS stop)."""
    ids = list(ids)
    out = []
    for _ in range(steps):
        token = int(hf_logits(model, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_checkpoint, kind):
    folder, model = tiny_checkpoint(kind)
    llm = LLM(folder, dtype="float32")
    prompts = _prompts(llm.engine.config.vocab_size)
    ours = prompt_logits(llm, prompts)
    for ids, logits in zip(prompts, ours):
        ref = hf_logits(model, ids)
        assert logits.shape == ref.shape
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(tiny_checkpoint, kind):
    folder, model = tiny_checkpoint(kind)
    llm = LLM(folder, dtype="float32")
    prompts = _prompts(llm.engine.config.vocab_size, lengths=(4, 9))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model, ids, GREEDY.max_tokens)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("kind", ["opt", "llama_gqa_untied"])
@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_chunked_prefill_equals_whole_prefill(tiny_checkpoint, kind, budget):
    assert_chunked_prefill_equals_whole(tiny_checkpoint(kind)[0], budget)


def assert_chunked_prefill_equals_whole(folder: str, budget: int) -> None:
    """Prompts prefilled in chunks of `budget` tokens give the whole prefill's prompt logits and tokens."""
    whole = LLM(folder, dtype="float32", policy=Policy(prefill_budget=64))
    chunked = LLM(folder, dtype="float32", policy=Policy(prefill_budget=budget))
    prompts = _prompts(whole.engine.config.vocab_size, lengths=(17, 23))
    for ref, got in zip(prompt_logits(whole, prompts), prompt_logits(chunked, prompts)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    ref_out = whole.generate(prompts, GREEDY, use_tqdm=False)
    got_out = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got_out] == [o.token_ids for o in ref_out]


@pytest.mark.parametrize("kind", ["opt350m", "qwen2"])
@pytest.mark.parametrize("num_gpu_batches", [1, 2, 3])
def test_mixed_passes_equal_separate_runs(tiny_checkpoint, kind, num_gpu_batches):
    """Many prompts through small passes mix prompt chunks with decodes of other sequences (and
    admit new requests as others finish); each must equal its own run alone."""
    folder, model = tiny_checkpoint(kind)
    lengths = (3, 14, 6, 21, 9, 2, 12)
    prompts = _prompts(model.config.vocab_size, lengths=lengths, seed=1)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 3, 8, 4, 6, 7, 2)]
    llm = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=2, num_gpu_batches=num_gpu_batches, prefill_budget=5))
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_stats["passes"] < sum(lengths) + sum(p.max_tokens for p in params)  # really mixed
    alone = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=1, prefill_budget=64))
    for ids, p, out in zip(prompts, params, mixed):
        ref = alone.generate([ids], p, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids
        assert out.token_ids == hf_greedy(model, ids, p.max_tokens)


@pytest.mark.parametrize("scheduler", ["block", "decode-maximal"])
def test_schedulers_give_the_same_tokens(tiny_checkpoint, scheduler):
    folder, model = tiny_checkpoint("llama_gqa_untied")
    prompts = _prompts(model.config.vocab_size, lengths=(3, 8, 5, 13, 6), seed=2)
    llm = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=2, num_gpu_batches=1, prefill_budget=4,
                                    scheduler=scheduler))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model, ids, GREEDY.max_tokens)


def test_prompt_logprobs_match_transformers(tiny_checkpoint):
    """vLLM's shape: None for the first prompt token, then per position the prompt token's
    log-probability with its rank and the top-k candidates, all from transformers' logits."""
    folder, model = tiny_checkpoint("opt")
    llm = LLM(folder, dtype="float32", policy=Policy(prefill_budget=4))
    ids = _prompts(model.config.vocab_size, lengths=(10,))[0]
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(model, ids), -1)[:-1]  # [len - 1, vocab]
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for step, token, row in zip(out.prompt_logprobs[1:], ids[1:], ref):
        top = torch.topk(row, 3)
        assert set(step) == set(top.indices.tolist()) | {token}
        assert step[token].rank == int((row > row[token]).sum()) + 1
        for rank, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert step[t].rank == rank and abs(step[t].logprob - value) < 1e-4
        assert abs(step[token].logprob - float(row[token])) < 1e-4


@pytest.mark.parametrize("kind", ["llama_gqa_untied", "gpt_oss", "glm4_moe"])  # + sinks, sigmoid routing in bf16
def test_bf16_compute_stays_close_to_fp32(tiny_checkpoint, kind):
    folder, model = tiny_checkpoint(kind)
    ids = _prompts(model.config.vocab_size, lengths=(12,))[0]
    logits = prompt_logits(LLM(folder, dtype="bfloat16"), [ids])[0]
    ref = hf_logits(model, ids)
    # bf16 keeps 8 mantissa bits: relative error ~ 2^-8 per op, a few percent end to end.
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("budget", [1, 5, 64])
def test_compressed_kv_results_do_not_depend_on_chunking(tiny_checkpoint, budget):
    """K is quantized by block and read as stored by every later query, so chunked prefill
    equals whole prefill under compression too (up to float rounding flipping a code)."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    whole = LLM(folder, dtype="float32", policy=Policy(prefill_budget=64, compress_kv=True), kv_block_size=4)
    chunked = LLM(folder, dtype="float32", policy=Policy(prefill_budget=budget, compress_kv=True), kv_block_size=4)
    prompts = _prompts(whole.engine.config.vocab_size, lengths=(17, 23))
    for ref, got in zip(prompt_logits(whole, prompts), prompt_logits(chunked, prompts)):
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
    ref_out = whole.generate(prompts, GREEDY, use_tqdm=False)
    got_out = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got_out] == [o.token_ids for o in ref_out]


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 128, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_in_either_orientation(rows, bias):
    """layers.linear computes a large fp32 weight's few rows as weight @ xᵀ (a faster MKL path on
    the CPU): the same product as F.linear up to fp32 rounding, in x's leading shape."""
    import torch.nn.functional as F  # noqa: PLC0415

    from flexsarathi.models import layers  # noqa: PLC0415

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(layers.TRANSPOSED_MIN_WEIGHT // 512, 512, generator=gen)
    b = torch.randn(weight.shape[0], generator=gen) if bias else None
    x = torch.randn(1, rows, 512, generator=gen)
    got = layers.linear(x, weight, b)
    assert got.shape == (1, rows, weight.shape[0]) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
