"""LLaMA family (llama, mistral, qwen2, qwen3): RMSNorm, SwiGLU, RoPE, grouped-query attention;
qwen3 normalises each head of q and k (RMSNorm over head_dim) before RoPE."""
from __future__ import annotations

import torch

from flexsarathi.models.base import ModelMath, Weights
from flexsarathi.models.layers import (apply_rope, apply_rope_, embedding, linear, rms_norm, rope_attention_factor,
                                       rope_inv_freq, rope_tables, swiglu)


ROPE_REMEMBERED = 4  # micro-batches of one pass whose rope tables are kept (FlexGen policies use 1-4)


class LlamaMath(ModelMath):
    def __init__(self, config):
        super().__init__(config)
        # RoPE rotates each head's first `rotary` dims (all but for glm4_moe's partial rotary)
        self.rotary = config.rotary_dim or config.head_dim
        self.inv_freq = rope_inv_freq(config.rope, self.rotary)  # [rotary / 2] fp32, CPU
        # gemma3's sliding layers rotate by another base: (they, the others) take (local, global)
        self.local_inv_freq = None if config.local_rope is None else rope_inv_freq(config.local_rope, self.rotary)
        self._rope_scale = {False: rope_attention_factor(config.rope),  # YaRN's cos / sin factor (1 otherwise)
                            True: 1.0 if config.local_rope is None else rope_attention_factor(config.local_rope)}
        # One copy per device, made once: `inv_freq.to(cuda)` in every layer would be two blocking
        # host-to-device copies per layer and micro-batch (each waits for all queued compute).
        self._inv_freq_on = {}
        self._rope_seen: list[tuple] = []  # rope_on's (positions, dtype, local, cos, sin), newest first

    def divide_rope_frequencies(self, factors: torch.Tensor) -> None:
        """Per-frequency scaling given as a tensor (llama.cpp's `rope_freqs.weight`) [head_dim / 2]."""
        self.inv_freq = self.inv_freq / factors
        self._inv_freq_on = {}  # copies of the old values dropped
        self._rope_seen = []

    def inv_freq_on(self, device, local: bool = False):
        """The full layers' (local: the sliding layers') inverse frequencies on `device`."""
        if (device, local) not in self._inv_freq_on:
            # non_blocking: no stream sync (the source lives on in self.inv_freq)
            source = self.local_inv_freq if local else self.inv_freq
            self._inv_freq_on[device, local] = source.to(device, non_blocking=True)
        return self._inv_freq_on[device, local]

    def _local_rope(self, layer: int) -> bool:
        return self.local_inv_freq is not None and self.window_of(layer) is not None

    def global_shapes(self):
        c = self.config
        shapes = {"embed_tokens.weight": (c.vocab_size, c.hidden_size),
                  "final_norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        return {**shapes, **self.classifier_shapes()}

    def layer_shapes(self, layer=0):
        return {**self.attention_shapes(), **self.dense_mlp_shapes()}

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """The layer up to the MLP: norms, q/k/v and o projections (with the family's biases)."""
        c = self.config
        qkv_out = c.q_size + 2 * c.kv_size
        shapes = {
            "attn_norm.weight": (c.hidden_size,),
            "qkv_proj.weight": (qkv_out, c.hidden_size),
            "o_proj.weight": (c.hidden_size, c.q_size),
            "mlp_norm.weight": (c.hidden_size,),
        }
        if c.qkv_bias:
            shapes["qkv_proj.bias"] = (qkv_out,)
        if c.o_bias:
            shapes["o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:  # over each head, or the whole projection (minimax_m2)
            shapes["q_norm.weight"], shapes["k_norm.weight"] = (
                ((c.q_size,), (c.kv_size,)) if c.qk_norm_whole else ((c.head_dim,), (c.head_dim,)))
        return shapes

    def dense_mlp_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        shapes = {"gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
                  "down_proj.weight": (c.hidden_size, c.intermediate_size)}
        if c.mlp_bias:
            shapes["gate_up_proj.bias"] = (2 * c.intermediate_size,)
            shapes["down_proj.bias"] = (c.hidden_size,)
        return shapes

    def part_rows(self, name, layer=0):
        c = self.config
        return (c.q_size, c.kv_size, c.kv_size) if name == "qkv_proj.weight" else super().part_rows(name, layer)

    def hf_layer_names(self, layer):
        p = f"model.layers.{layer}."
        names = {
            "attn_norm.weight": [p + "input_layernorm.weight"],
            "qkv_proj.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            "o_proj.weight": [p + "self_attn.o_proj.weight"],
            "mlp_norm.weight": [p + "post_attention_layernorm.weight"],
            "gate_up_proj.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "down_proj.weight": [p + "mlp.down_proj.weight"],
            "qkv_proj.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
            "o_proj.bias": [p + "self_attn.o_proj.bias"],
            "gate_up_proj.bias": [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"],
            "down_proj.bias": [p + "mlp.down_proj.bias"],
            "q_norm.weight": [p + "self_attn.q_norm.weight"],
            "k_norm.weight": [p + "self_attn.k_norm.weight"],
        }
        return {k: v for k, v in names.items() if k in self.layer_shapes(layer)}

    def hf_global_names(self):
        names = {"embed_tokens.weight": ["model.embed_tokens.weight"],
                 "final_norm.weight": ["model.norm.weight"],
                 "lm_head.weight": ["lm_head.weight"], **self.CLASSIFIER_NAMES}
        return {k: v for k, v in names.items() if k in self.global_shapes()}

    def embed(self, g: Weights, token_ids, positions):
        return embedding(token_ids, g["embed_tokens.weight"])  # [T, hidden]

    def qkv(self, w: Weights, hidden, positions, layer=0):
        c = self.config
        x = self.norm(hidden, w["attn_norm.weight"])
        heads = self._qkv_heads(linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias")))  # [T, h + 2 kvh, d]
        if "q_norm.weight" in w:  # qwen3, gemma3: per head, over head_dim; minimax_m2: over all heads
            q, k, v = self._split_heads(heads)
            if c.qk_norm_whole:
                q = self.norm(q.reshape(q.shape[0], -1), w["q_norm.weight"]).view(q.shape)
                k = self.norm(k.reshape(k.shape[0], -1), w["k_norm.weight"]).view(k.shape)
            else:
                q, k = self.norm(q, w["q_norm.weight"]), self.norm(k, w["k_norm.weight"])
            cos, sin = self.rope_on(positions, q.dtype, self._local_rope(layer))
            if self.rotary < c.head_dim:  # the first dims rotated, the rest as they are
                q, k = q.clone(), k.clone()
                apply_rope_(q[..., :self.rotary], cos, sin)
                apply_rope_(k[..., :self.rotary], cos, sin)
                return q, k, v
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        # q's and k's heads lie side by side: rotated together, in place, so K stays beside V (the
        # pool writes the pair at once)
        cos, sin = self.rope_on(positions, heads.dtype, self._local_rope(layer))
        rotated = heads.narrow(1, 0, c.num_heads + c.num_kv_heads)
        apply_rope_(rotated if self.rotary == c.head_dim else rotated.narrow(2, 0, self.rotary), cos, sin)
        return self._split_heads(heads)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm (LLaMA's; gemma3 overrides it)."""
        return rms_norm(x, weight, self.config.norm_eps)

    def rope_on(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_tables for these positions, computed once per pass: every layer of a pass gets the
        same positions tensor (built fresh per micro-batch, never written), so the last few are
        remembered by identity (a strong reference: no other tensor can take its id meanwhile)."""
        for seen, seen_dtype, seen_local, cos, sin in self._rope_seen:
            if seen is positions and seen_dtype == dtype and seen_local == local:
                return cos, sin
        cos, sin = rope_tables(positions, self.inv_freq_on(positions.device, local), dtype, self._rope_scale[local])
        self._rope_seen = [(positions, dtype, local, cos, sin), *self._rope_seen[:2 * ROPE_REMEMBERED - 1]]
        return cos, sin

    def post_attention(self, w: Weights, hidden, attn):
        hidden = hidden + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))
        x = self.norm(hidden, w["mlp_norm.weight"])
        return hidden.add_(swiglu(x, w["gate_up_proj.weight"], w["down_proj.weight"],  # this call's own sum
                                  w.get("gate_up_proj.bias"), w.get("down_proj.bias")))

    def final_hidden(self, g: Weights, hidden):
        """transformers' last_hidden_state: the final norm (the family's)."""
        return self.norm(hidden, g["final_norm.weight"])

    def logits(self, g: Weights, hidden):
        """[rows, vocab] fp32; divided by logits_scaling (Granite's) and soft-capped (Gemma's, where the
        config says) in the compute dtype first, as transformers does."""
        c = self.config
        head = g["lm_head.weight"] if "lm_head.weight" in g else g["embed_tokens.weight"]
        logits = linear(self.final_hidden(g, hidden), head)
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_logit_softcap is not None:
            logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        return logits.float()
