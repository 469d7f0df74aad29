"""OLMo 2 and OLMo 3 (olmo2, olmo3): the LLaMA family's attention and SwiGLU with AI2's norms, as
transformers' Olmo2/Olmo3 layers compute them:

- no pre-norms: q/k/v are projected from the layer's input as it is, and the MLP reads the residual
  stream as it is; the attention's and the MLP's outputs are normalised before their residual adds;
- q and k normalised over the whole projection (every head at once), before RoPE;
- RMSNorm scaled by its weight in fp32, then cast (LLaMA's casts first);
- OLMo 3: sliding layers (every 4th full), each within its window, the full layers' RoPE scaled.
"""
from __future__ import annotations


from flexsarathi.models.base import Weights
from flexsarathi.models.layers import apply_rope, linear, rms_norm_scaled_in_fp32, swiglu
from flexsarathi.models.llama import LlamaMath


class OlmoMath(LlamaMath):
    def attention_shapes(self):
        c = self.config
        pre_norms = ("attn_norm.weight", "mlp_norm.weight")  # OLMo has none
        shapes = {k: v for k, v in super().attention_shapes().items() if k not in pre_norms}
        return {**shapes, "q_norm.weight": (c.q_size,), "k_norm.weight": (c.kv_size,),
                "post_attn_norm.weight": (c.hidden_size,), "post_mlp_norm.weight": (c.hidden_size,)}

    def hf_layer_names(self, layer):
        p = f"model.layers.{layer}."
        names = {**super().hf_layer_names(layer), "post_attn_norm.weight": [p + "post_attention_layernorm.weight"],
                 "post_mlp_norm.weight": [p + "post_feedforward_layernorm.weight"]}
        return {k: v for k, v in names.items() if k in self.layer_shapes(layer)}

    def norm(self, x, weight):
        return rms_norm_scaled_in_fp32(x, weight, self.config.norm_eps)

    def qkv(self, w: Weights, hidden, positions, layer=0):
        c = self.config
        qkv = linear(hidden, w["qkv_proj.weight"], w.get("qkv_proj.bias"))  # [T, q + 2 kv]
        q, k, v = qkv.split_with_sizes((c.q_size, c.kv_size, c.kv_size), -1)
        q = self.norm(q, w["q_norm.weight"]).view(-1, c.num_heads, c.head_dim)  # [T, h, d]
        k = self.norm(k, w["k_norm.weight"]).view(-1, c.num_kv_heads, c.head_dim)
        cos, sin = self.rope_on(positions, q.dtype, self._local_rope(layer))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(-1, c.num_kv_heads, c.head_dim)

    def post_attention(self, w: Weights, hidden, attn):
        hidden = hidden + self.norm(linear(attn, w["o_proj.weight"], w.get("o_proj.bias")), w["post_attn_norm.weight"])
        mlp = swiglu(hidden, w["gate_up_proj.weight"], w["down_proj.weight"], w.get("gate_up_proj.bias"),
                     w.get("down_proj.bias"))
        return hidden.add_(self.norm(mlp, w["post_mlp_norm.weight"]))
