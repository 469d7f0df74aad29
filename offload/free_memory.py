"""How much memory the compute device can still give this process, now: what a default engine sizes
its running set by (LLMEngine, EngineConfig.fit_running).

On a GPU, what the driver says is free. On the CPU, the kernel's MemAvailable (free memory plus
the page cache it can drop), lowered to the room left under every memory cgroup limit this process
sits in: in a container /proc/meminfo shows the host's memory, and a job sized by it is OOM-killed
at the container's limit. A cgroup's room is its limit less its usage, plus the inactive file
cache it counts (reclaimed before the limit kills anything).
"""
from __future__ import annotations

import os

import torch

CGROUP_ROOT = "/sys/fs/cgroup"
# (limit, usage, inactive file cache key in memory.stat) per cgroup version; v1 also writes an
# unlimited limit as a huge number (PAGE_COUNTER_MAX pages), v2 as "max"
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
_V2 = ("memory.max", "memory.current", "inactive_file")


def free_bytes(device: torch.device) -> int:
    """Bytes the compute device can still allocate for this process (see the module's docstring)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return min([mem_available()] + [room for room in (_cgroup_room(d, names) for d, names in _cgroup_dirs())
                                    if room is not None])


def mem_available() -> int:
    """/proc/meminfo's MemAvailable in bytes."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read {field} from /proc/meminfo")


def _cgroup_dirs(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT):
    """(folder, file names) of each memory cgroup this process is in and of their ancestors: a
    parent's limit binds its children too. A v1 hierarchy is mounted at root/memory, v2's at root
    (or root/unified beside v1 controllers). Folders that are not there are left out (a path seen
    from outside the container's cgroup namespace)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            mounts = [(os.path.join(root, "memory"), _V1)]
        elif controllers == "":
            mounts = [(root, _V2), (os.path.join(root, "unified"), _V2)]
        else:
            continue
        for mount, names in mounts:
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                folder = os.path.join(mount, *parts[:depth])
                if os.path.exists(os.path.join(folder, names[0])):
                    found.append((folder, names))
    return found


def _cgroup_room(folder: str, names: tuple[str, str, str]) -> int | None:
    """limit - usage + inactive file cache of one cgroup; None where it has no limit or cannot be read."""
    limit_name, usage_name, inactive_key = names
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit_text = f.read().strip()
        if limit_text == "max" or int(limit_text) >= 1 << 62:  # no limit (v2 "max"; v1 PAGE_COUNTER_MAX)
            return None
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read().strip())
        inactive = 0
        with open(os.path.join(folder, "memory.stat")) as f:
            for line in f:
                key, value = line.split()
                if key == inactive_key:
                    inactive = int(value)
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - usage + inactive)
