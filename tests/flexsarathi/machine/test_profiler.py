"""`flexsarathi profile` measures this machine into a hardware JSON the planner and LLM accept."""
from __future__ import annotations

import subprocess
import sys

from policy_search.hardware import HardwareSpec
from tests.conftest import REPO


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_profile_writes_a_loadable_hardware_json(tmp_path):
    """`flexsarathi profile --model opt-125m`: the layer timed is that model's (the smallest registered
    one keeps the test short; the default, opt-1.3b's, takes 2-3x longer)."""
    out = tmp_path / "hw.json"
    result = subprocess.run([sys.executable, "-m", "flexsarathi", "profile", "-o", str(out), "--offload-dir",
                             str(tmp_path / "off"), "--disk-mib", "16", "--model", "opt-125m"], capture_output=True,
                            text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    spec = HardwareSpec.load(out)
    assert spec.disk_to_host > 0 and spec.gpu_matmul_prefill_flops > 0 and spec.cpu_attention_flops > 0
    # the engine's host step between passes is real work: never measured as nothing
    assert spec.step_overhead > 0 and spec.sequence_overhead >= 0 and "outside a pass" in result.stderr
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert spec.cpu_memory == total
    # without CUDA the gpu and cpu tiers are that one RAM: planned together within its usable share
    cuda = torch_cuda_available()
    assert spec.host_memory == (None if cuda else total) and spec.compute_on_host is not cuda
    assert "disk read" in result.stderr or "disk:" in result.stderr
    # Measured in the engine's own dtype (LLM(dtype=None): on the CPU what dtype auto picks), each step announced
    # before it runs, so a slow step is visible while it runs.
    import torch

    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype

    engine_dtype = resolve_dtype(None, torch.float16, resolve_device(None))
    assert f"with {engine_dtype}" in spec.notes and "layer of opt-125m" in spec.notes
    assert "layer of opt-125m (" in result.stderr.splitlines()[0]
    lines = result.stderr.splitlines()
    assert lines.index("  measuring the disk: writing and reading 16 MiB in "
                       f"{tmp_path / 'off'} ...") < next(i for i, line in enumerate(lines) if "disk: read" in line)


def test_int4_kernel_rate_where_a_kernel_covers_the_machine():
    """The profile's 4-bit figure: FLOP/s of torch's int4 kernel (bf16 where its layout is this
    machine's) or else of the int8 kernel (any dtype where it builds); None where neither covers the
    shapes (the int8 kernel needs an input dimension in whole 64s)."""
    import torch

    from flexsarathi.machine.profiler import LayerShapes, _int4_kernel_rate
    from quant import cpu_int8_matmul
    from quant.cpu_matmul import layout_matches_torch

    shapes = LayerShapes(((128, 256), (64, 128)), heads=2, kv_heads=2, head_dim=64)
    for dtype in (torch.bfloat16, torch.float32):
        rate = _int4_kernel_rate(torch.device("cpu"), dtype, shapes, rows=4)
        covered = cpu_int8_matmul.available() or (dtype == torch.bfloat16 and layout_matches_torch())
        assert (rate is not None and rate > 0) if covered else rate is None
    odd = LayerShapes(((128, 96),), heads=2, kv_heads=2, head_dim=64)  # K = 96: neither kernel covers it
    assert _int4_kernel_rate(torch.device("cpu"), torch.float32, odd) is None
