"""`ModelSpec`: the shapes the cost model needs, from an HF config dict, a registered name
(`opt-175b`, `dummy:llama-2-7b`) or a checkpoint folder holding config.json.

Two families, as the engine supports: OPT (`opt`; ReLU MLP of two matrices, biases, LayerNorm,
learned positions) and LLaMA (`llama`, `mistral`, `qwen2`; gated SiLU MLP of three matrices, RMSNorm,
grouped-query attention). Pure arithmetic: nothing here touches weights.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from policy_search.errors import SpecError
from policy_search.hf_config import DTYPE_BYTES, HFConfig
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
    layer_norm_bias: bool = False  # LayerNorm (OPT) has a bias, RMSNorm (LLaMA) does not
    weight_format: WeightFormat = WEIGHT_FORMAT  # compressed weights (the engine's weight_quant)
    kv_format: KVFormat = KV_FORMAT  # compressed KV cache (the engine's kv_bits, block, kv_value_group)

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
    def layer_matrix_params(self) -> int:
        """Parameters of one decoder layer's weight matrices (what matmuls read)."""
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h  # q, k, v, o
        ffn = (3 if self.ffn_kind == "gated" else 2) * h * self.ffn_size
        return attention + ffn

    @property
    def layer_vector_params(self) -> int:
        """Biases and norm weights of one layer: small, never quantized."""
        h = self.hidden_size
        norms = 2 * h * (2 if self.layer_norm_bias else 1)
        biases = 0
        if self.linear_bias:
            biases += self.q_dim + 2 * self.kv_dim + h + self.ffn_size + h
        elif self.qkv_bias:
            biases += self.q_dim + 2 * self.kv_dim
        return norms + biases

    @property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_vector_params

    @property
    def largest_matrix_params(self) -> int:
        """The biggest single matrix as the engine fuses them (q/k/v one matrix; a gated MLP's gate
        and up one [2 * ffn, hidden] matrix): what one dequantization buffer must hold."""
        ffn_out = (2 if self.ffn_kind == "gated" else 1) * self.ffn_size
        return self.hidden_size * max(ffn_out, self.q_dim + 2 * self.kv_dim)

    @property
    def matmul_flops_per_token(self) -> int:
        """FLOPs of one layer's matmuls for one token (2 per multiply-add)."""
        return 2 * self.layer_matrix_params

    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query token, key token) pair in one layer: QK^T and AV, 2 each per head dim."""
        return 4 * self.q_dim

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token adds to one layer's cache."""
        return 2 * self.kv_dim

    def layer_weight_bytes(self, compressed: bool) -> float:
        """Stored bytes of one layer's weights: matrices group-wise (weight_format) when compressed."""
        matrix_bytes = self.weight_format.bytes_per_value if compressed else self.bytes_per_value
        return self.layer_matrix_params * matrix_bytes + self.layer_vector_params * self.bytes_per_value

    def kv_bytes_per_token(self, compressed: bool) -> float:
        """Bytes one token's K and V take in one layer's cache (kv_format when compressed)."""
        if compressed:
            return self.kv_format.bytes_per_token(self.num_kv_heads, self.head_dim)
        return self.kv_values_per_token * self.bytes_per_value

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.hidden_size * self.bytes_per_value

    # ---- embeddings and LM head (kept in fp16; placed with the same fractions as the layers) ---
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
    def embedding_bytes(self) -> int:
        return self.embedding_params * self.bytes_per_value

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    def weight_bytes(self, compressed: bool) -> float:
        """All weights as stored: layers (maybe compressed) plus fp16 embeddings and head."""
        return self.num_layers * self.layer_weight_bytes(compressed) + self.embedding_bytes

    def describe(self) -> str:
        return (f"{self.name}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"{self.num_heads} heads ({self.num_kv_heads} KV) x {self.head_dim}, "
                f"{self.ffn_kind} FFN {self.ffn_size}, vocab {self.vocab_size}, "
                f"{self.num_params / 1e9:.2f}B params = {fmt_bytes(self.weight_bytes(False))} "
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
        return cls(name=name,
                   num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn_size=c.intermediate_size,
                   ffn_kind="mlp" if opt else "gated", vocab_size=c.vocab_size,
                   bytes_per_value=DTYPE_BYTES[c.dtype_name] if bytes_per_value is None else bytes_per_value,
                   embed_dim=c.word_embed_proj_dim or 0, max_positions=c.max_position_embeddings,
                   learned_positions=opt, tie_embeddings=c.tie_word_embeddings,
                   linear_bias=c.linear_bias, qkv_bias=c.qkv_bias, layer_norm_bias=opt)

    @classmethod
    def from_name(cls, name: str, bytes_per_value: int | None = None) -> "ModelSpec":
        """A registered name (`opt-30b`, `dummy:opt-175b`, `meta-llama/...`) or a checkpoint folder."""
        if os.path.isdir(name):
            path = os.path.join(name, "config.json")
            if not os.path.isfile(path):
                raise SpecError(f"model folder {name} has no config.json")
            try:
                with open(path) as f:
                    config = json.load(f)
            except json.JSONDecodeError as exc:
                raise SpecError(f"{path} is not valid JSON: {exc}") from None
            return cls.from_config(config, name=os.path.basename(os.path.normpath(name)),
                                   bytes_per_value=bytes_per_value)
        try:
            config = known_config(name)
        except KeyError:
            raise SpecError(f"unknown model {name!r}: not a folder with config.json and not a "
                            f"registered name ({', '.join(KNOWN_MODELS)})") from None
        short = name.strip().lower().split(":", 1)[-1].split("/")[-1]
        return cls.from_config(config, name=short, bytes_per_value=bytes_per_value)
