import json

import pytest

from policy_search import PRESETS, HardwareSpec, SpecError
from policy_search.units import GiB, TFLOPS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_json_round_trip(tmp_path, name):
    spec = HardwareSpec.preset(name)
    path = tmp_path / f"{name}.json"
    spec.save(path)
    assert HardwareSpec.load(path) == spec
    assert HardwareSpec.resolve(str(path)) == spec
    data = json.loads(path.read_text())
    assert data["format"] == "flexsarathi-hardware" and data["gpu_memory_bytes"] == spec.gpu_memory


def test_t4_is_flexgens_machine():
    t4 = HardwareSpec.preset("T4")
    assert t4.host_to_device == 12.89 * GiB  # FlexGen ctog_bdw
    assert t4.gpu_matmul_prefill_flops == 21.24 * TFLOPS and t4.gpu_matmul_decode_flops == 4.3 * TFLOPS
    assert t4.cpu_attention_flops == 0.0123 * TFLOPS
    assert (t4.gpu_memory, t4.cpu_memory) == (16 * GiB, 208 * GiB)
    assert t4.budgets() == {"gpu": 0.8 * t4.gpu_memory, "cpu": 0.8 * t4.cpu_memory, "disk": 0.8 * t4.disk_memory}


def test_bigger_gpus_are_faster_and_larger():
    t4, a100, h100 = (HardwareSpec.preset(n) for n in ("t4", "a100-80g", "h100-80g"))
    for field in ("gpu_memory", "host_to_device", "gpu_matmul_prefill_flops", "gpu_memory_bandwidth"):
        assert getattr(t4, field) < getattr(a100, field) <= getattr(h100, field)
    assert HardwareSpec.preset("h200").gpu_memory > h100.gpu_memory


def test_with_memory_overrides_only_capacities():
    t4 = HardwareSpec.preset("t4")
    small = t4.with_memory(gpu=4 * GiB, disk=0)
    assert (small.gpu_memory, small.cpu_memory, small.disk_memory) == (4 * GiB, t4.cpu_memory, 0)
    assert small.replace(gpu_memory=t4.gpu_memory, disk_memory=t4.disk_memory) == t4
    assert t4.with_memory() is t4


def test_load_errors_name_the_field(tmp_path):
    data = HardwareSpec.preset("t4").to_dict()
    cases = {
        "unknown field": {**data, "gpu_tflops": 1.0},
        "missing field": {k: v for k, v in data.items() if k != "disk_to_host_bytes_per_s"},
        "disk_to_host must be > 0": {**data, "disk_to_host_bytes_per_s": 0},
        "gpu_memory must be > 0": {**data, "gpu_memory_bytes": -1},
        "memory_usable_fraction": {**data, "memory_usable_fraction": 1.5},
        "version": {**data, "version": 99},
    }
    for message, bad in cases.items():
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(SpecError, match=message.split()[0]):
            HardwareSpec.load(path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SpecError, match="not valid JSON"):
        HardwareSpec.load(tmp_path / "broken.json")
    with pytest.raises(SpecError, match="does not exist"):
        HardwareSpec.load(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="neither a preset"):
        HardwareSpec.resolve("v100")
    # a CPU-only profile may have no disk, but never a zero-size GPU tier
    HardwareSpec.from_dict({**data, "disk_memory_bytes": 0})
