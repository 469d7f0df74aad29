"""`ModelConfig`: the model's shape and math options, parsed from an HF `config.json`.

Two families: OPT (`opt`) and LLaMA (`llama`, `mistral`, `qwen2`). Accepts configs written by
transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5 (`rope_parameters`, `dtype`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from flexsarathi.errors import CheckpointError

SUPPORTED_MODEL_TYPES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "float": torch.float32, "half": torch.float16}


def parse_dtype(value, where: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    key = str(value).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {value!r}; use float32, float16 or bfloat16")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "opt" | "llama"
    model_type: str  # as written in config.json
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    # OPT
    pre_norm: bool = True  # OPT's do_layer_norm_before (False for opt-350m)
    word_embed_proj_dim: int | None = None  # OPT's project_in / project_out width when != hidden
    final_norm: bool = True  # OPT drops its final LayerNorm when post-norm or _remove_final_layer_norm
    linear_bias: bool = False  # OPT: every linear layer has a bias
    # LLaMA family
    qkv_bias: bool = False  # qwen2, or llama's attention_bias
    o_bias: bool = False  # llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None  # mistral / qwen2 with use_sliding_window

    # ---- derived -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (OPT's word_embed_proj_dim, else hidden)."""
        return self.word_embed_proj_dim or self.hidden_size

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isdir(folder):
            raise CheckpointError(f"model folder {folder} does not exist")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: a checkpoint folder needs config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf(data, source=path)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        family = SUPPORTED_MODEL_TYPES[model_type]

        def need(key: str):
            if key not in cfg or cfg[key] is None:
                raise CheckpointError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        dtype = parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32", f"{source}: dtype")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        common = dict(
            model_type=model_type, family=family, vocab_size=int(need("vocab_size")),
            hidden_size=hidden, num_layers=int(need("num_hidden_layers")), num_heads=heads,
            max_position_embeddings=int(need("max_position_embeddings")), checkpoint_dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        )
        if family == "opt":
            if cfg.get("activation_function", "relu") != "relu":
                raise CheckpointError(f"{source}: OPT activation {cfg['activation_function']!r} "
                                      "is not supported (only relu)")
            if cfg.get("layer_norm_elementwise_affine", True) is False:
                raise CheckpointError(f"{source}: OPT without LayerNorm affine weights is not supported")
            pre_norm = bool(cfg.get("do_layer_norm_before", True))
            proj = cfg.get("word_embed_proj_dim")
            out = cls(
                **common, num_kv_heads=heads, head_dim=hidden // heads,
                intermediate_size=int(need("ffn_dim")), norm_eps=1e-5,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                pre_norm=pre_norm, word_embed_proj_dim=None if proj in (None, hidden) else int(proj),
                final_norm=pre_norm and not cfg.get("_remove_final_layer_norm", False),
                linear_bias=bool(cfg.get("enable_bias", True)),
            )
        else:
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (only silu)")
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            if heads % kv_heads:
                raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                      f"num_key_value_heads={kv_heads}")
            attention_bias = bool(cfg.get("attention_bias", False))
            window = cfg.get("sliding_window")
            if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None
            out = cls(
                **common, num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(need("intermediate_size")),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)), rope=_parse_rope(cfg, source),
                sliding_window=int(window) if window else None,
            )
        return out


def _parse_rope(cfg: dict, source: str) -> RopeConfig:
    # transformers 5 writes {"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}};
    # transformers 4 writes "rope_theta" and an optional "rope_scaling" dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in _SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{source}: rope type {kind!r} is not supported; supported: "
                              f"{', '.join(_SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=theta, kind=kind, factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
