"""What a Gemma 3 `config.json` says beyond a LLaMA-family one (hf_config.py calls in here).

- `gemma3_text` (Gemma3ForCausalLM: the 1B) and `gemma3` (Gemma3ForConditionalGeneration: 4B, 12B,
  27B, read for its text model: text_model_config.py, with Gemma3TextConfig's defaults).
- Layers are "sliding_attention" (keys within `sliding_window` of the query) or "full_attention":
  `layer_types`, or transformers 4's `sliding_window_pattern` (every pattern-th layer full).
- RoPE per kind of layer: transformers 5 writes `rope_parameters` {"sliding_attention": {...},
  "full_attention": {...}}; transformers 4 `rope_theta` (full layers, with `rope_scaling`) and
  `rope_local_base_freq` (sliding layers, unscaled).
- Scores scaled by `query_pre_attn_scalar ** -0.5`; logits optionally soft-capped.
Refused by name: attention-logit soft-capping (Gemma 2's; every attention kernel would need it) and
bidirectional attention (EmbeddingGemma's encoder).
"""
from __future__ import annotations

from policy_search.errors import SpecError
from policy_search.config_fields import RopeConfig, parse_rope, typed

LAYER_KINDS = ("sliding_attention", "full_attention")
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def gemma3_attention(cfg: dict, source: str, num_layers: int) -> dict:
    """HFConfig's attention fields of a gemma3 config (text_model_config's)."""
    for key, what in (("attn_logit_softcapping", "attention-logit soft-capping (Gemma 2's)"),
                      ("use_bidirectional_attention", "bidirectional attention (an encoder's)")):
        if cfg.get(key):
            raise SpecError(f"{source}: {key}={cfg[key]!r}: {what} is not supported")
    window = typed(cfg, "sliding_window", source, int, None, low=1)
    kinds = layer_kinds(cfg, source, num_layers)
    full, local = rope_per_kind(cfg, source)
    softcap = typed(cfg, "final_logit_softcapping", source, float, None, above=0.0)
    return dict(sliding_window=window, layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds),
                rope=full, local_rope=local, final_logit_softcap=softcap,
                attention_scale=typed(cfg, "query_pre_attn_scalar", source, float, above=0.0) ** -0.5)


def layer_kinds(cfg: dict, source: str, num_layers: int, every: int = 6) -> tuple[str, ...]:
    """Each layer's kind: layer_types, else every `every`-th layer full (sliding_window_pattern)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = typed(cfg, "sliding_window_pattern", source, int, every, low=1)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in LAYER_KINDS for k in kinds):
        raise SpecError(f"{source}: layer_types must list one of {', '.join(LAYER_KINDS)} for each of the "
                        f"{num_layers} layers, got {kinds!r}")
    return tuple(kinds)


def rope_per_kind(cfg: dict, source: str, thetas: dict = _THETA, local_key: str | None = "rope_local_base_freq"
                  ) -> tuple[RopeConfig, RopeConfig]:
    """(full layers' rope, sliding layers' rope); thetas: the bases where the config names none;
    local_key: the transformers 4 field of the sliding layers' base (None: there is none)."""
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
