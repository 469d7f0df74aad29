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
