"""`flexsarathi generate --ray` and `flexsarathi.ray.build_processor` on a local Ray instance with
2 CPU actors. Reference: the single-process run of the same command (itself tested against the
in-process API and transformers), record for record after sorting by id, error records included;
for kills, the uninterrupted single-process run. One Ray instance serves the module (the CLI
subprocesses join it with --ray-address); one test lets the CLI start its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flexsarathi.cli.main import main
from policy_search import Policy
from tests.conftest import KILLED_AFTER_RECORDS, REPO

try:
    import ray
except ImportError:  # make test installs the [ray] extra; a bare checkout skips these tests
    ray = None


def needs_ray(test):
    """Marked `ray`; skipped, saying why, where Ray Data is not installed."""
    skip = pytest.mark.skipif(ray is None, reason="Ray Data is not installed: pip install -e '.[ray]' "
                                                  "(make test installs it)")
    return pytest.mark.ray(skip(test))


# RAY_AUTH_MODE=token: the CLI joins the module's instance as a client of a cluster started with
# Ray's token authentication (its token is in ~/.ray/auth_token), as on a real cluster.
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), RAY_AUTH_MODE="token")
# float32: these tests compare records across unlike batchings (an actor's batches, a resumed
# rest) with the single-process run; bf16 CPU matmuls are batch-variant (a row can round
# differently beside other rows), so a near-tie could flip a greedy token there.
GREEDY = ["--temperature", "0", "--quiet", "--dtype", "float32"]


@pytest.fixture(scope="module")
def cluster():
    """The address of one small local Ray instance shared by this module's tests. 4 logical CPUs
    on 2 cores: the 2 one-CPU actors, and room for the user pipeline's own map and filter tasks
    (with every CPU held by an actor those would wait forever)."""
    if ray is None:
        pytest.skip("Ray Data is not installed: pip install -e '.[ray]' (make test installs it)")
    ray.init(address="local", num_cpus=4, object_store_memory=256 << 20, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexsarathi", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)


def write_lines(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def sorted_records(path) -> list[str]:
    """The file's records, sorted by id (or line), each as canonical JSON."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    records.sort(key=lambda r: json.dumps(r.get("id", r.get("line"))))
    return [json.dumps(r, sort_keys=True) for r in records]


def assert_same_records(got: list[str], expected: list[str]) -> None:
    """Equal record for record, except that log-probabilities agree to float32 rounding: an actor's
    batches are not the single process's, and batched matmuls round in another order."""
    assert len(got) == len(expected)
    for mine, theirs in zip(map(json.loads, got), map(json.loads, expected)):
        mine_lp, theirs_lp = mine.pop("logprobs", None), theirs.pop("logprobs", None)
        assert mine == theirs
        assert (mine_lp is None) == (theirs_lp is None)
        for step, ref in zip(mine_lp or [], theirs_lp or []):
            assert step.keys() == ref.keys() and all(step[t] == pytest.approx(ref[t], abs=1e-4) for t in ref)


def single_process(argv: list[str], rc: int) -> None:
    assert main(argv) == rc


def test_engine_without_ray_never_imports_it(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": 0, "prompt_token_ids": [2, 5, 6]}])
    code = ("import sys; from flexsarathi.cli.main import main; "
            f"rc = main(['generate', '--model', 'dummy:opt-125m', '--input', {src!r}, '--output', "
            f"{str(tmp_path / 'o.jsonl')!r}, '--max-tokens', '2', '--quiet']); "
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'pyarrow', 'pandas')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.split() == ["0", "[]"], proc.stdout + proc.stderr


def test_ray_flags_are_checked_before_any_work(stories_dir, tmp_path, capsys):
    src = write_lines(tmp_path / "in.txt", ["Once upon a time"])
    base = ["generate", "--model", stories_dir, "--input", src, "--output", str(tmp_path / "o.jsonl"), "--quiet"]
    for extra, message in ((["--ray-actors", "2"], "--ray-actors need(s) --ray"),
                           (["--ray", "--ray-actors", "0"], "--ray-actors must be >= 1"),
                           (["--ray", "--ray-batch-size", "0"], "--ray-batch-size must be >= 1"),
                           (["--ray", "--ray-cpus-per-actor", "0"], "--ray-cpus-per-actor must be a positive")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_ray_not_installed_is_one_clear_error(stories_dir, tmp_path):
    """Ray made unimportable in the subprocess (as in a checkout without the [ray] extra)."""
    src = write_lines(tmp_path / "in.txt", ["Once upon a time"])
    code = ("import sys; sys.modules['ray'] = None; from flexsarathi.cli.main import main; "
            f"sys.exit(main(['generate', '--model', {stories_dir!r}, '--input', {src!r}, '--output', "
            f"{str(tmp_path / 'o.jsonl')!r}, '--quiet', '--ray']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: flexsarathi.ray needs Ray Data") and "pip install" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()  # refused before any work


@needs_ray
def test_ray_output_equals_single_process(stories_dir, cluster, tmp_path):
    """stories260K, 2 actors, batches of 3: every record equal to the single-process run's,
    the error records (written by the driver, or refused by an actor's engine) included."""
    good = [{"id": f"p{i}", "prompt": f"Once upon a time, number {i}"} for i in range(9)]
    good += [{"id": 7, "prompt_token_ids": [1, 403, 407], "max_tokens": 3},
             {"id": "stop", "prompt": "Lily wanted to", "stop": [" a"], "max_tokens": 12},
             {"id": "lp", "prompt": "The dog", "logprobs": 2}]
    bad = ["{not json", {"id": "none"}, {"id": "long", "prompt_token_ids": [5] * 600},
           {"id": "typo", "prompt": "x", "max_token": 3}, {"id": "big", "prompt_token_ids": [99999]}]
    src = write_lines(tmp_path / "in.jsonl", good + bad)
    args = ["generate", "--model", stories_dir, "--input", src, "--max-tokens", "8", "--temperature", "0",
            "--dtype", "float32"]  # see GREEDY
    single_process(args + ["--output", str(tmp_path / "single.jsonl"), "--quiet"], rc=1)
    proc = cli(*args, "--output", str(tmp_path / "ray.jsonl"), "--ray", "--ray-address", cluster,
               "--ray-actors", "2", "--ray-batch-size", "3")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    expected = sorted_records(tmp_path / "single.jsonl")
    assert len(expected) == len(good) + len(bad)
    assert sum('"error": {' in r for r in expected) == len(bad)
    assert_same_records(sorted_records(tmp_path / "ray.jsonl"), expected)
    # The summary lines of a single-process run, plus where the batches ran.
    # both actors started; how the batches spread over them is Ray's (one may take every batch while
    # the other starts, on a busy machine)
    assert "ray: 2 actor(s) x" in proc.stdout and " batches on " in proc.stdout, proc.stdout
    assert f"done: {len(good)} ok, {len(bad)} failed" in proc.stdout and "generated tok/s" in proc.stdout


@needs_ray
def test_ray_lines_naming_lora_modules_equal_single_process(tiny_checkpoint, cluster, tmp_path):
    """`--lora-modules` on 2 actors, batches of 2: each line runs with the adapter its "model" names
    (the actors read the same adapter folders), every record equal to the single-process run's."""
    pytest.importorskip("peft")
    from tests.flexsarathi.formats.test_lora_adapter import save_adapter

    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=1)
    save_adapter(folder, tmp_path / "b", ["k_proj", "up_proj"], seed=2)
    lines = [{"id": f"r{i}", "prompt_token_ids": [3, 17, 42, 9 + i], **({"model": m} if m else {})}
             for i, m in enumerate(["a", "b", None, "a", "b", "c"])]
    src = write_lines(tmp_path / "in.jsonl", lines)
    args = ["generate", "--model", folder, "--input", src, "--max-tokens", "6", "--temperature", "0",
            "--dtype", "float32", "--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]
    single_process(args + ["--output", str(tmp_path / "single.jsonl"), "--quiet"], rc=1)
    proc = cli(*args, "--output", str(tmp_path / "ray.jsonl"), "--ray", "--ray-address", cluster,
               "--ray-actors", "2", "--ray-batch-size", "2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    expected = sorted_records(tmp_path / "single.jsonl")
    assert_same_records(sorted_records(tmp_path / "ray.jsonl"), expected)
    assert "neither the base model" in expected[-1]  # r5's model "c"


@needs_ray
def test_ray_embedding_lines_equal_single_process(stories_dir, cluster, tmp_path):
    """/v1/embeddings lines on 2 actors, batches of 2 (a line's inputs may land on both): each line's
    record gathers its inputs' embeddings back in order, equal to the single-process run's to
    float32 rounding (another batching of the same prompts)."""
    from tests.flexsarathi.cli.test_cli_embeddings import LINES

    lines = [ln for ln in LINES if ln["body"].get("encoding_format") != "base64"]  # floats, to compare
    src = write_lines(tmp_path / "in.jsonl", lines)
    args = ["generate", "--model", stories_dir, "--input", src, "--dtype", "float32"]
    single_process(args + ["--output", str(tmp_path / "single.jsonl"), "--quiet"], rc=1)
    proc = cli(*args, "--output", str(tmp_path / "ray.jsonl"), "--ray", "--ray-address", cluster,
               "--ray-actors", "2", "--ray-batch-size", "2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    got = {r["custom_id"]: r for r in map(json.loads, sorted_records(tmp_path / "ray.jsonl"))}
    expected = {r["custom_id"]: r for r in map(json.loads, sorted_records(tmp_path / "single.jsonl"))}
    assert got.keys() == expected.keys() and sum(r["error"] is None for r in got.values()) == 3
    for key, record in expected.items():
        if record["error"] is not None:
            assert got[key]["error"] == record["error"]
            continue
        data, ref = got[key]["response"]["body"]["data"], record["response"]["body"]["data"]
        assert [d["index"] for d in data] == [d["index"] for d in ref]
        for d, r in zip(data, ref):
            assert d["embedding"] == pytest.approx(r["embedding"], abs=1e-5)
    assert "prompt tok/s" in proc.stdout


@needs_ray
def test_ray_dummy_model_with_disk_weights_on_a_local_instance(tmp_path):
    """No --ray-address: the CLI starts (and stops) its own instance. Half the weights stream
    from disk; each actor claims its own offload folder."""
    ids = [[2, 100 + i, 200, 300 + 7 * i] for i in range(6)]
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": p} for i, p in enumerate(ids)]
                      + [{"id": "text", "prompt": "hello"}])  # no tokenizer: an error record
    policy = str(tmp_path / "policy.json")
    Policy(w_gpu=0.5, w_cpu=0.0, w_disk=0.5, kv_gpu=0.0, kv_cpu=1.0, cpu_attention=True).save(policy)
    # Two of opt-125m's layers: three offload stores (the single process's, each actor's) of 54 MiB.
    args = ["generate", "--model", "dummy:opt-125m-2l", "--input", src, "--policy", policy, "--max-tokens", "5",
            "--ignore-eos", *GREEDY]
    single_process(args + ["--output", str(tmp_path / "single.jsonl"), "--offload-dir", str(tmp_path / "o1")],
                   rc=1)
    proc = cli(*args, "--output", str(tmp_path / "ray.jsonl"), "--offload-dir", str(tmp_path / "o2"),
               "--ray", "--ray-actors", "2", "--ray-batch-size", "3")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert sorted_records(tmp_path / "ray.jsonl") == sorted_records(tmp_path / "single.jsonl")
    assert sorted(p.name for p in (tmp_path / "o2").iterdir() if p.is_dir()) == ["actor-0", "actor-1"]


def _actor_pids() -> list[int]:
    """The processes of this module's RequestRunner actors (their process titles name them) in THIS
    test process's Ray instance: its workers descend from it (the driver starts the raylet, the
    raylet the workers). Another suite running beside this one has actors of the same name, and
    killing those made its Ray test fail (seen with two `make test` runs side by side)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"MapWorker(MapBatches(RequestRunner))" in f.read() and _descends_from(int(entry), os.getpid()):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        with open(f"/proc/{pid}/stat") as f:  # "pid (comm) state ppid ...": comm may hold spaces
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return False


def _wait_for_lines(path, count: int, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            break
        time.sleep(0.05)
    return path.read_bytes().count(b"\n") if path.exists() else 0


@needs_ray
def test_dead_actor_and_killed_driver_lose_nothing(stories_dir, cluster, tmp_path):
    """The actors SIGKILLed mid-job: exit 3, one clear error line, the finished records kept. The
    rerun SIGKILLed itself (the driver), then rerun: the file equals the uninterrupted run
    (--policy auto: one search on the driver, the same policy in every actor)."""
    # One batch of 12 per actor: the first 8..52 tokens long, the second 300..388, so the first
    # batch's records are out while the second actor is still far from done and the kill below
    # lands mid-batch (an idle actor's death loses nothing and Ray Data just replaces it; with
    # lengths close together a fast machine could finish both before the kill).
    prompts = [{"id": i, "prompt": f"Once upon a time, number {i}",
                "max_tokens": 8 + 4 * i if i < 12 else 300 + 8 * (i - 12)} for i in range(24)]
    src = write_lines(tmp_path / "in.jsonl", prompts)
    args = ["generate", "--model", stories_dir, "--input", src, "--ignore-eos", *GREEDY,
            "--policy", "auto", "--hardware", "t4"]  # searched by the driver, shipped to the actors
    single_process(args + ["--output", str(tmp_path / "single.jsonl")], rc=0)
    expected = sorted_records(tmp_path / "single.jsonl")
    out = tmp_path / "ray.jsonl"
    command = [sys.executable, "-m", "flexsarathi", *args, "--output", str(out), "--ray", "--ray-address", cluster,
               "--ray-actors", "2", "--ray-batch-size", "12"]

    proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for_lines(out, 1, proc) >= 1
    actors = _actor_pids()
    assert actors, "no actor process found"
    for pid in actors:  # both: the one that wrote is mid-batch; the other may still be starting
        os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stdout + stderr
    assert "Traceback" not in stderr and stderr.count("error: ") == 1, stderr
    assert "error: the Ray job failed: " in stderr
    assert "an actor (pid" not in stderr or any(f"an actor (pid {pid} on " in stderr for pid in actors), stderr
    assert f"the finished records are in {out}: rerun the same command to resume" in stderr
    kept = sorted_records(out)
    assert 1 <= len(kept) < len(prompts) and set(kept) <= set(expected)

    driver_killed = [sys.executable, "-c", KILLED_AFTER_RECORDS, "4", *command[3:]]  # after 4 more records
    proc = subprocess.run(driver_killed, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL
    partial = out.read_bytes().count(b"\n")
    assert partial == len(kept) + 4
    assert partial < len(prompts), "the driver was not killed partway"

    proc = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted_records(out) == expected  # none lost, none twice


# `python -c ACTORS_FAIL_TO_START ARGS...` runs `flexsarathi ARGS...` with actors whose __init__ raises
# (the class is defined here, in __main__, so Ray ships it by value to the workers).
ACTORS_FAIL_TO_START = """
import sys
from flexsarathi.cli.main import main
from flexsarathi.ray import job

class BrokenRunner(job.RequestRunner):
    def __init__(self, *args, **kwargs):
        raise OSError("injected: the model folder cannot be read on this node")

job.RequestRunner = BrokenRunner
sys.exit(main(sys.argv[1:]))
"""


@needs_ray
def test_actor_that_cannot_start_is_one_error_naming_why(stories_dir, cluster, tmp_path):
    """An actor whose engine cannot be built (its __init__ raises): exit 3, one error line that says
    what the actor raised, not that its process was killed; no record written."""
    src = write_lines(tmp_path / "in.txt", ["Once upon a time", "The dog"])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-c", ACTORS_FAIL_TO_START, "generate", "--model", stories_dir,
                           "--input", src, "--output", str(out), "--max-tokens", "4", "--ray", "--ray-address",
                           cluster, "--ray-actors", "1", *GREEDY], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1, proc.stderr
    assert "could not start: OSError: injected: the model folder cannot be read on this node" in proc.stderr
    assert "its process was killed" not in proc.stderr
    assert not out.exists() or out.read_text() == ""
