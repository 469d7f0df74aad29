"""The hardware `policy="auto"` plans for when the user names none: this machine, measured once by
the profiler (`flexsarathi profile`'s measurement, ~20-40 s) and cached per machine, its
capacities read afresh on every use.

What is cached are the rates (copies, disk, matmuls, attention, the engine's overheads), which
belong to the machine; what is not are its capacities (free GPU memory, RAM, free disk in the
offload folder), which change between runs: a profile measured with 40 GB free on the disk must not
plan 40 GB there a week later. RAM is what this process can still allocate (MemAvailable under its
memory cgroups' limits: offload/free_memory.py), so a job in a container plans for the container.
The key: the compute device's kind (an engine on the CPU of a machine with a GPU plans for the CPU),
the CPU as torch uses it (model, cores, flags, capability), the GPU's name and its memory where
there is one, torch's version and threads, and the compute dtype the rates were measured in. The
cache is a small JSON file (`$FLEXSARATHI_CACHE_DIR` or ~/.cache/flexsarathi,
`hardware_profiles.json`); delete it to measure again (after measuring on a machine busy with other
work, say). A file that cannot be read is measured again and rewritten.
"""
from __future__ import annotations

import logging
import os
import shutil

import torch

from flexsarathi.machine.cache_file import cache_path, keep_others, read_entries, write_entries
from flexsarathi.machine.cpu_info import cpu_description
from offload.free_memory import free_bytes
from policy_search.errors import SpecError
from policy_search.hardware import HardwareSpec

CACHE_FILE = "hardware_profiles.json"
CACHE_VERSION = 1
MAX_CACHE_ENTRIES = 16  # other machines' entries kept beside this one's (a shared home folder)
log = logging.getLogger(__name__)


def this_machine_hardware(llm_class, dtype, device, offload_dir: str | None, say=None) -> HardwareSpec:
    """this_machine for an engine of these settings: its rates in the engine's compute dtype (as
    planned_model resolves it), the offload folder's disk. llm_class: flexsarathi.llm.LLM (the
    profiler times its engine; passed in, since LLM calls this)."""
    from flexsarathi.engine.llm_engine import DEFAULT_OFFLOAD_DIR, resolve_device, resolve_dtype

    device = resolve_device(device)
    compute = resolve_dtype(dtype, torch.float16, device)
    return this_machine(llm_class, offload_dir or DEFAULT_OFFLOAD_DIR, compute, device,
                        **({"say": say} if say else {}))


def this_machine(llm_class, offload_dir: str, dtype: torch.dtype, device: torch.device | None = None,
                 say=log.warning) -> HardwareSpec:
    """This machine as the planner sees it: the cached rates for its key (measured now, and cached,
    where there are none) with its capacities as they are now (device: the engine's compute device;
    a CUDA one's free memory is the gpu tier's; on the CPU the gpu and cpu tiers are one RAM, a GPU
    there or not; default the current GPU, else the CPU). say: where the one-time measurement is
    announced (it takes tens of seconds)."""
    from flexsarathi.engine.llm_engine import resolve_device
    from flexsarathi.machine.profiler import profile_machine  # noqa: PLC0415 - torch-heavy

    os.makedirs(offload_dir, exist_ok=True)  # the profile measures its disk; the capacity is its free space
    device = resolve_device(device)
    path, key = cache_path(CACHE_FILE), machine_key(dtype, device)
    entries = read_entries(path)
    cached = next((e for e in entries if e.get("key") == key), None)
    spec = None
    if cached is not None:
        try:
            spec = HardwareSpec.from_dict(cached["profile"], source=f"{path} (this machine's entry)")
        except (SpecError, KeyError, TypeError, ValueError):  # a damaged entry: measured again, never trusted
            spec = None
    if spec is None:
        say(f"no --hardware given: measuring this machine once for the planner (as `flexsarathi profile` does; "
            f"cached in {path})")
        spec = profile_machine(offload_dir, llm_class, dtype=dtype, log=say, device=device)
        write_entries(path, keep_others(entries, key, MAX_CACHE_ENTRIES) + [{"key": key, "profile": spec.to_dict()}],
                      "hardware profile")
    cuda = device.type == "cuda"
    ram = free_bytes(torch.device("cpu"))  # what the engine may still take of the RAM: cgroup limits included
    return spec.replace(gpu_memory=torch.cuda.mem_get_info(device)[0] if cuda else ram, cpu_memory=ram,
                        host_memory=None if cuda else ram, disk_memory=shutil.disk_usage(offload_dir).free)


def machine_key(dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """What the measured rates depend on (device: the engine's compute device; default the GPU
    where there is one)."""
    from flexsarathi.engine.llm_engine import resolve_device

    gpu = None
    if torch.cuda.is_available():
        gpu = {"name": torch.cuda.get_device_name(), "memory": torch.cuda.get_device_properties(0).total_memory}
    compute = resolve_device(device, check_available=False).type
    return {"version": CACHE_VERSION, "compute": compute, **cpu_description(), "gpu": gpu, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch.")}
