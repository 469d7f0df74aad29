"""`flexsarathi generate` with structured outputs and vLLM's sampling controls, as subprocesses on
stories260K: JSONL `structured_outputs` and OpenAI `response_format` jobs whose every output parses
and validates against the schema (jsonschema), in both schedulers, killed with SIGKILL partway and
rerun (the resumed file equals the uninterrupted one); an OpenAI batch file using
frequency_penalty, presence_penalty, logit_bias, top_logprobs, seed, allowed_token_ids and
truncate_prompt_tokens has no error record."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jsonschema
import pytest

from policy_search import Policy
from tests.conftest import KILLED_AFTER_RECORDS, REPO
from tests.flexsarathi.cli.test_cli_generate import cli, records, write_lines
from tests.flexsarathi.engine.test_structured_output import SCHEMA

pytest.importorskip("xgrammar")

PROMPTS = [f"Once upon a time, number {i}" for i in range(10)]


def jsonl_lines() -> list[dict]:
    lines = [{"id": i, "prompt": p, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
             for i, p in enumerate(PROMPTS)]
    lines[3] = {"id": 3, "prompt": PROMPTS[3]}  # unconstrained, side by side
    lines[7]["structured_outputs"] = {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}
    return lines


def openai_lines() -> list[dict]:
    fmt = {"type": "json_schema", "json_schema": {"name": "character", "schema": SCHEMA, "strict": True}}
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": p, "response_format": fmt}}
            for i, p in enumerate(PROMPTS)]


def text_of(fmt: str, record: dict) -> str:
    return record["response"]["body"]["choices"][0]["text"] if fmt == "openai" else record["text"]


@pytest.mark.parametrize("fmt", ["jsonl", "openai"])
@pytest.mark.parametrize("scheduler", ["decode-maximal", "block"])
def test_every_output_validates_and_a_killed_job_resumes_to_the_same_file(stories_dir, tmp_path, fmt, scheduler):
    src = write_lines(tmp_path / "in.jsonl", jsonl_lines() if fmt == "jsonl" else openai_lines())
    policy = str(tmp_path / "policy.json")
    Policy(gpu_batch_size=3, prefill_budget=16, scheduler=scheduler).save(policy)
    args = ["generate", "--model", stories_dir, "--input", src, "--policy", policy, "--max-tokens", "150",
            "--dtype", "float32", "--quiet"]
    full = tmp_path / "full.jsonl"
    cli(*args, "--output", str(full), check_rc=1 if fmt == "jsonl" else 0)
    key = "custom_id" if fmt == "openai" else "id"
    reference = {r[key]: r for r in records(full)}
    assert len(reference) == len(PROMPTS)
    for request_id, record in reference.items():
        if request_id == 7 and fmt == "jsonl":
            assert "structured_outputs.json cannot be compiled" in record["error"]["message"]
        elif request_id != 3 or fmt == "openai":
            jsonschema.validate(json.loads(text_of(fmt, record)), SCHEMA)

    killed = tmp_path / "killed.jsonl"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_RECORDS, "4", *args, "--output", str(killed)],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert 4 <= killed.read_bytes().count(b"\n") < len(PROMPTS), "the run was not killed partway"
    cli(*args, "--output", str(killed), check_rc=1 if fmt == "jsonl" else 0)
    resumed = {r[key]: r for r in records(killed)}
    for record in (*resumed.values(), *reference.values()):
        record.pop("created", None)
        if fmt == "openai":
            record["response"]["body"].pop("created")
    assert resumed == reference


def test_openai_batch_with_sampling_controls_has_no_error_record(stories_dir, tmp_path):
    bodies = [{"prompt": "Once upon a time", "frequency_penalty": 0.8, "presence_penalty": 0.5, "seed": 7},
              {"prompt": "Lily wanted to", "logit_bias": {"300": -100, "301": 5}, "logprobs": 2, "temperature": 0},
              {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2, "logprobs": True},
              {"prompt": "The dog", "response_format": {"type": "text"}, "repetition_penalty": 1.2, "min_p": 0.1},
              {"prompt": "Once upon a time", "allowed_token_ids": [300, 301], "truncate_prompt_tokens": 2}]
    lines = [{"custom_id": f"c{i}", "method": "POST",
              "url": "/v1/chat/completions" if "messages" in b else "/v1/completions",
              "body": {"model": "m", "max_tokens": 6, **b}} for i, b in enumerate(bodies)]
    lines.pop(2)  # stories260K has no chat template: the chat body is covered by test_cli_generate
    src = write_lines(tmp_path / "batch.jsonl", lines)
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), "--quiet",
        "--dtype", "float32", check_rc=0)
    got = {r["custom_id"]: r for r in records(tmp_path / "o.jsonl")}
    assert all(r["error"] is None for r in got.values())
    choice = got["c1"]["response"]["body"]["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 6 and all(len(t) == 2 for t in choice["logprobs"]["top_logprobs"])
    from flexsarathi import LLM, SamplingParams  # vLLM's extras as the API takes them

    asked = got["c4"]["response"]["body"]
    with LLM(stories_dir, dtype="float32") as llm:
        api = llm.generate("Once upon a time", SamplingParams(max_tokens=6, allowed_token_ids=[300, 301],
                                                              truncate_prompt_tokens=2, seed=0), use_tqdm=False)[0]
    assert asked["usage"]["prompt_tokens"] == len(api.prompt_token_ids) == 2
    assert set(api.token_ids) <= {300, 301} and asked["usage"]["completion_tokens"] == 6
