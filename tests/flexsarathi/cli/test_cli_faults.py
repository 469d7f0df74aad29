"""Numbers that must never become a silent token: a NaN in a checkpoint's weights (refused at load,
naming the tensor), a weight beyond the compute dtype's range, and non-finite logits in a pass (that
request fails with an error record; the others are what an unpoisoned run gives)."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM, SamplingParams
from flexsarathi.errors import CheckpointError, FlexSarathiError
from policy_search import Policy
from tests.conftest import REPO
from tests.flexsarathi.cli.test_cli_generate import GREEDY, cli, records, write_lines

BROKEN = "model.layers.1.mlp.up_proj.weight"
POISONED_PROMPT = [1, 403, 407, 99]  # the request whose logits the injected fault makes NaN

# `python -c POISON_LOGITS ARGS...` runs `flexsarathi ARGS...` with the real engine, except that the
# logits of the request whose prompt is POISONED_PROMPT get a NaN when it samples its third token:
# a pass that overflowed, injected at a named point.
POISON_LOGITS = f"""
import sys, torch
from flexsarathi.engine.llm_engine import LLMEngine
from flexsarathi.cli.main import main
forward = LLMEngine.forward

def poisoned(self, plan):
    outputs = forward(self, plan)
    for item, logits in outputs:
        if item.seq.prompt_token_ids == {POISONED_PROMPT} and len(item.seq.output_token_ids) == 2:
            with torch.inference_mode():  # the logits are inference tensors
                logits[-1, 7] = float("nan")
    return outputs

LLMEngine.forward = poisoned
sys.exit(main(sys.argv[1:]))
"""


def broken_checkpoint(stories_dir, folder, name: str, value: float):
    """stories260K with one entry of tensor `name` set to `value`."""
    shutil.copytree(stories_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name][3, 5] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def test_a_nan_weight_is_one_error_naming_the_tensor(stories_dir, tmp_path):
    model = broken_checkpoint(stories_dir, tmp_path / "nan", BROKEN, math.nan)
    src = write_lines(tmp_path / "in.txt", ["Once upon a time"])
    out = tmp_path / "o.jsonl"
    proc = cli("generate", "--model", model, "--input", src, "--output", str(out), *GREEDY, check_rc=2)
    assert proc.stderr.splitlines() == [
        f"error: tensor {BROKEN} in {model}/model.safetensors has non-finite weights (1 NaN, 0 inf; the first at "
        "[3, 5]): the checkpoint is damaged; the engine would compute NaN logits from it"]
    assert not out.exists() or out.read_bytes() == b""  # no record written


def test_a_weight_beyond_the_dtype_is_one_error_saying_so(stories_dir, tmp_path):
    model = broken_checkpoint(stories_dir, tmp_path / "big", BROKEN, 1e6)  # finite in fp32, inf in fp16
    with pytest.raises(CheckpointError, match=rf"tensor {BROKEN} in .* has values beyond the range of float16 "
                                              r"\(0 NaN, 1 inf after the cast, the first at \[3, 5\]: 1000000.0\)"):
        LLM(model, dtype="float16")
    with LLM(model, dtype="float32") as llm:  # the same checkpoint in a dtype that holds it loads
        assert llm.engine.dtype == torch.float32


def _poisoned_generate(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", POISON_LOGITS, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_non_finite_logits_fail_only_their_request(stories_dir, tmp_path):
    lines = [{"id": "a", "prompt": "Once upon a time"}, {"id": "bad", "prompt_token_ids": POISONED_PROMPT},
             {"id": "c", "prompt_token_ids": [1, 403, 407]}]
    src = write_lines(tmp_path / "in.jsonl", lines)
    args = ["generate", "--model", stories_dir, "--input", src, *GREEDY]
    clean, poisoned = tmp_path / "clean.jsonl", tmp_path / "poisoned.jsonl"
    cli(*args, "--output", str(clean), check_rc=0)
    proc = _poisoned_generate([*args, "--output", str(poisoned)])
    assert proc.returncode == 1, proc.stderr
    got, ref = ({r["id"]: r for r in records(path)} for path in (poisoned, clean))
    assert got["a"] == ref["a"] and got["c"] == ref["c"]
    assert got["bad"] == {"id": "bad", "error": {"code": "generation_failed", "message": (
        "line 2: the model's logits for output token 3 are not finite (NaN or inf: the pass overflowed "
        "float32)")}, "request_fingerprint": ref["bad"]["request_fingerprint"]}
    assert len(ref["bad"]["token_ids"]) == 6  # the clean run did sample there


def test_non_finite_logits_in_the_api(stories_dir, monkeypatch):
    """LLM.generate: on_error="record" gives the request an error output; "raise" raises."""
    from flexsarathi.engine.llm_engine import LLMEngine

    prompts = [[1, 403, 407], POISONED_PROMPT]
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(stories_dir, dtype="float32") as llm:
        clean = llm.generate(prompts, params, use_tqdm=False)
        forward = LLMEngine.forward

        def poisoned(self, plan):
            outputs = forward(self, plan)
            for item, logits in outputs:
                if item.seq.prompt_token_ids == POISONED_PROMPT:
                    with torch.inference_mode():  # the logits are inference tensors
                        logits[-1, 0] = math.inf
            return outputs

        monkeypatch.setattr(LLMEngine, "forward", poisoned)
        first, bad = llm.generate(prompts, params, use_tqdm=False, on_error="record")
        assert first.token_ids == clean[0].token_ids and first.error is None
        assert bad.outputs == [] and "logits for output token 1 are not finite" in bad.error
        assert llm.last_stats["failed"] == 1
        with pytest.raises(FlexSarathiError, match="prompt 1: the model's logits for output token 1"):
            llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(LLMEngine, "forward", forward)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [
            o.token_ids for o in clean]  # the engine goes on as before
    assert len(clean[1].token_ids) == 4  # the clean run sampled the poisoned prompt


def test_a_damaged_offload_store_is_one_warning_line(stories_dir, tmp_path):
    """The store written by a first job is damaged (a torn write over its first shard); the next job
    finds it in its first pass, rebuilds it and says so in one line of its own above the progress
    bar (not a Python RuntimeWarning with a thread's file path), and writes the same records."""
    policy = tmp_path / "policy.json"
    Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0).save(str(policy))
    src = write_lines(tmp_path / "in.txt", ["Once upon a time", "Lily wanted to"])
    args = ["generate", "--model", stories_dir, "--input", src, "--policy", str(policy), "--offload-dir",
            str(tmp_path / "offload"), "--temperature", "0", "--max-tokens", "4", "--dtype", "float32"]
    cli(*args, "--output", str(tmp_path / "first.jsonl"), check_rc=0)
    (shard,) = (tmp_path / "offload").rglob("data-00000.bin")
    with open(shard, "r+b") as f:
        f.write(b"\xff" * 4096)
    proc = cli(*args, "--output", str(tmp_path / "second.jsonl"), check_rc=0)
    lines = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if "store" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "rebuilding the store" in lines[0], proc.stderr
    assert "Warning" not in proc.stderr and ".py:" not in proc.stderr
    assert records(tmp_path / "second.jsonl") == records(tmp_path / "first.jsonl")
