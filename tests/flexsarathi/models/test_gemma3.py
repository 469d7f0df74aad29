"""Gemma 3 beyond the family tests (test_models.py compares gemma3_text logits and tokens with
transformers'): its config.json as transformers reads it (both writers' formats, the nested one of
the multimodal checkpoint), that checkpoint's text model run as it is stored (either naming, the
vision tower unread), and what is refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM
from policy_search.errors import SpecError
from policy_search.text_model_config import GEMMA3_TEXT_DEFAULTS as TEXT_DEFAULTS
from policy_search.hf_config import HFConfig
from tests.flexsarathi.models.test_models import _prompts, hf_logits
from tests.prompt_logits import prompt_logits

# google/gemma-3-27b-it's config.json as published (transformers 4.50: text_config holds only what
# differs from Gemma3TextConfig's defaults)
HUB_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
           "model_type": "gemma3",
           "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                           "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                           "num_key_value_heads": 16,
                           "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}


def _as_transformers_reads_it(ours: HFConfig, text) -> None:
    """Every field the runtime reads equals what transformers' Gemma3TextConfig `text` says."""
    assert (ours.vocab_size, ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim,
            ours.intermediate_size, ours.norm_eps, ours.max_position_embeddings) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim, text.intermediate_size, text.rms_norm_eps,
        text.max_position_embeddings)
    assert ours.attention_scale == text.query_pre_attn_scalar ** -0.5
    assert_layers_as_transformers(ours, text)
    assert ours.tie_word_embeddings and ours.final_logit_softcap == text.final_logit_softcapping


def assert_layers_as_transformers(ours: HFConfig, text) -> None:
    """Each layer's window and RoPE equal what transformers' config `text` (layer_types, rope_parameters
    per kind of layer) gives it."""
    assert ours.layer_windows == tuple(text.sliding_window if kind == "sliding_attention" else None
                                       for kind in text.layer_types)
    for layer, kind in enumerate(text.layer_types):
        rope, params = ours.rope_of(layer), text.rope_parameters[kind]
        assert (rope.theta, rope.kind, rope.factor) == (params["rope_theta"], params["rope_type"],
                                                         params.get("factor", 1.0))
        if rope.kind == "yarn":
            assert (rope.attention_factor, rope.original_max_position_embeddings) == (
                params["attention_factor"], params["original_max_position_embeddings"])


def test_defaults_are_transformers_gemma3_text_defaults():
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig()
    for key, value in TEXT_DEFAULTS.items():
        assert getattr(text, key) == value, key


@pytest.mark.parametrize("nested", [True, False])
def test_the_27b_config_reads_as_transformers_reads_it(nested):
    from transformers import Gemma3Config, Gemma3TextConfig

    cfg = HUB_27B if nested else {**HUB_27B["text_config"], "torch_dtype": "bfloat16", "eos_token_id": [1, 106]}
    ours = HFConfig.parse(cfg)
    text = Gemma3Config(**cfg).text_config if nested else Gemma3TextConfig(**cfg)
    _as_transformers_reads_it(ours, text)
    assert (ours.model_type, ours.dtype_name, ours.eos_token_ids) == (cfg["model_type"], "bfloat16", (1, 106))
    assert ours.windows == (1024, None) and ours.layer_windows.count(None) == 62 // 6


def test_transformers_5_rope_parameters_read_as_transformers_reads_them():
    """rope_parameters per kind of layer, with and without their own rope_theta (then the top-level
    rope_theta / rope_local_base_freq, as transformers fills them in), layer_types given."""
    from transformers import Gemma3TextConfig

    kinds = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    for rope in ({"full_attention": {"rope_type": "linear", "factor": 4.0},
                  "sliding_attention": {"rope_type": "default"}},
                 {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}):
        cfg = {"model_type": "gemma3_text", "num_hidden_layers": 4, "layer_types": kinds, "rope_parameters": rope,
               "rope_theta": 3e6, "rope_local_base_freq": 3e4, "sliding_window": 7}
        _as_transformers_reads_it(HFConfig.parse(json.loads(json.dumps(cfg))), Gemma3TextConfig(**cfg))


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 50.0}, "attention-logit soft-capping"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list one of"),
    ({"layer_types": ["local"] * 62}, "layer_types must list one of"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope type 'dynamic' is not supported"),
])
def test_what_is_not_gemma3_as_we_run_it_is_refused_by_name(change, match):
    with pytest.raises(SpecError, match=match):
        HFConfig.parse({**HUB_27B, "text_config": {**HUB_27B["text_config"], **change}})
    with pytest.raises(SpecError, match="text_config must be an object"):
        HFConfig.parse({**HUB_27B, "text_config": [1]})


def test_the_planner_counts_the_weights_the_engine_holds():
    from flexsarathi.models import build_model_math
    from flexsarathi.models.model_config import ModelConfig
    from policy_search.model_spec import ModelSpec

    config = ModelConfig.parse(HUB_27B)
    math = build_model_math(config)
    shapes = [*math.global_shapes().values(),
              *(s for i in range(config.num_layers) for s in math.layer_shapes(i).values())]
    assert ModelSpec.from_hf(config, "gemma-3-27b").num_params == sum(torch.Size(s).numel() for s in shapes)


def _multimodal_checkpoint(folder: str):
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower of one layer), saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=20,
                sliding_window=4, sliding_window_pattern=3)  # soft-capped logits: test_models.py (gemma3_softcap)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=127,
                          boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)  # the (1 + w) scale away from 1, so a wrong norm shows
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("naming", ["transformers 4", "transformers 5"])
def test_the_multimodal_checkpoint_runs_its_text_model(tmp_path, naming):
    """Gemma3ForConditionalGeneration's logits for text prompts, from the file as transformers saved
    it (language_model.model.*) or as its version 5 names the modules (model.language_model.*)."""
    model = _multimodal_checkpoint(str(tmp_path))
    weights = os.path.join(tmp_path, "model.safetensors")
    stored = load_file(weights)
    assert any(n.startswith("vision_tower.") for n in stored) and "language_model.model.norm.weight" in stored
    if naming == "transformers 5":
        renamed = {n.replace("language_model.model.", "model.language_model.")
                   .replace("vision_tower.", "model.vision_tower."): t for n, t in stored.items()}
        save_file(renamed, weights, metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32")
    prompts = _prompts(120, lengths=(3, 9, 14))
    for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
        torch.testing.assert_close(logits, hf_logits(model, ids), atol=1e-4, rtol=0)


def test_a_tensor_no_part_of_gemma3_reads_is_still_refused(tmp_path):
    _multimodal_checkpoint(str(tmp_path))
    weights = os.path.join(tmp_path, "model.safetensors")
    stored = load_file(weights)
    stored["language_model.model.layers.9.mlp.down_proj.weight"] = torch.zeros(32, 48)
    save_file(stored, weights, metadata={"format": "pt"})
    with pytest.raises(Exception, match="layers.9.mlp.down_proj"):
        LLM(str(tmp_path), dtype="float32")
