"""What a Gemma 3 `config.json` says beyond a LLaMA-family one (hf_config.py calls in here).

- `gemma3_text` (Gemma3ForCausalLM: the 1B) and `gemma3` (Gemma3ForConditionalGeneration: 4B, 12B,
  27B, read for its text model: text_model_config.py, with Gemma3TextConfig's defaults).
- Layers are "sliding_attention" (keys within `sliding_window` of the query) or "full_attention":
  `layer_types`, or transformers 4's `sliding_window_pattern` (every 6th layer full).
- RoPE per kind of layer (config_fields.rope_per_kind): the sliding layers' base is transformers 4's
  `rope_local_base_freq`, unscaled.
- Scores scaled by `query_pre_attn_scalar ** -0.5`; logits optionally soft-capped.
Refused by name: attention-logit soft-capping (Gemma 2's; every attention kernel would need it) and
bidirectional attention (EmbeddingGemma's encoder).
"""
from __future__ import annotations

from policy_search.config_fields import layer_kinds, rope_per_kind, typed
from policy_search.errors import SpecError

_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def gemma3_attention(cfg: dict, source: str, num_layers: int) -> dict:
    """HFConfig's attention fields of a gemma3 config (text_model_config's)."""
    for key, what in (("attn_logit_softcapping", "attention-logit soft-capping (Gemma 2's)"),
                      ("use_bidirectional_attention", "bidirectional attention (an encoder's)")):
        if cfg.get(key):
            raise SpecError(f"{source}: {key}={cfg[key]!r}: {what} is not supported")
    window = typed(cfg, "sliding_window", source, int, None, low=1)
    kinds = layer_kinds(cfg, source, num_layers, every=6)
    full, local = rope_per_kind(cfg, source, _THETA, local_key="rope_local_base_freq")
    softcap = typed(cfg, "final_logit_softcapping", source, float, None, above=0.0)
    return dict(sliding_window=window, layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds),
                rope=full, local_rope=local, final_logit_softcap=softcap,
                attention_scale=typed(cfg, "query_pre_attn_scalar", source, float, above=0.0) ** -0.5)
