"""Gemma 3 (gemma3_text; gemma3's text model): the LLaMA family's attention with Gemma's changes.

- every RMSNorm scales by (1 + weight), in fp32 (layers.gemma_rms_norm); q and k heads normalised
  before RoPE (as qwen3);
- four norms per layer: the attention output and the MLP output are normalised before their
  residual add ("sandwich"), besides the usual pre-norms;
- the MLP is GELU(tanh)-gated; the token embedding is scaled by sqrt(hidden) (rounded to the
  weights' dtype first, as transformers does); the head is tied, its logits optionally soft-capped;
- scores scaled by query_pre_attn_scalar ** -0.5 (ModelMath.scale from the config);
- layers are sliding (keys within the window, RoPE base 10k) or full (every key, the global RoPE
  base and scaling): config.window_of / rope_of, taken by LlamaMath.qkv and the executor.

A `gemma3` checkpoint (Gemma3ForConditionalGeneration) nests the text model: its tensors are
`language_model.model.*` (transformers 4) or `model.language_model.*` (5), the vision tower and
projector are never read (ModelMath.stored_names, unread_prefixes).
"""
from __future__ import annotations

import math

import torch

from flexsarathi.models.base import Weights
from flexsarathi.models.layers import embedding, gelu_glu, gemma_rms_norm, linear
from flexsarathi.models.llama import LlamaMath


class GemmaMath(LlamaMath):
    def __init__(self, config):
        super().__init__(config)
        # transformers keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype first
        self._embed_scale = {dt: torch.tensor(math.sqrt(config.hidden_size)).to(dt).item()
                             for dt in (torch.float32, torch.float16, torch.bfloat16)}

    def attention_shapes(self):
        c = self.config
        return {**super().attention_shapes(), "post_attn_norm.weight": (c.hidden_size,),
                "post_mlp_norm.weight": (c.hidden_size,)}

    def hf_layer_names(self, layer):
        p = f"model.layers.{layer}."
        return {**super().hf_layer_names(layer), "mlp_norm.weight": [p + "pre_feedforward_layernorm.weight"],
                "post_attn_norm.weight": [p + "post_attention_layernorm.weight"],
                "post_mlp_norm.weight": [p + "post_feedforward_layernorm.weight"]}

    def norm(self, x, weight):
        return gemma_rms_norm(x, weight, self.config.norm_eps)

    def embed(self, g: Weights, token_ids, positions):
        rows = embedding(token_ids, g["embed_tokens.weight"])  # [T, hidden]
        return rows * self._embed_scale[rows.dtype]

    def post_attention(self, w: Weights, hidden, attn):
        hidden = hidden + self.norm(linear(attn, w["o_proj.weight"], w.get("o_proj.bias")), w["post_attn_norm.weight"])
        mlp = gelu_glu(self.norm(hidden, w["mlp_norm.weight"]), w["gate_up_proj.weight"], w["down_proj.weight"])
        return hidden.add_(self.norm(mlp, w["post_mlp_norm.weight"]))
