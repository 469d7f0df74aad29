"""Describe this CPU: its model, cores, the instruction-set flags that decide which matmul kernels
are fast (bf16 / fp16 / int8 / AMX), and what torch makes of them. The one place that reads
/proc/cpuinfo: benchmarks print it in their headers and the compute dtype's cache is keyed by it.
"""
from __future__ import annotations

import os
import platform

import torch

# Flags that change which CPU kernels run and how fast: AVX2/FMA/F16C (fp32 and fp16 conversion),
# AVX-512 and its bf16 / fp16 / VNNI extensions, and AMX tiles.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                  "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
# Environment variables that make torch / oneDNN use fewer of the CPU's instructions (set before
# torch is imported); e.g. ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 emulates an AVX2 machine.
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _first_processor(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields ({} where there is no such file): its block ends at the first
    blank line."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed; ("", {}) where there is no such file."""
    fields = _first_processor(path)
    return fields.get("model name", ""), set(fields.get("flags", "").split())


def cpu_generation(path: str = "/proc/cpuinfo") -> str:
    """"family F model M" of the first processor listed ("" where not listed): a VM's model name is
    often just "AMD EPYC", while the family and model tell the core generation, and with it the
    throughput of the instructions the int8 kernel is made of (family 25 model 1: Zen 3)."""
    fields = _first_processor(path)
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_description() -> dict:
    """The CPU model, cores, relevant flags present, torch's CPU capability and the ISA overrides
    set in the environment (only those set)."""
    model, flags = _cpuinfo()
    return {"cpu": model or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "flags": [f for f in RELEVANT_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "overrides": {k: os.environ[k] for k in ISA_OVERRIDES if k in os.environ}}


def cpu_line(dtype: torch.dtype | str | None = None) -> str:
    """One line for a benchmark's header: the CPU, its flags, torch's capability and threads,
    and (given) the dtype the benchmark computes in."""
    d = cpu_description()
    overrides = "".join(f", {k}={v}" for k, v in d["overrides"].items())
    computes = f"; computes in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
    generation = cpu_generation()
    return (f"CPU: {d['cpu']}{f' ({generation})' if generation else ''}, {d['cores']} cores; flags: {' '.join(d['flags']) or 'none of note'}; "
            f"torch {torch.__version__} (capability {d['torch_cpu_capability']}{overrides}, "
            f"{torch.get_num_threads()} threads){computes}")
