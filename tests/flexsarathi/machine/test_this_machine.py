"""policy="auto" without hardware plans for this machine (flexsarathi/machine/this_machine.py): its
rates measured once by the profiler and cached per machine key, its capacities read afresh."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.machine import profiler
from flexsarathi.machine.cache_file import cache_path, write_entries
from flexsarathi.machine.this_machine import CACHE_FILE, machine_key, this_machine
from offload.free_memory import mem_available
from policy_search import Workload


@pytest.fixture
def counted_profiles(monkeypatch, tmp_path):
    """A fresh cache folder, and the profiler's real measurement counted."""
    monkeypatch.setenv("FLEXSARATHI_CACHE_DIR", str(tmp_path / "cache"))
    calls, real = [], profiler.profile_machine

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "profile_machine", counted)
    return calls


def test_auto_without_hardware_plans_for_this_machine_measured_once_and_cached(stories_dir, tmp_path, monkeypatch,
                                                                          counted_profiles):
    offload = str(tmp_path / "offload")
    short = Workload(prompt_len=64, gen_len=16)  # the default plans 512 + 32 tokens: beyond stories260K's context
    with LLM(stories_dir, dtype="float32", device="cpu", policy="auto", offload_dir=offload, workload=short) as llm:
        budget = llm.engine.memory.budget
        out = llm.generate("Once upon a time", use_tqdm=False)[0]
    assert len(counted_profiles) == 1 and out.token_ids
    entries = json.load(open(cache_path(CACHE_FILE)))["entries"]
    assert len(entries) == 1 and entries[0]["key"]["dtype"] == "float32"
    # the budgets are this machine's as it was: the free RAM for both RAM tiers (together too), the
    # folder's free disk, each at the usable fraction
    spec = this_machine(LLM, offload, torch.float32)
    usable = spec.memory_usable_fraction
    assert budget.gpu == budget.cpu == budget.host <= usable * (mem_available() + (1 << 30))
    assert abs(budget.disk - usable * shutil.disk_usage(offload).free) < 1 << 30
    assert spec.host_memory == spec.cpu_memory <= mem_available() + (256 << 20)  # what is free, not MemTotal
    with LLM(stories_dir, dtype="float32", device="cpu", policy="auto", offload_dir=offload, workload=short):
        pass
    assert len(counted_profiles) == 1  # cached
    # the rates are the compute device's: an entry measured for a GPU engine of this machine (first in
    # the file) is not what a CPU engine plans with
    cpu_entry = json.load(open(cache_path(CACHE_FILE)))["entries"][0]
    assert cpu_entry["key"]["compute"] == "cpu"
    gpu_profile = dict(cpu_entry["profile"], host_to_device_bytes_per_s=1.0)
    write_entries(cache_path(CACHE_FILE), [{"key": machine_key(torch.float32, torch.device("cuda")),
                                            "profile": gpu_profile}, cpu_entry], "test")
    assert this_machine(LLM, offload, torch.float32, torch.device("cpu")).host_to_device == spec.host_to_device > 1
    # the cache keeps rates, not capacities; a damaged file is measured again
    first, path = spec, cache_path(CACHE_FILE)
    data = json.load(open(path))
    data["entries"][0]["profile"].update(disk_memory_bytes=1, gpu_memory_bytes=1, cpu_memory_bytes=1)
    json.dump(data, open(path, "w"))
    again = this_machine(LLM, offload, torch.float32)
    assert len(counted_profiles) == 1 and again.host_to_device == first.host_to_device
    assert again.gpu_memory == again.cpu_memory > 1
    assert abs(again.disk_memory - shutil.disk_usage(offload).free) < 1 << 30  # read now, not the cached 1 byte
    with open(path, "w") as f:
        f.write("{not json")
    # measured again: the call counted, its measurement (the real one ran above) not repeated (30 s)
    monkeypatch.setattr(profiler, "profile_machine", lambda *args, **kwargs: (counted_profiles.append(args), first)[1])
    this_machine(LLM, offload, torch.float32)
    assert len(counted_profiles) == 2 and json.load(open(path))["entries"]  # the damaged file rewritten


IN_A_GROUP = """
import json, torch
from flexsarathi import LLM, SamplingParams
from flexsarathi.machine.cache_file import cache_path, write_entries
from flexsarathi.machine.this_machine import CACHE_FILE, machine_key
from policy_search import Workload
from tests.policy_search.conftest import host_profile
# this machine's rates as a cached entry would hold them (round figures: the test is about capacities)
write_entries(cache_path(CACHE_FILE), [{"key": machine_key(torch.bfloat16),
                                        "profile": host_profile(dequant_rate=5e9).to_dict()}], "test")
with LLM("dummy:opt-350m", dtype="bfloat16", device="cpu", policy="auto", offload_dir=OFFLOAD,
         workload=Workload(prompt_len=32, gen_len=8)) as llm:
    out = llm.generate([[5] * 32] * 4, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    m = llm.engine.memory
    print(json.dumps({"w_disk": llm.engine.policy.w_disk, "tokens": [len(o.token_ids) for o in out],
                      "host": m.budget.host, "peak": m.peak("gpu") + m.peak("cpu")}))
"""


def test_auto_in_a_memory_cgroup_plans_for_the_group_and_runs_there(tmp_path):
    """dummy:opt-350m (0.62 GiB of bf16 weights) in a 1 GiB group, where the interpreter and torch
    take ~0.35: this machine's capacities are the group's, so the plan streams most layers from disk
    and the engine runs within them (before, MemTotal's 24 GiB would have been planned)."""
    from tests.offload.test_free_memory import _answer, _in_cgroup

    code = IN_A_GROUP.replace("OFFLOAD", repr(str(tmp_path / "offload")))
    done = _in_cgroup(code, 1 << 30, f"flexsarathi_test_auto_{tmp_path.name}")
    answer = _answer(done)
    assert answer["w_disk"] > 0.5 and answer["tokens"] == [8] * 4
    assert answer["host"] < 1 << 30 and answer["peak"] <= answer["host"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_auto_engine_on_the_cpu_of_a_machine_with_a_gpu_plans_for_the_cpu(stories_dir, tmp_path, monkeypatch):
    """device="cpu" where CUDA is there: the planner's machine is the host (its rates cached under
    the CPU's key, its RAM both tiers), not the GPU beside it."""
    from tests.policy_search.conftest import host_profile

    monkeypatch.setenv("FLEXSARATHI_CACHE_DIR", str(tmp_path / "cache"))
    write_entries(cache_path(CACHE_FILE), [{"key": machine_key(torch.float32, torch.device("cpu")),
                                            "profile": host_profile(dequant_rate=5e9).to_dict()}], "test")
    spec = this_machine(LLM, str(tmp_path / "offload"), torch.float32, torch.device("cpu"))
    assert spec.compute_on_host and spec.host_memory == spec.gpu_memory == spec.cpu_memory
    assert spec.gpu_memory <= mem_available() + (256 << 20)  # the RAM that is free, not the GPU's memory
    short = Workload(prompt_len=64, gen_len=16)
    with LLM(stories_dir, dtype="float32", device="cpu", policy="auto", offload_dir=str(tmp_path / "offload"),
             workload=short) as llm:
        assert llm.engine.memory.budget.host is not None  # planned as one RAM
        assert llm.generate("Once upon a time", use_tqdm=False)[0].token_ids
