"""Real shapes of well-known models, as HF `config.json` dicts.

Used by `dummy:<name>` (random weights of the real shape, for benchmarks) and by
`ModelSpec.from_name`. Pure data: nothing here loads weights.
"""
from __future__ import annotations

import copy


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
}


def _normalise(name: str) -> str:
    name = name.strip().lower()
    for prefix in ("dummy:", "facebook/", "meta-llama/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("llama-2-7b-hf", "llama-2-7b")


def known_config(name: str) -> dict:
    """HF config dict of a registered model (`opt-30b`, `dummy:llama-2-7b`, ...); a copy."""
    key = _normalise(name)
    if key not in KNOWN_MODELS:
        raise KeyError(f"unknown model name {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return copy.deepcopy(KNOWN_MODELS[key])
