"""OpenAI gpt-oss (model_type gpt_oss: gpt-oss-20b, gpt-oss-120b), as transformers' GptOss layers
compute it: the LLaMA family's attention with biased q/k/v/o, sliding and full layers alternating,
YaRN RoPE and a learned sink logit per head; every layer a mixture of experts.

- RMSNorm scaled by its weight in fp32, then cast (as OLMo's; LLaMA's casts first).
- Attention sinks: `sinks` [heads] is one more logit in every softmax's denominator, with no value:
  each part's (out, lse) merged with it (attention.merge_partial_attention), so every placement of
  the KV cache and every kernel that returns an lse serves it unchanged.
- Router: linear with a bias, top-k of its logits, softmax over those k (in the logits' dtype).
- Experts: the checkpoint's [E, in, out] tensors (or their MXFP4 blocks) read as MoeMath's row
  stacks (StackedExperts), the interleaved gate/up rows split into gate rows then up rows; each
  expert computes (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit,
  every projection with its bias.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsarathi.models import attention
from flexsarathi.models.base import StackedExperts, Weights
from flexsarathi.models.layers import linear, rms_norm_scaled_in_fp32
from flexsarathi.models.llama import LlamaMath
from flexsarathi.models.moe import DOWN, GATE_UP, ROUTER, MoeMath, Routing

SINKS, ROUTER_BIAS = "sinks", "router.bias"
GATE_UP_BIAS, DOWN_BIAS = "experts.gate_up_proj.bias", "experts.down_proj.bias"


class GptOssMath(MoeMath):
    def attention_shapes(self):
        return {**super().attention_shapes(), SINKS: (self.config.num_heads,)}

    def layer_shapes(self, layer=0):
        m, h = self.moe, self.config.hidden_size
        return {**super().layer_shapes(layer), ROUTER_BIAS: (m.num_experts,),
                GATE_UP_BIAS: (m.num_experts * 2 * m.expert_ffn_size,), DOWN_BIAS: (m.num_experts * h,)}

    def hf_layer_names(self, layer):
        p = f"model.layers.{layer}."
        experts = p + "mlp.experts."
        return {**LlamaMath.hf_layer_names(self, layer), SINKS: [p + "self_attn.sinks"],
                ROUTER: [p + "mlp.router.weight"], ROUTER_BIAS: [p + "mlp.router.bias"],
                GATE_UP: [experts + "gate_up_proj"], GATE_UP_BIAS: [experts + "gate_up_proj_bias"],
                DOWN: [experts + "down_proj"], DOWN_BIAS: [experts + "down_proj_bias"]}

    def stacked_experts(self, layer):
        return {GATE_UP: StackedExperts(interleaved=True), GATE_UP_BIAS: StackedExperts(bias=True, interleaved=True),
                DOWN: StackedExperts(), DOWN_BIAS: StackedExperts(bias=True)}

    def part_rows(self, name, layer=0):
        # the experts' stacks are one checkpoint tensor each (a LoRA adapter's rows cover all of it)
        return super().part_rows(name, layer) if name == "qkv_proj.weight" else (self.layer_shapes(layer)[name][0],)

    def norm(self, x, weight):
        return rms_norm_scaled_in_fp32(x, weight, self.config.norm_eps)

    def merge_attention(self, parts, w=None):
        return attention.merge_partial_attention(parts, w[SINKS])

    def post_attention(self, w: Weights, hidden, attn):
        hidden = hidden + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))
        x = self.norm(hidden, w["mlp_norm.weight"])  # [T, hidden]
        return hidden + self.run_experts(w, x, self.route(w, x))

    def route(self, w: Weights, x: torch.Tensor) -> Routing:
        logits = F.linear(x, w[ROUTER], w[ROUTER_BIAS])  # [T, E]
        top_logit, top_index = torch.topk(logits, self.moe.top_k, dim=-1)  # [T, k]
        return Routing(top_index, torch.softmax(top_logit, dim=-1, dtype=top_logit.dtype), self.moe.num_experts)

    def expert(self, w: Weights, e: int, x: torch.Tensor, gate_up, down) -> torch.Tensor:
        f2, h, limit = 2 * self.moe.expert_ffn_size, self.config.hidden_size, self.moe.glu_limit
        gate_up_bias = w[GATE_UP_BIAS][e * f2:(e + 1) * f2].to(x.device)
        gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)  # [rows, F] each
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * self.moe.glu_alpha)
        return linear((up + 1) * glu, down, w[DOWN_BIAS][e * h:(e + 1) * h].to(x.device))
