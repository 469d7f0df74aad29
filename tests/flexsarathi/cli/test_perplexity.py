"""`flexsarathi perplexity`'s scoring (flexsarathi/cli/perplexity.py) on hostile sizes: a long text
is scored a bounded number of windows per engine call (each window's output holds a log-probability
per token), with the result of transformers' sliding-window reference."""
from __future__ import annotations

from flexsarathi import LLM
from flexsarathi.cli import perplexity as ppl
from tests.flexsarathi.models.test_stories260k import _transformers_perplexity


def test_a_long_text_is_scored_a_few_windows_per_call(stories_dir, stories_hf, tinystories_text, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_dir)
    text = tokenizer.decode(tokenizer(tinystories_text)["input_ids"][1:1500])
    llm = LLM(stories_dir, dtype="float32")
    calls = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, *a, **k: calls.append(len(prompts)) or generate(prompts, *a,
                                                                                                         **k))
    monkeypatch.setattr(ppl, "WINDOWS_PER_CALL", 4)
    ours = ppl.perplexity(llm, [text, "Once upon a time"], stride=100)
    context = stories_hf.config.max_position_embeddings
    ref, tokens = _transformers_perplexity(stories_hf, tokenizer, [text, "Once upon a time"], context, 100)
    assert ours["windows"] == sum(calls) > 8 and max(calls) == 4  # every window scored, 4 at a time
    assert ours["tokens"] == tokens
    assert abs(ours["perplexity"] - ref) / ref < 1e-4
