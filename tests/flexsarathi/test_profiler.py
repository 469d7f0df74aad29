"""`flexsarathi profile` measures this machine into a hardware JSON the planner and LLM accept."""
from __future__ import annotations

import subprocess
import sys

from policy_search.hardware import HardwareSpec
from tests.conftest import REPO


def test_profile_writes_a_loadable_hardware_json(tmp_path):
    out = tmp_path / "hw.json"
    result = subprocess.run([sys.executable, "-m", "flexsarathi", "profile", "-o", str(out), "--offload-dir",
                             str(tmp_path / "off"), "--disk-mib", "16"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    spec = HardwareSpec.load(out)
    assert spec.disk_to_host > 0 and spec.gpu_matmul_prefill_flops > 0 and spec.cpu_attention_flops > 0
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert spec.cpu_memory == total
    assert "disk read" in result.stderr or "disk:" in result.stderr
    # Measured in the engine's own dtype (LLM(dtype=None): on the CPU what dtype auto picks), each step announced
    # before it runs, so a slow step is visible while it runs.
    import torch

    from flexsarathi.engine import resolve_device, resolve_dtype

    engine_dtype = resolve_dtype(None, torch.float16, resolve_device(None))
    assert f"with {engine_dtype}" in spec.notes
    lines = result.stderr.splitlines()
    assert lines.index("  measuring the disk: writing and reading 16 MiB in "
                       f"{tmp_path / 'off'} ...") < next(i for i, line in enumerate(lines) if "disk: read" in line)
