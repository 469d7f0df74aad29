"""scripts/gpu_checks.sh, the one command a short GPU lease runs: the commands it forms from its
variables are taken by the real parsers of what they call (a lease that fails on a flag is lost).
The GPU steps cannot run here, so PYTHON is a stand-in that records each command line; the lines are
then parsed by flexsarathi's CLI and run through bench_flexgen_gpu.py's own argument handling."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _commands(tmp_path: Path, **env: str) -> list[list[str]]:
    """Each command line gpu_checks.sh hands to PYTHON with these variables."""
    log, stand_in = tmp_path / "argv.log", tmp_path / "python"
    # each argument followed by a unit separator, one command a line
    stand_in.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\037" "$a"; done >> "$ARGV_LOG"\n'
                        'echo >> "$ARGV_LOG"\n')
    stand_in.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stand_in), ARGV_LOG=str(log), OUT=str(tmp_path / "out"), **env)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_checks.sh")], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line.rstrip("\x1f").split("\x1f") for line in log.read_text().splitlines() if line]


def test_the_next_leases_flexgen_step_forms_commands_the_tools_accept(tmp_path):
    """docs/GPU.md's step 2 (profile, then the bench with FLEXGEN_SKIP): the profile's flags parse
    with `flexsarathi`'s parser, and the bench gets past its arguments and case names to where it
    asks for a GPU."""
    from flexsarathi.cli.main import build_parser

    commands = _commands(tmp_path, STEPS="flexgen", FLEXGEN_PROFILE="1",
                         FLEXGEN_CASES="opt-6.7b/4bit opt-30b/cpu-weights opt-6.7b/all-gpu",
                         FLEXGEN_SKIP="opt-30b/cpu-weights", FLEXGEN_SCHEDULERS="decode-maximal",
                         FLEXGEN_DEADLINE="380")
    profile = next(c for c in commands if c[:3] == ["-m", "flexsarathi", "profile"])
    args = build_parser().parse_args(profile[2:])
    assert args.model == "opt-6.7b" and args.output.endswith("profile.json")
    bench = next(c for c in commands if c[0].endswith("bench_flexgen_gpu.py"))
    assert bench[bench.index("--skip-flexgen") + 1] == "opt-30b/cpu-weights"
    ran = subprocess.run([sys.executable, *bench], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert ran.returncode == 2 and "needs a CUDA GPU" in ran.stderr, ran.stderr[-500:]


def test_an_unknown_case_to_skip_fails_before_any_run(tmp_path):
    commands = _commands(tmp_path, STEPS="flexgen", FLEXGEN_SKIP="opt-99b")
    bench = next(c for c in commands if c[0].endswith("bench_flexgen_gpu.py"))
    ran = subprocess.run([sys.executable, *bench], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0 and "unknown case(s) ['opt-99b']" in ran.stderr + ran.stdout, shlex.join(bench)
