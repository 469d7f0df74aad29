"""What every benchmark script does besides its own workload: name the machine and the commit, time
engines side by side, hold a run in a memory cgroup, drop files' page cache, count disk bytes and CPU
seconds, split an engine's steps into phases, print a ratio table, and write the run's JSON result
beside the printed table.

A script imports it as `import harness` (the script's folder is on sys.path when it runs); importing
it puts the repository root on sys.path too, so the packages import from a checkout. Nothing here
imports torch at import time: bench_gguf's parent process must stay small (Linux carries a parent's
peak RSS into its children's ru_maxrss), so torch is imported only where a function needs it.

The scripts build our engines with `enable_prefix_caching=False` (all but bench_prefix, which
measures it): they repeat prompts across warm-ups, rounds and schedulers, and a run that found
the last one's KV would not do the work its baseline does.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS_DIR = REPO / "bench_results"  # git-ignored: where each script's JSON result goes by default
GiB = 1 << 30
GB = 1e9


def say(*args) -> None:
    print(*args, flush=True)


def stamp(t0: float) -> str:
    return f"[{time.perf_counter() - t0:6.0f}s]"


# ---- the machine and the commit ------------------------------------------------------------------


def machine(dtype=None) -> dict:
    """The CPU (model, family/model, relevant flags, torch's capability), the GPU where CUDA has one,
    torch's version and threads, the RAM and the load average now."""
    import torch

    from flexsarathi.machine.cpu_info import cpu_description, cpu_generation, cpu_line

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / GiB, 1),
               "capability": list(torch.cuda.get_device_capability(0))}
    return {"cpu": cpu_description(), "cpu_generation": cpu_generation(), "line": cpu_line(dtype), "gpu": gpu,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
            "load_average": list(os.getloadavg())}


def git_commit(repo: Path = REPO) -> dict:
    """{"commit": the checkout's HEAD (None outside git), "dirty": whether tracked files differ from it}."""
    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


# ---- process and machine counters ----------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU seconds of this process, all threads."""
    t = os.times()
    return t.user + t.system


def children_cpu_seconds() -> float:
    """CPU seconds of this process's waited-for children."""
    t = os.times()
    return t.children_user + t.children_system


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have been busy (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Neighbours:
    """Cores the rest of the machine used from construction to `cores()`: the machine's busy CPU time
    less this process's (and, with children=True, its waited-for children's), over the wall time.
    On a shared machine this says how much a figure may be off."""

    def __init__(self, children: bool = False):
        self.children = children
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        own = cpu_seconds() + (children_cpu_seconds() if self.children else 0.0)
        return time.perf_counter(), machine_busy_seconds(), own

    def cores(self) -> float:
        wall0, busy0, own0 = self.start
        wall1, busy1, own1 = self._sample()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)


def timed_into(totals: dict, key: str, fn: Callable) -> Callable:
    """`fn`, each call's wall seconds added to totals[key] (however the call ends)."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return call


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """The median wall seconds of `repeats` calls of fn, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class StepPhases:
    """Where an engine's steps spend their wall time: `with StepPhases(llm.engine) as phases:` times
    each step's parts (the scheduler's schedule and postprocess, the engine's forward and sample) on
    that engine object alone (its class is untouched; restored on exit), then `phases.summary()`.
    Passes are told apart: replayed from a CUDA graph, decode (every item one generated token), or
    with prompt tokens. On a GPU, forward ends with a device sync, so a pass's GPU time is its own
    (the sampler syncs right after it anyway, reading its tokens: the run's speed is unchanged)."""

    PHASES = ("schedule", "graph pass", "decode pass", "prompt pass", "sample", "postprocess")

    def __init__(self, engine):
        self.engine = engine
        self.times: dict[str, list[float]] = {phase: [] for phase in self.PHASES}  # each call's seconds

    def __enter__(self) -> "StepPhases":
        import torch

        e, s = self.engine, self.engine.scheduler
        schedule, forward, sample, postprocess = s.schedule, e.forward, e.sample, s.postprocess
        sync = torch.cuda.synchronize if e.device.type == "cuda" else (lambda: None)

        def timed_forward(plan):
            replays, start = e.stats["graph_passes"], time.perf_counter()
            out = forward(plan)
            sync()
            decode = all(item.start >= item.seq.num_prompt_tokens for item in plan.items)
            kind = ("graph pass" if e.stats["graph_passes"] > replays else
                    "decode pass" if decode else "prompt pass")
            self._add(kind, time.perf_counter() - start)
            return out

        s.schedule = self._timed("schedule", schedule)
        e.forward = timed_forward
        e.sample = self._timed("sample", sample)
        s.postprocess = self._timed("postprocess", postprocess)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name in ((self.engine.scheduler, "schedule"), (self.engine, "forward"), (self.engine, "sample"),
                            (self.engine.scheduler, "postprocess")):
            vars(owner).pop(name, None)  # the class's method again

    def _timed(self, phase: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(phase, time.perf_counter() - start)
        return call

    @property
    def counts(self) -> dict[str, int]:
        return {phase: len(times) for phase, times in self.times.items()}

    def _add(self, phase: str, seconds: float) -> None:
        self.times[phase].append(seconds)

    def summary(self) -> dict:
        """Per phase: calls, seconds, ms per call, and the median and slowest call's ms (one slow call,
        a kernel compiled on first use, shows as a max far above the median; phases never entered
        left out)."""
        return {phase: {"calls": len(t), "s": round(sum(t), 4), "ms_each": round(1e3 * sum(t) / len(t), 3),
                        "ms_median": round(1e3 * statistics.median(t), 3), "ms_max": round(1e3 * max(t), 3)}
                for phase, t in self.times.items() if t}


def disk_read_bytes() -> int:
    """Bytes this process (all threads) caused to be read from the storage layer (/proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def drop_cache_of(paths) -> None:
    """Drop the page cache of each file (offload/page_cache.py: dirty pages written back, then
    posix_fadvise DONTNEED), so the next read comes from the disk; a file that cannot be is named."""
    from offload.page_cache import drop_page_cache  # noqa: PLC0415 - after the repository root is on sys.path

    for path in paths:
        try:
            drop_page_cache(path)
        except OSError as exc:
            say(f"  WARNING: could not drop the page cache of {path}: {exc}")


def release_free_memory() -> None:
    """gc, then give the C heap's free pages back to the kernel (glibc malloc_trim): freed memory the
    allocator keeps stays charged to a memory group, and how much it keeps depends on the allocation
    history (it varied by 0.45 GiB between identical runs), so every run starts from what is in use."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---- cgroup v1 memory group ----------------------------------------------------------------------


class MemoryGroup:
    """Puts this process in a fresh cgroup-v1 memory group with a limit; `leave()` undoes it.

    The group is a child of the memory group the process is in now, and leaving moves the process
    back there (not to the root): limits of the parent keep applying and nothing outside is touched.
    Children started while inside (a baseline engine's binary) are in the group too.
    """

    ROOT = "/sys/fs/cgroup/memory"

    def __init__(self, limit_bytes: int, root: str | None = None):
        self.limit = limit_bytes
        self.root = root or self.ROOT
        self.path: str | None = None
        self.home: str | None = None
        self.active = False

    def current_group(self, proc_cgroup: str = "/proc/self/cgroup") -> str | None:
        try:
            with open(proc_cgroup) as f:
                for line in f:
                    _, controllers, path = line.rstrip("\n").split(":", 2)
                    if "memory" in controllers.split(","):
                        return self.root + path.rstrip("/") if path != "/" else self.root
        except OSError:
            return None
        return None

    def enter(self) -> str | None:
        """Join the group; returns None on success, else why not (the caller warns)."""
        home = self.current_group()
        if home is None or not os.path.exists(os.path.join(home, "cgroup.procs")):
            return "no cgroup-v1 memory controller at " + self.root
        path = os.path.join(home, f"bench_{os.getpid()}")
        try:
            os.mkdir(path)
        except OSError as exc:
            return f"cannot create {path}: {exc.strerror} (root needed)"
        try:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(self.limit))
            _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
        except OSError as exc:
            _rmdir_quietly(path)
            return f"cannot set up {path}: {exc.strerror}"
        self.path, self.home, self.active = path, home, True
        atexit.register(self.leave)
        return None

    def leave(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            _write(os.path.join(self.home, "cgroup.procs"), str(os.getpid()))
        except OSError as exc:
            say(f"WARNING: could not move pid {os.getpid()} back to {self.home}: {exc}")
        # Page cache still charged to the group keeps it busy: empty it, then remove it.
        try:
            _write(os.path.join(self.path, "memory.force_empty"), "0")
        except OSError:
            pass
        _rmdir_quietly(self.path)

    def read(self, name: str) -> int | None:
        if not self.active:
            return None
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError):
            return None

    def reset_peak(self) -> None:
        if self.active:
            try:
                _write(os.path.join(self.path, "memory.max_usage_in_bytes"), "0")
            except OSError:
                pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _rmdir_quietly(path: str) -> None:
    for _ in range(20):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    say(f"WARNING: could not remove cgroup {path}; remove it by hand (rmdir)")


# ---- engines side by side ------------------------------------------------------------------------


@dataclass
class SideBySide:
    """Seconds of each engine per round, the engines having taken turns (see `alternate`)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def best(self, name: str) -> float:
        return min(self.seconds[name])

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def pair_ratios(self, a: str, b: str) -> list[float]:
        """a's seconds / b's, round by round (each pair ran back to back, so drift hits both)."""
        return [x / y for x, y in zip(self.seconds[a], self.seconds[b])]

    def median_pair_ratio(self, a: str, b: str) -> float:
        return statistics.median(self.pair_ratios(a, b))

    def ratio_of_medians(self, a: str, b: str) -> float:
        return self.median(a) / self.median(b)


def alternate(engines: dict[str, Callable[[], object]], rounds: int, warmup: bool = True,
              clock: Callable[[], float] = time.perf_counter) -> SideBySide:
    """Time each engine once per round, the order rotated every round (A B, B A, ... for two), so
    a machine whose load drifts hits each alike; one untimed call of each first with `warmup`."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(engines)
    if warmup:
        for name in names:
            engines[name]()
    result = SideBySide({name: [] for name in names})
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = clock()
            engines[name]()
            result.seconds[name].append(clock() - start)
    return result


# ---- the ratio table and the JSON result ---------------------------------------------------------


def ratio_table(rows: list[dict], label: str, value: str, baseline: str, unit: str = "") -> list[str]:
    """Lines of a table: each row's `label`, its `value` and value / the value of the row labelled
    `baseline` (a ratio above 1: more than the baseline)."""
    base = next((r[value] for r in rows if r[label] == baseline), None)
    if base is None:
        raise ValueError(f"ratio_table: no row has {label} == {baseline!r}")
    width = max(len(str(r[label])) for r in rows)
    lines = [f"{label:<{width}}  {value + (f' ({unit})' if unit else ''):>14}  {'/ ' + baseline:>12}"]
    for r in rows:
        ratio = r[value] / base if base else float("nan")
        lines.append(f"{str(r[label]):<{width}}  {r[value]:>14.4g}  {ratio:>12.3f}")
    return lines


def add_json_option(parser, script_file: str) -> None:
    """--json PATH: where the run's JSON result goes (default bench_results/<script>.json)."""
    script = Path(script_file).stem
    parser.add_argument("--json", default=str(RESULTS_DIR / f"{script}.json"), metavar="PATH", type=json_path,
                        help=f"write the run's result (machine, commit, date, command, table rows, ratios) as "
                             f"JSON here (default: bench_results/{script}.json under the repository)")
    parser.set_defaults(bench_script=script)


def json_path(path: str) -> str:
    """--json's check, when the arguments are parsed: a run that could not write its result fails
    before it starts, not after it. The folder is made; it must be writable and the path not a folder."""
    import argparse

    folder = Path(path).resolve().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create the folder {folder}: {exc.strerror}")
    if Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file path")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder} is not writable")
    return path


def _plain(value):
    """JSON-able: dataclasses and namespaces as dicts, dtypes and paths as text, NaN/inf as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    return str(value)


def result(script: str, args, rows: list, ratios: dict | None = None, dtype=None, note: str | None = None,
           extra: dict | None = None) -> dict:
    """The run's result: the script, its command line and arguments, the machine, the commit, the
    date (UTC), the table's rows, the ratios it printed, a note (why a figure is missing or not to be
    trusted) and `extra`: what else the script measured that the table's figures rest on."""
    arguments = {k: v for k, v in vars(args).items() if k != "bench_script"} if args is not None else {}
    return _plain({"script": script, "command": [Path(sys.executable).name, *sys.argv], "args": arguments,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   **git_commit(), "machine": machine(dtype), "rows": rows, "ratios": ratios or {},
                   "note": note, "extra": extra or {}})


def write_result(args, rows: list, ratios: dict | None = None, dtype=None, note: str | None = None,
                 extra: dict | None = None) -> Path:
    """Write the run's result (see `result`) to args.json, whole or not at all (a temporary file
    renamed over it), and say where."""
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = result(args.bench_script, args, rows, ratios, dtype, note, extra)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    say(f"JSON result: {path}")
    return path


def read_result(path) -> dict:
    return json.loads(Path(path).read_text())
