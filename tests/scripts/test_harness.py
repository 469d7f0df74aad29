"""scripts/harness.py, the benchmark scripts' one harness, tested for real: the side-by-side timing
and the ratio table from given figures, the JSON result read back (machine, commit, date, command,
rows), --json's checks, the page-cache drop and /proc/self/io on this disk, the memory group where
this machine lets a process make one."""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import subprocess
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import harness  # noqa: E402
from bound import Rates  # noqa: E402


def test_alternate_rotates_the_order_and_times_each_call():
    now, order = [0.0], []

    def engine(name: str, seconds: float):
        def run() -> None:
            order.append(name)
            now[0] += seconds
        return run

    times = harness.alternate({"a": engine("a", 1.0), "b": engine("b", 3.0)}, rounds=3, clock=lambda: now[0])
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]  # one warm-up call each, then A B, B A, A B
    assert times.seconds == {"a": [1.0, 1.0, 1.0], "b": [3.0, 3.0, 3.0]}
    assert times.pair_ratios("b", "a") == [3.0, 3.0, 3.0]
    assert times.ratio_of_medians("b", "a") == 3.0 and times.median_pair_ratio("a", "b") == pytest.approx(1 / 3)


def test_alternate_three_engines_each_leads_once_and_no_rounds_is_an_error():
    order = []
    engines = {n: (lambda n=n: order.append(n)) for n in "xyz"}
    harness.alternate(engines, rounds=3, warmup=False)
    assert order == list("xyz") + list("yzx") + list("zxy")
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        harness.alternate(engines, rounds=0)


def test_ratio_of_medians_and_median_of_pair_ratios_differ_as_they_should():
    times = harness.SideBySide({"ours": [1.0, 2.0, 10.0], "theirs": [2.0, 2.0, 5.0]})
    assert times.median("ours") == 2.0 and times.best("ours") == 1.0
    assert times.ratio_of_medians("theirs", "ours") == 1.0  # 2 / 2
    assert times.pair_ratios("theirs", "ours") == [2.0, 1.0, 0.5]
    assert times.median_pair_ratio("theirs", "ours") == 1.0


def test_ratio_table_divides_by_the_baseline_row():
    rows = [{"engine": "llama.cpp", "seconds": 6.0}, {"engine": "ours", "seconds": 2.0},
            {"engine": "accelerate", "seconds": 30.0}]
    lines = harness.ratio_table(rows, "engine", "seconds", "ours", unit="s")
    assert len(lines) == 4 and "/ ours" in lines[0] and "seconds (s)" in lines[0]
    figures = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[1:]}
    assert figures == {"llama.cpp": [6.0, 3.0], "ours": [2.0, 1.0], "accelerate": [30.0, 15.0]}
    with pytest.raises(ValueError, match="no row has engine == 'vllm'"):
        harness.ratio_table(rows, "engine", "seconds", "vllm")


@dataclass
class _Row:
    name: str
    tok_s: float


def _args(tmp_path: Path, **more) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="opt-125m")
    harness.add_json_option(parser, str(SCRIPTS / "bench_example.py"))
    return parser.parse_args(["--json", str(tmp_path / "out" / "r.json"), *more.get("argv", [])])


def _git(*argv: str) -> subprocess.CompletedProcess:
    """git in this checkout; the test skips where the tree is not a git checkout (an unpacked archive)."""
    try:
        done = subprocess.run(["git", "-C", str(SCRIPTS), *argv], capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"no git here: {exc}")
    if subprocess.run(["git", "-C", str(SCRIPTS), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    return done


def test_json_result_reads_back_with_machine_commit_date_and_rows(tmp_path, capsys):
    args = _args(tmp_path)
    args.dtype = torch.bfloat16  # scripts keep torch dtypes in args: written as text
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    path = harness.write_result(args, [_Row("ours", 12.5), {"engine": "theirs", "tok_s": float("nan")}],
                                {"ours / theirs": 2.5}, dtype=torch.float32, note="a note", extra={"rates": (1, 2)})
    assert f"JSON result: {path}" in capsys.readouterr().out
    data = harness.read_result(path)
    assert data == json.loads(path.read_text()) and not path.with_name("r.json.tmp").exists()
    assert data["script"] == "bench_example"
    assert data["args"] == {"model": "opt-125m", "json": str(tmp_path / "out" / "r.json"), "dtype": "torch.bfloat16"}
    assert data["command"][1:] == sys.argv
    assert data["rows"] == [{"name": "ours", "tok_s": 12.5}, {"engine": "theirs", "tok_s": None}]  # NaN: null
    assert data["ratios"] == {"ours / theirs": 2.5} and data["note"] == "a note" and data["extra"] == {"rates": [1, 2]}
    head = _git("rev-parse", "HEAD").stdout.strip()
    assert data["commit"] == head and len(head) == 40 and isinstance(data["dirty"], bool)
    date = datetime.datetime.fromisoformat(data["date"])
    assert before <= date <= datetime.datetime.now(datetime.timezone.utc)
    m = data["machine"]
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    if model:
        assert m["cpu"]["cpu"] == model and model in m["line"]
    assert m["line"].endswith("computes in float32")
    assert m["torch"] == torch.__version__ and m["threads"] == torch.get_num_threads()
    assert m["gpu"] is None if not torch.cuda.is_available() else m["gpu"]["name"] == torch.cuda.get_device_name(0)
    assert m["ram_gib"] > 0 and len(m["load_average"]) == 3


def test_json_default_path_is_the_scripts_own_under_bench_results():
    parser = argparse.ArgumentParser()
    harness.add_json_option(parser, "/somewhere/scripts/bench_thing.py")
    args = parser.parse_args([])
    assert Path(args.json) == harness.REPO / "bench_results" / "bench_thing.json"
    assert args.bench_script == "bench_thing"
    assert _git("check-ignore", "-q", args.json).returncode == 0, "bench_results/ must be git-ignored"


def test_json_path_that_cannot_be_written_fails_when_the_arguments_are_parsed(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="bench_x")
    harness.add_json_option(parser, "bench_x.py")
    with pytest.raises(SystemExit):
        parser.parse_args(["--json", str(tmp_path)])
    assert f"{tmp_path} is a folder, not a file path" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        parser.parse_args(["--json", str(tmp_path / "file" / "r.json")])
    assert "cannot create the folder" in capsys.readouterr().err
    assert parser.parse_args(["--json", str(tmp_path / "new" / "r.json")]).json
    assert (tmp_path / "new").is_dir()


def test_git_commit_outside_a_checkout_is_none(tmp_path):
    assert harness.git_commit(tmp_path) == {"commit": None, "dirty": False}


def test_importing_the_harness_imports_no_torch():
    # bench_gguf's parent must stay small: its children inherit its peak RSS
    code = "import sys; import harness, workloads; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=SCRIPTS, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=""))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache: mincore on a read-only shared mapping of it (libc's own
    mmap: Python's mmap object gives no address of a read-only mapping)."""
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_drop_cache_of_empties_the_page_cache_and_the_next_read_is_counted(tmp_path, capsys):
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io on this system")
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()  # in the page cache now
    try:
        cached = _resident_pages(path)
    except (OSError, AttributeError, TypeError) as exc:
        pytest.skip(f"cannot ask mincore here: {exc}")
    if cached == 0:
        pytest.skip(f"{tmp_path}'s file system keeps no page cache to drop")
    harness.drop_cache_of([path])
    if _resident_pages(path) == cached:
        pytest.skip(f"{tmp_path}'s file system ignores posix_fadvise DONTNEED (tmpfs or the like)")
    assert _resident_pages(path) < cached // 8
    before = harness.disk_read_bytes()
    path.read_bytes()
    assert harness.disk_read_bytes() - before >= (8 << 20) * 7 // 8
    harness.drop_cache_of([tmp_path / "missing.bin"])  # a file that cannot be dropped is named, not fatal
    assert f"could not drop the page cache of {tmp_path / 'missing.bin'}" in capsys.readouterr().out


def test_cpu_seconds_and_neighbours_count_this_process_apart():
    neighbours = harness.Neighbours()
    start, began = harness.cpu_seconds(), time.perf_counter()
    deadline = began + 30  # spin until this process has 0.3 CPU seconds (a loaded machine takes longer)
    while harness.cpu_seconds() - start < 0.3 and time.perf_counter() < deadline:
        pass
    assert harness.cpu_seconds() - start >= 0.3
    wall = time.perf_counter() - began
    cores = neighbours.cores()
    # /proc/stat counts in clock ticks (1/100 s): a tick per core at each end may land either side
    tick_slack = 2 * os.cpu_count() * 0.01 / wall
    assert 0.0 <= cores <= os.cpu_count() + tick_slack
    assert harness.machine_busy_seconds() > 0


def test_memory_group_current_group_reads_the_memory_line(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/a/b\n1:cpu,cpuacct:/\n")
    assert harness.MemoryGroup(1, root="/cg").current_group(str(proc)) == "/cg/a/b"
    proc.write_text("4:memory:/\n")
    assert harness.MemoryGroup(1, root="/cg").current_group(str(proc)) == "/cg"
    proc.write_text("0::/\n")
    assert harness.MemoryGroup(1, root="/cg").current_group(str(proc)) is None


def test_memory_group_where_this_machine_allows_one():
    limit = 64 << 30  # far above what this test process uses: joining it changes nothing else
    group = harness.MemoryGroup(limit)
    home = group.current_group()
    why = group.enter()
    if why:
        pytest.skip(f"no memory group here: {why}")
    try:
        assert group.current_group() == group.path and os.path.dirname(group.path) == home
        assert group.read("memory.limit_in_bytes") == limit
        assert 0 < group.read("memory.usage_in_bytes") < limit
    finally:
        group.leave()
    assert group.current_group() == home and not os.path.exists(group.path)
    assert group.read("memory.limit_in_bytes") is None


def test_rates_interpolate_in_log_tokens_and_clamp_outside():
    rates = Rates(1e9, 2e9, {1: 1e9, 8: 8e9, 64: 8e9})
    assert rates.disk == 2e9
    assert rates.rate(2) == pytest.approx(2e9)  # exp(2/3 ln 1e9 + 1/3 ln 8e9) = 1e9 * 8^(1/3)
    assert rates.rate(4) == pytest.approx(4e9) and rates.rate(32) == pytest.approx(8e9)
    assert rates.rate(0) == 1e9 and rates.rate(4096) == 8e9
    assert math.isclose(rates.rate(8), 8e9)


def test_the_bound_uses_the_faster_of_two_matmul_measurements_at_each_row_count():
    from bound import Pass, rebound  # noqa: PLC0415

    before = Rates(2e9, 1e9, {1: 1e9, 64: 4e9})
    best = before.with_best_matmul({1: 0.5e9, 64: 8e9})
    assert best.matmul == {1: 1e9, 64: 8e9} and best.disk == before.disk and before.matmul[64] == 4e9

    class Model:  # what rebound asks of the shapes: 2 FLOPs per token per parameter of 1e6 parameters
        def pass_flops(self, tokens, attended, rows):
            return 2e6 * tokens

    p = Pass(tokens=64, attended=0, rows=1, seconds=1.0, disk_bytes=4e9)
    rebound([p], Model(), before)
    assert (p.io_s, p.compute_s) == (2.0, pytest.approx(128e6 / 4e9))
    rebound([p], Model(), best)
    assert (p.io_s, p.compute_s) == (2.0, pytest.approx(128e6 / 8e9))


def test_timed_into_adds_each_calls_seconds_however_it_ends(monkeypatch):
    clock = iter([10.0, 12.5, 20.0, 21.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    totals = {"work": 0.0}

    def work(x, fail=False):
        if fail:
            raise ValueError("boom")
        return 2 * x

    timed = harness.timed_into(totals, "work", work)
    assert timed(3) == 6 and totals["work"] == 2.5
    with pytest.raises(ValueError, match="boom"):
        timed(1, fail=True)
    assert totals["work"] == 3.5


def test_step_phases_counts_every_step_by_its_pass_and_leaves_the_engine_as_it_was(tiny_checkpoint):
    """StepPhases on a real engine, block schedule: one prompt pass (every prompt at once), then one
    decode pass per further token; schedule, sample and postprocess once per step; the phases' seconds
    lie within the run's; afterwards the engine's methods are its class's again."""
    from flexsarathi import LLM, SamplingParams
    from policy_search import Policy

    with LLM(tiny_checkpoint("opt")[0], policy=Policy(gpu_batch_size=3, scheduler="block")) as llm:
        engine = llm.engine
        began = time.perf_counter()
        with harness.StepPhases(engine) as phases:
            llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                         SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
        took = time.perf_counter() - began
        summary = phases.summary()
        assert {name: p["calls"] for name, p in summary.items()} == {
            "schedule": 5, "prompt pass": 1, "decode pass": 4, "sample": 5, "postprocess": 5}
        assert 0 < sum(p["s"] for p in summary.values()) <= took
        for name, p in summary.items():  # each call's time kept: the median and the slowest of them
            times = phases.times[name]
            assert 0 < min(times) <= statistics.median(times) <= max(times) <= sum(times)
            assert (p["ms_median"], p["ms_max"]) == (round(1e3 * statistics.median(times), 3),
                                                     round(1e3 * max(times), 3))
        assert all(name not in vars(engine) for name in ("forward", "sample"))
        assert all(name not in vars(engine.scheduler) for name in ("schedule", "postprocess"))
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)  # the class's methods, untimed
        assert phases.counts["schedule"] == 5
