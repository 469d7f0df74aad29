"""The text model of a multimodal checkpoint's config.json, as its causal LM's config: what the
engine runs of Gemma3ForConditionalGeneration (`gemma3`) and Mistral3ForConditionalGeneration
(`mistral3`: Mistral Small 3.1 / 3.2) for text prompts, the vision tower left unread.

transformers writes a nested config as its difference from the class defaults, and reads it back
by filling in the text config class's defaults (Gemma3TextConfig's, MistralConfig's): so do we
(tests compare both tables with transformers'). A field the text config does not name is taken
from the wrapper where that is where transformers keeps it (the dtype, the end-of-turn ids).
The config keeps the wrapper's model_type: its tensors' names are nested too (ModelMath.stored_names).
"""
from __future__ import annotations

from policy_search.errors import SpecError

# transformers' Gemma3TextConfig defaults for what the runtime reads
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
# transformers' MistralConfig defaults for what the runtime reads (head_dim: hidden / heads where absent)
MISTRAL_TEXT_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "sliding_window": 4096, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
}
# wrapper model_type -> (its text model's defaults, the wrapper's fields that hold for the text model)
NESTED = {
    "gemma3": (GEMMA3_TEXT_DEFAULTS, ("torch_dtype", "dtype", "bos_token_id", "eos_token_id", "tie_word_embeddings")),
    "mistral3": (MISTRAL_TEXT_DEFAULTS, ("torch_dtype", "dtype", "bos_token_id", "eos_token_id")),
}
TEXT_DEFAULTS = {"gemma3_text": GEMMA3_TEXT_DEFAULTS}  # standalone text models written as diffs too


def text_model_config(cfg: dict, source: str) -> tuple[dict, str]:
    """(the text model's config, defaults filled in, under the checkpoint's model_type; where errors
    say it is)."""
    model_type = cfg["model_type"]
    if model_type in TEXT_DEFAULTS:
        return {**TEXT_DEFAULTS[model_type], **cfg}, source
    defaults, inherited_keys = NESTED[model_type]
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise SpecError(f"{source}: text_config must be an object, got {text!r}")
    inherited = {key: cfg[key] for key in inherited_keys if cfg.get(key) is not None and text.get(key) is None}
    return {**defaults, **text, **inherited, "model_type": model_type}, f"{source} (text_config)"
