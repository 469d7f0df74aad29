"""IBM Granite (model_type granite: Granite 3.x and 4.x dense): the LLaMA family's math scaled by its
config's multipliers, as transformers' GraniteForCausalLM: the embedding's rows times
embedding_multiplier, scores by attention_multiplier (ModelMath.scale, from the config), attention's
and the MLP's outputs times residual_multiplier before their residual adds, logits divided by
logits_scaling (LlamaMath.logits: in the compute dtype, before fp32)."""
from __future__ import annotations

from flexsarathi.models.base import Weights
from flexsarathi.models.layers import embedding, linear, swiglu
from flexsarathi.models.llama import LlamaMath


class GraniteMath(LlamaMath):
    def embed(self, g: Weights, token_ids, positions):
        return embedding(token_ids, g["embed_tokens.weight"]) * self.config.embedding_multiplier  # [T, hidden]

    def post_attention(self, w: Weights, hidden, attn):
        scale = self.config.residual_multiplier
        hidden = hidden + linear(attn, w["o_proj.weight"], w.get("o_proj.bias")) * scale
        mlp = swiglu(self.norm(hidden, w["mlp_norm.weight"]), w["gate_up_proj.weight"], w["down_proj.weight"],
                     w.get("gate_up_proj.bias"), w.get("down_proj.bias"))
        return hidden.add_(mlp * scale)
