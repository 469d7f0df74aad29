"""Perplexity of a text file: each document (split by a separator) scored alone, with BOS,
truncated to the model's context; every token after the first is scored."""
from __future__ import annotations

import math

from flexsarathi.errors import FlexSarathiError
from flexsarathi.llm import LLM
from flexsarathi.sampling import SamplingParams


def split_documents(text: str, separator: str | None) -> list[str]:
    docs = text.split(separator) if separator else [text]
    return [d.strip() for d in docs if d.strip()]


def perplexity(llm: LLM, documents: list[str], use_tqdm: bool = False) -> dict:
    if llm.tokenizer is None:
        raise FlexSarathiError("perplexity needs a model folder with tokenizer.json")
    if not documents:
        raise FlexSarathiError("no documents to score (the text is empty)")
    context = llm.engine.config.max_position_embeddings
    prompts = [llm.tokenizer.encode(doc)[:context] for doc in documents]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True),
                           use_tqdm=use_tqdm)
    logprobs = [lp for out in outputs for lp in out.prompt_logprobs]
    if not logprobs:
        raise FlexSarathiError("no token to score: every document is a single token")
    nll = -math.fsum(logprobs) / len(logprobs)
    return {"documents": len(documents), "tokens": len(logprobs), "nll": nll, "perplexity": math.exp(nll)}
