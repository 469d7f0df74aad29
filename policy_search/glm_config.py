"""What a GLM-4.5 / 4.6 / 4.7 `config.json` (`glm4_moe`: GLM-4.5-Air, GLM-4.5, GLM-4.7) says beyond a
LLaMA-family one (hf_config.py calls in here), as transformers' Glm4MoeConfig reads it:

- RoPE over the first half of each head (partial_rotary_factor, 0.5 where the config names none);
- q, k and v biased (attention_bias), o never; q/k RMSNorm per head where use_qk_norm;
- the first `first_k_dense_replace` layers dense, the others `n_routed_experts` experts of
  `moe_intermediate_size`, routed by sigmoid scores plus a learned correction bias (the bias only
  chooses; the weights are the scores), within the best `topk_group` of `n_group` groups, renormalised
  where norm_topk_prob and scaled by routed_scaling_factor, beside `n_shared_experts` always-on
  experts (one MLP of that many widths, no gate);
- `num_nextn_predict_layers` multi-token-prediction layers stored after the last layer, unread
  (speculative decoding's; transformers drops them too).
"""
from __future__ import annotations

from policy_search.config_fields import typed
from policy_search.errors import SpecError


def glm4_moe_experts(cfg: dict, need, source: str) -> dict:
    """MoEConfig's fields of a glm4_moe config."""
    experts, top_k = need("n_routed_experts"), need("num_experts_per_tok")
    groups = typed(cfg, "n_group", source, int, 1, low=1)
    top_groups = typed(cfg, "topk_group", source, int, 1, low=1)
    if experts % groups or top_groups > groups or top_k > top_groups * (experts // groups):
        raise SpecError(f"{source}: n_routed_experts={experts} in n_group={groups} groups, of which topk_group="
                        f"{top_groups} are chosen, cannot give num_experts_per_tok={top_k} experts")
    width = need("moe_intermediate_size")
    dense = typed(cfg, "first_k_dense_replace", source, int, 1, low=0, high=need("num_hidden_layers"))
    return dict(num_experts=experts, top_k=top_k, expert_ffn_size=width,
                norm_topk_prob=typed(cfg, "norm_topk_prob", source, bool, True),
                shared_expert_ffn_size=width * typed(cfg, "n_shared_experts", source, int, 1, low=0),
                shared_expert_gate=False, mlp_only_layers=tuple(range(dense)), scoring="sigmoid",
                groups=groups, top_groups=top_groups,
                routed_scaling=typed(cfg, "routed_scaling_factor", source, float, 1.0, above=0.0))


def mtp_layers(cfg: dict, source: str) -> int:
    """Multi-token-prediction layers the checkpoint stores after the model's own (transformers 4 and
    5 name the count differently)."""
    key = "num_nextn_predict_layers" if cfg.get("num_nextn_predict_layers") is not None else "num_mtp_layers"
    return typed(cfg, key, source, int, 0, low=0)
