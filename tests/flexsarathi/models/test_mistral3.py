"""Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration, model_type mistral3) read for its text
model: its config.json as transformers reads it (MistralConfig's defaults under text_config), the
checkpoint's text model run as it is stored (either naming, the Pixtral tower unread), against
transformers' logits for text prompts."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM
from policy_search.hf_config import HFConfig
from policy_search.text_model_config import MISTRAL_TEXT_DEFAULTS
from tests.flexsarathi.models.test_models import _prompts, hf_logits
from tests.prompt_logits import prompt_logits

# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (transformers 4.50), vision_config cut
HUB_24B = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
           "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
           "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                           "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                           "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                           "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                           "sliding_window": None, "use_cache": True, "vocab_size": 131072},
           "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
           "vision_config": {"head_dim": 64, "hidden_size": 1024, "model_type": "pixtral", "num_hidden_layers": 24},
           "vision_feature_layer": -1}


def test_defaults_are_transformers_mistral_defaults():
    from transformers import MistralConfig

    text = MistralConfig()
    for key, value in MISTRAL_TEXT_DEFAULTS.items():
        got = text.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(text, key)
        assert got == value, key


@pytest.mark.parametrize("drop", [(), ("sliding_window", "head_dim", "rms_norm_eps")])
def test_the_24b_config_reads_as_transformers_reads_it(drop):
    """As published, and with fields left out (transformers then fills in MistralConfig's defaults)."""
    from transformers import Mistral3Config

    cfg = {**HUB_24B, "text_config": {k: v for k, v in HUB_24B["text_config"].items() if k not in drop}}
    ours, text = HFConfig.parse(cfg), Mistral3Config(**cfg).text_config
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim,
            ours.intermediate_size, ours.norm_eps, ours.sliding_window, ours.rope.theta, ours.tie_word_embeddings) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
        text.head_dim, text.intermediate_size, text.rms_norm_eps, text.sliding_window,
        text.rope_parameters["rope_theta"], text.tie_word_embeddings)
    assert (ours.model_type, ours.dtype_name, ours.nests_text_model) == ("mistral3", "bfloat16", True)


def _checkpoint(folder: str, window: int | None):
    """A tiny Mistral3ForConditionalGeneration (a one-layer Pixtral tower), saved by transformers, its
    head untied (Mistral Small's)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                sliding_window=window, rope_theta=1e9, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, head_dim=8)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=127, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("naming", ["transformers 4", "transformers 5"])
@pytest.mark.parametrize("window", [None, 5])
def test_the_multimodal_checkpoint_runs_its_text_model(tmp_path, naming, window):
    model = _checkpoint(str(tmp_path), window)
    weights = os.path.join(tmp_path, "model.safetensors")
    stored = load_file(weights)
    assert any(n.startswith("vision_tower.") for n in stored) and "language_model.lm_head.weight" in stored
    if naming == "transformers 5":
        renamed = {n.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.",
                                                                                       "lm_head."): t
                   for n, t in stored.items()}
        save_file(renamed, weights, metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.config.sliding_window == window and not llm.engine.config.tie_word_embeddings
    prompts = _prompts(120, lengths=(3, 9, 14))
    for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
        torch.testing.assert_close(logits, hf_logits(model, ids), atol=1e-4, rtol=0)
