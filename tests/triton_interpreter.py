"""Running a script under Triton's interpreter (TRITON_INTERPRET=1 runs Triton kernels with numpy on
CPU tensors): the variable must be set before triton is imported, so each script runs in a fresh
Python, with the repository (and tests/, for conftest's helpers) importable."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: int = 600) -> str:
    """The script's standard output; fails the calling test with its error where it exits non-zero."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
