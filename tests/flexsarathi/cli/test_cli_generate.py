"""`flexsarathi generate` and `flexsarathi bench` end to end, as subprocesses, on stories260K and a
dummy model. References: the in-process `LLM.generate` API (itself tested against transformers)
and, for kills and torn lines, the uninterrupted run of the same command."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.cli import main as cli_main
from flexsarathi.cli.main import main
from flexsarathi.engine.llm_engine import LLMEngine
from flexsarathi.cli.generate import request_seed
from flexsarathi.cli.request_files import record_key_of
from policy_search import Policy
from tests.conftest import KILLED_AFTER_RECORDS, REPO, on_call

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# float32 on both sides: the CLI runs requests together that the references run alone (or under
# another policy), and bf16 CPU matmuls are batch-variant (a near-tie could flip a greedy token).
GREEDY = ["--temperature", "0", "--max-tokens", "6", "--dtype", "float32", "--quiet"]


def cli(*args: str, check_rc: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "flexsarathi", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout + proc.stderr
    return proc


def records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_lines(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    with LLM(stories_dir, dtype="float32") as llm:  # float32: see GREEDY
        yield llm


@pytest.fixture(scope="module")
def chat_dir(stories_dir, tmp_path_factory):
    """stories260K with a chat template added (it ships none)."""
    folder = tmp_path_factory.mktemp("chat") / "stories-chat"
    shutil.copytree(stories_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": CHAT_TEMPLATE}))
    return str(folder)


def greedy(llm, prompts, max_tokens=6):
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)


def test_text_input(stories_dir, stories_llm, tmp_path):
    prompts = ["Once upon a time", "Lily wanted to", "The little dog"]
    src = write_lines(tmp_path / "in.txt", [prompts[0], prompts[1], "   ", prompts[2]])
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "out.jsonl"), *GREEDY,
        check_rc=0)
    got = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    assert sorted(got) == [1, 2, 4]  # ids are line numbers; the blank line is skipped
    for line, ref in zip([1, 2, 4], greedy(stories_llm, prompts)):
        r = got[line]
        assert (r["text"], r["token_ids"], r["finish_reason"]) == (ref.text, ref.token_ids, ref.finish_reason)
        assert r["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 6,
                              "total_tokens": len(ref.prompt_token_ids) + 6,
                              "prompt_tokens_details": {"cached_tokens": ref.num_cached_tokens}}
        full = stories_llm.tokenizer.decode(ref.prompt_token_ids + r["token_ids"])
        assert r["prompt"] + r["text"] == full  # the leading space of the first word is kept


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(stories_dir, tinystories_text, tmp_path):
    """Two requests sharing their first ~80 tokens: the second's usage says how many of its prompt
    tokens came from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens), as the engine
    counts them for the same two prompts (RequestOutput.num_cached_tokens)."""
    system = tinystories_text.split("<|endoftext|>")[0].strip()[:300]
    prompts = [system + " Then the cat", system + " One day a bird"]
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "out.jsonl"), *GREEDY,
        check_rc=0)
    by_id = {r["id"]: r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records(tmp_path / "out.jsonl")}
    got = [by_id[i] for i in range(len(prompts))]
    with LLM(stories_dir, dtype="float32") as llm:  # a cache of its own (stories_llm's keeps earlier tests')
        refs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert got == [r.num_cached_tokens for r in refs] and got[0] == 0 and got[1] >= 64


def test_a_lines_cache_salt_shares_cached_blocks_with_its_own_salt_only(stories_dir, tinystories_text, tmp_path):
    """JSONL records and OpenAI Batch bodies take vLLM's cache_salt: of four requests sharing their start,
    run one at a time, the second (the first's salt) finds the first's blocks, the third (another salt)
    and the fourth (none) find none; a salt that is no string is that line's error record."""
    system = tinystories_text.split("<|endoftext|>")[0].strip()[:300]
    lines = [{"id": i, "prompt": f"{system} {name} went home.", **({"cache_salt": salt} if salt else {})}
             for i, (name, salt) in enumerate([("Tom", "t1"), ("Sue", "t1"), ("Max", "t2"), ("Ann", None)])]
    lines.append({"id": 4, "prompt": "Lily", "cache_salt": 5})
    policy = tmp_path / "one.json"
    Policy(gpu_batch_size=1, prefill_budget=64).save(str(policy))
    assert main(["generate", "--model", stories_dir, "--input", write_lines(tmp_path / "in.jsonl", lines),
                 "--output", str(tmp_path / "out.jsonl"), "--policy", str(policy), *GREEDY]) == 1  # one bad line
    got = {r["id"]: r for r in records(tmp_path / "out.jsonl")}
    cached = [got[i]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in range(4)]
    assert cached[0] == cached[2] == cached[3] == 0 and cached[1] >= 64
    assert "cache_salt must be a non-empty string" in got[4]["error"]["message"]
    batch = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": lines[0]["prompt"], "max_tokens": 2, "cache_salt": ""}}]
    assert main(["generate", "--model", stories_dir, "--input", write_lines(tmp_path / "b.jsonl", batch),
                 "--output", str(tmp_path / "b_out.jsonl"), *GREEDY]) == 1
    assert "body.cache_salt must be a non-empty string" in str(records(tmp_path / "b_out.jsonl")[0]["error"])


def test_jsonl_bad_lines_become_error_records(stories_dir, stories_llm, tmp_path):
    good = [{"id": "a", "prompt": "Once upon a time"},
            {"id": 7, "prompt_token_ids": [1, 403, 407], "max_tokens": 3},
            {"id": "s", "prompt": "Lily wanted to", "stop": [" a"], "max_tokens": 12}]
    bad = [{"id": "chat", "messages": [{"role": "user", "content": "hi"}]},  # no chat template
           "{not json", {"id": "none"}, {"id": "long", "prompt_token_ids": [5] * 600},
           {"id": "temp", "prompt": "x", "temperature": -1}, {"id": "typo", "prompt": "x", "max_token": 3},
           {"id": "sur", "prompt": "bad \ud800"},  # a lone surrogate, as JSON can carry one
           {"id": "lp", "prompt": "x", "logprobs": 21}]  # over --max-logprobs (default 20)
    src = write_lines(tmp_path / "in.jsonl", good + bad)
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), *GREEDY,
        check_rc=1)
    got = {r.get("id", r.get("line")): r for r in records(tmp_path / "o.jsonl")}
    assert len(got) == 11
    ref_a, = greedy(stories_llm, ["Once upon a time"])
    ref_7, = greedy(stories_llm, [[1, 403, 407]], max_tokens=3)
    assert got["a"]["token_ids"] == ref_a.token_ids and got["a"]["text"] == ref_a.text
    assert got[7]["token_ids"] == ref_7.token_ids and got[7]["prompt_token_ids"] == [1, 403, 407]
    free, = greedy(stories_llm, ["Lily wanted to"], max_tokens=12)
    assert " a" in free.text and got["s"]["text"] == free.text[:free.text.index(" a")]
    assert got["s"]["finish_reason"] == "stop"
    messages = {"chat": "no chat template", 5: "line 5 is not valid JSON", "none": "needs exactly one of",
                "long": "600 tokens, more than the model's context of 512",
                "temp": "temperature must be a finite number", "typo": "unknown field(s) ['max_token']",
                "sur": "line 10: the text is not valid Unicode (surrogates not allowed at character 4)",
                "lp": "line 11: SamplingParams.logprobs=21 asks for 21 alternatives per token, more than this "
                      "engine's max_logprobs=20 (LLM(max_logprobs=...), --max-logprobs; -1: no limit)"}
    for key, text in messages.items():
        assert text in got[key]["error"]["message"], got[key]
    assert got[5] == {"line": 5, "error": got[5]["error"], "request_fingerprint": got[5]["request_fingerprint"]}


def test_openai_batch_with_chat(chat_dir, tmp_path):
    lines = [{"custom_id": "c1", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}},
             {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "A story"}], "max_tokens": 5,
                       "temperature": 0, "logprobs": True, "top_logprobs": 2}},
             {"custom_id": "c3", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
             {"custom_id": "c4", "method": "POST", "url": "/v1/completions"}]
    src = write_lines(tmp_path / "batch.jsonl", lines)
    cli("generate", "--model", chat_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), "--quiet",
        "--dtype", "float32", check_rc=1)
    got = {r["custom_id"]: r for r in records(tmp_path / "o.jsonl")}
    with LLM(chat_dir, dtype="float32") as llm:  # float32: see GREEDY
        chat_ids = llm.tokenizer.apply_chat_template(lines[1]["body"]["messages"])
        ref1, ref2 = llm.generate(["Once upon a time", chat_ids], SamplingParams(max_tokens=5, temperature=0),
                                  use_tqdm=False)
    body1, body2 = got["c1"]["response"]["body"], got["c2"]["response"]["body"]
    assert got["c1"]["error"] is None and got["c1"]["response"]["status_code"] == 200
    assert body1["object"] == "text_completion" and body1["choices"][0]["text"] == ref1.text
    assert body2["object"] == "chat.completion"
    assert body2["choices"][0]["message"] == {"role": "assistant", "content": ref2.text}
    assert body2["usage"] == {"prompt_tokens": len(chat_ids), "completion_tokens": 5, "total_tokens": len(chat_ids) + 5,
                              "prompt_tokens_details": {"cached_tokens": ref2.num_cached_tokens}}
    content = body2["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(step["top_logprobs"]) == 2 for step in content)
    assert "".join(step["token"] for step in content) == ref2.text  # each token as it reads in place
    assert all(bytes(step["bytes"]).decode() == step["token"] for step in content)
    for cid, text in (("c3", "url must be"), ("c4", '"body" must be an object')):
        assert got[cid]["response"] is None and text in got[cid]["error"]["message"]


def _policy_file(tmp_path, **fields) -> str:
    path = str(tmp_path / "policy.json")
    Policy(**fields).save(path)
    return path


def test_kill_and_resume_equals_an_uninterrupted_run(stories_dir, tmp_path):
    """SIGKILL partway (seeded sampling, so results are comparable), rerun, and a torn last line."""
    prompts = [f"Once upon a time, number {i}" for i in range(24)]
    src = write_lines(tmp_path / "in.txt", prompts)
    args = ["generate", "--model", stories_dir, "--input", src, "--policy",
            _policy_file(tmp_path, gpu_batch_size=2), "--max-tokens", "8", "--ignore-eos",
            "--dtype", "float32", "--quiet"]  # the resumed rest runs in other batches: bf16 is batch-variant
    full = tmp_path / "full.jsonl"
    cli(*args, "--output", str(full), check_rc=0)
    reference = {r["id"]: r for r in records(full)}
    assert len(reference) == 24

    killed = tmp_path / "killed.jsonl"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_RECORDS, "4", *args, "--output", str(killed)],
                          cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    partial = killed.read_bytes().count(b"\n")
    assert 4 <= partial < 24, "the run was not killed partway"
    cli(*args, "--output", str(killed), check_rc=0)
    resumed = records(killed)
    assert len(resumed) == 24 and {r["id"]: r for r in resumed} == reference  # no duplicate, none lost

    data = full.read_bytes()  # a torn last line (and a complete one before it) is redone
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(data[:-9])
    shutil.copy(str(full) + ".meta.json", str(torn) + ".meta.json")
    proc = cli(*args[:-1], "--output", str(torn), check_rc=0)
    assert "torn last line" in proc.stdout and "23 already in" in proc.stdout
    assert sorted(map(json.dumps, records(torn))) == sorted(map(json.dumps, records(full)))


def test_ctrl_c_exits_130_and_the_rerun_equals_an_uninterrupted_run(stories_dir, tmp_path, capsys, python_sigint):
    """SIGINT (real, Python's own handler) while the parser is built and in a job's 12th pass: one
    `error: interrupted` line, exit 130 (the first used to escape as a traceback); the second is taken
    at a layer boundary, and the rerun resumes to the uninterrupted run's records."""
    prompts = [f"Once upon a time, number {i}" for i in range(6)]
    src = write_lines(tmp_path / "in.txt", prompts)
    args = ["generate", "--model", stories_dir, "--input", src, "--policy", _policy_file(tmp_path, gpu_batch_size=2),
            "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--quiet"]
    full, cut = str(tmp_path / "full.jsonl"), str(tmp_path / "cut.jsonl")
    assert main([*args, "--output", full]) == 0
    ctrl_c = lambda: signal.raise_signal(signal.SIGINT)  # noqa: E731
    with on_call(cli_main, "build_parser", 1, ctrl_c):
        assert main([*args, "--output", cut]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    with on_call(LLMEngine, "forward", 12, ctrl_c):  # inside the 12th step: after the first two prompts
        assert main([*args, "--output", cut]) == 130
    assert "interrupted: finished records are in" in capsys.readouterr().err
    assert 0 < len(records(cut)) < 6, "the job was not interrupted partway"
    assert main([*args, "--output", cut]) == 0
    assert sorted(map(json.dumps, records(cut))) == sorted(map(json.dumps, records(full)))


def test_mismatch_duplicates_and_bad_jobs_exit_2(stories_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "in.txt", ["Once upon a time"])
    out = str(tmp_path / "o.jsonl")
    base = ["generate", "--model", stories_dir, "--input", src, "--output", out, "--quiet", "--max-tokens", "2"]
    assert main(base) == 0 and main(base) == 0 and len(records(out)) == 1  # rerun: nothing to redo
    capsys.readouterr()
    assert main(base + ["--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output") and "temperature" in err and "--overwrite" in err
    assert main(base + ["--temperature", "0.5", "--overwrite"]) == 0 and len(records(out)) == 1
    dup = write_lines(tmp_path / "dup.jsonl", [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"},
                                                {"id": "x", "prompt": "c"}])
    assert main(["generate", "--model", stories_dir, "--input", dup, "--output", str(tmp_path / "d.jsonl")]) == 2
    assert "duplicate id 'x' on lines 1 and 3" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl").exists()  # refused before any work
    options = {"--model": stories_dir, "--input": src, "--output": out}
    for flag, value in (("--model", str(tmp_path / "nope")), ("--input", str(tmp_path / "missing.txt")),
                        ("--gpu-mem", "4"), ("--policy", str(tmp_path / "no_policy.json"))):
        argv = ["generate", *[x for kv in (options | {flag: value}).items() for x in kv], "--quiet", "--overwrite"]
        assert main(argv) == 2, flag
        assert capsys.readouterr().err.startswith("error: ")
    argv = ["generate", *[x for kv in options.items() for x in kv], "--max-logprobs", "-2", "--overwrite"]
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, its error line first
        main(argv)
    assert exited.value.code == 2
    assert "argument --max-logprobs: must be an integer >= -1 (-1: no limit), got '-2'" in capsys.readouterr().err


def test_seeds_follow_the_request_id():
    assert request_seed(0, record_key_of("a", 1)) == request_seed(0, record_key_of("a", 9))
    assert request_seed(0, record_key_of("a", 1)) != request_seed(1, record_key_of("a", 1))
    assert request_seed(0, record_key_of("a", 1)) != request_seed(0, record_key_of("b", 1))


DUMMY = "dummy:opt-125m-2l"  # two of its layers: the store a disk policy writes is 54 MiB, not 324


def test_policy_auto_with_a_prompt_beyond_the_context(stories_dir, stories_llm, tmp_path):
    """--policy auto plans for the requests the engine will run: a prompt longer than the context is
    that line's error record (it used to fail the policy search for the whole job), and an output
    that would run past the context is planned as the engine cuts it."""
    near = [1] + [403] * 505  # 506 + 12 > 512: the engine stops at the context
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Once upon a time"},
                                              {"id": "long", "prompt_token_ids": [5] * 600},
                                              {"id": "near", "prompt_token_ids": near, "max_tokens": 12}])
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"),
        "--policy", "auto", "--hardware", "t4", *GREEDY, check_rc=1)
    got = {r["id"]: r for r in records(tmp_path / "o.jsonl")}
    assert "600 tokens, more than the model's context of 512" in got["long"]["error"]["message"]
    ref_a, = greedy(stories_llm, ["Once upon a time"])
    ref_near, = greedy(stories_llm, [near], max_tokens=12)
    assert got["a"]["token_ids"] == ref_a.token_ids
    assert got["near"]["token_ids"] == ref_near.token_ids and len(ref_near.token_ids) == 512 - 506


def test_dummy_model_with_weights_on_disk(tmp_path):
    """Token-id prompts on a dummy model with half its weights on disk, against the all-on-device
    API; a text prompt (no tokenizer) is an error record."""
    ids = [[2, 100, 200, 300], [2, 5, 6, 7, 8, 9], [2, 42]]
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": p} for i, p in enumerate(ids)]
                      + [{"id": "text", "prompt": "hello"}])
    policy = _policy_file(tmp_path, w_gpu=0.5, w_cpu=0.0, w_disk=0.5, kv_gpu=0.0, kv_cpu=1.0, cpu_attention=True)
    cli("generate", "--model", DUMMY, "--input", src, "--output", str(tmp_path / "o.jsonl"), "--policy", policy,
        "--offload-dir", str(tmp_path / "offload"), "--ignore-eos", *GREEDY, check_rc=1)
    got = {r["id"]: r for r in records(tmp_path / "o.jsonl")}
    assert "no tokenizer.json" in got["text"]["error"]["message"]
    with LLM(DUMMY, dtype="float32") as llm:  # float32: see GREEDY
        refs = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [got[i]["token_ids"] for i in range(3)] == [r.token_ids for r in refs]


def test_bench_prints_consistent_json():
    proc = cli("bench", "--model", DUMMY, "--prompt-len", "8", "--gen-len", "3", "--num-prompts", "2", check_rc=0)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["generated_tokens"] == 2 * 3 and result["prompt_tokens"] == 2 * 8
    assert result["throughput_tok_s"] == pytest.approx(result["generated_tokens"] / result["seconds"])
    assert result["total_tok_s"] == pytest.approx((6 + 16) / result["seconds"])
    assert result["passes"] >= 3 and result["device"].startswith(("cpu", "cuda"))
    assert set(result["peak_bytes"]) == {"gpu", "cpu", "disk"} and result["peak_bytes"]["gpu"] > 0
    table = dict(line.split(None, 1) if " " in line else (line, "") for line in proc.stdout.splitlines()[:-1]
                 if line.startswith(("throughput ", "passes ")))
    # the table above the JSON line reports the same run: its figures as the JSON gives them
    assert table == {"throughput": f"{result['throughput_tok_s']:.3f} generated tok/s",
                     "passes": str(result["passes"])}


def test_bench_warms_the_decode_path_up_before_the_clock(monkeypatch, capsys):
    """The warm-up run makes a decode pass as well as a prompt pass: the decode path's GPU kernels
    (Triton's, compiled on first use) are compiled before the measured run, not inside it."""
    from flexsarathi import llm as llm_module

    passes, generate = [], llm_module.LLM.generate

    def counted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        passes.append(self.last_stats["passes"])
        return out

    monkeypatch.setattr(llm_module.LLM, "generate", counted)
    assert main(["bench", "--model", DUMMY, "--prompt-len", "8", "--gen-len", "3", "--num-prompts", "2"]) == 0
    assert passes == [2, 3]  # warm-up: the prompts' pass and one decode pass; then the measured run's
    capsys.readouterr()


def test_inspect_names_the_dtype_generate_runs_in(stories_dir, tmp_path, capsys):
    """The reference is generate's own record of the dtype it ran in on this machine (its meta.json)."""
    src = write_lines(tmp_path / "in.txt", ["Once upon a time"])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), "--max-tokens", "1",
                 "--quiet"]) == 0
    ran = json.loads((tmp_path / "o.jsonl.meta.json").read_text())["dtype"]
    capsys.readouterr()
    assert main(["inspect", "--model", stories_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    kinds = [line for line in lines if line.startswith("  ") and "[" in line]
    assert len(kinds) == 4 and all(f": float32 -> {ran} (" in line for line in kinds), lines
    assert lines[-2].endswith(f"({ran})")  # the engine stores line


def test_max_logprobs_lifts_the_cap(stories_dir, tmp_path):
    """--max-logprobs N: a line may ask up to N alternatives per token (-1: the whole vocabulary)."""
    src = write_lines(tmp_path / "in.jsonl", [{"id": "lp", "prompt": "Once", "logprobs": -1, "max_tokens": 2}])
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), *GREEDY,
        "--max-logprobs", "-1", check_rc=0)
    record, = records(tmp_path / "o.jsonl")
    assert [len(step) for step in record["logprobs"]] == [512, 512]  # stories260K's vocabulary


def test_openai_logprobs_read_as_the_text(stories_dir, stories_llm, tmp_path):
    """Each token's string is the text it adds in its place (decoding the whole sequence, prefix
    by prefix, is the reference), so the tokens join into the choice's text; text_offset counts
    from the start of the prompt, the first at its length, as OpenAI gives it without echo."""
    prompt = "Once upon a time"
    src = write_lines(tmp_path / "in.jsonl", [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                               "body": {"prompt": prompt, "max_tokens": 8, "logprobs": 2}}])
    cli("generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), *GREEDY,
        check_rc=0)
    choice = records(tmp_path / "o.jsonl")[0]["response"]["body"]["choices"][0]
    ref, = stories_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False)
    tok = stories_llm.tokenizer
    ids = ref.prompt_token_ids + ref.token_ids
    start = len(ref.prompt_token_ids)
    added = [tok.decode(ids[:start + i + 1])[len(tok.decode(ids[:start + i])):] for i in range(8)]
    lp = choice["logprobs"]
    assert lp["tokens"] == added and "".join(added) == choice["text"] == ref.text
    assert any(t.startswith(" ") for t in added)  # the words' leading spaces, as in the text
    assert lp["text_offset"] == [len(prompt) + len("".join(added[:i])) for i in range(8)]
    assert lp["token_logprobs"] == pytest.approx([step[t].logprob for step, t in zip(ref.outputs[0].logprobs,
                                                                                   ref.token_ids)])
    for i, (step, alternatives) in enumerate(zip(ref.outputs[0].logprobs, lp["top_logprobs"])):
        best = sorted(((a, v.logprob) for a, v in step.items()), key=lambda kv: -kv[1])[:2]
        context = tok.decode(ids[:start + i])
        assert alternatives == pytest.approx({tok.decode(ids[:start + i] + [a])[len(context):]: v for a, v in best})


def test_demo_honours_its_prompt_flags(stories_dir, capsys):
    """On a model with a tokenizer: --num-prompts text prompts; --prompt-len random token prompts
    of that length (one longer than the context is one error line)."""
    assert main(["demo", "--model", stories_dir, "--num-prompts", "6", "--max-tokens", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("]")[0] for ln in lines if ln.startswith("[")] == [f"[{i}" for i in range(6)]
    assert main(["demo", "--model", stories_dir, "--num-prompts", "2", "--prompt-len", "20", "--max-tokens", "2"]) == 0
    shown = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    assert len(shown) == 2 and all(" prompt 20 tokens -> " in ln for ln in shown)
    assert main(["demo", "--model", stories_dir, "--num-prompts", "2", "--prompt-len", "600"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --prompt-len 600 leaves no room to generate in the model's context of 512 tokens"]


def test_chat_options_in_jsonl_and_openai_lines_render_as_llm_chat(chat_dir, tmp_path):
    """vLLM's chat options on a line (a JSONL record with messages; an OpenAI chat body):
    add_generation_prompt, continue_final_message, chat_template_kwargs: the tokens LLM.chat gives
    with the same options; on a prompt record, the line's error."""
    reply = [{"role": "user", "content": "A story"}, {"role": "assistant", "content": "Once upon a"}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    lines = [{"id": "j", "messages": reply, **options, "max_tokens": 5, "temperature": 0},
             {"id": "p", "prompt": "Once", "add_generation_prompt": False}]
    body = {"model": "m", "messages": reply, **options, "max_tokens": 5, "temperature": 0}
    jsonl, openai = write_lines(tmp_path / "in.jsonl", lines), write_lines(tmp_path / "in_openai.jsonl", [
        {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": body}])
    for src, out in ((jsonl, "j.jsonl"), (openai, "o.jsonl")):
        cli("generate", "--model", chat_dir, "--input", src, "--output", str(tmp_path / out), "--quiet",
            "--dtype", "float32", check_rc=1 if src == jsonl else 0)
    got = {r.get("custom_id", r.get("id")): r for f in ("j.jsonl", "o.jsonl") for r in records(tmp_path / f)}
    with LLM(chat_dir, dtype="float32") as llm:  # float32: see GREEDY
        ref = llm.chat(reply, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"x": 1})[0]
    assert got["j"]["token_ids"] == ref.token_ids and got["j"]["prompt_token_ids"] == ref.prompt_token_ids
    assert got["o"]["response"]["body"]["choices"][0]["message"]["content"] == ref.text
    assert 'add_generation_prompt apply to "messages" only' in got["p"]["error"]["message"]


def test_a_job_run_in_chunks_writes_the_records_of_one_run(stories_dir, tmp_path, monkeypatch, capsys):
    """A job is tokenized and run CHUNK_SEQUENCES sequences at a time on one engine (a job of millions
    of prompts holds one chunk's token ids and sequences): chunks of 3 give the records of the
    whole job at once, bad lines' error records included, sampled with the same seeds; the summary
    counts every chunk."""
    import flexsarathi.cli.generate as generate

    lines = [{"id": i, "prompt": f"Once upon a time, number {i}", "temperature": 0.8} for i in range(8)]
    lines[4] = {"id": 4, "prompt": ""}
    src = write_lines(tmp_path / "in.jsonl", lines)
    argv = ["generate", "--model", stories_dir, "--input", src, "--max-tokens", "5", "--dtype", "float32"]
    assert main([*argv, "--output", str(tmp_path / "whole.jsonl"), "--quiet"]) == 1
    monkeypatch.setattr(generate, "CHUNK_SEQUENCES", 3)
    capsys.readouterr()
    assert main([*argv, "--output", str(tmp_path / "chunks.jsonl")]) == 1
    said = capsys.readouterr()
    text = said.out + said.err
    assert "requests 1-3 of 8" in text and "requests 7-8 of 8" in text
    assert "done: 7 ok, 1 failed" in text and "35 generated" in text  # 7 x 5 tokens, every chunk counted
    assert text.count("policy: ") == 2  # the engine's, once (and the summary's)
    whole, chunks = ({r["id"]: r for r in records(tmp_path / name)} for name in ("whole.jsonl", "chunks.jsonl"))
    assert chunks == whole


def test_request_chunks_weigh_each_request_by_its_sequences(tmp_path):
    """A chunk holds requests whose sequences (n, an embedding line's inputs) add up to the limit; a
    request larger than the limit is a chunk of its own; the order is kept."""
    from flexsarathi.cli.generate import request_chunks
    from flexsarathi.cli.request_files import read_requests

    lines = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x", "n": 3}, {"id": "c", "prompt": "x", "n": 2},
             {"id": "d", "prompt": "x", "n": 9}, {"id": "e", "prompt": "x", "n": "bad"}, {"id": "f", "prompt": "x"}]
    _, requests = read_requests(write_lines(tmp_path / "in.jsonl", lines))
    assert [[r.id for r in chunk] for chunk in request_chunks(requests, 4)] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    embed = [{"custom_id": f"{k}", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["x"] * k}}
             for k in (2, 3, 1)]
    _, requests = read_requests(write_lines(tmp_path / "embed.jsonl", embed))
    assert [[r.id for r in chunk] for chunk in request_chunks(requests, 4)] == [["2"], ["3", "1"]]


def test_prefix_caching_is_on_by_default_and_its_flag_turns_it_off(stories_dir, tinystories_text, tmp_path, capsys):
    """A job whose prompts share their start: the summary says how many tokens were found cached
    (one request at a time, so each finds the ones before), and the records equal those of the
    run without the cache."""
    system = tinystories_text.split("<|endoftext|>")[0][:300]
    lines = [{"id": str(i), "prompt": f"{system} {name} went to the park."}
             for i, name in enumerate(["Tom", "Sue", "Max"])]
    job = write_lines(tmp_path / "in.jsonl", lines)
    policy = tmp_path / "one.json"
    Policy(gpu_batch_size=1, prefill_budget=64).save(str(policy))
    args = ["generate", "--model", stories_dir, "--input", job, "--policy", str(policy),
            "--temperature", "0", "--max-tokens", "6", "--dtype", "float32"]
    capsys.readouterr()
    assert main([*args, "--output", str(tmp_path / "on.jsonl")]) == 0
    assert "prefix cache: " in capsys.readouterr().out  # the summary's line
    assert main([*args, "--output", str(tmp_path / "off.jsonl"), "--no-enable-prefix-caching"]) == 0
    assert "prefix cache: " not in capsys.readouterr().out
    on, off = records(tmp_path / "on.jsonl"), records(tmp_path / "off.jsonl")
    cached = [r["usage"].pop("prompt_tokens_details")["cached_tokens"] for r in on]
    assert [r["usage"].pop("prompt_tokens_details")["cached_tokens"] for r in off] == [0, 0, 0] and min(cached[1:]) > 0
    assert on == off  # but for what the cache held, the same records
