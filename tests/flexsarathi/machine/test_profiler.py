"""`flexsarathi profile` measures this machine into a hardware JSON the planner and LLM accept."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flexsarathi.errors import FlexSarathiError
from flexsarathi.llm import LLM
from flexsarathi.machine.profiler import profile_machine
from policy_search.hardware import HardwareSpec
from tests.conftest import REPO, mounted_tmpfs


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
    # what the disk test writes: --disk-mib in whole layers, two at least (two of opt-125m's: more than 16 MiB)
    from flexsarathi.engine.planner_spec import planner_model_spec
    from flexsarathi.machine.layer_timing import LayerShapes
    from flexsarathi.machine.profiler import disk_test_bytes

    written = disk_test_bytes(16 << 20, LayerShapes.of(planner_model_spec("opt-125m", engine_dtype)), engine_dtype)
    assert written > 16 << 20
    lines = result.stderr.splitlines()
    assert lines.index(f"  measuring the disk: writing and reading {written / 2**20:.0f} MiB in "
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


def test_a_disk_test_that_cannot_fit_is_refused_before_measuring(tmp_path):
    """--disk-mib 1 writes two whole layers (192 MiB of OPT-1.3B's, bf16): on a 1 MiB filesystem that
    is one error naming the real size, before the copies and matmuls are measured (it came after
    them, in an offload store's words, and the log said 1 MiB)."""
    logged = []
    with mounted_tmpfs(tmp_path / "tiny", "size=1m", "a filesystem smaller than the disk test") as mount:
        with pytest.raises(FlexSarathiError) as err:
            profile_machine(str(mount), LLM, dtype=torch.bfloat16, disk_bytes=1 << 20, log=logged.append,
                            device=torch.device("cpu"))
    assert str(err.value) == (f"the disk test writes 192.00 MiB in {mount} (1.00 MiB asked for, whole layers of "
                              "opt-1.3b, two at least), and it has 1.00 MiB free: ask for a smaller test or "
                              "measure a folder on a disk with room")
    assert logged == []  # nothing measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_rates_are_the_devices_time_not_its_launches():
    """device_seconds replays a captured call: a chain of small kernels costs the GPU far less than the
    host's launches of it (what a replayed or large pass sees), while a large matmul, whose launch is
    nothing beside its work, times as the host times it; the profile's GPU rates are taken that way."""
    from flexsarathi.machine.layer_timing import device_seconds, median_seconds

    cuda = torch.device("cuda")
    x = torch.randn(64, device=cuda)

    def small_kernels():
        y = x
        for _ in range(50):
            y = y + 1.0
        return y

    graphed, captured = device_seconds(small_kernels, cuda)
    launched = median_seconds(lambda: (small_kernels(), torch.cuda.synchronize()))
    assert captured and graphed < launched / 2
    a, b = torch.randn(4096, 8192, device=cuda, dtype=torch.float16), torch.randn(8192, 8192, device=cuda,
                                                                                   dtype=torch.float16)
    big, _ = device_seconds(lambda: a @ b, cuda)
    assert big == pytest.approx(median_seconds(lambda: (a @ b, torch.cuda.synchronize())), rel=0.25)
    # the fused 4-bit kernel's rate, where the engine uses it (sm_80+): what 4-bit decode passes are priced at
    from flexsarathi.machine.layer_timing import LayerShapes
    from flexsarathi.machine.profiler import _gpu_int4_kernel_rate
    from quant import fused

    rate = _gpu_int4_kernel_rate(cuda, torch.float16, LayerShapes.of(None))
    assert (rate is not None and rate > 0) == fused.use_triton(64, torch.cuda.get_device_capability())
