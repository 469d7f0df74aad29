"""Bad input on the command line: every case ends with exit code 2 and exactly one `error: ...` line
on stderr naming what is wrong, never a traceback. The cases run through `main()` in this process
(19 subprocesses would each pay torch's import: half a minute); two of them also as real
subprocesses, which must say exactly the same. The API says the same through FlexSarathiError."""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.errors import FlexSarathiError
from tests.conftest import REPO, STORIES, mounted_tmpfs

NOT_UTF8 = b"Once upon a time \xff\xfe there was"


def _cases(tmp: str) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, what the one error line must contain)."""
    text = f"{tmp}/not_utf8.txt"
    return {
        "demo zero prompts": (["demo", "--num-prompts", "0"], "--num-prompts: must be >= 1"),
        "demo non-integer": (["demo", "--max-tokens", "many"], "'many' is not an integer"),
        "demo cuda without CUDA": (["demo", "--device", "cuda"], "CUDA is not available"),
        "demo device gpu": (["demo", "--device", "gpu"], "device 'gpu'"),
        "demo unknown device": (["demo", "--device", "tpu:3"], "device 'tpu:3'"),
        "demo missing policy file": (["demo", "--policy", f"{tmp}/none.json"], "does not exist"),
        "demo unknown command": (["dmeo"], "invalid choice: 'dmeo'"),
        "policy json under a file": (["policy", "--model", "dummy:opt-125m", "--json", "/etc/passwd/x.json"],
                                     "/etc/passwd is not a folder"),
        "policy json is a folder": (["policy", "--model", "dummy:opt-125m", "--json", tmp], "is a folder"),
        "policy json missing folder": (["policy", "--model", "dummy:opt-125m", "--json", f"{tmp}/no/p.json"],
                                       "does not exist"),
        "policy gpu memory nan": (["policy", "--model", "dummy:opt-125m", "--gpu-mem", "nan"],
                                   "--gpu-mem: must be a finite number of GiB > 0, got nan"),
        "policy zero gpu memory": (["policy", "--model", "dummy:opt-125m", "--gpu-mem", "0"],
                                   "--gpu-mem: must be a finite number of GiB > 0, got 0"),
        "policy negative cpu memory": (["policy", "--model", "dummy:opt-125m", "--cpu-mem", "-1"],
                                       "--cpu-mem: must be a finite number of GiB >= 0, got -1"),
        "policy infinite disk": (["policy", "--model", "dummy:opt-125m", "--disk-mem", "inf"],
                                 "--disk-mem: must be a finite number of GiB >= 0, got inf"),
        "generate cpu memory not a number": (["generate", "--model", "dummy:opt-125m", "-i", text, "-o",
                                              f"{tmp}/out.jsonl", "--cpu-mem", "lots"],
                                             "--cpu-mem: 'lots' is not a number of GiB"),
        "policy zero prompt": (["policy", "--model", "dummy:opt-125m", "--prompt-len", "0"],
                               "prompt_len must be a positive integer"),
        "perplexity not utf-8": (["perplexity", "--model", str(STORIES), "--text", text],
                                 "is not UTF-8 text: byte 0xff at offset 17"),
        "perplexity missing text": (["perplexity", "--model", str(STORIES), "--text", f"{tmp}/none.txt"],
                                    "No such file"),
        "perplexity text is a folder": (["perplexity", "--model", str(STORIES), "--text", tmp],
                                        "Is a directory"),
        "perplexity zero stride": (["perplexity", "--model", str(STORIES), "--text", text, "--stride", "0"],
                                   "--stride: must be >= 1"),
        "profile output under a file": (["profile", "-o", "/etc/passwd/hw.json"], "/etc/passwd is not a folder"),
        "profile offload dir under a file": (["profile", "--offload-dir", "/etc/passwd/off"],
                                             "--offload-dir /etc/passwd/off cannot be created"),
        "profile bad dtype": (["profile", "--dtype", "int3", "-o", f"{tmp}/hw.json"], "unsupported dtype 'int3'"),
        "profile unknown model": (["profile", "--model", "opt-7", "-o", f"{tmp}/hw.json"], "unknown model 'opt-7'"),
        "profile bad device": (["profile", "--device", "gpu", "-o", f"{tmp}/hw.json"],
                               "device 'gpu' is not one FlexSarathi computes on"),
        "demo compress head of a tied model": (["demo", "--compress-head"], "compress_head: dummy:opt-125m has no "
                                               "LM head of its own"),
        "perplexity compress head of a tied model": (["perplexity", "--model", str(STORIES), "--text", f"{tmp}/ok.txt",
                                                     "--compress-head"], "has no LM head of its own"),
        "inspect a text file": (["inspect", "--model", text], f"model {text} is a file of {len(NOT_UTF8)} bytes, not "
                                "a checkpoint; a model is a checkpoint folder (config.json + safetensors), a "
                                ".gguf file or dummy:<name>"),
        "inspect missing model": (["inspect", "--model", f"{tmp}/none"], f"model {tmp}/none does not exist; a model "
                                  "is a checkpoint folder"),
        "perplexity utf-16 text": (["perplexity", "--model", str(STORIES), "--text", f"{tmp}/utf16.txt"],
                                   f"--text {tmp}/utf16.txt is not UTF-8 text: a NUL byte at offset 0 (UTF-16 text "
                                   "or a binary file?)"),
        "profile offload dir is a file": (["profile", "-o", f"{tmp}/hw.json", "--offload-dir", f"{tmp}/ok.txt"],
                                          f"--offload-dir {tmp}/ok.txt is a file, not a folder"),
        "profile disk test larger than the disk": (["profile", "-o", f"{tmp}/hw.json", "--offload-dir", f"{tmp}/off",
                                                    "--disk-mib", "100000000"],
                                                   f"the disk test writes 95.37 TiB in {tmp}/off (95.37 TiB asked for"),
        "inspect a folder named .gguf": (["inspect", "--model", f"{tmp}/folder.gguf"],
                                         f"model folder {tmp}/folder.gguf has no config.json"),
        "demo prompt length of the context": (["demo", "--prompt-len", "2048", "--num-prompts", "1"],
                                              "--prompt-len 2048 leaves no room to generate in the model's context "
                                              "of 2048 tokens"),
        "generate safetensors file": (["generate", "--model", f"{STORIES}/model.safetensors", "-i", "pkg:dummy_opt.jsonl", "-o",
                                       f"{tmp}/o.jsonl"], "is one safetensors file: give the folder that holds it"),
    }


@dataclass(frozen=True)
class Done:
    returncode: int
    stderr: str


def run_in_process(argv: list[str]) -> Done:
    """`flexsarathi ARGV` through main(), its stderr captured; a usage error's SystemExit is its exit."""
    from flexsarathi.cli.main import main  # noqa: PLC0415

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return Done(code, err.getvalue())


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every case run once, in this process; (the folder of its files, name -> (run, message))."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "not_utf8.txt").write_bytes(NOT_UTF8)
    (tmp / "ok.txt").write_text("Once upon a time there was a cat.")
    (tmp / "utf16.txt").write_bytes("Once upon a time".encode("utf-16-be"))  # no BOM: valid UTF-8, NUL bytes
    (tmp / "folder.gguf").mkdir()
    return tmp, {name: (run_in_process(argv), message) for name, (argv, message) in _cases(str(tmp)).items()}


@pytest.mark.parametrize("name", list(_cases("/tmp")))
def test_bad_input_is_one_error_line_and_exit_2(name, cli_runs):
    if "cuda" in name and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if str(STORIES) in " ".join(_cases("/tmp")[name][0]) and not STORIES.exists():
        pytest.skip(f"{STORIES} is absent: the shared stories260K checkpoint is needed")
    done, message = cli_runs[1][name]
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert message in lines[0]


@pytest.mark.parametrize("name", ["demo unknown command", "perplexity not utf-8"])
def test_a_real_subprocess_says_exactly_the_same(name, cli_runs):
    """`python -m flexsarathi` (its import, its entry point, its real stderr: a warning printed on
    import would be a second line) ends the same: a usage error and one found by the checks."""
    tmp, runs = cli_runs
    argv, _ = _cases(str(tmp))[name]
    proc = subprocess.run([sys.executable, "-m", "flexsarathi", *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert (proc.returncode, proc.stderr) == (runs[name][0].returncode, runs[name][0].stderr)


# ids avoid the bare word "gpu": conftest skips tests with that keyword on machines without CUDA
@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:3", "nonsense"],
                         ids=["named-gpu", "named-cuda", "cuda-3", "nonsense"])
def test_llm_rejects_devices_it_cannot_use(device):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(FlexSarathiError, match=f"device '{device}'"):
        LLM("dummy:opt-125m", device=device)


def test_outputs_on_a_read_only_filesystem_are_refused_before_any_work(tmp_path):
    """Root ignores permission bits, a read-only mount it cannot: the write check sees it."""
    with mounted_tmpfs(tmp_path / "ro", "size=64k,ro", "the read-only case needs one") as mount:
        for argv in (["policy", "--model", "opt-125m", "--json", f"{mount}/p.json"],
                     ["profile", "--output", f"{mount}/hw.json"]):
            run = subprocess.run([sys.executable, "-m", "flexsarathi", *argv], capture_output=True,
                                 text=True, cwd=REPO, timeout=300)
            assert run.returncode == 2 and run.stderr.splitlines() == [
                f"error: {argv[-2]} {argv[-1]} is not writable"], run.stderr
            assert "search" not in run.stdout and "profiling" not in run.stderr  # refused first


def _with_stdout_closed(argv: list[str]) -> tuple[int, str]:
    """`flexsarathi ARGV | head -0`: the reader of stdout is gone before the command prints."""
    proc = subprocess.Popen([sys.executable, "-m", "flexsarathi", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    proc.stdout.close()
    return proc.wait(timeout=300), proc.stderr.read()


def test_a_closed_stdout_is_not_an_error(tmp_path):
    """The policy JSON is written before the report is printed; a reader that stops early (`| head
    -1`) ends nothing early and prints no error, for `policy` and for a `generate` job."""
    out = tmp_path / "p.json"
    assert _with_stdout_closed(["policy", "--model", "opt-125m", "--json", str(out)]) == (0, "")
    assert json.loads(out.read_text())["policy"]["gpu_batch_size"] >= 1
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is absent: the generate half needs the shared stories260K checkpoint")
    prompts = tmp_path / "in.txt"
    prompts.write_text("Once upon a time\nLily wanted to\n")
    result = tmp_path / "o.jsonl"
    code, err = _with_stdout_closed(["generate", "--model", str(STORIES), "--input", str(prompts), "--output",
                                     str(result), "--max-tokens", "3"])
    assert code == 0 and "error" not in err, err
    assert sorted(json.loads(line)["id"] for line in result.read_text().splitlines()) == [1, 2]
