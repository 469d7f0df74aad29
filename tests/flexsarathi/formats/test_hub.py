"""Models named as on the Hugging Face Hub, resolved offline from a cache laid out as
huggingface_hub lays it out (models--org--name/blobs, snapshots/<commit>/ links, refs/main: its
own repo_folder_name and _create_symlink, and its scan_cache_dir / try_to_load_from_cache reading
it back). Reference: the same checkpoint or GGUF file opened by its local path."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.hub import HubName, resolve_model
from tests.conftest import REPO

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def add_repo(cache: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT) -> Path:
    """Put `files` ({name in the repo: local file}) into the cache as one commit of `repo_id`
    on branch main, as a download would; returns the snapshot folder."""
    from huggingface_hub.file_download import _create_symlink, repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(snapshot / name))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch, stories_dir):
    """An HF_HOME whose cache holds stories260K as `tiny-org/stories` (no network: offline)."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = home / "hub"
    files = {f.name: f for f in Path(stories_dir).iterdir() if f.suffix in (".json", ".safetensors")}
    snapshot = add_repo(cache, "tiny-org/stories", files)
    return cache, snapshot


def test_the_cache_is_one_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    cache, snapshot = hub
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == "tiny-org/stories" and {r.commit_hash for r in repo.revisions} == {COMMIT}
    assert try_to_load_from_cache("tiny-org/stories", "config.json", cache_dir=cache) == str(snapshot / "config.json")


def test_llm_by_repo_name_loads_the_cached_checkpoint_offline(hub, stories_dir):
    _, snapshot = hub
    assert resolve_model("tiny-org/stories") == str(snapshot)
    assert resolve_model(f"tiny-org/stories@{COMMIT}") == str(snapshot)
    prompts = ["Once upon a time", "Lily wanted to"]
    with LLM("tiny-org/stories", dtype="float32") as llm, LLM(stories_dir, dtype="float32") as local:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
               [o.token_ids for o in local.generate(prompts, GREEDY, use_tqdm=False)]


def test_a_missing_repo_or_revision_says_where_it_looked(hub):
    cache, _ = hub
    for name, shown in (("tiny-org/nothing", "tiny-org/nothing"), ("tiny-org/stories@v9", "at revision v9")):
        with pytest.raises(CheckpointError) as err:
            LLM(name)
        message = str(err.value)
        assert shown in message and str(cache) in message and "HF_HUB_OFFLINE=1" in message
        assert os.path.abspath(name) in message  # the local path it tried first
    assert resolve_model("dummy:opt-125m") == "dummy:opt-125m"


def test_names_parse_as_the_hub_spells_them():
    assert HubName.parse("Qwen/Qwen2.5-7B-Instruct") == HubName("Qwen/Qwen2.5-7B-Instruct")
    assert HubName.parse("org/m-GGUF@v1.0:Q4_K_M") == HubName("org/m-GGUF", "v1.0", "Q4_K_M")
    assert HubName.parse("org/name:q8_0") == HubName("org/name", None, "q8_0")
    assert HubName.parse("no-slash") is None and HubName.parse("a/b/c") is None


def test_a_gguf_in_a_repo_by_quantization_and_by_file(hub, tmp_path):
    from tests.gguf_files import build_model, write_gguf

    cache, _ = hub
    files = {}
    for quant in ("Q8_0", "F32"):
        path = tmp_path / f"tiny-{quant}.gguf"
        write_gguf(build_model("llama"), path, weight_type=quant)
        files[path.name] = path
    snapshot = add_repo(cache, "tiny-org/tiny-GGUF", files)
    assert resolve_model("tiny-org/tiny-GGUF:Q8_0") == str(snapshot / "tiny-Q8_0.gguf")
    assert resolve_model("tiny-org/tiny-GGUF:q8_0") == str(snapshot / "tiny-Q8_0.gguf")
    assert resolve_model("tiny-org/tiny-GGUF", gguf_file="tiny-F32.gguf") == str(snapshot / "tiny-F32.gguf")
    with pytest.raises(CheckpointError, match=r"no GGUF files for quantization Q4_K_M .*tiny-F32.gguf, tiny-Q8_0.gguf"):
        resolve_model("tiny-org/tiny-GGUF:Q4_K_M")
    prompt = [[3, 9, 27, 81, 5]]
    with LLM("tiny-org/tiny-GGUF:Q8_0", dtype="float32") as llm, LLM(str(files["tiny-Q8_0.gguf"]), dtype="float32") as local:
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == \
               local.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids


def test_cli_model_by_repo_name_offline(hub, tmp_path, stories_dir):
    cache, _ = hub
    src = tmp_path / "in.txt"
    src.write_text("Once upon a time\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    args = ["--input", str(src), "--temperature", "0", "--max-tokens", "6", "--dtype", "float32", "--quiet"]
    outputs = []
    for model in ("tiny-org/stories", stories_dir):
        out = tmp_path / f"{len(outputs)}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "flexsarathi", "generate", "--model", model, *args,
                               "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outputs.append(out.read_text().split('"text"')[1])
    assert outputs[0] == outputs[1]
    proc = subprocess.run([sys.executable, "-m", "flexsarathi", "generate", "--model", "tiny-org/absent", *args,
                           "--output", str(tmp_path / "x.jsonl")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and str(cache) in proc.stderr and "tiny-org/absent" in proc.stderr
    shutil.rmtree(cache)


def test_cli_gguf_in_a_repo_by_quantization_and_by_file_offline(hub, tmp_path):
    """`--model org/name:QUANT` and `--model org/name --gguf-file FILE` in `generate`: the tokens of
    the same GGUF file opened by its local path (in process)."""
    import json

    from tests.gguf_files import build_model, write_gguf

    cache, _ = hub
    files = {}
    for quant in ("Q8_0", "F32"):
        files[quant] = tmp_path / f"tiny-{quant}.gguf"
        write_gguf(build_model("llama"), files[quant], weight_type=quant)
    add_repo(cache, "tiny-org/tiny-GGUF", {path.name: path for path in files.values()})
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [3, 9, 27, 81, 5]}) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    args = ["--input", str(src), "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
            "--quiet"]
    for quant, model in (("Q8_0", ["tiny-org/tiny-GGUF:Q8_0"]), ("F32", ["tiny-org/tiny-GGUF", "--gguf-file",
                                                                         "tiny-F32.gguf"])):
        out = tmp_path / f"{quant}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "flexsarathi", "generate", "--model", *model, *args,
                               "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        with LLM(str(files[quant]), dtype="float32") as local:
            expected = local.generate([[3, 9, 27, 81, 5]], GREEDY, use_tqdm=False)[0].token_ids
        assert json.loads(out.read_text())["token_ids"] == expected


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from flexsarathi.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_policy_of_a_repo_reads_its_config_alone_and_plans_the_registered_shape(hub, tmp_path, capsys, monkeypatch):
    """`flexsarathi policy --model org/name` of a full-precision repo whose cache holds config.json
    alone: only its JSON files are asked of the hub (no weights: all a plan reads), and the policy
    and estimate are the registered shape's with that config, the repo's name in the plan; a
    registered name spelled as a repo (meta-llama/Llama-2-7b-hf) is not looked up; a pre-quantized
    repo is asked whole, and without its files it is one error saying why (its packed modules are
    read from the files)."""
    import json

    import huggingface_hub

    from flexsarathi.formats.hub import CHECKPOINT_PATTERNS, CONFIG_PATTERNS
    from policy_search.model_registry import known_config

    asked, download = [], huggingface_hub.snapshot_download

    def recorded(repo_id, **kwargs):  # the real download (offline: the cache), what was asked noted
        asked.append((repo_id, kwargs["allow_patterns"]))
        return download(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorded)
    cache, _ = hub
    config = tmp_path / "config.json"
    config.write_text(json.dumps(known_config("llama-2-7b")))
    add_repo(cache, "some-org/Llama-7B-like", {"config.json": config})
    search = ["--hardware", "t4", "--scheduler", "block", "--gpu-batch-size", "8", "--num-gpu-batches", "1",
              "--prompt-len", "256", "--gen-len", "16"]
    plans = {}
    for model in ("some-org/Llama-7B-like", "llama-2-7b", "meta-llama/Llama-2-7b-hf"):
        code, out, err = _cli(capsys, "policy", "--model", model, *search, "--json", str(tmp_path / "p.json"))
        assert code == 0, err
        plans[model] = (json.loads((tmp_path / "p.json").read_text()), out)
    (repo_plan, repo_out), (registered_plan, _), (alias_plan, _) = plans.values()
    assert [p.pop("model") for p in (repo_plan, registered_plan, alias_plan)] == [
        "some-org/Llama-7B-like", "llama-2-7b", "llama-2-7b-hf"]
    assert repo_plan == registered_plan == alias_plan and "some-org/Llama-7B-like" in repo_out
    assert asked == [("some-org/Llama-7B-like", CONFIG_PATTERNS)]
    quantized = {**known_config("llama-2-7b"), "quantization_config": {"quant_method": "gptq", "bits": 4}}
    config.write_text(json.dumps(quantized))
    add_repo(cache, "some-org/Llama-7B-GPTQ", {"config.json": config})
    code, _, err = _cli(capsys, "policy", "--model", "some-org/Llama-7B-GPTQ", *search)
    assert code == 2 and "names a quantization (gptq)" in err and ".safetensors" in err
    assert asked[1:] == [("some-org/Llama-7B-GPTQ", CONFIG_PATTERNS), ("some-org/Llama-7B-GPTQ", CHECKPOINT_PATTERNS)]


def test_perplexity_and_inspect_take_a_repo_name(hub, tmp_path, capsys, stories_dir):
    """The commands that read weights (perplexity, inspect) resolve a repo name as generate does:
    the local folder's figures."""
    import json

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She loved to play outside.\n")
    scores = []
    for model in ("tiny-org/stories", stories_dir):
        code, out, err = _cli(capsys, "perplexity", "--model", model, "--text", str(text), "--quiet",
                              "--dtype", "float32")
        assert code == 0, err
        scores.append({k: v for k, v in json.loads(out).items() if k != "model"})
    assert scores[0] == scores[1]
    shown = []
    for model in ("tiny-org/stories", stories_dir):
        code, out, err = _cli(capsys, "inspect", "--model", model)
        assert code == 0, err
        shown.append(out.replace(str(hub[1]), "MODEL").replace(str(stories_dir), "MODEL"))
    assert shown[0] == shown[1]
