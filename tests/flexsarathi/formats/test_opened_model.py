"""A model is opened once per job: `flexsarathi generate` reads the tokenizer and the weights'
fingerprint, then builds the engine on the same opened model; an engine refuses an opened model
other than the one it is configured for."""
from __future__ import annotations

import json

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.cli.main import main
from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine
from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats import checkpoint, tokenizer
from flexsarathi.formats.opened_model import open_model


def _counting(monkeypatch, owner, name):
    """Counts calls of owner.name; the real function still runs."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_generate_opens_the_checkpoint_and_tokenizer_once(stories_dir, tmp_path, monkeypatch):
    checkpoints = _counting(monkeypatch, checkpoint.SafetensorsCheckpoint, "__init__")
    tokenizers = _counting(monkeypatch, tokenizer.Tokenizer, "from_folder")
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                                for i, p in enumerate(["Once upon a time", "Lily saw"])))
    rc = main(["generate", "--model", stories_dir, "--input", str(requests), "--output", str(tmp_path / "out.jsonl"),
               "--max-tokens", "4", "--temperature", "0", "--dtype", "float32", "--quiet",
               "--offload-dir", str(tmp_path / "off")])
    assert rc == 0
    assert len(checkpoints) == 1 and len(tokenizers) == 1
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == [0, 1] and all(len(r["token_ids"]) == 4 for r in records)


def test_an_engine_on_an_opened_model_equals_one_that_opens_it(stories_dir):
    params = SamplingParams(max_tokens=6, temperature=0)
    with LLM(stories_dir, dtype="float32") as fresh, LLM(open_model(stories_dir), dtype="float32") as given:
        assert [o.token_ids for o in given.generate(["Once upon a time"], params, use_tqdm=False)] == \
               [o.token_ids for o in fresh.generate(["Once upon a time"], params, use_tqdm=False)]


def test_an_engine_refuses_an_opened_model_it_is_not_configured_for(stories_dir):
    with pytest.raises(FlexSarathiError, match="is not the one this engine is configured for"):
        LLMEngine(EngineConfig("dummy:opt-125m"), open_model(stories_dir))
