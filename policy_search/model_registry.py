"""Real shapes of well-known models, as HF `config.json` dicts.

Used by `dummy:<name>` (random weights of the real shape, for benchmarks) and by
`ModelSpec.from_name`. Pure data: nothing here loads weights.
"""
from __future__ import annotations

import copy
import re


def _opt(hidden: int, layers: int, heads: int, ffn: int, proj_dim: int | None = None,
         pre_norm: bool = True) -> dict:
    return {
        "model_type": "opt",
        "architectures": ["OPTForCausalLM"],
        "vocab_size": 50272,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "ffn_dim": ffn,
        "word_embed_proj_dim": proj_dim or hidden,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": pre_norm,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int = 32000,
           max_pos: int = 4096, theta: float = 10000.0, bos: int = 1, eos: int = 2,
           rope_scaling: dict | None = None) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float16",
    }


def _mixtral(hidden: int, layers: int, heads: int, ffn: int, max_pos: int, aux: float) -> dict:
    # mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 config.json (their published values:
    # 8 experts, top 2, 8 KV heads, rope_theta 1e6, vocab 32000, untied, bfloat16)
    return _llama(hidden, layers, heads, 8, ffn, vocab=32000, max_pos=max_pos, theta=1e6) | {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
        "num_experts_per_tok": 2, "sliding_window": None, "router_aux_loss_coef": aux,
        "torch_dtype": "bfloat16"}


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, **moe) -> dict:
    # Qwen/Qwen3-* config.json: head_dim 128 whatever hidden / heads, rope_theta 1e6, rms_norm_eps
    # 1e-6, vocab 151936, max_position_embeddings 40960, untied heads from 8B up, bfloat16
    cfg = _llama(hidden, layers, heads, kv_heads, ffn, vocab=151936, max_pos=40960, theta=1e6,
                 bos=151643, eos=151645) | {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 128,
        "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "torch_dtype": "bfloat16"}
    if moe:
        cfg |= {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001, **moe}
    return cfg


def _gemma3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, head_dim: int = 256,
            query_scalar: int = 256, window: int = 1024, vocab: int = 262208, max_pos: int = 131072,
            rope_scaling: dict | None = None) -> dict:
    # google/gemma-3-*-it text models (the 1B's config.json; the 4B, 12B and 27B's text_config with
    # Gemma3TextConfig's defaults): every 6th layer full, the others within `window`; bfloat16
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ffn,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": rope_scaling,
            "query_pre_attn_scalar": query_scalar, "sliding_window": window, "sliding_window_pattern": 6,
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"}


def _gpt_oss(layers: int, experts: int) -> dict:
    # openai/gpt-oss-20b and -120b config.json (cross-checked with copies found by the project's code
    # search): hidden and expert width 2880, 64 heads (8 KV) of 64, top 4, windows of 128 on even layers,
    # YaRN x32 over 4096 positions, base 150000; the experts MXFP4 there, bfloat16 here
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 4,
            "sliding_window": 128, "attention_bias": True, "hidden_act": "silu", "swiglu_limit": 7.0,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096},
            "tie_word_embeddings": False, "pad_token_id": 199999, "eos_token_id": 200002, "torch_dtype": "bfloat16"}


def _glm4_moe(hidden: int, layers: int, experts: int, ffn: int, expert_ffn: int, dense: int, **extra) -> dict:
    # zai-org GLM-4.5-Air and GLM-4.7 config.json (copies found by the project's code search): 96 heads (8 KV)
    # of 128, RoPE over half of each, base 1e6; 8 of the experts and one shared; one MTP layer; bfloat16
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 96,
            "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
            "attention_bias": True, "n_routed_experts": experts, "num_experts_per_tok": 8, "n_shared_experts": 1,
            "moe_intermediate_size": expert_ffn, "first_k_dense_replace": dense, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16", **extra}


_GEMMA3_SCALING = {"rope_type": "linear", "factor": 8.0}
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

KNOWN_MODELS: dict[str, dict] = {
    "opt-125m": _opt(768, 12, 12, 3072),
    "opt-350m": _opt(1024, 24, 16, 4096, proj_dim=512, pre_norm=False),
    "opt-1.3b": _opt(2048, 24, 32, 8192),
    "opt-2.7b": _opt(2560, 32, 32, 10240),
    "opt-6.7b": _opt(4096, 32, 32, 16384),
    "opt-13b": _opt(5120, 40, 40, 20480),
    "opt-30b": _opt(7168, 48, 56, 28672),
    "opt-66b": _opt(9216, 64, 72, 36864),
    "opt-175b": _opt(12288, 96, 96, 49152),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672),
    "llama-3-8b": _llama(4096, 32, 32, 8, 14336, vocab=128256, max_pos=8192, theta=500000.0,
                         bos=128000, eos=128001),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, vocab=128256, max_pos=131072, theta=500000.0,
                           bos=128000, eos=128001, rope_scaling=_LLAMA3_SCALING),
    # Mixture of experts. Sources of the values (each file's config.json as published on the HF hub,
    # cross-checked with copies found by the project's code search): Mixtral-8x7B-v0.1 (also
    # transformers' MixtralConfig defaults and its printed module tree: 8 x w1/w3 14336 x 4096);
    # Mixtral-8x22B-v0.1 (a verbatim copy in scaleapi/llm-engine's tests, transformers 4.40.0.dev0).
    "mixtral-8x7b": _mixtral(4096, 32, 32, 14336, max_pos=32768, aux=0.02),
    "mixtral-8x22b": _mixtral(6144, 56, 48, 16384, max_pos=65536, aux=0.001),
    # Qwen3 (Qwen/Qwen3-8B, -32B, -30B-A3B, -235B-A22B config.json; cross-checked with THUDM/slime's
    # Megatron argument files scripts/models/qwen3-*.sh: layers, hidden, ffn, heads, query groups,
    # kv-channels 128, moe-ffn-hidden-size, top-k 8 of 128 experts, vocab 151936, rotary base 1e6).
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288),
    "qwen3-32b": _qwen3(5120, 64, 64, 8, 25600),
    "qwen3-30b-a3b": _qwen3(2048, 48, 32, 4, 6144, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3(4096, 94, 64, 4, 12288, num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=1536),
    # Gemma 3 (google/gemma-3-1b-it config.json; gemma-3-4b/12b/27b-it text_config, cross-checked with
    # copies found by the project's code search: the 27B's head_dim 128 and query_pre_attn_scalar 168)
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, window=512, vocab=262144, max_pos=32768),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240, rope_scaling=_GEMMA3_SCALING),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360, rope_scaling=_GEMMA3_SCALING),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, query_scalar=168, rope_scaling=_GEMMA3_SCALING),
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503's text_config (3.2's is the same shape): head_dim 128
    # where hidden / heads is 160, rope_theta 1e9, no sliding window, an untied head
    "mistral-small-24b": _llama(5120, 40, 32, 8, 32768, vocab=131072, max_pos=131072, theta=1e9) | {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "head_dim": 128, "sliding_window": None,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"},
    # microsoft/phi-4 config.json (phi3: q/k/v and gate/up fused in the checkpoint; cross-checked with a
    # copy found by the project's code search)
    "phi-4": _llama(5120, 40, 40, 10, 17920, vocab=100352, max_pos=16384, theta=250000.0, bos=100257,
                    eos=100257) | {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "sliding_window": None,
                                   "original_max_position_embeddings": 16384, "torch_dtype": "bfloat16"},
    "glm-4.5-air": _glm4_moe(4096, 46, 128, 10944, 1408, 1, max_position_embeddings=131072,
                             routed_scaling_factor=1.0, use_qk_norm=False),
    "glm-4.7": _glm4_moe(5120, 92, 160, 12288, 1536, 3, max_position_embeddings=202752, routed_scaling_factor=2.5,
                         use_qk_norm=True),
    # MiniMaxAI/MiniMax-M2 config.json (transformers' MiniMaxM2Config defaults are its values): 62 layers of
    # 256 experts (top 8) of 1536, 48 heads (8 KV) of 128, RoPE over 64 dims of each, base 5e6
    "minimax-m2": {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 200064,
                   "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
                   "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256,
                   "num_experts_per_tok": 8, "max_position_embeddings": 196608, "rope_theta": 5000000,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020,
                   "torch_dtype": "bfloat16"},
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}


def _normalise(name: str) -> str:
    name = name.strip().lower()
    for prefix in ("dummy:", "facebook/", "meta-llama/", "mistralai/", "qwen/", "openai/", "zai-org/", "minimaxai/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("llama-2-7b-hf", "llama-2-7b").removesuffix("-v0.1")


def known_config(name: str) -> dict:
    """HF config dict of a registered model (`opt-30b`, `dummy:llama-2-7b`, ...), or of one cut to
    its first N layers (`llama-2-70b-2l`: the same shapes, fewer layers; a smoke run or a test of a
    big model's layer); a copy."""
    key = _normalise(name)
    cut = re.fullmatch(r"(.+)-([1-9][0-9]*)l", key)
    if key not in KNOWN_MODELS and cut and cut[1] in KNOWN_MODELS:
        # Resolved here, not only by register_variant: a CLI subprocess or a Ray actor given the
        # name must find the same shapes as the process that chose it.
        base, layers = KNOWN_MODELS[cut[1]], int(cut[2])
        if layers > base["num_hidden_layers"]:
            raise KeyError(f"model name {name!r}: {cut[1]} has {base['num_hidden_layers']} layers, so "
                           f"<name>-<N>l takes N from 1 to {base['num_hidden_layers']}")
        return _cut(base, layers)
    if key not in KNOWN_MODELS:
        raise KeyError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)} "
                       f"(or one of them cut to its first N layers: <name>-<N>l)")
    return copy.deepcopy(KNOWN_MODELS[key])


def is_registered(name: str) -> bool:
    """Whether `name` is a registered model (known_config gives its config)."""
    try:
        known_config(name)
    except KeyError:
        return False
    return True


def register_variant(base: str, layers: int | None = None, small: dict | None = None) -> str:
    """The registered name of `base` cut to its first `layers` layers (`<base>-<N>l`), or with the
    config overrides `small` (`<base>-tiny`: a benchmark's smoke run); `base` itself where neither
    changes it. A benchmark runs a dummy of the returned name."""
    if small is not None:
        name = f"{base}-tiny"
        KNOWN_MODELS[name] = {**known_config(base), **small}
        return name
    if layers is None or layers == known_config(base)["num_hidden_layers"]:
        return base
    name = f"{base}-{layers}l"
    KNOWN_MODELS[name] = _cut(known_config(base), layers)
    return name


def _cut(config: dict, layers: int) -> dict:
    """A copy of `config` with its first `layers` layers (its per-layer lists cut alike)."""
    cut = {**copy.deepcopy(config), "num_hidden_layers": layers}
    if isinstance(cut.get("layer_types"), list):
        cut["layer_types"] = cut["layer_types"][:layers]
    return cut
