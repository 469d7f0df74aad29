"""Typed fields of an HF `config.json`, its RoPE and its kinds of layer (sliding or full): what
hf_config.py (the parser), gemma3_config.py and olmo_config.py (their families' additions) read with.
Errors are SpecErrors naming the source and the field."""
from __future__ import annotations

import math
from dataclasses import dataclass

from policy_search.errors import SpecError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_KINDS = ("sliding_attention", "full_attention")  # transformers' layer_types


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


def layer_kinds(cfg: dict, source: str, num_layers: int, every: int) -> tuple[str, ...]:
    """Each layer's kind: layer_types, else every `every`-th layer full (sliding_window_pattern)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = typed(cfg, "sliding_window_pattern", source, int, every, low=1)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in LAYER_KINDS for k in kinds):
        raise SpecError(f"{source}: layer_types must list one of {', '.join(LAYER_KINDS)} for each of the "
                        f"{num_layers} layers, got {kinds!r}")
    return tuple(kinds)


def rope_per_kind(cfg: dict, source: str, thetas: dict, local_key: str | None) -> tuple[RopeConfig, RopeConfig]:
    """(full layers' rope, sliding layers' rope) of a model with both kinds of layer (Gemma 3, OLMo 3):
    transformers 5 writes `rope_parameters` {"sliding_attention": {...}, "full_attention": {...}},
    transformers 4 `rope_theta` and `rope_scaling` (full layers) and, for some, a field of the sliding
    layers' base (local_key; None: there is none). thetas: the bases where the config names none."""
    per_kind = cfg.get("rope_parameters")
    if isinstance(per_kind, dict) and per_kind and set(per_kind) <= set(LAYER_KINDS):  # transformers 5
        ropes = []
        for kind, theta_key in (("full_attention", "rope_theta"), ("sliding_attention", local_key)):
            params = per_kind.get(kind) or {}
            if not isinstance(params, dict):
                raise SpecError(f"{source}: rope_parameters.{kind} must be an object, got {params!r}")
            # as transformers' setdefault: the kind's own base, else the config's field, else the default
            theta = params.get("rope_theta") or (theta_key and cfg.get(theta_key)) or thetas[kind]
            ropes.append(parse_rope({"rope_parameters": {**params, "rope_theta": theta},
                                     "max_position_embeddings": cfg.get("max_position_embeddings")},
                                    f"{source}: rope_parameters.{kind}"))
        return ropes[0], ropes[1]
    full = parse_rope({"rope_theta": cfg.get("rope_theta") or thetas["full_attention"],
                       "rope_scaling": cfg.get("rope_scaling"), "rope_parameters": per_kind,
                       "max_position_embeddings": cfg.get("max_position_embeddings")}, source)
    local = RopeConfig(theta=typed(cfg, local_key, source, float, thetas["sliding_attention"], above=0.0)
                       if local_key else thetas["sliding_attention"])
    return full, local
