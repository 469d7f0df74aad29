"""Units used throughout the planner. Everything is stored in SI base units: bytes, bytes/s,
FLOP/s, seconds. FlexGen quotes memory and bandwidth in GiB (2**30 bytes) and compute in 1e12
FLOP/s; the presets convert with these constants so its figures can be copied verbatim."""
from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9  # decimal gigabyte, as datasheets quote bandwidth
TFLOPS = 1e12


def gib(num_bytes: float) -> float:
    return num_bytes / GiB


def fmt_bytes(num_bytes: float) -> str:
    """Human-readable size in binary units (GiB, MiB...)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
