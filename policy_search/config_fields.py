"""Typed fields of an HF `config.json` and its RoPE: what hf_config.py (the parser) and
gemma3_config.py (Gemma 3's additions) both read with. Errors are SpecErrors naming the source and
the field."""
from __future__ import annotations

import math
from dataclasses import dataclass

from policy_search.errors import SpecError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (transformers' _compute_yarn_parameters): the ramp between interpolated and extrapolated
    # frequencies, and cos / sin scaled by attention_factor (None: from factor, mscale, mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


_REQUIRED = object()


def typed(cfg: dict, key: str, source: str, kind: type, default=_REQUIRED, low=None, high=None, above=None):
    """cfg[key] as a JSON `kind` (int, float or bool), in [low, high] and > above; `default` when absent or null
    (a SpecError when required); anything else a SpecError naming the source and the field."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise SpecError(f"{source}: required field {key!r} is missing")
        return default
    return typed_value(value, key, source, kind, low, high, above)


def typed_value(value, key: str, source: str, kind: type, low=None, high=None, above=None):
    """`value` checked as `typed` does."""
    if kind is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{source}: {key} must be true or false, got {value!r}")
        return value
    what = "an integer" if kind is int else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)) or (kind is int and int(value) != value):
        raise SpecError(f"{source}: {key} must be {what}, got {value!r}")
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high) or (
            above is not None and value <= above):
        bounds = [f">= {low}" if low is not None else None, f"> {above}" if above is not None else None,
                  f"<= {high}" if high is not None else None]
        raise SpecError(f"{source}: {key} must be {what} {' and '.join(b for b in bounds if b)}, got {value!r}")
    return value


def parse_rope(cfg: dict, source: str) -> RopeConfig:
    # transformers 5 writes {"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}};
    # transformers 4 writes "rope_theta" and an optional "rope_scaling" dict.
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise SpecError(f"{source}: {key} must be an object or null, got {cfg[key]!r}")
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise SpecError(f"{source}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    prefix = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"

    def param(key: str, kind: type, default, **bounds):
        return typed({f"{prefix}.{key}": merged.get(key)}, f"{prefix}.{key}", source, kind, default, **bounds)
    theta = cfg.get("rope_theta") if merged.get("rope_theta") is None else merged["rope_theta"]
    original = param("original_max_position_embeddings", int, None, low=1)
    if original is None:  # yarn: the config's own, else its max_position_embeddings (as transformers fills it in)
        original = typed(cfg, "original_max_position_embeddings", source, int,
                         cfg.get("max_position_embeddings") if kind == "yarn" else 8192, low=1)
    factor = param("factor", float, None, above=0.0)
    if factor is None:  # yarn without one: max_position_embeddings over the original (DeepSeek-V3's rule)
        longest = cfg.get("max_position_embeddings") if kind == "yarn" else None
        factor = longest / original if longest else 1.0
    return RopeConfig(
        theta=typed({"rope_theta": theta}, "rope_theta", source, float, 10000.0, above=0.0), kind=kind,
        factor=factor, low_freq_factor=param("low_freq_factor", float, 1.0, above=0.0),
        high_freq_factor=param("high_freq_factor", float, 4.0, above=0.0),
        original_max_position_embeddings=original, **(_yarn_fields(param) if kind == "yarn" else {}))


def _yarn_fields(param) -> dict:
    return dict(beta_fast=param("beta_fast", float, 32.0, above=0.0),
                beta_slow=param("beta_slow", float, 1.0, above=0.0),
                mscale=param("mscale", float, None), mscale_all_dim=param("mscale_all_dim", float, None),
                attention_factor=param("attention_factor", float, None, above=0.0),
                truncate=param("truncate", bool, True))
