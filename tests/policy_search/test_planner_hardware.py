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


@pytest.mark.parametrize("changes, message", [
    ({"gpu_memory_bytes": 10**400}, r"field 'gpu_memory_bytes' \(HardwareSpec.gpu_memory\) must be a finite number"),
    ({"host_to_device_bytes_per_s": 5e-324},
     r"field 'host_to_device_bytes_per_s' \(HardwareSpec.host_to_device\) must be >= 1 \(a rate per second\)"),
    ({"cpu_attention_flops": 0.5}, r"field 'cpu_attention_flops' \(HardwareSpec.cpu_attention_flops\) must be >= 1"),
    ({"disk_to_host_bytes_per_s": float("nan")}, r"field 'disk_to_host_bytes_per_s' \(HardwareSpec.disk_to_host\) must "
                                                r"be a finite number, got nan"),
    ({"notes": [1]}, r"HardwareSpec.notes must be a string, got \[1\]"),
    ({"gpu_memory_byte": 1}, r"unknown field\(s\) \['gpu_memory_byte'\]; did you mean 'gpu_memory_bytes' for "
                             r"'gpu_memory_byte'\?; known"),
])
def test_a_bad_profile_field_is_named_as_the_file_names_it(tmp_path, changes, message):
    """A huge int escaped as an OverflowError; a subnormal rate gave an inf/NaN estimate and a CBC
    failure in the search; fields were named by the dataclass, not the profile's key."""
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**HardwareSpec.preset("t4").to_dict(), **changes}))
    with pytest.raises(SpecError, match=f"^hardware profile {path}: {message}"):
        HardwareSpec.load(path)


@pytest.mark.parametrize("text, message", [
    (b'{"name": "\xfe"}', r"is not UTF-8 text \(byte 0xfe at offset 10\)"),
    (b"[" * 100_000, "is not valid JSON: nested too deeply"),
    (None, "is a folder, not a JSON file"),
], ids=["not-utf8", "deep", "folder"])
def test_an_unreadable_profile_is_one_error_naming_it(tmp_path, text, message):
    path = tmp_path / "hw.json"
    if text is None:
        path.mkdir()
    else:
        path.write_bytes(text)
    with pytest.raises(SpecError, match=f"^hardware profile {path} {message}"):
        HardwareSpec.resolve(str(path))
