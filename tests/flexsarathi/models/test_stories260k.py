"""A real pretrained LLaMA (stories260K, GQA, tied embeddings) against transformers."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.cli.perplexity import split_documents
from policy_search import Policy
from tests.conftest import REPO, TINYSTORIES_TEXT

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big bird",
           "Tom and Sue went to the park"]


def test_greedy_continuations_match_transformers(stories_dir, stories_hf):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(stories_dir)
    llm = LLM(stories_dir, dtype="float32", policy=Policy(gpu_batch_size=3, prefill_budget=4))
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = stories_hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
        # The text is what decoding prompt + output adds after the prompt's text: the first
        # word keeps its leading space, so prompt + text reads as the whole decode.
        prompt_text = hf_tok.decode(ids, skip_special_tokens=True)
        full = hf_tok.decode(ids + ref, skip_special_tokens=True)
        assert full.startswith(prompt_text) and out.text == full[len(prompt_text):]
        assert prompt + out.text == full
        assert out.text  # real words, not an empty decode


def test_tokenizer_matches_transformers(stories_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(stories_dir)
    llm = LLM(stories_dir)
    for text in PROMPTS + ["Hello, world!  Two  spaces.", "ünïcödé ✓"]:
        assert llm.tokenizer.encode(text) == ref(text)["input_ids"]


def _transformers_perplexity(model, tokenizer, documents: list[str], context: int,
                             stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored) by HF's perplexity guide: windows of `context` tokens every
    `stride`, each scoring the positions past the previous window's end."""
    nll, count = 0.0, 0
    for doc in documents:
        ids = tokenizer(doc)["input_ids"]
        prev_end = 0
        for begin in range(0, len(ids), stride):
            end = min(begin + context, len(ids))
            window = torch.tensor([ids[begin:end]])
            with torch.no_grad():
                logits = model(window).logits[0].float()
            logprobs = torch.log_softmax(logits[:-1], -1).gather(1, window[0, 1:, None])[:, 0]
            scored = logprobs[max(prev_end, begin + 1) - begin - 1:]
            nll -= scored.sum().item()
            count += scored.numel()
            prev_end = end
            if end == len(ids):
                break
    return math.exp(nll / count), count


def test_perplexity_cli_matches_transformers(stories_dir, stories_hf, tinystories_text):
    from transformers import AutoTokenizer

    result = subprocess.run(
        [sys.executable, "-m", "flexsarathi", "perplexity", "--model", stories_dir, "--text",
         str(TINYSTORIES_TEXT), "--separator", "<|endoftext|>", "--quiet", "--dtype", "float32"],
        capture_output=True, text=True, cwd=REPO, check=True)
    ours = json.loads(result.stdout.strip().splitlines()[-1])
    docs = split_documents(tinystories_text, "<|endoftext|>")
    assert ours["documents"] == len(docs) == 45
    context = stories_hf.config.max_position_embeddings
    ref, tokens = _transformers_perplexity(stories_hf, AutoTokenizer.from_pretrained(stories_dir), docs,
                                           context, context // 2)
    assert ours["tokens"] == tokens  # every token after a document's first, none cut off
    assert ours["windows"] > len(docs)  # one story is longer than the context
    assert abs(ours["perplexity"] - ref) / ref < 1e-3


@pytest.mark.parametrize("stride", [100, 512])
def test_perplexity_without_separator_scores_the_whole_text(stories_dir, stories_hf, tinystories_text, stride):
    """One document four contexts long, sliding windows as HF's perplexity guide computes them."""
    from transformers import AutoTokenizer

    from flexsarathi.cli.perplexity import perplexity

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    text = tokenizer.decode(tokenizer(tinystories_text)["input_ids"][1:2000])
    context = stories_hf.config.max_position_embeddings
    ours = perplexity(LLM(stories_dir, dtype="float32"), [text], stride=stride)
    ref, tokens = _transformers_perplexity(stories_hf, tokenizer, [text], context, stride)
    assert ours["tokens"] == tokens
    if stride < context:  # overlapping windows score every token but the first
        assert tokens == len(tokenizer(text)["input_ids"]) - 1
    assert abs(ours["perplexity"] - ref) / ref < 1e-4
