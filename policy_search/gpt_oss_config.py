"""What an OpenAI gpt-oss `config.json` (`gpt_oss`: gpt-oss-20b, gpt-oss-120b) says beyond a
LLaMA-family one (hf_config.py calls in here), as transformers' GptOssConfig fills it in:

- sliding and full layers alternating (layer_types; else even layers sliding), one RoPE for both:
  YaRN (factor 32 over 4096 positions, not truncated) where the config names none, base 150000;
- a learned sink logit per attention head (`sinks`): each softmax's denominator has one more term;
- biases on q, k, v and o (attention_bias, true by default);
- experts (num_local_experts, num_experts_per_tok, each intermediate_size wide) whose router and
  experts carry biases, routed by softmax over the top-k logits, and a clamped GLU
  ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit).
"""
from __future__ import annotations

from policy_search.config_fields import layer_kinds, parse_rope, typed

_THETA = 150_000.0  # GptOssConfig.default_theta
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}  # GptOssConfig's rope where the config names none


def gpt_oss_attention(cfg: dict, source: str, num_layers: int) -> dict:
    """HFConfig's attention fields of a gpt_oss config."""
    window = typed(cfg, "sliding_window", source, int, 128, low=1)
    kinds = layer_kinds(cfg, source, num_layers, every=2)
    rope_cfg = cfg if cfg.get("rope_parameters") or cfg.get("rope_scaling") else {**cfg, "rope_parameters": _YARN}
    rope_cfg = {**rope_cfg, "rope_theta": cfg.get("rope_theta") or _THETA}
    return dict(sliding_window=window, rope=parse_rope(rope_cfg, source), attention_sinks=True,
                layer_windows=tuple(window if k == "sliding_attention" else None for k in kinds))


def gpt_oss_experts(cfg: dict, source: str) -> dict:
    """MoEConfig's fields of a gpt_oss config beyond the expert counts."""
    return dict(biases=True,
                glu_limit=typed(cfg, "swiglu_limit", source, float, 7.0, above=0.0),
                glu_alpha=typed(cfg, "swiglu_alpha", source, float, 1.702, above=0.0))
