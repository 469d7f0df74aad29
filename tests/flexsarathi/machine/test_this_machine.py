"""policy="auto" without hardware plans for this machine (flexsarathi/machine/this_machine.py): its
rates measured once by the profiler and cached per machine key, its capacities read afresh."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.machine import profiler
from flexsarathi.machine.cache_file import cache_path
from flexsarathi.machine.this_machine import CACHE_FILE, this_machine
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


def test_auto_without_hardware_plans_for_this_machine_measured_once_and_cached(stories_dir, tmp_path,
                                                                          counted_profiles):
    offload = str(tmp_path / "offload")
    short = Workload(prompt_len=64, gen_len=16)  # the default plans 512 + 32 tokens: beyond stories260K's context
    with LLM(stories_dir, dtype="float32", device="cpu", policy="auto", offload_dir=offload, workload=short) as llm:
        budget = llm.engine.memory.budget
        out = llm.generate("Once upon a time", use_tqdm=False)[0]
    assert len(counted_profiles) == 1 and out.token_ids
    entries = json.load(open(cache_path(CACHE_FILE)))["entries"]
    assert len(entries) == 1 and entries[0]["key"]["dtype"] == "float32"
    # the budgets are this machine's: its RAM for both RAM tiers (together too), the folder's free disk
    spec = this_machine(LLM, offload, torch.float32)
    assert budget.gpu == int(spec.gpu_budget) and budget.host == int(spec.host_budget)
    assert spec.host_memory == spec.cpu_memory == profiler._host_memory()
    with LLM(stories_dir, dtype="float32", device="cpu", policy="auto", offload_dir=offload, workload=short):
        pass
    assert len(counted_profiles) == 1  # cached
    # the cache keeps rates, not capacities; a damaged file is measured again
    first, path = spec, cache_path(CACHE_FILE)
    data = json.load(open(path))
    data["entries"][0]["profile"].update(disk_memory_bytes=1, gpu_memory_bytes=1, cpu_memory_bytes=1)
    json.dump(data, open(path, "w"))
    again = this_machine(LLM, offload, torch.float32)
    assert len(counted_profiles) == 1 and again.host_to_device == first.host_to_device
    assert again.gpu_memory == again.cpu_memory == profiler._host_memory()
    assert abs(again.disk_memory - shutil.disk_usage(offload).free) < 1 << 30  # read now, not the cached 1 byte
    with open(path, "w") as f:
        f.write("{not json")
    this_machine(LLM, offload, torch.float32)
    assert len(counted_profiles) == 2
