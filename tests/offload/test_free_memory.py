"""What the compute device can still allocate (offload/free_memory.py), which a default engine sizes
its running set by: on the CPU the host's MemAvailable, lowered to every memory cgroup's room."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from offload.free_memory import _cgroup_dirs, _cgroup_room, free_bytes, mem_available
from tests.conftest import REPO

V1_ROOT = "/sys/fs/cgroup/memory"
GiB = 1 << 30

# In a child process: a default engine's running set for 64 requests of 2048 tokens (bf16
# opt-125m: 72 MiB of KV each, 4.5 GiB in all), then a short generate, under whatever cgroup it is in.
CHILD = """
import json, sys
from flexsarathi import LLM, SamplingParams
from offload.free_memory import free_bytes
import torch
with LLM("dummy:opt-125m", dtype="bfloat16", device="cpu") as llm:
    running = llm.engine.fitted_running([16] * 64, [2048] * 64)
    kv_per_seq = 2 * 12 * 2048 * 768 * 2
    llm.generate([[5] * 16] * 8, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"running": running, "kv_per_seq": kv_per_seq, "free": free_bytes(torch.device("cpu"))}))
"""


def _in_cgroup(code: str, limit: int | None, tmp_name: str = "") -> subprocess.CompletedProcess:
    """`python -c code`, in a fresh cgroup-v1 memory group of `limit` bytes (None: where this runs)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if limit is None:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    home = _current_v1_group()
    if not os.access(home, os.W_OK):
        pytest.skip(f"cannot create a memory cgroup under {home} (root needed)")
    group = os.path.join(home, tmp_name)
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        join = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"'
        return subprocess.run(["sh", "-c", join, sys.executable, code], env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        os.rmdir(group)


def _answer(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _current_v1_group() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join(V1_ROOT, path.strip("/"))
    pytest.skip("no cgroup-v1 memory controller here")


def test_a_default_engine_in_a_memory_cgroup_runs_what_the_group_holds(tmp_path):
    """Unlimited, the 64 requests' 4.5 GiB of KV fit this machine and all run at once; in a 1.5 GiB
    group (the interpreter, torch and the weights take ~0.6 of it) only what fits the group runs,
    and the engine generates there without being killed."""
    if mem_available() < 8 * GiB:
        pytest.skip("needs 8 GiB available for the unlimited run")
    home = _current_v1_group()
    if not os.access(home, os.W_OK):
        pytest.skip(f"cannot create a memory cgroup under {home} (root needed)")
    unlimited = _answer(_in_cgroup(CHILD, None))
    assert unlimited["running"] == 64
    limit = 3 * GiB // 2
    limited = _answer(_in_cgroup(CHILD, limit, f"flexsarathi_test_{os.getpid()}"))
    assert limited["free"] < limit
    assert 1 <= limited["running"] < 64 and limited["running"] * limited["kv_per_seq"] < limit


TOO_LARGE = """
from flexsarathi import LLM
from flexsarathi.errors import FlexSarathiError
try:
    LLM("dummy:opt-1.3b", dtype="bfloat16", device="cpu")
except FlexSarathiError as exc:
    print(exc)
"""


def test_a_default_engine_too_large_for_its_memory_cgroup_says_so_instead_of_being_killed(tmp_path):
    """opt-1.3b's 2.4 GiB of bf16 weights in a 1.5 GiB group: refused before loading, by name."""
    done = _in_cgroup(TOO_LARGE, 3 * GiB // 2, f"flexsarathi_test_big_{os.getpid()}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dummy:opt-1.3b does not fit on the cpu without offloading" in done.stdout
    assert "memory cgroups included" in done.stdout and "--policy auto" in done.stdout


def test_free_bytes_on_this_machine_is_at_most_mem_available():
    # two reads of a machine whose memory moves (the suite's other worker): within 256 MiB
    assert 0 < free_bytes(torch.device("cpu")) <= mem_available() + (256 << 20)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limits_of_a_group_and_its_ancestors(tmp_path):
    """cgroup v2 (not mounted on this machine): the group's and each ancestor's memory.max, usage
    and inactive file cache read as the kernel writes them; "max" is no limit."""
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/jobs/job7\n")
    root = tmp_path / "cg"
    for folder, limit, usage, inactive in (("", "max", 9 * GiB, 0), ("jobs", str(4 * GiB), GiB, GiB // 4),
                                           ("jobs/job7", str(2 * GiB), GiB, GiB // 2)):
        _write(root / folder / "memory.max", limit + "\n")
        _write(root / folder / "memory.current", f"{usage}\n")
        _write(root / folder / "memory.stat", f"anon 123\ninactive_file {inactive}\nactive_file 7\n")
    dirs = _cgroup_dirs(str(proc), str(root))
    assert [os.path.relpath(d, root) for d, _ in dirs] == ["jobs/job7", "jobs", "."]
    assert [_cgroup_room(d, names) for d, names in dirs] == [2 * GiB - GiB + GiB // 2, 4 * GiB - GiB + GiB // 4, None]


def test_cgroup_v1_unlimited_and_unreadable_groups_count_as_no_limit(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "4:memory:/a\n3:cpu:/elsewhere\n")
    root = tmp_path / "cg"
    _write(root / "memory" / "a" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(root / "memory" / "a" / "memory.usage_in_bytes", "100\n")
    _write(root / "memory" / "a" / "memory.stat", "total_inactive_file 5\n")
    _write(root / "memory" / "memory.limit_in_bytes", "1000\n")  # the root group: no usage file
    dirs = _cgroup_dirs(str(proc), str(root))
    assert [os.path.relpath(d, root) for d, _ in dirs] == ["memory/a", "memory"]
    assert [_cgroup_room(d, names) for d, names in dirs] == [None, None]
    _write(root / "memory" / "a" / "memory.limit_in_bytes", "1000\n")
    assert _cgroup_room(*dirs[0]) == 1000 - 100 + 5
