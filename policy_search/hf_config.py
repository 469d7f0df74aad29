"""`HFConfig`: an HF `config.json` of the OPT or LLaMA family, parsed once for everyone.

LLaMA-family model types include Qwen3 (per-head q/k RMSNorm, `head_dim` independent of hidden /
heads), the mixture-of-experts ones (`mixtral`, `qwen2_moe`, `qwen3_moe`: their experts are
described by `MoEConfig`, None for a dense model) and Gemma 3 (`gemma3_text`, and `gemma3`'s text
model: policy_search/gemma3_config.py reads what differs: sliding and full layers, a rope per kind).

Stdlib only: the planner's `ModelSpec` and the runtime's `ModelConfig` (flexsarathi/models/model_config.py,
which adds the torch dtype) are both built from it, so they cannot disagree on a default. Accepts
configs written by transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5
(`rope_parameters`, `dtype`). Errors are SpecErrors naming the source and the field.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

# RopeConfig and typed_value are read from here too (models/model_config.py, formats/tokenizer.py)
from policy_search.config_fields import RopeConfig, parse_rope, typed, typed_value  # noqa: F401
from policy_search.errors import SpecError
from policy_search.gemma3_config import gemma3_attention
from policy_search.glm_config import glm4_moe_experts, mtp_layers
from policy_search.gpt_oss_config import gpt_oss_attention, gpt_oss_experts
from policy_search.olmo_config import olmo3_attention
from policy_search.text_model_config import NESTED, TEXT_DEFAULTS, text_model_config

FAMILIES = {"opt": "opt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
            "mixtral": "llama", "qwen2_moe": "llama", "qwen3_moe": "llama", "gemma3_text": "llama", "gemma3": "llama",
            "phi3": "llama", "mistral3": "llama", "granite": "llama", "olmo2": "llama", "olmo3": "llama",
            "gpt_oss": "llama", "glm4_moe": "llama", "minimax_m2": "llama"}
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "glm4_moe", "minimax_m2")
# RoPE over part of each head where the config says so (partial_rotary_factor): the model types whose
# transformers layers rotate the first dims only (the others would be another model: refused)
_PARTIAL_ROTARY = {"glm4_moe": 0.5, "phi3": 1.0, "minimax_m2": 1.0}  # -> the factor where the config names none
# transformers' default_theta of the model types whose RoPE base is not 10000 where the config names none
_DEFAULT_THETA = {"minimax_m2": 5_000_000.0}
# RMSNorm of q and k before RoPE (over each head; OLMo's over the whole projection)
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2", "olmo3", "minimax_m2")
QK_NORM_WHOLE_TYPES = ("olmo2", "olmo3", "minimax_m2")  # q / k normalised over the whole projection
OLMO_MODEL_TYPES = ("olmo2", "olmo3")  # q / k normalised whole; post-norms instead of pre-norms
_QWEN_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # sliding window only with use_sliding_window
GEMMA_MODEL_TYPES = ("gemma3_text", "gemma3")  # gemma3: the multimodal checkpoint, read for its text model
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
class MoEConfig:
    """The experts of a mixture-of-experts model (the layers that have them: `is_sparse`)."""
    num_experts: int  # routed experts per sparse layer (num_experts / num_local_experts)
    top_k: int  # experts each token is routed to (num_experts_per_tok)
    expert_ffn_size: int  # one expert's gated FFN width (moe_intermediate_size; Mixtral: intermediate_size)
    norm_topk_prob: bool  # the top-k routing weights are renormalised to sum to 1 (Mixtral: always)
    shared_expert_ffn_size: int = 0  # qwen2_moe: an always-on expert with a sigmoid gate; 0: none
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (those keep a dense MLP)
    # gpt_oss (policy_search/gpt_oss_config.py): biased router and experts, and the clamped GLU
    # (up + 1) * gate * sigmoid(glu_alpha * gate) where glu_limit is set (its router: models/gpt_oss.py)
    biases: bool = False
    glu_limit: float | None = None  # None: the SwiGLU silu(gate) * up
    glu_alpha: float = 1.0
    # glm4_moe (policy_search/glm_config.py): sigmoid scores, a correction bias that only chooses, the
    # best top_groups of `groups` expert groups, weights times routed_scaling; a shared expert ungated
    scoring: str = "softmax"  # "softmax" over all experts, or "sigmoid" per expert
    groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True  # qwen2_moe's sigmoid gate on the shared expert
    router_fp32: bool = True  # sigmoid scoring: logits from fp32 x and weight (glm4_moe), else in the weight's
    # dtype, then fp32 (minimax_m2)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has experts, as transformers decides it."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def sparse_layers(self, num_layers: int) -> int:
        return sum(self.is_sparse(i) for i in range(num_layers))


@dataclass(frozen=True)
class ClassifierConfig:
    """A *ForSequenceClassification checkpoint's head (`score`: [num_labels, hidden], no bias)."""

    labels: tuple[str, ...]  # id2label, in label order
    problem_type: str | None = None  # transformers': regression, single_label_ or multi_label_classification

    @property
    def num_labels(self) -> int:
        return len(self.labels)


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
    qk_norm: bool = False  # qwen3: RMSNorm of each q and k head before RoPE
    moe: MoEConfig | None = None  # mixtral / qwen2_moe / qwen3_moe; None: every layer a dense MLP
    classifier: ClassifierConfig | None = None  # a sequence-classification checkpoint's score head
    # Gemma 3
    attention_scale: float | None = None  # query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full); (): sliding_window
    local_rope: RopeConfig | None = None  # the sliding layers' rope; None: `rope` in every layer
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # gpt_oss: a learned logit per head in each softmax's denominator
    rotary_dim: int | None = None  # RoPE over each head's first rotary_dim dims (glm4_moe: half); None: all
    unread_layers: int = 0  # glm4_moe's multi-token-prediction layers, stored after the last one
    # Granite (its config's multipliers; 1: none)
    embedding_multiplier: float = 1.0  # the token embedding's rows times this
    residual_multiplier: float = 1.0  # attention's and the MLP's outputs times this before each residual add
    logits_scaling: float = 1.0  # logits divided by this

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def is_olmo(self) -> bool:
        """OLMo 2 / 3: q and k normalised over the whole projection; outputs normalised, not inputs."""
        return self.model_type in OLMO_MODEL_TYPES

    @property
    def qk_norm_whole(self) -> bool:
        """q and k normalised over the whole projection (every head at once), not per head."""
        return self.model_type in QK_NORM_WHOLE_TYPES

    @property
    def nests_text_model(self) -> bool:
        """A multimodal checkpoint read for its text model (text_model_config.py): its tensors nested."""
        return self.model_type in NESTED

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it sees every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers, in layer order (one for most models)."""
        return tuple(dict.fromkeys(self.layer_windows)) if self.layer_windows else (self.sliding_window,)

    @property
    def smallest_window(self) -> int | None:
        """The narrowest window any layer has (None: every layer sees every earlier key)."""
        return min((w for w in self.windows if w is not None), default=None)

    def rope_of(self, layer: int) -> RopeConfig:
        return self.local_rope if self.local_rope is not None and self.window_of(layer) is not None else self.rope

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
        if model_type in NESTED or model_type in TEXT_DEFAULTS:
            cfg, source = text_model_config(cfg, source)
        need = _integer_fields(cfg, source)
        bos, eos = _token_ids(cfg, source)
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        family = FAMILIES[model_type]
        family_fields = (_opt_fields if family == "opt" else _llama_fields)(cfg, need, source, hidden, heads)
        return cls(
            model_type=model_type, family=family, vocab_size=need("vocab_size"), hidden_size=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads,
            max_position_embeddings=need("max_position_embeddings"),
            dtype_name=dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "float32", f"{source}: dtype"),
            bos_token_id=bos, eos_token_ids=eos, classifier=_classifier(cfg, source),
            **family_fields)


# The fields every family has, with their ranges (num_hidden_layers bounded: each layer's shapes are built)
_SIZE_RANGES = {"vocab_size": (1, None), "hidden_size": (1, None), "num_hidden_layers": (1, 10000),
                "num_attention_heads": (1, None), "max_position_embeddings": (1, None),
                "intermediate_size": (1, None), "ffn_dim": (1, None), "num_experts": (1, None),
                "num_local_experts": (1, None), "num_experts_per_tok": (1, None), "moe_intermediate_size": (1, None),
                "n_routed_experts": (1, None),
                "shared_expert_intermediate_size": (0, None), "decoder_sparse_step": (1, None)}


def _integer_fields(cfg: dict, source: str):
    def need(key: str) -> int:
        low, high = _SIZE_RANGES.get(key, (None, None))
        return typed(cfg, key, source, int, low=low, high=high)
    return need


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def _classifier(cfg: dict, source: str) -> ClassifierConfig | None:
    """The score head of a checkpoint whose architectures name a *ForSequenceClassification; its
    labels from id2label (transformers saves it; num_labels alone: LABEL_0, LABEL_1, ...)."""
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list) or not any(
            isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures):
        return None
    id2label = cfg.get("id2label")
    if id2label is not None:
        if not isinstance(id2label, dict) or not id2label:
            raise SpecError(f"{source}: id2label must be a non-empty object {{index: label}}, got {id2label!r}")
        try:
            by_index = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise SpecError(f"{source}: id2label's keys must be label indices, got {sorted(id2label)[:3]}") from None
        if sorted(by_index) != list(range(len(by_index))):
            raise SpecError(f"{source}: id2label must number its labels 0..{len(by_index) - 1}, got {sorted(by_index)}")
        labels = tuple(by_index[i] for i in range(len(by_index)))
    else:
        count = typed(cfg, "num_labels", source, int, 2, low=1)
        labels = tuple(f"LABEL_{i}" for i in range(count))
    problem = cfg.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise SpecError(f"{source}: problem_type {problem!r} is not one of {', '.join(PROBLEM_TYPES)}")
    return ClassifierConfig(labels, problem)


def _token_ids(cfg: dict, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(bos_token_id, eos_token_ids): eos_token_id is one id or a list of ids."""
    bos = typed(cfg, "bos_token_id", source, int, None, low=0)
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        return bos, tuple(typed_value(e, f"eos_token_id[{i}]", source, int, low=0) for i, e in enumerate(eos))
    return bos, () if eos is None else (typed_value(eos, "eos_token_id", source, int, low=0),)


def _opt_fields(cfg: dict, need, source: str, hidden: int, heads: int) -> dict:
    if cfg.get("activation_function", "relu") != "relu":
        raise SpecError(f"{source}: OPT activation {cfg['activation_function']!r} is not supported (only relu)")
    if cfg.get("layer_norm_elementwise_affine", True) is False:
        raise SpecError(f"{source}: OPT without LayerNorm affine weights is not supported")
    flag = functools.partial(typed, cfg, source=source, kind=bool)
    pre_norm = flag(key="do_layer_norm_before", default=True)
    proj = typed(cfg, "word_embed_proj_dim", source, int, None, low=1)
    return dict(num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=need("ffn_dim"),
                norm_eps=1e-5, tie_word_embeddings=flag(key="tie_word_embeddings", default=True),
                pre_norm=pre_norm, word_embed_proj_dim=None if proj in (None, hidden) else proj,
                final_norm=pre_norm and not flag(key="_remove_final_layer_norm", default=False),
                linear_bias=flag(key="enable_bias", default=True))


def _llama_fields(cfg: dict, need, source: str, hidden: int, heads: int) -> dict:
    gemma = cfg.get("model_type") in GEMMA_MODEL_TYPES
    act_key, act_want = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    act = cfg.get(act_key) or act_want
    if act != act_want:
        raise SpecError(f"{source}: {act_key} {act!r} is not supported (only {act_want})")
    kv_heads = typed(cfg, "num_key_value_heads", source, int, heads, low=1)
    if heads % kv_heads:
        raise SpecError(f"{source}: num_heads={heads} (num_attention_heads) is not a multiple of "
                        f"num_kv_heads={kv_heads} (num_key_value_heads)")
    model_type = cfg.get("model_type")
    flag = functools.partial(typed, cfg, source=source, kind=bool)
    attention_bias = flag(key="attention_bias", default=model_type == "gpt_oss")
    head_dim = typed(cfg, "head_dim", source, int, hidden // heads, low=1)
    if model_type in _QWEN_TYPES and not flag(key="use_sliding_window", default=False):
        window = None  # qwen: sliding_window is read only with use_sliding_window
    else:
        window = typed(cfg, "sliding_window", source, int, None, low=1)  # null: none
    # qwen2 and qwen2_moe bias q, k and v (transformers 5 writes it as qkv_bias); qwen3 does not
    qkv_bias = flag(key="qkv_bias", default=model_type in ("qwen2", "qwen2_moe")) or attention_bias
    if gemma:
        attention = gemma3_attention(cfg, source, need("num_hidden_layers"))
    elif model_type == "olmo3":
        attention = olmo3_attention(cfg, source, need("num_hidden_layers"), window)
    elif model_type == "gpt_oss":
        attention = gpt_oss_attention(cfg, source, need("num_hidden_layers"))
    else:
        theta = _DEFAULT_THETA.get(model_type)
        rope_cfg = cfg if theta is None or _names_theta(cfg) else {**cfg, "rope_theta": theta}
        attention = dict(rope=parse_rope(rope_cfg, source), sliding_window=window,
                         **(_granite_fields(cfg, source) if model_type == "granite" else {}))
    glm = model_type == "glm4_moe"
    return dict(num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=need("intermediate_size"),
                rotary_dim=_rotary_dim(cfg, source, model_type, head_dim),
                unread_layers=mtp_layers(cfg, source) if glm else 0,
                norm_eps=typed(cfg, "rms_norm_eps", source, float, 1e-5 if model_type == "gpt_oss" else 1e-6,
                               above=0.0),
                tie_word_embeddings=flag(key="tie_word_embeddings", default=False),
                qkv_bias=qkv_bias, o_bias=attention_bias and not glm,  # glm4_moe: q, k, v only
                mlp_bias=flag(key="mlp_bias", default=False), **attention,
                qk_norm=model_type in QK_NORM_MODEL_TYPES or (glm and flag(key="use_qk_norm", default=False)),
                moe=_parse_moe(cfg, need, source) if model_type in MOE_MODEL_TYPES else None)


def _granite_fields(cfg: dict, source: str) -> dict:
    """Granite's multipliers (GraniteConfig's defaults: 1), its score scale attention_multiplier."""
    number = functools.partial(typed, cfg, source=source, kind=float, default=1.0, above=0.0)
    return dict(embedding_multiplier=number(key="embedding_multiplier"),
                residual_multiplier=number(key="residual_multiplier"), logits_scaling=number(key="logits_scaling"),
                attention_scale=number(key="attention_multiplier"))


def _names_theta(cfg: dict) -> bool:
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    return cfg.get("rope_theta") is not None or rope.get("rope_theta") is not None


def _rotary_dim(cfg: dict, source: str, model_type: str, head_dim: int) -> int | None:
    """The dims of each head RoPE rotates (the first ones; transformers' int(head_dim * factor)), None
    where it is all of them; refused by name for model types whose layers rotate every dim."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    given = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if given is None and cfg.get("rotary_dim") is not None:  # MiniMax's: the dims themselves
        given = typed(cfg, "rotary_dim", source, int, low=2, high=head_dim) / head_dim
    factor = typed({"partial_rotary_factor": given}, "partial_rotary_factor", source, float,
                   _PARTIAL_ROTARY.get(model_type, 1.0), above=0.0, high=1.0)
    if factor == 1.0:
        return None
    if model_type not in _PARTIAL_ROTARY:
        raise SpecError(f"{source}: partial_rotary_factor={factor} (RoPE over part of each head) is not supported "
                        f"for {model_type}")
    dims = int(head_dim * factor)
    if dims < 2 or dims % 2:
        raise SpecError(f"{source}: partial_rotary_factor={factor} rotates {dims} of {head_dim} dims; RoPE needs an "
                        "even number")
    return dims


# Router options of other MoE families that change the routing math: accepted only at the value
# that means the softmax-then-top-k these model types compute (anything else is refused, by name).
_ROUTER_OPTIONS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                   "routed_scaling_factor": 1.0, "moe_router_use_sigmoid": False,
                   "moe_router_enable_expert_bias": False}


def _check_router(cfg: dict, source: str) -> None:
    for key, plain in _ROUTER_OPTIONS.items():
        if cfg.get(key) is not None and cfg[key] != plain:
            raise SpecError(f"{source}: router option {key}={cfg[key]!r} is not supported for "
                            f"{cfg['model_type']} (routing is softmax over the experts, then top-k)")
    typed(cfg, "norm_topk_prob", source, bool, False)


def _parse_moe(cfg: dict, need, source: str) -> MoEConfig:
    """The experts of a mixtral / qwen2_moe / qwen3_moe / gpt_oss / glm4_moe config; errors name the field."""
    model_type = cfg["model_type"]
    if model_type == "glm4_moe":  # its own router options (n_group, topk_group, routed_scaling_factor)
        return MoEConfig(**glm4_moe_experts(cfg, need, source))
    if model_type == "minimax_m2":  # sigmoid scores, correction bias, renormalised; every layer sparse
        experts, top_k = need("num_local_experts"), need("num_experts_per_tok")
        if top_k > experts:
            raise SpecError(f"{source}: num_experts_per_tok={top_k} must be in [1, num_local_experts={experts}]")
        return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=need("intermediate_size"),
                         norm_topk_prob=True, scoring="sigmoid", router_fp32=False)
    _check_router(cfg, source)
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts, top_k = need(key), need("num_experts_per_tok")
    if experts < 1 or not 1 <= top_k <= experts:
        raise SpecError(f"{source}: num_experts_per_tok={top_k} must be in [1, {key}={experts}]")
    if model_type == "mixtral":  # every layer sparse, experts as wide as intermediate_size, top-k renormalised
        return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=need("intermediate_size"),
                         norm_topk_prob=True)
    if model_type == "gpt_oss":  # every layer sparse, experts as wide as intermediate_size
        return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=need("intermediate_size"),
                         norm_topk_prob=False, **gpt_oss_experts(cfg, source))
    step = need("decoder_sparse_step") if cfg.get("decoder_sparse_step") is not None else 1
    if step < 1:
        raise SpecError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
    layers = need("num_hidden_layers")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense):
        raise SpecError(f"{source}: mlp_only_layers must list layer indices in [0, {layers}), got {dense!r}")
    shared = need("shared_expert_intermediate_size") if model_type == "qwen2_moe" else 0
    return MoEConfig(num_experts=experts, top_k=top_k, expert_ffn_size=need("moe_intermediate_size"),
                     norm_topk_prob=typed(cfg, "norm_topk_prob", source, bool, False), shared_expert_ffn_size=shared,
                     decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(dense))))


def read_config_json(folder: str | os.PathLike) -> tuple[dict, str]:
    """(the parsed config.json of a checkpoint folder, its path); SpecError naming what is wrong."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise SpecError(f"model folder {folder} does not exist")
    if not os.path.isfile(path):
        raise SpecError(f"model folder {folder} has no config.json (a checkpoint folder needs one)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), path
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
