"""Perplexity of a text file: each document (split by a separator, or the whole text) is tokenized
with BOS and scored in windows of the model's context, as HF's perplexity guide and
llama-perplexity do. Windows start every `stride` tokens; a token is scored once, by the first
window that reaches it (where it has the most history: at least context - stride tokens once past
the first window). With stride < context every token after the document's first is scored; with
stride = context (non-overlapping windows) a window's first token has no history in it and is not
scored. Nothing is truncated: the result says how many tokens were scored in how many windows."""
from __future__ import annotations

import array
import math

from tqdm.auto import tqdm

from flexsarathi.errors import FlexSarathiError
from flexsarathi.llm import LLM
from flexsarathi.engine.sampling import SamplingParams


def split_documents(text: str, separator: str | None) -> list[str]:
    docs = text.split(separator) if separator else [text]
    return [d.strip() for d in docs if d.strip()]


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) per window over a document of `num_tokens`: the window is tokens
    [begin, end) and its last `scored` positions are the ones it scores (HF's loop)."""
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        scored = min(end - prev_end, end - begin - 1)  # a window's first token has no prediction
        windows.append((begin, end, scored))
        prev_end = end
        if end == num_tokens:
            break
    return windows


# Windows scored per generate call: each window's output holds a log-probability entry per token, so
# scoring all of a large text's windows at once held them all (1 MB of text took 430 MB more memory).
WINDOWS_PER_CALL = 64


def perplexity(llm: LLM, documents: list[str], stride: int | None = None, use_tqdm: bool = False) -> dict:
    if llm.tokenizer is None:
        raise FlexSarathiError("perplexity needs a model folder with tokenizer.json")
    if not documents:
        raise FlexSarathiError("no documents to score (the text is empty)")
    context = llm.engine.config.max_position_embeddings
    stride = context // 2 if stride is None else stride
    if not 1 <= stride <= context:
        raise FlexSarathiError(f"stride must be between 1 and the model's context of {context}, got {stride}")
    # token ids as 4-byte integers (a Python list of ints is 36 bytes a token), and the windows over them
    docs = [array.array("i", llm.tokenizer.encode(doc, whole=True)) for doc in documents]  # read in windows
    windows = [(ids, begin, end, count) for ids in docs
               for begin, end, count in sliding_windows(len(ids), context, stride) if count]
    sums, scored = [], 0
    with tqdm(total=len(windows), unit="window", disable=not use_tqdm) as progress:
        for first in range(0, len(windows), WINDOWS_PER_CALL):
            logprobs = _window_logprobs(llm, windows[first:first + WINDOWS_PER_CALL])
            sums.append(math.fsum(logprobs))
            scored += len(logprobs)
            progress.update(min(WINDOWS_PER_CALL, len(windows) - first))
    if not scored:
        raise FlexSarathiError("no token to score: every document is a single token")
    nll = -math.fsum(sums) / scored
    return {"documents": len(documents), "windows": len(windows), "context": context, "stride": stride,
            "tokens": scored, "nll": nll, "perplexity": math.exp(nll)}


def _window_logprobs(llm: LLM, windows: list[tuple]) -> list[float]:
    """The log-probabilities of the tokens the windows (ids, begin, end, count) score."""
    outputs = llm.generate([ids[begin:end].tolist() for ids, begin, end, _ in windows],
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    # prompt_logprobs[i] holds the log-probability of window token i: keep the last `count`.
    return [step[token].logprob for out, (_, _, _, count) in zip(outputs, windows)
            for step, token in zip(out.prompt_logprobs[-count:], out.prompt_token_ids[-count:])]
