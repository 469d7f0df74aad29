"""Every scripts/bench_*.py goes through the one harness: it imports scripts/harness.py, takes --json
and writes its result with harness.write_result, and imports no other bench_ script (shared code
lives in harness.py, bound.py or workloads.py, which import no bench_ script either). And each one
still imports and parses its arguments (`--help`), CUDA-only ones included."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
BENCHES = sorted(SCRIPTS.glob("bench_*.py"))
SHARED = [SCRIPTS / "harness.py", SCRIPTS / "bound.py", SCRIPTS / "workloads.py"]


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at any depth (function-local imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _called(path: Path) -> set[str]:
    """`harness.X` attribute calls and bare calls of names imported from harness."""
    tree = ast.parse(path.read_text(), str(path))
    from_harness = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "harness" for a in n.names}
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "harness":
                calls.add(f.attr)
            elif isinstance(f, ast.Name) and f.id in from_harness:
                calls.add(f.id)
    return calls


def test_there_are_bench_scripts():
    assert len(BENCHES) >= 18


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.stem)
def test_bench_script_uses_the_harness_and_no_other_bench_script(path):
    imported = _imported_modules(path)
    assert "harness" in imported, f"{path.name} does not import the harness"
    others = sorted(name for name in imported if name.startswith("bench_"))
    assert not others, f"{path.name} imports other bench scripts: {others}"
    calls = _called(path)
    assert {"add_json_option", "write_result"} <= calls, f"{path.name}: no --json / JSON result ({calls})"


@pytest.mark.parametrize("path", SHARED, ids=lambda p: p.stem)
def test_shared_modules_import_no_bench_script(path):
    assert not sorted(name for name in _imported_modules(path) if name.startswith("bench_"))


# Runs each script as __main__ with --help in one process (torch imported once, not once a script):
# prints {script: (exit code, its output's tail)} as JSON.
_HELP_ALL = """
import contextlib, io, json, os, runpy, sys, traceback
found = {}
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as `python scripts/X.py` puts its folder first
for path in sys.argv[1:]:
    out, code = io.StringIO(), None
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc(file=out)
            code = 1
    found[path] = (code, out.getvalue()[-600:])
print(json.dumps(found))
"""


def test_every_bench_script_imports_and_parses_its_arguments():
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *map(str, BENCHES)], cwd=SCRIPTS.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    failed = {Path(p).name: out for p, (code, out) in found.items()
              if code not in (0, None) or "--json PATH" not in out}
    assert len(found) == len(BENCHES) and not failed, failed


def test_bench_flexgen_gpu_plans_without_a_gpu(tmp_path):
    """bench_flexgen_gpu.py --plan-only, before a GPU session: for each of our runs of a case
    (FlexGen's policy with each scheduler, the policy searched under the same T4 caps), the planner's
    prediction and memory check, with no GPU. FlexGen's all-GPU and 4-bit batch-72 policies fit a
    T4's 15 GiB in the planner's model; the searched policy fits by construction."""
    out = tmp_path / "plan.json"
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_flexgen_gpu.py"), "--plan-only", "--cases", "opt-6.7b",
                           "--cpu-gib", "100", "--json", str(out)], cwd=SCRIPTS.parent, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    flexgen = [(r["case"], r["who"]) for r in rows if "FlexGen's policy" in r["who"]]
    assert flexgen == [(case, f"ours, FlexGen's policy, {s}") for case in ("opt-6.7b/all-gpu", "opt-6.7b/4bit")
                       for s in ("block", "decode-maximal")]
    assert [r["case"] for r in rows if r["who"] == "ours, searched for t4"] == ["opt-6.7b/all-gpu"]
    for r in rows:
        assert r["fits"] and not r["over_budget"] and r["predicted_tok_s"] > 0, r
        assert r["gpu_budget_gib"] == 15.0 and r["peak_gpu_gib"] <= 15.0
    assert done.stdout.startswith("planned, not run: CPU: ")


def test_bench_flexgen_gpu_runs_the_cases_in_the_order_named(tmp_path):
    """A short GPU lease runs the first case named first: --plan-only lists them in that order, and
    --schedulers keeps only those runs of FlexGen's policies."""
    out = tmp_path / "plan.json"
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_flexgen_gpu.py"), "--plan-only", "--cases",
                           "opt-30b/cpu-weights", "opt-6.7b/4bit", "--schedulers", "decode-maximal", "--cpu-gib", "100",
                           "--json", str(out)], cwd=SCRIPTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [(r["case"], r["who"]) for r in json.loads(out.read_text())["rows"]]
    assert rows == [("opt-30b/cpu-weights", "ours, FlexGen's policy, decode-maximal"),
                    ("opt-30b/cpu-weights", "ours, searched for t4"),
                    ("opt-6.7b/4bit", "ours, FlexGen's policy, decode-maximal")]


@pytest.mark.parametrize("policy", ["file", "auto"])
def test_bench_flexgen_gpus_engine_run_measures_a_policy_file_and_a_searched_one(tmp_path, policy):
    """One of our measured runs, as a GPU lease runs it (`--ours-run`), here on the CPU with a small
    dummy OPT: FlexGen's policy from a file (an LLM given a policy and no workload) and the searched
    one (policy "auto" with the case's workload) each print one JSON line with the tokens per second
    and the planner's prediction. (A lease's runs of FlexGen's policies once all failed on the
    workload meant for the search alone.)"""
    from policy_search import Policy

    if policy == "file":
        policy = str(tmp_path / "policy.json")
        Policy(gpu_batch_size=2, scheduler="decode-maximal").save(policy)
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_flexgen_gpu.py"), "--ours-run", "cpu", "opt-125m",
                           policy, "t4", "-", "8", str(tmp_path / "offload"), "16", "4", "2", "decode-maximal"],
                          cwd=SCRIPTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert line["scheduler"] == "decode-maximal" and line["num_prompts"] == 2
    assert line["tok_s"] > 0 and line["predicted_tok_s"] > 0 and line["device"].startswith("cpu")


def test_a_prefill_budget_the_engine_refuses_falls_back_to_the_next_smaller(capsys):
    """bench_flexgen_gpu's measured run where the planner (given more room than the engine has) picks
    every prompt in one pass: the engine's own largest-pass check refuses it before any work, and the
    run goes on at the next smaller whole-prompt budget, saying so. The engine's budget is set between
    its own reservations for two and for four prompts a pass."""
    sys.path.insert(0, str(SCRIPTS))
    import bench_flexgen_gpu as bench

    from flexsarathi import LLM, SamplingParams
    from flexsarathi.engine.planner_spec import planned_model
    from policy_search import HardwareSpec, Policy, Workload

    model, policy = "dummy:opt-125m-2l", Policy(gpu_batch_size=4, scheduler="decode-maximal")
    measured = Workload(prompt_len=64, gen_len=2, num_requests=4)
    roomy = HardwareSpec.preset("t4").replace(memory_usable_fraction=1.0)
    needs = {}
    with LLM(model, dtype="float32", device="cpu", policy=policy, hardware=roomy, enable_prefix_caching=False) as llm:
        engine = llm.engine
        for budget in (128, 256):
            engine.set_schedule(prefill_budget=budget)
            engine.add_requests([[engine.make_sequence([5 + i] * 64, SamplingParams(max_tokens=2, ignore_eos=True))]
                                 for i in range(4)])
            needs[budget] = engine.memory.report()["gpu"]["in_use"] + engine.worst_pass_bytes
            engine.abort_all()
    assert needs[128] < needs[256]
    tight = roomy.with_memory(gpu=(needs[128] + needs[256]) / 2)
    spec = planned_model(model, "float32", device="cpu").spec
    with LLM(model, dtype="float32", device="cpu", policy=policy, hardware=tight, enable_prefix_caching=False) as llm:
        phases = bench._measured_run(llm, "decode-maximal", measured, (spec, roomy))
        assert llm.engine.policy.prefill_budget == 128 and llm.last_stats["generated_tokens"] == 4 * 2
    assert phases.counts["prompt pass"] == 2  # two prompts a pass
    assert "prefill budget 256 refused" in capsys.readouterr().err
