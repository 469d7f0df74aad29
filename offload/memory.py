"""Per-tier memory budgets and the engine's own accounting of what uses them.

Tiers are "gpu" (compute device memory; on a CPU-only machine a budgeted working set in host memory),
"cpu" (host RAM) and "disk" (the offload folder). Every placement reserves bytes here before it
allocates, so the engine fails early with the arithmetic instead of running out of memory halfway
through a pass. The accounting is ours, not the allocator's: it works the same on a CPU-only machine,
and on CUDA the report adds torch's own peak so the two can be compared.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from policy_search.policy import TIERS


def human_bytes(n: int | float) -> str:
    """Binary units, two decimals: 1536 -> '1.50 KiB', 512 -> '512 B'."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")


def _bytes_with_exact(n: int) -> str:
    # Human units for reading, exact bytes for checking the arithmetic by hand (below 1 KiB the
    # human form is already exact).
    return human_bytes(n) if abs(n) < 1024 else f"{human_bytes(n)} ({n} bytes)"


class MemoryBudgetError(RuntimeError):
    """A reservation would exceed a tier's capacity. The message carries the whole arithmetic."""

    def __init__(self, message: str, *, tier: str, what: str, requested: int, in_use: int,
                 capacity: int):
        super().__init__(message)
        self.tier = tier
        self.what = what
        self.requested = requested
        self.in_use = in_use
        self.capacity = capacity


@dataclass(frozen=True)
class TierBudget:
    """Capacity of each tier in bytes; None means unlimited. host: the gpu and cpu tiers together,
    where both are the host's RAM (HardwareSpec.host_budget: a CPU-only machine's profile)."""

    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None
    host: int | None = None

    def __post_init__(self) -> None:
        for tier in (*TIERS, "host"):
            capacity = getattr(self, tier)
            if capacity is not None and capacity < 0:
                raise ValueError(f"capacity of tier {tier!r} must be >= 0 or None, got {capacity}")

    def capacity(self, tier: str) -> int | None:
        _check_tier(tier)
        return getattr(self, tier)


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")


class MemoryTracker:
    """Reserve / release bytes per tier and per purpose ("what"), tracking current and peak use.

    Thread-safe: every read-modify-write of the counters happens under one lock, so a reservation
    made off the engine's thread (today all are made on it) cannot lose an update.
    """

    def __init__(self, budget: TierBudget | Mapping[str, int | None] | None = None,
                 device: torch.device | str | None = None):
        """device: the engine's compute device; on CUDA the report adds that device's torch peak
        (not the current device's: `--device cuda:1`)."""
        self.device = torch.device(device) if device is not None else None
        if budget is None:
            budget = TierBudget()
        elif not isinstance(budget, TierBudget):
            unknown = set(budget) - set(TIERS)
            if unknown:
                raise ValueError(f"unknown tiers {sorted(unknown)}; tiers are {', '.join(TIERS)}")
            budget = TierBudget(**budget)
        self.budget = budget
        self._lock = threading.Lock()
        self._in_use_by_what: dict[str, dict[str, int]] = {tier: {} for tier in TIERS}
        self._in_use: dict[str, int] = {tier: 0 for tier in TIERS}
        self._peak: dict[str, int] = {tier: 0 for tier in TIERS}
        self._peak_by_what: dict[str, dict[str, int]] = {tier: {} for tier in TIERS}

    # ---- reserve / release -------------------------------------------------------------------

    def reserve(self, tier: str, nbytes: int, what: str) -> None:
        """Account `nbytes` on `tier` for `what`, or raise MemoryBudgetError leaving nothing changed."""
        _check_tier(tier)
        nbytes = _checked_nbytes(nbytes)
        with self._lock:
            capacity = self.budget.capacity(tier)
            in_use = self._in_use[tier]
            if capacity is not None and in_use + nbytes > capacity:
                raise self._budget_error(tier, nbytes, what, in_use, capacity)
            self._check_host(tier, nbytes, what)
            by_what = self._in_use_by_what[tier]
            by_what[what] = by_what.get(what, 0) + nbytes
            peaks = self._peak_by_what[tier]
            peaks[what] = max(peaks.get(what, 0), by_what[what])
            self._in_use[tier] = in_use + nbytes
            self._peak[tier] = max(self._peak[tier], self._in_use[tier])

    def release(self, tier: str, nbytes: int, what: str) -> None:
        """Give back bytes reserved for `what`. Releasing more than was reserved is a bug: raise."""
        _check_tier(tier)
        nbytes = _checked_nbytes(nbytes)
        with self._lock:
            by_what = self._in_use_by_what[tier]
            held = by_what.get(what, 0)
            if nbytes > held:
                raise ValueError(
                    f"release of {_bytes_with_exact(nbytes)} for {what!r} on tier {tier!r}, "
                    f"but only {_bytes_with_exact(held)} is reserved for it")
            if held == nbytes:
                del by_what[what]
            else:
                by_what[what] = held - nbytes
            self._in_use[tier] -= nbytes

    @contextmanager
    def reservation(self, tier: str, nbytes: int, what: str) -> Iterator[None]:
        """Reserve for the duration of a `with` block (released even when the block raises)."""
        self.reserve(tier, nbytes, what)
        try:
            yield
        finally:
            self.release(tier, nbytes, what)

    # ---- queries ------------------------------------------------------------------------------

    def capacity(self, tier: str) -> int | None:
        return self.budget.capacity(tier)

    def in_use(self, tier: str) -> int:
        _check_tier(tier)
        with self._lock:
            return self._in_use[tier]

    def peak(self, tier: str) -> int:
        _check_tier(tier)
        with self._lock:
            return self._peak[tier]

    def available(self, tier: str) -> int | None:
        """Bytes still reservable on `tier` (within the host budget too, for gpu and cpu); None when
        nothing limits it."""
        capacity, host = self.capacity(tier), self.budget.host
        with self._lock:
            rooms = [] if capacity is None else [capacity - self._in_use[tier]]
            if host is not None and tier in _HOST_TIERS:
                rooms.append(host - sum(self._in_use[t] for t in _HOST_TIERS))
        return min(rooms) if rooms else None

    def in_use_by_what(self, tier: str) -> dict[str, int]:
        _check_tier(tier)
        with self._lock:
            return dict(self._in_use_by_what[tier])

    def peak_by_what(self, tier: str) -> dict[str, int]:
        """The most each purpose ever held on `tier` (those released since included: the load's own
        memory, offload/tiered_weights.py)."""
        _check_tier(tier)
        with self._lock:
            return dict(self._peak_by_what[tier])

    def reset_peak(self) -> None:
        """Start peak tracking afresh from the current use (e.g. between prefill and decode)."""
        with self._lock:
            for tier in TIERS:
                self._peak[tier] = self._in_use[tier]
                self._peak_by_what[tier] = dict(self._in_use_by_what[tier])

    # ---- reporting ----------------------------------------------------------------------------

    def report(self) -> dict[str, dict]:
        """Per tier: capacity, in_use, peak, by_what, peak_by_what; on CUDA the gpu tier adds torch's
        own peak."""
        with self._lock:
            report = {
                tier: {
                    "capacity": self.budget.capacity(tier),
                    "in_use": self._in_use[tier],
                    "peak": self._peak[tier],
                    "by_what": dict(self._in_use_by_what[tier]),
                    "peak_by_what": dict(self._peak_by_what[tier]),
                }
                for tier in TIERS
            }
        torch_peak = _torch_cuda_peak_bytes(self.device)
        if torch_peak is not None:
            report["gpu"]["torch_peak"] = torch_peak
        return report

    def format_report(self) -> str:
        lines = [] if self.budget.host is None else [
            f"host: gpu + cpu tiers within {human_bytes(self.budget.host)} (both this machine's RAM)"]
        for tier, entry in self.report().items():
            capacity = entry["capacity"]
            capacity_text = "unlimited" if capacity is None else human_bytes(capacity)
            line = (f"{tier:>4}: in use {human_bytes(entry['in_use'])}, "
                    f"peak {human_bytes(entry['peak'])}, capacity {capacity_text}")
            if "torch_peak" in entry:
                line += f", torch peak {human_bytes(entry['torch_peak'])}"
            lines.append(line)
            for what, nbytes in sorted(entry["by_what"].items(), key=lambda item: -item[1]):
                lines.append(f"        {what}: {human_bytes(nbytes)}")
            for what, nbytes in sorted(entry["peak_by_what"].items(), key=lambda item: -item[1]):
                if what not in entry["by_what"]:  # released since: the load's own memory
                    lines.append(f"        {what}: none now, peak {human_bytes(nbytes)}")
        return "\n".join(lines)

    __str__ = format_report

    def _check_host(self, tier: str, nbytes: int, what: str) -> None:
        """With the lock held: the gpu and cpu tiers together within the host budget."""
        host = self.budget.host
        if host is None or tier not in _HOST_TIERS:
            return
        used = {t: self._in_use[t] for t in _HOST_TIERS}
        if sum(used.values()) + nbytes > host:
            needed = sum(used.values()) + nbytes
            raise MemoryBudgetError(
                f"host memory budget exceeded reserving {what!r} on the {tier} tier (the gpu and cpu tiers are "
                f"both this machine's RAM): gpu {_bytes_with_exact(used['gpu'])} + cpu "
                f"{_bytes_with_exact(used['cpu'])} + {_bytes_with_exact(nbytes)} = {_bytes_with_exact(needed)} "
                f"> host capacity {_bytes_with_exact(host)}, short by {_bytes_with_exact(needed - host)}",
                tier=tier, what=what, requested=nbytes, in_use=sum(used.values()), capacity=host)

    def _budget_error(self, tier: str, nbytes: int, what: str, in_use: int,
                      capacity: int) -> MemoryBudgetError:
        breakdown = " + ".join(
            f"{name} {_bytes_with_exact(held)}"
            for name, held in sorted(self._in_use_by_what[tier].items(), key=lambda item: -item[1])
        ) or "nothing"
        needed = in_use + nbytes
        message = (
            f"{tier} memory budget exceeded reserving {what!r}: "
            f"asked {_bytes_with_exact(nbytes)}; "
            f"in use {_bytes_with_exact(in_use)} = {breakdown}; "
            f"{human_bytes(in_use)} + {human_bytes(nbytes)} = {_bytes_with_exact(needed)} "
            f"> capacity {_bytes_with_exact(capacity)}, "
            f"short by {_bytes_with_exact(needed - capacity)}"
        )
        return MemoryBudgetError(message, tier=tier, what=what, requested=nbytes, in_use=in_use,
                                 capacity=capacity)


_HOST_TIERS = ("gpu", "cpu")  # the tiers TierBudget.host caps together


def _checked_nbytes(nbytes: int) -> int:
    # operator.index accepts numpy integers and rejects floats, which would silently drift the sums.
    if isinstance(nbytes, bool):
        raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    try:
        nbytes = operator.index(nbytes)
    except TypeError:
        raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}") from None
    if nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
    return nbytes


def _torch_cuda_peak_bytes(device: torch.device | None) -> int | None:
    # Only for a CUDA engine, and only when CUDA is already in use: querying would otherwise
    # create a CUDA context as a side effect of printing a report.
    if device is None or device.type != "cuda":
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated(device))
    return None


def dequant_scratch_bytes(layer_shapes: Mapping[str, tuple[int, ...]], itemsize: int,
                          expert_stacks: Mapping[str, int] | None = None) -> int:
    """The gpu-tier bytes of a CUDA engine's one dequantized weight (quant/fused.py: a buffer grown
    to the largest matrix it dequantizes, in the compute dtype; a stack of experts is dequantized one
    expert's rows at a time); the planner prices the same (cost_model: largest_matrix_params x
    bytes_per_value)."""
    stacks = expert_stacks or {}
    return max((math.prod(shape) // stacks.get(name, 1) for name, shape in layer_shapes.items() if len(shape) == 2),
               default=0) * itemsize
