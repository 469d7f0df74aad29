"""`HardwareSpec`: capacities, link bandwidths and compute rates of one GPU machine.

Presets: `t4` (FlexGen's machine and its fitted constants), `a100-40g`, `a100-80g`, `h100-80g`,
`h200` (datasheet figures derated as noted), or a JSON profile (`HardwareSpec.load`) such as the one
`flexsarathi profile` measures. All fields are SI: bytes, bytes/s, FLOP/s, values/s.

JSON schema (`save` writes it, `load` reads it; unknown or missing fields are errors naming them):

    {"format": "flexsarathi-hardware", "version": 1, "name": "...", "notes": "...",
     "gpu_memory_bytes": ..., "cpu_memory_bytes": ..., "disk_memory_bytes": ...,
     "memory_usable_fraction": 0.8,
     "host_to_device_bytes_per_s": ..., "device_to_host_bytes_per_s": ...,
     "disk_to_host_bytes_per_s": ..., "host_to_disk_bytes_per_s": ...,
     "gpu_matmul_prefill_flops": ..., "gpu_matmul_decode_flops": ...,
     "gpu_memory_bandwidth_bytes_per_s": ...,
     "gpu_attention_prefill_flops": ..., "gpu_attention_decode_flops": ...,
     "cpu_matmul_flops": ..., "cpu_attention_flops": ...,
     "gpu_dequant_values_per_s": ..., "cpu_dequant_values_per_s": ...,
     "compute_on_host": false, "layer_overhead_seconds": 0.0, "graph_layer_overhead_seconds": null,
     "step_overhead_seconds": 0.0, "sequence_overhead_seconds": 0.0,
     "disk_read_cpu_seconds_per_byte": 0.0, "cpu_int4_matmul_flops": null,
     "gpu_int4_matmul_flops": null, "cpu_memory_bandwidth_bytes_per_s": null, "host_memory_bytes": null}

`memory_usable_fraction` (default 0.8), `compute_on_host` (default false), `host_memory_bytes`
(default null; with compute_on_host the RAM the gpu and cpu tiers share: `host_budget`),
`layer_overhead_seconds`, `step_overhead_seconds`, `sequence_overhead_seconds`,
`disk_read_cpu_seconds_per_byte` (default 0),
`graph_layer_overhead_seconds` (default null: decode passes priced as eager ones) and
`cpu_int4_matmul_flops` and `gpu_int4_matmul_flops` (default null: no int4 kernel figure, 4-bit weights
priced as dequantization + matmul) and `cpu_memory_bandwidth_bytes_per_s` (default null: see
`cpu_read_bandwidth`) may be left out.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields

from policy_search.errors import SpecError
from policy_search.json_file import read_json_file, unknown_keys
from policy_search.units import GB, GiB, TFLOPS, fmt_bytes

FORMAT = "flexsarathi-hardware"
VERSION = 1

# JSON key -> dataclass field. Keys carry their unit so a profile reads unambiguously.
_JSON_KEYS = {
    "gpu_memory_bytes": "gpu_memory",
    "cpu_memory_bytes": "cpu_memory",
    "disk_memory_bytes": "disk_memory",
    "memory_usable_fraction": "memory_usable_fraction",
    "host_to_device_bytes_per_s": "host_to_device",
    "device_to_host_bytes_per_s": "device_to_host",
    "disk_to_host_bytes_per_s": "disk_to_host",
    "host_to_disk_bytes_per_s": "host_to_disk",
    "gpu_matmul_prefill_flops": "gpu_matmul_prefill_flops",
    "gpu_matmul_decode_flops": "gpu_matmul_decode_flops",
    "gpu_memory_bandwidth_bytes_per_s": "gpu_memory_bandwidth",
    "gpu_attention_prefill_flops": "gpu_attention_prefill_flops",
    "gpu_attention_decode_flops": "gpu_attention_decode_flops",
    "cpu_matmul_flops": "cpu_matmul_flops",
    "cpu_attention_flops": "cpu_attention_flops",
    "gpu_dequant_values_per_s": "gpu_dequant_rate",
    "cpu_dequant_values_per_s": "cpu_dequant_rate",
    "compute_on_host": "compute_on_host",
    "layer_overhead_seconds": "layer_overhead",
    "graph_layer_overhead_seconds": "graph_layer_overhead",
    "step_overhead_seconds": "step_overhead",
    "sequence_overhead_seconds": "sequence_overhead",
    "disk_read_cpu_seconds_per_byte": "disk_read_cpu",
    "cpu_int4_matmul_flops": "cpu_int4_matmul_flops",
    "gpu_int4_matmul_flops": "gpu_int4_matmul_flops",
    "cpu_memory_bandwidth_bytes_per_s": "cpu_memory_bandwidth",
    "host_memory_bytes": "host_memory",
}
_OPTIONAL_KEYS = ("memory_usable_fraction", "compute_on_host", "layer_overhead_seconds", "graph_layer_overhead_seconds",
                  "step_overhead_seconds", "sequence_overhead_seconds", "disk_read_cpu_seconds_per_byte",
                  "cpu_int4_matmul_flops", "gpu_int4_matmul_flops", "cpu_memory_bandwidth_bytes_per_s",
                  "host_memory_bytes")
_NOT_RATES = ("gpu_memory", "memory_usable_fraction")  # the positive fields that are no rate per second
_NULLABLE = ("cpu_int4_matmul_flops", "gpu_int4_matmul_flops", "cpu_memory_bandwidth", "graph_layer_overhead",
             "host_memory")


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    # capacities, bytes; a tier may be 0 (no disk, say)
    gpu_memory: float
    cpu_memory: float
    disk_memory: float
    # links, bytes/s
    host_to_device: float
    device_to_host: float
    disk_to_host: float
    host_to_disk: float
    # GPU compute. A matmul of t tokens over a layer's weights costs
    #   max(flops(t) / gpu_matmul_prefill_flops,              large, compute-bound shapes
    #       flops(decode tokens) / gpu_matmul_decode_flops,    skinny decode-shaped rows
    #       fp16 weight bytes / gpu_memory_bandwidth)          every micro-batch streams the weights from HBM
    # so prompt tokens ride along decode tokens for free until the pass turns compute-bound (SARATHI).
    gpu_matmul_prefill_flops: float
    gpu_matmul_decode_flops: float
    gpu_memory_bandwidth: float
    gpu_attention_prefill_flops: float  # prompt (chunk) attention
    gpu_attention_decode_flops: float  # one query token against its cache (also bounded by HBM bytes)
    # CPU compute: delegated decode attention where the KV cache lives on the CPU (or disk)
    cpu_matmul_flops: float  # matmuls on the CPU: MoE experts computed where they live (cpu_experts)
    cpu_attention_flops: float
    # 4-bit group-wise dequantization (and quantization on store), values/s
    gpu_dequant_rate: float
    cpu_dequant_rate: float
    # FlexGen plans against 80% of each tier: its memory model (and ours) misses allocator slack,
    # CUDA context, pinned staging and fragmentation.
    memory_usable_fraction: float = 0.8
    # No GPU: the compute device is the host CPU and the "gpu" tier is a budgeted working set in host
    # memory (DESIGN.md, Tiers). Then host->device and device->host copies are memcpys run by the same
    # cores that compute, so they add to the compute time instead of overlapping it, and disk reads
    # land in the working buffers directly (no second copy). `flexsarathi profile` sets it without CUDA.
    compute_on_host: bool = False
    # Fixed seconds a pass costs per layer and micro-batch beyond its math: the executor's
    # bookkeeping and thread hand-offs, per-call costs of small ops (kernel launches on a GPU). The
    # presets carry one measured on a GPU machine's host (GPU_LAYER_OVERHEAD); profiles measure their own.
    layer_overhead: float = 0.0
    # The same for a decode pass replayed from a CUDA graph (the engine's default where weights, KV
    # and activations all stay on the GPU: flexsarathi/engine/graph_passes.py); None: not measured,
    # such passes priced as eager ones. Profiles on CUDA measure it.
    graph_layer_overhead: float | None = None
    # Host seconds an engine step costs outside its pass (scheduling, building the micro-batches,
    # sampling, handing out outputs): step_overhead, plus sequence_overhead per sequence the pass
    # computes. Serial with the pass: the next pass starts after it. Profiles measure both; presets
    # carry the figures measured on the CPU path (STEP_OVERHEAD, SEQUENCE_OVERHEAD).
    step_overhead: float = 0.0
    sequence_overhead: float = 0.0
    # CPU seconds the host spends per byte read from disk (the store's reader threads: O_DIRECT
    # syscalls, page pinning, completions). Matters where those cores compute (compute_on_host);
    # presets leave it at 0, profiles measure it.
    disk_read_cpu: float = 0.0
    # FLOP/s of torch's CPU int4 kernel (quant/cpu_matmul.py linear_4bit) on the layer's 4-bit weights
    # at a decode row count, dequantization inside its tiles included; None where the kernel does not
    # cover the machine or dtype (and in presets and older profiles): 4-bit weights are then priced
    # as dequantization + matmul. Used for passes on the host with few rows (cost_model.py).
    cpu_int4_matmul_flops: float | None = None
    # FLOP/s of the fused Triton kernel (quant/triton_kernels.py) on the layer's 4-bit weights at a
    # decode row count on an sm_80+ GPU: micro-batches of at most GPU_INT4_KERNEL_MAX_ROWS rows multiply
    # with it, reading the codes (no dequantization). None (presets, older profiles, a GPU below sm_80):
    # 4-bit weights priced as dequantization + matmul there too.
    gpu_int4_matmul_flops: float | None = None
    # Bytes/s the CPU's matmuls stream weights from host memory at (cpu_experts: a decode micro-batch
    # routes a few rows to each expert, so reading the expert bounds it). None: `cpu_read_bandwidth`.
    cpu_memory_bandwidth: float | None = None
    # The host's RAM, where it is also the compute device's memory (compute_on_host): the gpu and
    # cpu tiers then share it, held together within host_budget. `flexsarathi profile` writes it
    # without CUDA; None (presets, older profiles, a GPU machine): each tier's capacity alone.
    host_memory: float | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"HardwareSpec.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.notes, str):
            raise SpecError(f"HardwareSpec.notes must be a string, got {self.notes!r}")
        for f in fields(self):
            if f.name in ("name", "notes"):
                continue
            if f.name in _NULLABLE and getattr(self, f.name) is None:
                continue
            if f.name == "compute_on_host":
                if not isinstance(self.compute_on_host, bool):
                    raise SpecError(f"HardwareSpec.compute_on_host must be true or false, got "
                                    f"{self.compute_on_host!r}")
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                raise SpecError(f"HardwareSpec.{f.name} must be a finite number, got {value!r}")
            # a tier may be empty (no disk) and the overhead nil; rates and the GPU must not be
            may_be_zero = (f.name.endswith("_memory") and f.name != "gpu_memory") or f.name in (
                "layer_overhead", "graph_layer_overhead", "step_overhead", "sequence_overhead", "disk_read_cpu")
            if value < 0 or (value == 0 and not may_be_zero):
                raise SpecError(f"HardwareSpec.{f.name} must be {'>= 0' if may_be_zero else '> 0'}, "
                                f"got {value!r}")
            # a rate below one unit a second (5e-324 bytes/s) turns a pass's bytes into inf seconds,
            # the estimate into NaN and the search's LP into a solver failure
            if f.name not in _NOT_RATES and not may_be_zero and value < 1:
                raise SpecError(f"HardwareSpec.{f.name} must be >= 1 (a rate per second), got {value!r}")
        if not 0 < self.memory_usable_fraction <= 1:
            raise SpecError("HardwareSpec.memory_usable_fraction must be in (0, 1], got "
                            f"{self.memory_usable_fraction!r}")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def gpu_budget(self) -> float:
        """Bytes of GPU memory the planner may fill."""
        return self.gpu_memory * self.memory_usable_fraction

    @property
    def cpu_budget(self) -> float:
        return self.cpu_memory * self.memory_usable_fraction

    @property
    def disk_budget(self) -> float:
        return self.disk_memory * self.memory_usable_fraction

    @property
    def cpu_read_bandwidth(self) -> float:
        """cpu_memory_bandwidth where known; else on a host compute device its memory bandwidth (the
        same memory), and on a GPU machine the host->device rate: no faster than the copy it saves."""
        if self.cpu_memory_bandwidth is not None:
            return self.cpu_memory_bandwidth
        return self.gpu_memory_bandwidth if self.compute_on_host else self.host_to_device

    def budgets(self) -> dict[str, float]:
        return {"gpu": self.gpu_budget, "cpu": self.cpu_budget, "disk": self.disk_budget}

    @property
    def host_budget(self) -> float | None:
        """Where the compute device is the host (compute_on_host) and its RAM is known (host_memory),
        the gpu and cpu tiers are both that RAM: together they stay within its usable fraction
        (each also within its own budget). None otherwise: each tier's budget alone."""
        if not self.compute_on_host or self.host_memory is None:
            return None
        return self.host_memory * self.memory_usable_fraction

    def total_budget(self) -> float:
        """Bytes every tier together may hold (the gpu and cpu tiers' sum capped by host_budget)."""
        ram = self.gpu_budget + self.cpu_budget
        return (ram if self.host_budget is None else min(ram, self.host_budget)) + self.disk_budget

    def replace(self, **changes) -> "HardwareSpec":
        return dataclasses.replace(self, **changes)

    def with_memory(self, gpu: float | None = None, cpu: float | None = None,
                    disk: float | None = None) -> "HardwareSpec":
        """Override capacities (bytes); None keeps the preset's."""
        changes = {k: v for k, v in (("gpu_memory", gpu), ("cpu_memory", cpu),
                                     ("disk_memory", disk)) if v is not None}
        return self.replace(**changes) if changes else self

    def describe(self) -> str:
        return (f"{self.name}: GPU {fmt_bytes(self.gpu_memory)}, CPU {fmt_bytes(self.cpu_memory)}, "
                f"disk {fmt_bytes(self.disk_memory)} (planned at {self.memory_usable_fraction:.0%}"
                + ("" if self.host_budget is None else f"; GPU + CPU one {fmt_bytes(self.host_memory)} RAM")
                + "); "
                f"h2d {self.host_to_device / GB:.2f} GB/s, d2h {self.device_to_host / GB:.2f} GB/s, "
                f"disk read {self.disk_to_host / GB:.2f} GB/s, write {self.host_to_disk / GB:.2f} GB/s; "
                f"{'compute (host CPU)' if self.compute_on_host else 'GPU'} "
                f"{self.gpu_matmul_prefill_flops / TFLOPS:.3g} / "
                f"{self.gpu_matmul_decode_flops / TFLOPS:.3g} TFLOP/s (prefill / decode), "
                f"CPU attention {self.cpu_attention_flops / TFLOPS:.3g} TFLOP/s")

    # ---- presets and JSON ------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "HardwareSpec":
        key = name.strip().lower()
        if key not in PRESETS:
            raise SpecError(f"unknown hardware preset {name!r}; presets: {', '.join(PRESETS)} "
                            "(or a JSON profile path)")
        return PRESETS[key]

    @classmethod
    def resolve(cls, name_or_path: str, what: str = "--hardware") -> "HardwareSpec":
        """A preset name or a JSON profile path (what `--hardware` accepts); `what` names the argument
        in the error (`hardware=` in the API)."""
        if name_or_path.strip().lower() in PRESETS:
            return cls.preset(name_or_path)
        if os.path.exists(name_or_path) or name_or_path.endswith(".json"):
            return cls.load(name_or_path)
        raise SpecError(f"{what} {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                        "nor an existing JSON profile")

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "version": VERSION, "name": self.name, "notes": self.notes}
        for key, attr in _JSON_KEYS.items():
            out[key] = getattr(self, attr)
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "hardware profile") -> "HardwareSpec":
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format", FORMAT) != FORMAT:
            raise SpecError(f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        if data.get("version", VERSION) != VERSION:
            raise SpecError(f"{source}: field 'version' is {data.get('version')!r}; this planner "
                            f"reads version {VERSION}")
        known = set(_JSON_KEYS) | {"format", "version", "name", "notes"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{source}: unknown field(s) {unknown_keys(unknown, known)}; known: {sorted(known)}")
        missing = sorted(k for k in _JSON_KEYS if k not in data and k not in _OPTIONAL_KEYS)
        if missing:
            raise SpecError(f"{source}: missing field(s) {missing}")
        kwargs = {attr: data[key] for key, attr in _JSON_KEYS.items() if key in data}
        try:
            return cls(name=data.get("name") or os.path.basename(source), notes=data.get("notes", ""),
                       **kwargs)
        except SpecError as exc:
            raise SpecError(f"{source}: {_json_named(str(exc))}") from None

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HardwareSpec":
        data = read_json_file(path, "hardware profile", SpecError)
        return cls.from_dict(data, source=f"hardware profile {path}")


def _finite(value: int | float) -> bool:
    """A finite float, or an int a float holds (json reads 1e400 as inf, but 10**400 as an int)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _json_named(message: str) -> str:
    """A field's error as a profile names it: "HardwareSpec.host_to_device must ..." ->
    "field 'host_to_device_bytes_per_s' (HardwareSpec.host_to_device) must ..."."""
    for key, attr in _JSON_KEYS.items():
        if message.startswith(f"HardwareSpec.{attr} "):
            return f"field {key!r} (HardwareSpec.{attr}){message[len('HardwareSpec.' + attr):]}"
    return message


# ---------------------------------------------------------------------------------------------
# Presets. FlexGen's constants (flexgen/cost_model.py, CostModelConfig) are in GiB/s and 1e12 FLOP/s,
# fitted by gradient descent to runs on its GCP machine: one T4 16 GB, n1-highmem-32 (208 GB RAM),
# 1.5 TB local NVMe SSD (4 x 375 GB). For the other GPUs: datasheet peaks derated as noted; host
# figures are those of a typical server hosting that GPU. Override capacities with `with_memory`
# (CLI: --gpu-mem/--cpu-mem/--disk-mem), or measure the machine with `flexsarathi profile`.
# ---------------------------------------------------------------------------------------------

# Disk read on FlexGen's T4 machine. FlexGen fitted dtoc_bdw = 0.473 GiB/s, but with that figure its
# own OPT-175B run (weights 50% on disk, KV cache 100% on disk, gbs 32 x 8, 0.69 tok/s) is impossible:
# each decode layer-step reads 1.8 GB of weights + 6.5 GB of KV cache from disk, and the measured
# 0.69 tok/s leaves ~3.3 s for it, i.e. >= 2.5 GB/s (FlexGen's cost model itself predicts 0.16 tok/s
# for that policy). 2.65 GB/s is Google Cloud's documented read throughput of 4 x 375 GB NVMe local
# SSD (the 1.5 TB of FlexGen's machine); its write figure is 1.4 GB/s, but FlexGen's fitted store
# rate below is what its runs achieved and is kept.
T4_DISK_READ = 2.65 * GB

# Dequantization rate (values/s, weights once per micro-batch, KV on load and store). FlexGen gives no
# constant; 1e10 values/s balances its three published compressed T4 runs under this cost model
# (OPT-6.7B 29.12, OPT-30B 8.38, OPT-175B 1.12 tok/s -> estimates +15%, +4%, -12%). That is HBM bytes/s
# / 32: unpack, scale and add as separate PyTorch kernels, each a pass over memory. Other GPUs: same
# ratio to their datasheet HBM bandwidth.
T4_DEQUANT = 1e10
_DEQUANT_PER_HBM_BYTE = T4_DEQUANT / (320 * GB)

# The engine's host time per layer and micro-batch beyond the math, eager and for a decode pass
# replayed from a CUDA graph: `flexsarathi profile` on an H200 machine (16 cores of an Intel Xeon,
# family 6 model 207; dummy:opt-125m, fp16, one decode token per pass), 2026-11-28, commit f4ba45f.
# Host-bound, so it follows the host's CPU more than the GPU; a profile of the machine at hand
# replaces it.
GPU_LAYER_OVERHEAD = 0.545e-3
GPU_GRAPH_LAYER_OVERHEAD = 0.0
# The engine's host work around a pass (scheduling, micro-batches, sampling, outputs), per step and per
# sequence: `flexsarathi profile`'s measurement (flexsarathi/machine/profiler.py _step_overhead) on a
# 512-token vocabulary (../shared/models/stories260K, fp32, 1 and 32 sequences), where the sampler's
# vocabulary-wide reductions cost next to nothing, as on a GPU that runs them; 2 Zen 5 cores (AMD EPYC
# family 26 model 2), 2026-11-29, three runs: 79-81 us + 7.4-7.7 us per sequence. Not yet measured on
# a GPU machine's host; a profile of the machine at hand replaces it.
STEP_OVERHEAD = 80e-6
SEQUENCE_OVERHEAD = 7.5e-6


_T4 = HardwareSpec(
    name="t4",
    gpu_memory=16 * GiB,  # T4 datasheet: 16 GB GDDR6
    cpu_memory=208 * GiB,  # GCP n1-highmem-32
    disk_memory=1500 * GiB,  # FlexGen paper: 1.5 TB SSD (its cost model's nvme-mem default 1500)
    host_to_device=12.89 * GiB,  # FlexGen ctog_bdw (PCIe 3.0 x16)
    device_to_host=0.97 * GiB,  # FlexGen gtoc_bdw_cache (its KV-cache store path; hidden: 4.82)
    disk_to_host=T4_DISK_READ,  # see above (FlexGen's fitted dtoc_bdw: 0.473 GiB/s)
    host_to_disk=0.746 * GiB,  # FlexGen ctod_bdw_cache_p
    gpu_matmul_prefill_flops=21.24 * TFLOPS,  # FlexGen mm_flops_p
    gpu_matmul_decode_flops=4.3 * TFLOPS,  # FlexGen mm_flops_g
    gpu_memory_bandwidth=320 * GB * 0.8,  # T4 datasheet 320 GB/s, 80% achievable
    gpu_attention_prefill_flops=9.97 * TFLOPS,  # FlexGen bmm_flops_p
    gpu_attention_decode_flops=0.079 * TFLOPS,  # FlexGen bmm_flops_g
    cpu_matmul_flops=0.5 * TFLOPS,  # 16 Skylake cores x 2.0 GHz x 32 fp32 FLOP/cycle = 1.0, half achieved
    cpu_attention_flops=0.0123 * TFLOPS,  # FlexGen cpu_flops (fitted on CPU attention)
    gpu_dequant_rate=T4_DEQUANT,
    cpu_dequant_rate=2e9,  # estimate: a few cores of vectorised unpack + fma
    # estimate: one Skylake socket's 6 DDR4-2666 channels (128 GB/s peak), a third achieved by a VM's matmuls
    cpu_memory_bandwidth=40 * GB,
    layer_overhead=GPU_LAYER_OVERHEAD, graph_layer_overhead=GPU_GRAPH_LAYER_OVERHEAD,
    step_overhead=STEP_OVERHEAD, sequence_overhead=SEQUENCE_OVERHEAD,
    notes="FlexGen's T4 machine and fitted constants; disk read from GCP local-SSD docs (see source)",
)


def _datacenter(name: str, *, gpu_gib: float, hbm_gbps: float, dense_tflops: float,
                fp32_tflops: float, pcie_gbps: float, cpu_gib: float, disk_gib: float,
                disk_read_gbps: float, disk_write_gbps: float, cpu_attention_tflops: float,
                cpu_memory_gbps: float, notes: str) -> HardwareSpec:
    hbm = hbm_gbps * GB * 0.8  # ~80% of datasheet HBM bandwidth is achievable by streaming kernels
    return HardwareSpec(
        name=name, gpu_memory=gpu_gib * GiB, cpu_memory=cpu_gib * GiB, disk_memory=disk_gib * GiB,
        # pinned cudaMemcpy reaches ~70% of the PCIe x16 theoretical rate each way
        host_to_device=pcie_gbps * GB * 0.7, device_to_host=pcie_gbps * GB * 0.65,
        disk_to_host=disk_read_gbps * GB, host_to_disk=disk_write_gbps * GB,
        gpu_matmul_prefill_flops=dense_tflops * TFLOPS * 0.7,  # large bf16 GEMMs reach ~70% of dense peak
        gpu_matmul_decode_flops=dense_tflops * TFLOPS * 0.35,  # skinny rows: ~half that, above the HBM floor
        gpu_memory_bandwidth=hbm,
        gpu_attention_prefill_flops=dense_tflops * TFLOPS * 0.5,  # FlashAttention-2: ~50% of peak
        gpu_attention_decode_flops=fp32_tflops * TFLOPS * 0.5,  # CUDA-core math; HBM bytes usually bind
        cpu_matmul_flops=1.0 * TFLOPS,  # two-socket server, AVX-512/AMX, rough
        cpu_attention_flops=cpu_attention_tflops * TFLOPS,
        gpu_dequant_rate=hbm_gbps * GB * _DEQUANT_PER_HBM_BYTE, cpu_dequant_rate=8e9,
        cpu_memory_bandwidth=cpu_memory_gbps * GB * 0.3,  # a third of the sockets' peak: rough
        layer_overhead=GPU_LAYER_OVERHEAD, graph_layer_overhead=GPU_GRAPH_LAYER_OVERHEAD,
        step_overhead=STEP_OVERHEAD, sequence_overhead=SEQUENCE_OVERHEAD, notes=notes,
    )


PRESETS: dict[str, HardwareSpec] = {
    "t4": _T4,
    # A100 datasheet: 312 TFLOP/s dense bf16, 19.5 fp32; HBM2 1555 GB/s (40 GB), HBM2e 2039 GB/s (80 GB);
    # PCIe 4.0 x16 32 GB/s per direction. Host: 256/512 GB RAM, one PCIe 4.0 NVMe SSD (~3 GB/s read,
    # ~2 GB/s write through a filesystem). CPU attention: 4x FlexGen's T4 host (more cores, DDR4-3200);
    # CPU memory: two sockets x 8 DDR4-3200 channels = 410 GB/s peak (H100/H200 hosts: DDR5-4800, 614).
    "a100-40g": _datacenter("a100-40g", gpu_gib=40, hbm_gbps=1555, dense_tflops=312, fp32_tflops=19.5,
                            pcie_gbps=32, cpu_gib=256, disk_gib=2000, disk_read_gbps=3.0,
                            disk_write_gbps=2.0, cpu_attention_tflops=0.05, cpu_memory_gbps=410,
                            notes="A100 40GB PCIe4 datasheet, derated; typical host assumed"),
    "a100-80g": _datacenter("a100-80g", gpu_gib=80, hbm_gbps=2039, dense_tflops=312, fp32_tflops=19.5,
                            pcie_gbps=32, cpu_gib=512, disk_gib=4000, disk_read_gbps=3.0,
                            disk_write_gbps=2.0, cpu_attention_tflops=0.05, cpu_memory_gbps=410,
                            notes="A100 80GB datasheet, derated; typical host assumed"),
    # H100 SXM datasheet: 989 TFLOP/s dense bf16, 67 fp32, HBM3 3.35 TB/s, PCIe 5.0 x16 64 GB/s.
    # Host: 1 TB DDR5, PCIe 4.0 NVMe (~6 GB/s read / 4 write datasheet, about 2/3 through a filesystem).
    "h100-80g": _datacenter("h100-80g", gpu_gib=80, hbm_gbps=3350, dense_tflops=989, fp32_tflops=67,
                            pcie_gbps=64, cpu_gib=1024, disk_gib=4000, disk_read_gbps=4.0,
                            disk_write_gbps=2.5, cpu_attention_tflops=0.08, cpu_memory_gbps=614,
                            notes="H100 SXM datasheet, derated; typical host assumed"),
    # H200 datasheet: 141 GB HBM3e at 4.8 TB/s, same compute as H100 SXM, PCIe 5.0 x16.
    "h200": _datacenter("h200", gpu_gib=141e9 / GiB, hbm_gbps=4800, dense_tflops=989, fp32_tflops=67,
                        pcie_gbps=64, cpu_gib=2048, disk_gib=8000, disk_read_gbps=4.0,
                        disk_write_gbps=2.5, cpu_attention_tflops=0.08, cpu_memory_gbps=614,
                        notes="H200 SXM datasheet, derated; typical host assumed"),
}
