"""Mixture-of-experts LLaMA-family models (mixtral, qwen2_moe, qwen3_moe, glm4_moe, minimax_m2; gpt_oss in
gpt_oss.py): a sparse layer's MLP is a router and `E` experts (each a SwiGLU MLP of the expert
width), qwen2_moe adding one shared expert behind a sigmoid gate, glm4_moe one without (its router
sigmoid-scored, grouped, with a correction bias); dense layers (`mlp_only_layers`,
`decoder_sparse_step`) keep the LLaMA MLP. Everything up to the MLP is LlamaMath's (qwen3_moe: with
its q/k norms; glm4_moe: RoPE over half of each head).

The experts of a layer are stacked by rows into two weights, `experts.gate_up_proj.weight`
[E * 2F, hidden] (expert e's gate rows then its up rows) and `experts.down_proj.weight`
[E * hidden, F], so a layer still moves few large tensors and expert e is one contiguous row
range of each: placement cuts, streams and compresses them as any other weight, and reading only
the routed experts is reading row ranges. The router stays uncompressed on the compute device.

The router is transformers' (softmax in fp32 over all experts, top-k, renormalised where
`norm_topk_prob`); the experts run grouped: one matmul per routed expert over the rows routed to
it, results scaled by their routing weight and summed in expert order (index_add_), as
transformers' `*Experts.forward` does, so fp32 results match it to rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flexsarathi.models.base import Weights
from flexsarathi.models.layers import linear, rms_norm, swiglu
from flexsarathi.models.llama import LlamaMath
from offload.weights import ROW_BLOCKS

GATE_UP, DOWN = "experts.gate_up_proj.weight", "experts.down_proj.weight"
ROUTER, SHARED_GATE = "router.weight", "shared_expert_gate.weight"
CORRECTION = "router.correction_bias"  # glm4_moe's e_score_correction_bias: added to the scores that choose
CPU = torch.device("cpu")


class _AllLoaded:
    """The expert reads of weights that came without ROW_BLOCKS: every expert is there already."""

    def ready(self, block: int) -> None:
        pass

    def __enter__(self) -> _AllLoaded:
        return self

    def __exit__(self, *exc_info) -> None:
        return None


_ALL_LOADED = _AllLoaded()


def weight_rows(weight, start: int, stop: int):
    """Rows [start, stop) of a 2-D weight as the model uses it: a tensor, a QTensor or an
    Int4Packed (both compressed forms keep a row range contiguous)."""
    return weight[start:stop] if isinstance(weight, torch.Tensor) else weight.rows(start, stop)


class Routing:
    """Which experts each of T tokens goes to, grouped by expert: `order` lists the (token, slot)
    pairs sorted by expert, `counts[e]` how many of them expert e gets."""

    def __init__(self, top_index: torch.Tensor, top_weight: torch.Tensor, num_experts: int):
        # top_index, top_weight: [T, k]
        flat = top_index.reshape(-1)  # [T * k], token-major
        self.order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
        self.tokens = self.order // top_index.shape[1]  # [T * k] token of each sorted pair
        self.weights = top_weight.reshape(-1)[self.order]  # [T * k]
        self.counts = torch.bincount(flat, minlength=num_experts).tolist()

    def experts(self):
        """(expert, first, last) per routed expert, in expert order: its pairs are order[first:last]."""
        start = 0
        for e, n in enumerate(self.counts):
            if n:
                yield e, start, start + n
            start += n


class MoeMath(LlamaMath):
    def __init__(self, config):
        super().__init__(config)
        self.moe = config.moe
        self.sparse = frozenset(i for i in range(config.num_layers) if self.moe.is_sparse(i))
        self.mixtral = config.model_type == "mixtral"
        self.mixtral_names = config.model_type in ("mixtral", "minimax_m2")  # block_sparse_moe, w1/w3/w2

    # ---- shapes and names --------------------------------------------------------------------
    def layer_shapes(self, layer=0):
        if layer not in self.sparse:
            return super().layer_shapes(layer)
        c, m = self.config, self.moe
        h, f, e = c.hidden_size, m.expert_ffn_size, m.num_experts
        shapes = {**self.attention_shapes(), ROUTER: (e, h), GATE_UP: (e * 2 * f, h), DOWN: (e * h, f)}
        if m.scoring == "sigmoid":
            shapes[CORRECTION] = (e,)
        if m.shared_expert_ffn_size:
            s = m.shared_expert_ffn_size
            shapes.update({"shared_expert.gate_up_proj.weight": (2 * s, h), "shared_expert.down_proj.weight": (h, s),
                           **({SHARED_GATE: (1, h)} if m.shared_expert_gate else {})})
        return shapes

    def expert_stacks(self):
        return {GATE_UP: self.moe.num_experts, DOWN: self.moe.num_experts}

    def resident_weights(self):
        return frozenset((ROUTER, SHARED_GATE))

    def hf_layer_names(self, layer):
        names = super().hf_layer_names(layer)  # attention (and a dense layer's MLP)
        if layer not in self.sparse:
            return names
        p = f"model.layers.{layer}."
        if self.mixtral_names:  # w1: gate, w3: up, w2: down
            mlp, gate, up, down = p + "block_sparse_moe.", "w1", "w3", "w2"
        else:
            mlp, gate, up, down = p + "mlp.", "gate_proj", "up_proj", "down_proj"
        experts = range(self.moe.num_experts)
        names[ROUTER] = [mlp + "gate.weight"]
        names[GATE_UP] = [mlp + f"experts.{e}.{x}.weight" for e in experts for x in (gate, up)]
        names[DOWN] = [mlp + f"experts.{e}.{down}.weight" for e in experts]
        if self.moe.scoring == "sigmoid":  # glm4_moe keeps it in the gate, minimax_m2 in the block
            names[CORRECTION] = [mlp + ("e_score_correction_bias" if self.mixtral_names else
                                        "gate.e_score_correction_bias")]
        if self.moe.shared_expert_ffn_size:  # qwen2_moe's one gated expert; glm4_moe's shared_experts
            shared = mlp + ("shared_expert." if self.moe.shared_expert_gate else "shared_experts.")
            names["shared_expert.gate_up_proj.weight"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
            names["shared_expert.down_proj.weight"] = [shared + "down_proj.weight"]
            if self.moe.shared_expert_gate:
                names[SHARED_GATE] = [mlp + "shared_expert_gate.weight"]
        return names

    # ---- math ----------------------------------------------------------------------------------
    def post_attention(self, w: Weights, hidden, attn):
        if ROUTER not in w:
            return super().post_attention(w, hidden, attn)  # a dense layer
        hidden = hidden + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))
        x = rms_norm(hidden, w["mlp_norm.weight"], self.config.norm_eps)  # [T, hidden]
        return hidden + self.sparse_mlp(w, x, self.route(w, x))

    def route(self, w: Weights, x: torch.Tensor) -> Routing:
        """The router as transformers computes it: fp32 softmax over all experts, top-k, renormalised
        where norm_topk_prob; qwen casts the weights back to the activations' dtype, mixtral keeps
        them fp32 (its experts' products are then fp32, cast when summed). glm4_moe: route_sigmoid."""
        if self.moe.scoring == "sigmoid":
            return self.route_sigmoid(w, x)
        logits = F.linear(x, w[ROUTER])  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weight, top_index = torch.topk(probs, self.moe.top_k, dim=-1)  # [T, k]
        if self.moe.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        if not self.mixtral:
            top_weight = top_weight.to(logits.dtype)
        return Routing(top_index, top_weight, self.moe.num_experts)

    def expert(self, w: Weights, e: int, x: torch.Tensor, gate_up, down) -> torch.Tensor:
        """Expert e on its rows x (on x's device), given its two weights there: a SwiGLU MLP."""
        return swiglu(x, gate_up, down)

    def route_sigmoid(self, w: Weights, x: torch.Tensor) -> Routing:
        """glm4_moe's and minimax_m2's router (DeepSeek-V3's): fp32 sigmoid scores; the correction bias added to choose
        the best `top_groups` groups (each scored by its two best) and the top-k within them; their
        scores (without the bias) renormalised where norm_topk_prob, times routed_scaling; fp32."""
        m = self.moe
        router = w[ROUTER]
        logits = F.linear(x.float(), router.float()) if m.router_fp32 else F.linear(x.to(router.dtype), router).float()
        scores = torch.sigmoid(logits)  # [T, E]
        choice = scores + w[CORRECTION].float()
        if m.top_groups < m.groups:  # experts outside the chosen groups cannot be chosen
            grouped = choice.view(-1, m.groups, m.num_experts // m.groups)  # [T, G, E / G]
            best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), m.top_groups, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)  # [T, G]
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(-1, m.num_experts)
        top_index = torch.topk(choice, m.top_k, dim=-1, sorted=False)[1]  # [T, k]
        top_weight = scores.gather(1, top_index)
        if m.norm_topk_prob:
            top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(top_index, top_weight * m.routed_scaling, m.num_experts)

    def sparse_mlp(self, w: Weights, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed experts (one matmul per expert over its rows) plus the shared expert (qwen2_moe's
        behind its sigmoid gate)."""
        out = self.run_experts(w, x, routing)
        if "shared_expert.gate_up_proj.weight" in w:
            shared = swiglu(x, w["shared_expert.gate_up_proj.weight"], w["shared_expert.down_proj.weight"])
            out = out + (torch.sigmoid(F.linear(x, w[SHARED_GATE])) * shared if SHARED_GATE in w else shared)
        return out

    def run_experts(self, w: Weights, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sum over the routed experts of weight * expert(x rows): [T, hidden], in expert order.
        Where the weights come with ROW_BLOCKS (offload/tiered_weights.py): an expert held whole
        on the cpu tier is computed there (its rows of x go to the CPU, its output comes back);
        the others are read into the working buffer now, if they were left for after routing."""
        f2, h = 2 * self.moe.expert_ffn_size, self.config.hidden_size
        blocks, on_cpu = w.get(ROW_BLOCKS), {}
        routed = [e for e, _, _ in routing.experts()]
        reads = _ALL_LOADED
        if blocks is not None:
            on_cpu = {e: held for e in routed if (held := blocks.on_cpu(e)) is not None}
            reads = blocks.load([e for e in routed if e not in on_cpu])  # expert e computes once its rows are in
        out = torch.zeros_like(x)
        with reads:
            for e, first, last in routing.experts():
                tokens = routing.tokens[first:last]
                if e in on_cpu:
                    y = self.expert(w, e, x[tokens].to(CPU), on_cpu[e][GATE_UP], on_cpu[e][DOWN]).to(x.device)
                else:
                    reads.ready(e)
                    y = self.expert(w, e, x[tokens], weight_rows(w[GATE_UP], e * f2, (e + 1) * f2),
                                    weight_rows(w[DOWN], e * h, (e + 1) * h))
                out.index_add_(0, tokens, (y * routing.weights[first:last, None]).to(out.dtype))
        return out
