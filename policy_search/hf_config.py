"""`HFConfig`: an HF `config.json` of the OPT or LLaMA family (with qwen3's q/k norms and the
mixture-of-experts variants mixtral, qwen2_moe, qwen3_moe: `MoeConfig`), parsed once for everyone.

Stdlib only: the planner's `ModelSpec` and the runtime's `ModelConfig` (flexsarathi/model_config.py,
which adds the torch dtype) are both built from it, so they cannot disagree on a default. Accepts
configs written by transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5
(`rope_parameters`, `dtype`). Errors are SpecErrors naming the source and the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from policy_search.errors import SpecError

FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
            "qwen3_moe": "llama", "mixtral": "llama", "qwen2_moe": "llama"}
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
# Router options of other MoE families (DeepSeek's grouped / sigmoid routing); with anything but
# their neutral value the router would not be softmax-then-top-k, so such a config is refused.
_NEUTRAL_ROUTER_OPTIONS = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 1),
                           "topk_group": (None, 1), "routed_scaling_factor": (None, 1, 1.0),
                           "n_routed_experts": (None,), "n_shared_experts": (None, 0)}
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
class MoeConfig:
    """Mixture-of-experts MLPs (mixtral, qwen2_moe, qwen3_moe): the router is a softmax over all
    experts, then top-k, renormalised to sum 1 where `norm_topk_prob` (always for mixtral)."""
    num_experts: int
    top_k: int  # num_experts_per_tok
    expert_intermediate_size: int  # each expert's FFN width (moe_intermediate_size; mixtral's intermediate_size)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]  # layers whose MLP is the experts; the others are dense (intermediate_size)
    shared_expert_intermediate_size: int = 0  # qwen2_moe: one sigmoid-gated shared expert; 0: none


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
    qk_norm: bool = False  # qwen3, qwen3_moe: per-head RMSNorm of q and k before RoPE
    moe: MoeConfig | None = None

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
    model_type = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not cfg.get("use_sliding_window", False):
        window = None
    if window and model_type in ("qwen3", "qwen2_moe"):  # windows on only some layers (max_window_layers)
        raise SpecError(f"{source}: use_sliding_window=true is not supported for {model_type}")
    return dict(num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=need("intermediate_size"), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or attention_bias or (
                    model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
                o_bias=attention_bias, mlp_bias=bool(cfg.get("mlp_bias", False)), rope=_parse_rope(cfg, source),
                sliding_window=int(window) if window else None, qk_norm=model_type in ("qwen3", "qwen3_moe"),
                moe=_parse_moe(cfg, need, source) if model_type in MOE_TYPES else None)


def _parse_moe(cfg: dict, need, source: str) -> MoeConfig:
    for key, neutral in _NEUTRAL_ROUTER_OPTIONS.items():
        if key in cfg and cfg[key] not in neutral:
            raise SpecError(f"{source}: router option {key!r}={cfg[key]!r} is not supported (the router "
                            f"is a softmax over all experts, then top-k)")
    mixtral = cfg["model_type"] == "mixtral"
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts, top_k = need(experts_key), need("num_experts_per_tok")
    if experts < 1 or not 1 <= top_k <= experts:
        raise SpecError(f"{source}: num_experts_per_tok={top_k} must be between 1 and {experts_key}={experts}")
    layers = need("num_hidden_layers")
    step = need("decoder_sparse_step") if not mixtral and cfg.get("decoder_sparse_step") is not None else 1
    dense = [] if mixtral else (cfg.get("mlp_only_layers") or [])
    if step < 1 or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise SpecError(f"{source}: decoder_sparse_step={step} / mlp_only_layers={dense} do not name layers of "
                        f"a {layers}-layer model")
    return MoeConfig(  # which layers are sparse: transformers' Qwen2MoeDecoderLayer rule
        num_experts=experts, top_k=top_k, norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
        expert_intermediate_size=need("intermediate_size" if mixtral else "moe_intermediate_size"),
        sparse_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))


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
