"""Running a script under Triton's interpreter (TRITON_INTERPRET=1 runs Triton kernels with numpy on
CPU tensors): the variable must be set before triton is imported, so each script runs in a fresh
Python, with the repository (and tests/, for conftest's helpers) importable."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# Where a GPU is, its compiled kernels are tested instead (tests/offload/test_cuda.py).
without_a_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel "
                                   "itself (tests/offload/test_cuda.py); the interpreter stands in only without a GPU")


def run_interpreted(script: str, timeout: int = 600) -> str:
    """The script's standard output; fails the calling test with its error where it exits non-zero."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
