"""`Policy`: where every tensor kind lives and how passes are formed.

A leaf module (stdlib only) so that both the runtime (offload/, flexsarathi/) and the planner
import it without importing each other. FlexGen's symbols are given in brackets.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields

from policy_search.errors import FlexSarathiError
from policy_search.json_file import read_json_file, unknown_keys

TIERS = ("gpu", "cpu", "disk")  # where a tensor can live, fastest first; fractions follow this order
SCHEDULERS = ("decode-maximal", "block")
KV_ADMISSIONS = ("on-demand", "reserve")
_FRACTION_KINDS = {
    "weights": ("w_gpu", "w_cpu", "w_disk"),  # (wg, wc, wd)
    "KV cache": ("kv_gpu", "kv_cpu", "kv_disk"),  # (cg, cc, cd)
    "activations": ("act_gpu", "act_cpu", "act_disk"),  # (hg, hc, hd)
}
_TOL = 1e-6
# The largest count a policy field may hold: beyond any machine's sequences, tokens or layers, and
# within what tensor sizes and floats (the estimate's arithmetic) represent.
MAX_COUNT = 2**31 - 1


class PolicyError(FlexSarathiError):
    """A policy field (or policy file) is invalid; the message names the field."""


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 8  # (gbs) sequences per micro-batch ("GPU batch")
    num_gpu_batches: int = 1  # micro-batches per pass; weights are loaded once per pass for all
    w_gpu: float = 1.0
    w_cpu: float = 0.0
    w_disk: float = 0.0
    kv_gpu: float = 1.0
    kv_cpu: float = 0.0
    kv_disk: float = 0.0
    act_gpu: float = 1.0
    act_cpu: float = 0.0
    act_disk: float = 0.0
    compress_weight: bool = False  # 4-bit group-wise weights, dequantized right before use
    compress_kv: bool = False  # 4-bit group-wise KV cache
    cpu_attention: bool = False  # decode attention runs on the CPU where the KV cache lives there
    # Mixture of experts (no effect on dense models). routed_expert_reads: a layer's experts on the
    # cpu or disk tier are read after its router ran, only those some row of the pass routes to.
    # cpu_experts: the cpu tier's part of the experts is computed on the CPU where it lives (only
    # activations cross, like cpu_attention) instead of being copied to the compute device.
    routed_expert_reads: bool = False
    cpu_experts: bool = False
    prefill_budget: int = 512  # prompt tokens per pass (decode-maximal scheduler)
    overlap: bool = True  # I/O of the next layer / micro-batch overlaps the current compute
    # Layers whose weights load ahead of the one computing (overlap on): each costs one more layer
    # working buffer. 2 keeps a disk queue full across layer boundaries (measured: decode passes of
    # disk-streamed opt-1.3b 5% faster on the development VM); 1 is FlexGen's double buffering.
    weight_prefetch: int = 1
    scheduler: str = "decode-maximal"  # or "block" (FlexGen's schedule, the baseline)
    pin_weight: bool = True  # pin CPU-tier weights on CUDA (faster copies, costs locked RAM)
    # KV admission (decode-maximal; block always reserves): "on-demand" admits a request when its
    # prompt fits, grows tables while decoding and preempts (recomputes) the latest admitted when
    # the cache runs short; "reserve" admits only when prompt + max_tokens fit, never preempting.
    kv_admission: str = "on-demand"
    # KV-cache capacity in tokens (every layer holds this many; split over the tiers by the KV
    # fractions). None: room for max_running sequences of the longest request of each generate
    # (every running lifetime fits, so on-demand never preempts).
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches", "prefill_budget", "weight_prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PolicyError(f"Policy.{name} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:
                raise PolicyError(f"Policy.{name} must be at most {MAX_COUNT}, got {value!r}")
        for kind, names in _FRACTION_KINDS.items():
            for name in names:
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise PolicyError(f"Policy.{name} must be a number in [0, 1], got {value!r}")
                if not -_TOL <= value <= 1 + _TOL:
                    raise PolicyError(f"Policy.{name} must be in [0, 1], got {value!r}")
            total = sum(getattr(self, n) for n in names)
            if abs(total - 1.0) > 1e-4:
                parts = " + ".join(f"{n}={getattr(self, n):g}" for n in names)
                raise PolicyError(f"Policy {kind} fractions must sum to 1: {parts} = {total:g}")
        for name in ("compress_weight", "compress_kv", "cpu_attention", "overlap", "pin_weight",
                     "routed_expert_reads", "cpu_experts"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"Policy.{name} must be true or false, got {getattr(self, name)!r}")
        if self.kv_admission not in KV_ADMISSIONS:
            raise PolicyError(f"Policy.kv_admission must be one of {KV_ADMISSIONS}, got {self.kv_admission!r}")
        if self.kv_cache_tokens is not None and (isinstance(self.kv_cache_tokens, bool) or not isinstance(
                self.kv_cache_tokens, int) or not 1 <= self.kv_cache_tokens <= MAX_COUNT):
            raise PolicyError(f"Policy.kv_cache_tokens must be a positive integer (at most {MAX_COUNT}) or null, "
                              f"got {self.kv_cache_tokens!r}")
        if self.scheduler not in SCHEDULERS:
            raise PolicyError(f"Policy.scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def kv_block_size(self) -> int:
        """The engine's default KV block: 64 tokens for a 4-bit pool (K grouped by block), 16 otherwise."""
        return 64 if self.compress_kv else 16

    @property
    def max_running(self) -> int:
        """Sequences that may run at once (one decode token each per pass)."""
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def weight_buffers(self) -> int:
        """Layer working buffers for streamed weights: the computing layer's and the prefetched."""
        return self.weight_prefetch + 1 if self.overlap else 1

    @property
    def weight_fractions(self) -> tuple[float, float, float]:
        return (self.w_gpu, self.w_cpu, self.w_disk)

    @property
    def kv_fractions(self) -> tuple[float, float, float]:
        return (self.kv_gpu, self.kv_cpu, self.kv_disk)

    @property
    def act_fractions(self) -> tuple[float, float, float]:
        return (self.act_gpu, self.act_cpu, self.act_disk)

    def replace(self, **changes) -> "Policy":
        return dataclasses.replace(self, **changes)

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "policy") -> "Policy":
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a JSON object of policy fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"{source}: unknown policy field(s) {unknown_keys(unknown, known)}; "
                              f"known fields: {sorted(known)}")
        try:
            return cls(**data)
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)  # never leave a half-written policy file

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Policy":
        data = read_json_file(path, "policy file", PolicyError)
        # A file written by `flexsarathi policy --json` holds {"policy": {...}, "estimate": {...}}.
        if isinstance(data, dict) and "policy" in data:
            return cls.from_dict(data["policy"], source=f"policy file {path}, field 'policy'")
        return cls.from_dict(data, source=f"policy file {path}")
