"""OPT: learned positions (offset 2), LayerNorm, ReLU MLP, multi-head attention, every linear
biased; pre-norm except opt-350m (post-norm, with 512-wide embeddings projected in and out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsarathi.models.base import ModelMath, Weights
from flexsarathi.models.layers import embedding, layer_norm, linear

POSITION_OFFSET = 2  # OPT's learned position table reserves its first two rows


class OPTMath(ModelMath):
    def global_shapes(self):
        c = self.config
        shapes = {"embed_tokens.weight": (c.vocab_size, c.embed_dim),
                  "embed_positions.weight": (c.max_position_embeddings + POSITION_OFFSET, c.hidden_size)}
        if c.word_embed_proj_dim:
            shapes["project_in.weight"] = (c.hidden_size, c.embed_dim)
            shapes["project_out.weight"] = (c.embed_dim, c.hidden_size)
        if c.final_norm:
            shapes["final_norm.weight"] = (c.hidden_size,)
            shapes["final_norm.bias"] = (c.hidden_size,)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.embed_dim)
        return {**shapes, **self.classifier_shapes()}

    def layer_shapes(self, layer=0):
        c = self.config
        h, f = c.hidden_size, c.intermediate_size
        shapes = {
            "attn_norm.weight": (h,), "attn_norm.bias": (h,),
            "qkv_proj.weight": (3 * h, h), "qkv_proj.bias": (3 * h,),
            "o_proj.weight": (h, h), "o_proj.bias": (h,),
            "mlp_norm.weight": (h,), "mlp_norm.bias": (h,),
            "fc1.weight": (f, h), "fc1.bias": (f,),
            "fc2.weight": (h, f), "fc2.bias": (h,),
        }
        if not c.linear_bias:  # enable_bias=False drops the linear biases, never the norms'
            shapes = {k: v for k, v in shapes.items() if k.endswith(".weight") or "norm" in k}
        return shapes

    def hf_layer_names(self, layer):
        p = f"model.decoder.layers.{layer}."
        names = {
            "attn_norm.weight": [p + "self_attn_layer_norm.weight"],
            "attn_norm.bias": [p + "self_attn_layer_norm.bias"],
            "qkv_proj.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            "qkv_proj.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
            "o_proj.weight": [p + "self_attn.out_proj.weight"],
            "o_proj.bias": [p + "self_attn.out_proj.bias"],
            "mlp_norm.weight": [p + "final_layer_norm.weight"],
            "mlp_norm.bias": [p + "final_layer_norm.bias"],
            "fc1.weight": [p + "fc1.weight"], "fc1.bias": [p + "fc1.bias"],
            "fc2.weight": [p + "fc2.weight"], "fc2.bias": [p + "fc2.bias"],
        }
        return {k: v for k, v in names.items() if k in self.layer_shapes()}

    def hf_global_names(self):
        p = "model.decoder."
        names = {
            "embed_tokens.weight": [p + "embed_tokens.weight"],
            "embed_positions.weight": [p + "embed_positions.weight"],
            "project_in.weight": [p + "project_in.weight"],
            "project_out.weight": [p + "project_out.weight"],
            "final_norm.weight": [p + "final_layer_norm.weight"],
            "final_norm.bias": [p + "final_layer_norm.bias"],
            "lm_head.weight": ["lm_head.weight"],
            **self.CLASSIFIER_NAMES,
        }
        return {k: v for k, v in names.items() if k in self.global_shapes()}

    def embed(self, g: Weights, token_ids, positions):
        x = embedding(token_ids, g["embed_tokens.weight"])  # [T, embed_dim]
        if "project_in.weight" in g:
            x = linear(x, g["project_in.weight"])  # [T, hidden]
        return x + F.embedding(positions + POSITION_OFFSET, g["embed_positions.weight"])

    def qkv(self, w: Weights, hidden, positions, layer=0):
        x = hidden
        if self.config.pre_norm:
            x = layer_norm(x, w["attn_norm.weight"], w["attn_norm.bias"], self.config.norm_eps)
        return self._split_qkv(linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias")))

    def post_attention(self, w: Weights, hidden, attn):
        eps, pre = self.config.norm_eps, self.config.pre_norm
        hidden = hidden + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))
        if not pre:
            hidden = layer_norm(hidden, w["attn_norm.weight"], w["attn_norm.bias"], eps)
        x = layer_norm(hidden, w["mlp_norm.weight"], w["mlp_norm.bias"], eps) if pre else hidden
        # ReLU in place: one [T, ffn] buffer, as the working set prices it (ModelSpec.ffn_buffers)
        x = linear(torch.relu_(linear(x, w["fc1.weight"], w.get("fc1.bias"))), w["fc2.weight"], w.get("fc2.bias"))
        hidden = hidden + x
        if not pre:
            hidden = layer_norm(hidden, w["mlp_norm.weight"], w["mlp_norm.bias"], eps)
        return hidden

    def final_hidden(self, g: Weights, hidden):
        """transformers' last_hidden_state: the final norm, then the projection to the embedding width."""
        x = hidden
        if "final_norm.weight" in g:
            x = layer_norm(x, g["final_norm.weight"], g["final_norm.bias"], self.config.norm_eps)
        if "project_out.weight" in g:
            x = linear(x, g["project_out.weight"])
        return x

    def logits(self, g: Weights, hidden):
        head = g["lm_head.weight"] if "lm_head.weight" in g else g["embed_tokens.weight"]
        return linear(self.final_hidden(g, hidden), head).float()  # [rows, vocab]
