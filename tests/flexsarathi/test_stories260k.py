"""A real pretrained LLaMA (stories260K, GQA, tied embeddings) against transformers."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.perplexity import split_documents
from policy_search import Policy
from tests.conftest import REPO, TINYSTORIES_TEXT

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a big bird",
           "Tom and Sue went to the park"]


def test_greedy_continuations_match_transformers(stories_dir, stories_hf):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(stories_dir)
    llm = LLM(stories_dir, policy=Policy(gpu_batch_size=3, prefill_budget=4))
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


def _transformers_perplexity(model, tokenizer, documents: list[str], context: int) -> float:
    nll, count = 0.0, 0
    for doc in documents:
        ids = tokenizer(doc)["input_ids"][:context]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
        nll -= logprobs.sum().item()
        count += len(ids) - 1
    return math.exp(nll / count)


def test_perplexity_cli_matches_transformers(stories_dir, stories_hf, tinystories_text):
    from transformers import AutoTokenizer

    result = subprocess.run(
        [sys.executable, "-m", "flexsarathi", "perplexity", "--model", stories_dir, "--text",
         str(TINYSTORIES_TEXT), "--separator", "<|endoftext|>", "--quiet"],
        capture_output=True, text=True, cwd=REPO, check=True)
    ours = json.loads(result.stdout.strip().splitlines()[-1])
    docs = split_documents(tinystories_text, "<|endoftext|>")
    assert ours["documents"] == len(docs) == 45
    ref = _transformers_perplexity(stories_hf, AutoTokenizer.from_pretrained(stories_dir), docs,
                                   stories_hf.config.max_position_embeddings)
    assert abs(ours["perplexity"] - ref) / ref < 1e-3
