"""`HFConfig`: an HF `config.json` of the OPT or LLaMA family, parsed once for everyone.

Stdlib only: the planner's `ModelSpec` and the runtime's `ModelConfig` (flexsarathi/models/model_config.py,
which adds the torch dtype) are both built from it, so they cannot disagree on a default. Accepts
configs written by transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5
(`rope_parameters`, `dtype`). Errors are SpecErrors naming the source and the field.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from policy_search.errors import SpecError

FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def dtype_name(value, where: str = "dtype") -> str:
    """'float32', 'float16' or 'bfloat16' for any of their spellings ('torch.float16', 'half', ...)."""
    key = str(value).replace("torch.", "").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise SpecError(f"{where}: unsupported dtype {value!r}; use float32, float16 or bfloat16")
    return key


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class HFConfig:
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
    dtype_name: str  # the checkpoint's: float32 (when config.json names none), float16, bfloat16
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

    @classmethod
    def parse(cls, cfg: dict, source: str = "config.json"):
        """An instance of `cls` (HFConfig or a subclass) from a config.json dict."""
        if not isinstance(cfg, dict):
            raise SpecError(f"{source}: expected a config dict, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise SpecError(f"{source}: model_type {model_type!r} is not supported; supported: "
                            f"{', '.join(FAMILIES)}")
        need = _integer_fields(cfg, source)
        eos = cfg.get("eos_token_id")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        family = FAMILIES[model_type]
        family_fields = (_opt_fields if family == "opt" else _llama_fields)(cfg, need, source, hidden, heads)
        return cls(
            model_type=model_type, family=family, vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            max_position_embeddings=need("max_position_embeddings"),
            dtype_name=dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "float32", f"{source}: dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),)),
            **family_fields)


def _integer_fields(cfg: dict, source: str):
    def need(key: str) -> int:
        value = cfg.get(key)
        if value is None:
            raise SpecError(f"{source}: required field {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise SpecError(f"{source}: field {key!r} must be an integer, got {value!r}")
        return int(value)
    return need


def _opt_fields(cfg: dict, need, source: str, hidden: int, heads: int) -> dict:
    if cfg.get("activation_function", "relu") != "relu":
        raise SpecError(f"{source}: OPT activation {cfg['activation_function']!r} is not supported (only relu)")
    if cfg.get("layer_norm_elementwise_affine", True) is False:
        raise SpecError(f"{source}: OPT without LayerNorm affine weights is not supported")
    pre_norm = bool(cfg.get("do_layer_norm_before", True))
    proj = cfg.get("word_embed_proj_dim")
    return dict(num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=need("ffn_dim"),
                norm_eps=1e-5, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                pre_norm=pre_norm, word_embed_proj_dim=None if proj in (None, hidden) else int(proj),
                final_norm=pre_norm and not cfg.get("_remove_final_layer_norm", False),
                linear_bias=bool(cfg.get("enable_bias", True)))


def _llama_fields(cfg: dict, need, source: str, hidden: int, heads: int) -> dict:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise SpecError(f"{source}: num_heads={heads} (num_attention_heads) is not a multiple of "
                        f"num_kv_heads={kv_heads} (num_key_value_heads)")
    attention_bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    return dict(num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=need("intermediate_size"), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=cfg.get("model_type") == "qwen2" or attention_bias, o_bias=attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)), rope=_parse_rope(cfg, source),
                sliding_window=int(window) if window else None)


def _parse_rope(cfg: dict, source: str) -> RopeConfig:
    # transformers 5 writes {"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}};
    # transformers 4 writes "rope_theta" and an optional "rope_scaling" dict.
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise SpecError(f"{source}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return RopeConfig(
        theta=float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0))), kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def read_config_json(folder: str | os.PathLike) -> tuple[dict, str]:
    """(the parsed config.json of a checkpoint folder, its path); SpecError naming what is wrong."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise SpecError(f"model folder {folder} does not exist")
    if not os.path.isfile(path):
        raise SpecError(f"model folder {folder} has no config.json (a checkpoint folder needs one)")
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON: {exc}") from None
