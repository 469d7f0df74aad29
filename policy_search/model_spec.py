"""`ModelSpec`: the shapes the cost model needs, from an HF config dict, a registered name
(`opt-175b`, `dummy:llama-2-7b`) or a checkpoint folder holding config.json.

Two families, as the engine supports: OPT (`opt`; ReLU MLP of two matrices, biases, LayerNorm,
learned positions) and LLaMA (`llama`, `mistral`, `qwen2`, `qwen3`; gated SiLU MLP of three matrices,
RMSNorm, grouped-query attention). Pure arithmetic: nothing here touches weights.

Mixture of experts (`mixtral`, `qwen2_moe`, `qwen3_moe`): `sparse_layers` of the layers replace the
dense MLP by `num_experts` gated experts of width `expert_ffn_size`, a router (hidden x experts) and,
in qwen2_moe, a shared expert with its sigmoid gate. Bytes count every expert; FLOPs only the
`experts_per_token` (top-k) a token is routed to. Per-layer figures are means over the layers
(placement fractions apply alike to every layer, so totals are exact); `expert_touched_fraction`
gives the share of a layer's experts that some row of a batch routes to.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from policy_search.errors import SpecError
from policy_search.hf_config import DTYPE_BYTES, HFConfig, read_config_json
from policy_search.model_registry import KNOWN_MODELS, known_config
from policy_search.quant_format import KV_FORMAT, WEIGHT_FORMAT, KVFormat, WeightFormat
from policy_search.units import fmt_bytes

FFN_KINDS = ("mlp", "gated")  # mlp: up + down (OPT); gated: gate + up + down (LLaMA)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    ffn_kind: str  # "mlp" | "gated"
    vocab_size: int
    bytes_per_value: int = 2  # fp16 / bf16 weights, activations and KV cache
    embed_dim: int = 0  # token-embedding width (OPT-350m's word_embed_proj_dim); 0 means hidden_size
    max_positions: int = 2048
    learned_positions: bool = False  # OPT keeps a position-embedding table
    tie_embeddings: bool = True  # LM head shares the token embedding
    linear_bias: bool = False  # OPT: every linear layer has a bias
    qkv_bias: bool = False  # qwen2
    o_bias: bool = False  # llama's attention_bias (gpt-oss): o_proj biased too
    attention_sinks: bool = False  # gpt-oss: a sink logit per head in every layer
    layer_norm_bias: bool = False  # LayerNorm (OPT) has a bias, RMSNorm (LLaMA) does not
    weight_format: WeightFormat = WEIGHT_FORMAT  # compressed weights (the engine's weight_quant)
    kv_format: KVFormat = KV_FORMAT  # compressed KV cache (the engine's kv_bits, block, kv_value_group)
    compressed_head: bool = False  # the engine's compress_head: an untied LM head held in weight_format
    # The tiers whose decode rows the engine attends in the pool, no context gathered (plain KV, 4-bit
    # KV): its kernels on the device it runs on (offload/kv_cache.py decode_in_pool_tiers); the
    # working set charges their slot indices instead of K/V copies. () by default: every tier gathered.
    decode_in_pool: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # the checkpoint's own 4-bit codes (a GGUF's Q4_0 token embedding / untied head), held as they are
    coded_embedding: bool = False
    coded_head: bool = False
    qk_norm: bool = False  # qwen3: an RMSNorm weight over head_dim for q and for k in every layer
    sandwich_norms: bool = False  # gemma3: attention and MLP outputs normalised too (4 norms a layer)
    qk_norm_whole: bool = False  # olmo2/3: the q and k norms span the whole projection, not one head
    # Mixture of experts (0 experts: a dense model, the fields below stay 0)
    num_experts: int = 0  # routed experts of each sparse layer
    experts_per_token: int = 0  # top-k: experts each token is computed by
    expert_ffn_size: int = 0  # one expert's gated FFN width
    shared_expert_ffn_size: int = 0  # qwen2_moe: an expert every token uses, gated by sigmoid(h . g)
    sparse_layers: int = 0  # layers with experts; the other num_layers - sparse_layers keep ffn_size
    expert_biases: bool = False  # gpt-oss: the router and every expert's projections biased
    shared_expert_gate: bool = True  # qwen2_moe's shared expert has a sigmoid gate (hidden x 1); glm4_moe's none
    router_correction_bias: bool = False  # glm4_moe: a bias per expert added to the scores that choose

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "ffn_size", "vocab_size", "bytes_per_value", "max_positions"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"ModelSpec.{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"ModelSpec.num_heads={self.num_heads} must be a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        if self.ffn_kind not in FFN_KINDS:
            raise SpecError(f"ModelSpec.ffn_kind must be one of {FFN_KINDS}, got {self.ffn_kind!r}")
        if self.embed_dim < 0:
            raise SpecError(f"ModelSpec.embed_dim must be >= 0, got {self.embed_dim}")
        self._check_experts()

    def _check_experts(self) -> None:
        fields = ("num_experts", "experts_per_token", "expert_ffn_size", "shared_expert_ffn_size", "sparse_layers")
        for field in fields:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"ModelSpec.{field} must be a non-negative integer, got {value!r}")
        if not self.num_experts:
            if any(getattr(self, f) for f in fields):
                raise SpecError("ModelSpec: expert fields are set but num_experts is 0")
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise SpecError(f"ModelSpec.experts_per_token={self.experts_per_token} must be in "
                            f"[1, num_experts={self.num_experts}]")
        if self.expert_ffn_size < 1 or not 1 <= self.sparse_layers <= self.num_layers:
            raise SpecError(f"ModelSpec: a model with experts needs expert_ffn_size >= 1 and sparse_layers "
                            f"in [1, {self.num_layers}], got {self.expert_ffn_size} and {self.sparse_layers}")

    # ---- per-layer shapes ------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def token_embed_dim(self) -> int:
        return self.embed_dim or self.hidden_size

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h  # q, k, v, o

    @property
    def dense_ffn_params(self) -> int:
        """The MLP of a layer without experts."""
        return (3 if self.ffn_kind == "gated" else 2) * self.hidden_size * self.ffn_size

    @property
    def expert_params(self) -> int:
        """One expert: gate, up (hidden -> expert_ffn_size) and down."""
        return 3 * self.hidden_size * self.expert_ffn_size

    @property
    def moe_shared_params(self) -> int:
        """What every token of a sparse layer multiplies besides its experts: the router (hidden x
        experts) and the shared expert with its gate (hidden x 1)."""
        h, shared = self.hidden_size, self.shared_expert_ffn_size
        return h * self.num_experts + (3 * h * shared + self._shared_gate_params if shared else 0)

    @property
    def _shared_gate_params(self) -> int:
        return self.hidden_size if self.shared_expert_ffn_size and self.shared_expert_gate else 0

    def _per_layer(self, sparse: float, dense: float) -> float:
        """Mean over the layers of a quantity that is `sparse` in a layer with experts, else `dense`."""
        if self.sparse_layers == 0:
            return dense
        if self.sparse_layers == self.num_layers:
            return sparse
        return (self.sparse_layers * sparse + (self.num_layers - self.sparse_layers) * dense) / self.num_layers

    @property
    def layer_expert_params(self) -> float:
        """Every routed expert of a layer (mean over layers): stored and streamed, not all computed."""
        return self._per_layer(self.num_experts * self.expert_params, 0)

    @property
    def layer_routed_params(self) -> float:
        """Expert parameters one token multiplies in a layer (top-k experts; mean over layers)."""
        return self._per_layer(self.experts_per_token * self.expert_params, 0)

    @property
    def layer_dense_matrix_params(self) -> float:
        """Matrices every token multiplies (attention, dense MLP, router, shared expert): all but the
        routed experts (mean over layers)."""
        return self.attention_params + self._per_layer(self.moe_shared_params, self.dense_ffn_params)

    @property
    def layer_matrix_params(self) -> int:
        """Parameters of one decoder layer's weight matrices (what matmuls read), every expert included."""
        return self.layer_dense_matrix_params + self.layer_expert_params

    @property
    def layer_active_matrix_params(self) -> float:
        """Matrix parameters one token multiplies in a layer: the dense ones and its top-k experts."""
        return self.layer_dense_matrix_params + self.layer_routed_params

    def expert_touched_fraction(self, rows: float) -> float:
        """Expected share of a sparse layer's experts that `rows` tokens route to, for uniform routing:
        one token leaves a given expert out with probability 1 - k/E (k distinct of E), so `rows`
        independent tokens touch it with probability 1 - (1 - k/E)^rows. 0 for a dense model."""
        if not self.num_experts or rows <= 0:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** rows

    @property
    def layer_vector_params(self) -> int:
        """Biases and norm weights of one layer: small, never quantized."""
        h = self.hidden_size
        qk_norms = (self.q_dim + self.kv_dim if self.qk_norm_whole else 2 * self.head_dim) if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * h * (2 if self.layer_norm_bias else 1) + qk_norms
        biases = 0
        if self.linear_bias:
            biases += self.q_dim + 2 * self.kv_dim + h + self.ffn_size + h
        elif self.qkv_bias:
            biases += self.q_dim + 2 * self.kv_dim
        biases += (h if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        if self.expert_biases:  # router, gate/up and down of every expert
            biases += self._per_layer(self.num_experts * (1 + 2 * self.expert_ffn_size + h), 0)
        if self.router_correction_bias:
            biases += self._per_layer(self.num_experts, 0)
        return norms + biases

    @property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_vector_params

    @property
    def largest_matrix_params(self) -> int:
        """The biggest single matrix as the engine fuses them (q/k/v one matrix; a gated MLP's gate
        and up one [2 * ffn, hidden] matrix; one expert's): what one dequantization buffer must hold."""
        dense_ffn = self.ffn_size if self.sparse_layers < self.num_layers else 0
        ffn_out = (2 if self.ffn_kind == "gated" else 1) * max(dense_ffn, self.expert_ffn_size, self.shared_expert_ffn_size)
        return self.hidden_size * max(ffn_out, self.q_dim + 2 * self.kv_dim)

    @property
    def ffn_activation_width(self) -> int:
        """Per token, the widest FFN intermediate (gate and up outputs are this wide each): the dense
        MLP's, or the top-k experts' plus the shared expert's (tokens grouped by expert)."""
        dense_ffn = self.ffn_size if self.sparse_layers < self.num_layers else 0
        routed = self.experts_per_token * self.expert_ffn_size + self.shared_expert_ffn_size
        return max(dense_ffn, routed if self.num_experts else 0)

    @property
    def ffn_buffers(self) -> int:
        """FFN intermediates of ffn_activation_width a token holds at once: an MLP applies its
        activation in place on the up projection's output (1); a gated MLP holds its fused gate + up
        output (two widths) and the activated gate (one) when the down projection runs (3)."""
        return 1 if self.ffn_kind == "mlp" and not self.num_experts else 3

    @property
    def matmul_flops_per_token(self) -> float:
        """FLOPs of one layer's matmuls for one token (2 per multiply-add): routed experts only."""
        return 2 * self.layer_active_matrix_params

    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query token, key token) pair in one layer: QK^T and AV, 2 each per head dim."""
        return 4 * self.q_dim

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token adds to one layer's cache."""
        return 2 * self.kv_dim

    def matrix_bytes_per_value(self, compressed: bool) -> float:
        return self.weight_format.bytes_per_value if compressed else self.bytes_per_value

    def disk_read_ratio(self, compressed: bool) -> float:
        """Bytes the disk tier reads per byte of weights held (below 1 where it streams a checkpoint's
        own blocks, which lack the minimums its memory tiers hold)."""
        wf = self.weight_format
        return wf.streamed_bytes_per_value / wf.bytes_per_value if compressed else 1.0

    @property
    def resident_params(self) -> int:
        """Per sparse layer, the router (hidden x experts) and the shared expert's gate (hidden x 1):
        the engine keeps them uncompressed on the compute device whatever the placement
        (ModelMath.resident_weights), as every token needs them before any expert."""
        if not self.num_experts:
            return 0
        return self.hidden_size * self.num_experts + self._shared_gate_params

    @property
    def layer_resident_bytes(self) -> float:
        """What the engine keeps on the compute device whatever the placement, in the compute dtype
        (mean over layers): the norms and biases (a layer's small tensors) and resident_params."""
        return (self.layer_vector_params + self._per_layer(self.resident_params, 0)) * self.bytes_per_value

    def layer_placed_bytes(self, compressed: bool) -> float:
        """One layer's bytes the weight fractions place and a streamed layer reads (mean over layers):
        the matrices but the resident ones, group-wise (weight_format) when compressed."""
        placed = self.layer_matrix_params - self._per_layer(self.resident_params, 0)
        return placed * self.matrix_bytes_per_value(compressed)

    def layer_weight_bytes(self, compressed: bool) -> float:
        """Stored bytes of one layer's weights: matrices group-wise (weight_format) when compressed,
        the resident ones (routers) in the compute dtype."""
        return self.layer_placed_bytes(compressed) + self.layer_resident_bytes

    def layer_expert_bytes(self, compressed: bool) -> float:
        """The routed experts' share of layer_weight_bytes (mean over layers)."""
        return self.layer_expert_params * self.matrix_bytes_per_value(compressed)

    def largest_layer_weight_bytes(self, compressed: bool) -> float:
        """The largest layer's placed bytes (a streamed layer's working buffer holds any layer's
        streamed matrices: not its router, norms and biases, which stay on the compute device)."""
        sparse = self.num_experts * self.expert_params + self.moe_shared_params - self.resident_params
        ffn = max(self.dense_ffn_params if self.sparse_layers < self.num_layers else 0,
                  sparse if self.num_experts else 0)
        return (self.attention_params + ffn) * self.matrix_bytes_per_value(compressed)

    def in_pool_tiers(self, compress_kv: bool) -> tuple[str, ...]:
        """decode_in_pool's tiers for a plain or a 4-bit KV cache."""
        return self.decode_in_pool[1 if compress_kv else 0]

    def kv_bytes_per_token(self, compressed: bool) -> float:
        """Bytes one token's K and V take in one layer's cache (kv_format when compressed)."""
        if compressed:
            return self.kv_format.bytes_per_token(self.num_kv_heads, self.head_dim)
        return self.kv_values_per_token * self.bytes_per_value

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.hidden_size * self.bytes_per_value

    # ---- embeddings and LM head (kept in fp16, the head in weight_format with compressed_head) ---
    @property
    def embedding_params(self) -> int:
        h, e = self.hidden_size, self.token_embed_dim
        params = self.vocab_size * e + h * (2 if self.layer_norm_bias else 1)  # tokens + final norm
        if self.learned_positions:
            params += (self.max_positions + 2) * h  # OPT offsets positions by 2
        if e != h:
            params += 2 * e * h  # OPT-350m's project_in / project_out
        if not self.tie_embeddings:
            params += self.vocab_size * e  # separate LM head
        return params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.token_embed_dim

    @property
    def lm_head_flops_per_token(self) -> int:
        return 2 * self.lm_head_params

    @property
    def embedding_bytes(self) -> float:
        """The token embedding, head and the rest (norms, positions) as held: the embedding and an
        untied head in weight_format where they are coded (or the head compressed), else fp16."""
        table = self.vocab_size * self.token_embed_dim
        coded = (table if self.coded_embedding else 0) + (
            table if not self.tie_embeddings and (self.compressed_head or self.coded_head) else 0)
        return (self.embedding_params - coded) * self.bytes_per_value + coded * self.matrix_bytes_per_value(True)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    def weight_bytes(self, compressed: bool) -> float:
        """All weights as stored: layers (maybe compressed) plus fp16 embeddings and head (the head
        compressed with compressed_head)."""
        return self.num_layers * self.layer_weight_bytes(compressed) + self.embedding_bytes

    @property
    def num_active_params(self) -> float:
        """Parameters one token is computed with: every expert but its top-k left out."""
        return self.num_params - self.num_layers * (self.layer_expert_params - self.layer_routed_params)

    def describe(self) -> str:
        ffn = f"{self.ffn_kind} FFN {self.ffn_size}"
        if self.num_experts:
            shared = f" + shared expert {self.shared_expert_ffn_size}" if self.shared_expert_ffn_size else ""
            ffn = (f"{self.num_experts} experts (top-{self.experts_per_token}) x FFN {self.expert_ffn_size}"
                   f"{shared} in {self.sparse_layers} of {self.num_layers} layers"
                   + (f", dense FFN {self.ffn_size} in the others" if self.sparse_layers < self.num_layers else ""))
        active = f", {self.num_active_params / 1e9:.2f}B active" if self.num_experts else ""
        return (f"{self.name}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads ({self.num_kv_heads} KV) x {self.head_dim}, "
                f"{ffn}, vocab {self.vocab_size}, "
                f"{self.num_params / 1e9:.2f}B params{active} = {fmt_bytes(self.weight_bytes(False))} "
                f"({fmt_bytes(self.weight_bytes(True))} {self.weight_format.bits}-bit)")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict, name: str | None = None,
                    bytes_per_value: int | None = None) -> "ModelSpec":
        """From an HF `config.json` dict of the OPT or LLaMA family (parsed by HFConfig, as the
        runtime's ModelConfig is); bytes_per_value defaults to the checkpoint dtype's."""
        c = HFConfig.parse(config, name or "config")
        return cls.from_hf(c, name or str(config.get("_name_or_path") or c.model_type), bytes_per_value)

    @classmethod
    def from_hf(cls, c: HFConfig, name: str, bytes_per_value: int | None = None) -> "ModelSpec":
        """From a parsed config (the runtime's ModelConfig is one)."""
        opt = c.family == "opt"
        moe = c.moe
        experts = {} if moe is None else dict(
            num_experts=moe.num_experts, experts_per_token=moe.top_k, expert_ffn_size=moe.expert_ffn_size,
            shared_expert_ffn_size=moe.shared_expert_ffn_size, sparse_layers=moe.sparse_layers(c.num_layers),
            expert_biases=moe.biases, shared_expert_gate=moe.shared_expert_gate,
            router_correction_bias=moe.scoring == "sigmoid")
        return cls(name=name,
                   num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn_size=c.intermediate_size,
                   ffn_kind="mlp" if opt else "gated", vocab_size=c.vocab_size,
                   bytes_per_value=DTYPE_BYTES[c.dtype_name] if bytes_per_value is None else bytes_per_value,
                   embed_dim=c.word_embed_proj_dim or 0, max_positions=c.max_position_embeddings,
                   learned_positions=opt, tie_embeddings=c.tie_word_embeddings,
                   linear_bias=c.linear_bias, qkv_bias=c.qkv_bias, o_bias=c.o_bias and not opt,
                   attention_sinks=c.attention_sinks, layer_norm_bias=opt,
                   qk_norm=c.qk_norm, sandwich_norms=c.is_gemma, qk_norm_whole=c.qk_norm_whole, **experts)

    @classmethod
    def from_name(cls, name: str, bytes_per_value: int | None = None) -> "ModelSpec":
        """A registered name (`opt-30b`, `dummy:opt-175b`, `meta-llama/...`) or a checkpoint folder."""
        if os.path.isdir(name):
            config, _ = read_config_json(name)
            return cls.from_config(config, name=os.path.basename(os.path.normpath(name)),
                                   bytes_per_value=bytes_per_value)
        try:
            config = known_config(name)
        except KeyError:
            raise SpecError(f"unknown model {name!r}: not a folder with config.json and not a "
                            f"registered name ({', '.join(KNOWN_MODELS)}; or <name>-<N>l, one cut to N layers)") from None
        short = name.strip().lower().split(":", 1)[-1].split("/")[-1]
        return cls.from_config(config, name=short, bytes_per_value=bytes_per_value)
