"""What an OLMo 2 / OLMo 3 `config.json` says beyond a LLaMA-family one (hf_config.py calls in here):
q and k normalised over the whole projection, the attention's and the MLP's outputs normalised
before their residual adds (no pre-norms); OLMo 3's sliding layers (every 4th full, or layer_types)
with the full layers' RoPE scaling (YaRN in its long-context models) and the sliding ones unscaled."""
from __future__ import annotations

from policy_search.config_fields import layer_kinds, rope_per_kind

# Olmo3Config: where a config names no base, both kinds rotate by default_theta; a transformers 4
# config's rope_theta goes to the full layers only (its sliding layers keep default_theta)
_OLMO3_THETA = {"full_attention": 500_000.0, "sliding_attention": 500_000.0}


def olmo3_attention(cfg: dict, source: str, num_layers: int, window: int | None) -> dict:
    """HFConfig's attention fields of an olmo3 config."""
    kinds = layer_kinds(cfg, source, num_layers, every=4)
    full, local = rope_per_kind(cfg, source, _OLMO3_THETA, local_key=None)
    return dict(sliding_window=window, rope=full, local_rope=local,
                layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds))
