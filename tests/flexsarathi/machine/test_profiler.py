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

    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype

    engine_dtype = resolve_dtype(None, torch.float16, resolve_device(None))
    assert f"with {engine_dtype}" in spec.notes
    lines = result.stderr.splitlines()
    assert lines.index("  measuring the disk: writing and reading 16 MiB in "
                       f"{tmp_path / 'off'} ...") < next(i for i, line in enumerate(lines) if "disk: read" in line)


def test_int4_kernel_rate_where_the_kernel_covers_the_machine():
    """The profile's int4 figure: FLOP/s of linear_4bit on the layer's shapes in bf16 on the CPU
    (None where the kernel's layout is not this machine's), never for other dtypes."""
    import torch

    from flexsarathi.machine.profiler import LayerShapes, _int4_kernel_rate
    from quant.cpu_matmul import layout_matches_torch

    shapes = LayerShapes(((128, 256), (64, 128)), heads=2, kv_heads=2, head_dim=64)
    rate = _int4_kernel_rate(torch.device("cpu"), torch.bfloat16, shapes, rows=4)
    assert (rate is not None and rate > 0) if layout_matches_torch() else rate is None
    assert _int4_kernel_rate(torch.device("cpu"), torch.float32, shapes) is None
    odd = LayerShapes(((100, 256),), heads=2, kv_heads=2, head_dim=64)  # not whole 64-row blocks
    assert _int4_kernel_rate(torch.device("cpu"), torch.bfloat16, odd) is None
