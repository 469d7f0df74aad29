"""OLMo 2 / 3 beyond the family tests (test_models.py compares their logits and tokens with
transformers'): an OLMo 3 config.json in either writer's format read as transformers reads it (its
sliding and full layers, each kind's RoPE), and the planner counting the weights the engine holds."""
from __future__ import annotations

import pytest
import torch

from policy_search.hf_config import HFConfig
from tests.flexsarathi.models.test_gemma3 import assert_layers_as_transformers

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2,
        "beta_fast": 32.0, "beta_slow": 1.0}
# an OLMo-3-7B-shaped config as transformers 4 wrote them (rope_theta and rope_scaling at the top level)
LEGACY = {"model_type": "olmo3", "architectures": ["Olmo3ForCausalLM"], "hidden_size": 4096,
          "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
          "max_position_embeddings": 65536,
          "rms_norm_eps": 1e-6, "rope_theta": 500000, "rope_scaling": YARN, "sliding_window": 4096,
          "vocab_size": 100278, "eos_token_id": 100257, "pad_token_id": 100277, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("cfg", [
    LEGACY,
    {**LEGACY, "rope_scaling": None, "layer_types": ["sliding_attention", "full_attention"] * 16},
    {**{k: v for k, v in LEGACY.items() if k not in ("rope_theta", "rope_scaling")},
     "rope_parameters": {"full_attention": {**YARN, "rope_theta": 250000.0},
                         "sliding_attention": {"rope_type": "default"}}},
], ids=["transformers 4", "layer_types", "transformers 5"])
def test_an_olmo3_config_reads_as_transformers_reads_it(cfg):
    from transformers import Olmo3Config

    ours = HFConfig.parse(dict(cfg))
    assert_layers_as_transformers(ours, Olmo3Config(**cfg))
    assert ours.is_olmo and ours.qk_norm and ours.attention_scale is None


def test_the_planner_counts_the_weights_the_engine_holds():
    from flexsarathi.models import build_model_math
    from flexsarathi.models.model_config import ModelConfig
    from policy_search.model_spec import ModelSpec

    config = ModelConfig.parse({**LEGACY, "num_key_value_heads": 8})
    math = build_model_math(config)
    shapes = [*math.global_shapes().values(),
              *(s for i in range(config.num_layers) for s in math.layer_shapes(i).values())]
    assert ModelSpec.from_hf(config, "olmo-3").num_params == sum(torch.Size(s).numel() for s in shapes)
