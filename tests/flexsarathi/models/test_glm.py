"""GLM-4.5 / 4.7 (glm4_moe) beyond the family tests (test_moe_models.py compares their logits and tokens
with transformers'): its config read as transformers reads it, its multi-token-prediction layers left
unread, its experts placed like any others (the all-on-device tokens), the planner counting the weights
the engine holds."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM
from flexsarathi.errors import CheckpointError
from flexsarathi.models import build_model_math
from flexsarathi.models.model_config import ModelConfig
from policy_search.model_registry import known_config
from policy_search.model_spec import ModelSpec
from tests.offload.test_policy_matrix import CASES, _check, references, stories_dir_or_none  # noqa: F401 (fixtures)
from tests.prompt_logits import prompt_logits


@pytest.mark.parametrize("name", ["glm-4.5-air", "glm-4.7"])
def test_a_glm_config_reads_as_transformers_reads_it(name):
    """Its RoPE frequencies (over half of each head), biases, q/k norms and router, field by field."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    cfg = known_config(name)
    theirs, ours = Glm4MoeConfig(**cfg), ModelConfig.parse(dict(cfg))
    inv_freq, _ = Glm4MoeRotaryEmbedding.compute_default_rope_parameters(theirs)
    # half of each head's 128 dims; the frequencies as transformers' to float32's rounding (ours: from float64)
    torch.testing.assert_close(build_model_math(ours).inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.rotary_dim == 64
    assert (ours.qkv_bias, ours.o_bias, ours.qk_norm) == (True, False, theirs.use_qk_norm)
    moe = ours.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_size, moe.shared_expert_ffn_size) == (
        theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
        theirs.moe_intermediate_size * theirs.n_shared_experts)
    assert (moe.routed_scaling, moe.groups, moe.top_groups, moe.scoring) == (
        theirs.routed_scaling_factor, theirs.n_group, theirs.topk_group, "sigmoid")
    assert [moe.is_sparse(i) for i in range(ours.num_layers)] == [
        i >= theirs.first_k_dense_replace for i in range(ours.num_layers)]
    assert ours.unread_layers == 1


def test_the_planner_counts_the_weights_the_engine_holds():
    config = ModelConfig.parse(known_config("glm-4.5-air-3l"))
    math = build_model_math(config)
    shapes = [*math.global_shapes().values(),
              *(s for i in range(config.num_layers) for s in math.layer_shapes(i).values())]
    assert ModelSpec.from_hf(config, "glm").num_params == sum(torch.Size(s).numel() for s in shapes)


def _with_mtp_layer(tiny_checkpoint, tmp_path, count: int | None):
    """The tiny checkpoint with one more layer's tensors after its last (GLM's MTP layer), and
    num_nextn_predict_layers = count (None: the field left out)."""
    folder, model = tiny_checkpoint("glm4_moe")
    out = tmp_path / "mtp"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    last = model.config.num_hidden_layers
    tensors |= {k.replace(f"layers.{last - 1}.", f"layers.{last}."): v.clone() for k, v in tensors.items()
                if k.startswith(f"model.layers.{last - 1}.")}
    tensors[f"model.layers.{last}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, out / "model.safetensors")
    config = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
              if k not in ("num_nextn_predict_layers", "num_mtp_layers")}
    count_field = {} if count is None else {"num_nextn_predict_layers": count}
    (out / "config.json").write_text(json.dumps(config | count_field))
    return out, model


def test_the_multi_token_prediction_layer_is_left_unread(tiny_checkpoint, tmp_path):
    from tests.flexsarathi.models.test_models import _prompts, hf_logits

    folder, model = _with_mtp_layer(tiny_checkpoint, tmp_path, 1)
    llm = LLM(str(folder), dtype="float32")
    for ids, logits in zip(_prompts(128), prompt_logits(llm, _prompts(128))):
        torch.testing.assert_close(logits, hf_logits(model, ids), atol=1e-4, rtol=0)


def test_a_layer_past_the_last_that_the_config_does_not_name_is_refused(tiny_checkpoint, tmp_path):
    folder, _ = _with_mtp_layer(tiny_checkpoint, tmp_path, None)
    with pytest.raises(CheckpointError, match="num_hidden_layers is 3, but the files hold layer 3"):
        LLM(str(folder), dtype="float32")


@pytest.mark.parametrize("case", ["weights_disk", "weights_30_40_30", "everything_off_gpu"])
def test_placement_gives_reference_tokens(references, case, tmp_path):  # noqa: F811
    _check(references, "glm4_moe_deep", False, CASES[case], tmp_path)


def test_compressed_placement_gives_compressed_reference_tokens(references, tmp_path):  # noqa: F811
    _check(references, "glm4_moe_deep", True, CASES["weights_30_40_30"], tmp_path)


# ---- MiniMax-M2: the same router (no groups, no shared expert), q/k normalised whole, RoPE over its rotary_dim
def test_a_minimax_m2_config_reads_as_transformers_reads_it():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    cfg = known_config("minimax-m2")
    theirs, ours = MiniMaxM2Config(**cfg), ModelConfig.parse(dict(cfg))
    inv_freq, _ = MiniMaxM2RotaryEmbedding.compute_default_rope_parameters(theirs)
    torch.testing.assert_close(build_model_math(ours).inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert ours.rotary_dim == 64 and ours.qk_norm and ours.qk_norm_whole and not ours.qkv_bias
    no_theta = ModelConfig.parse({k: v for k, v in cfg.items() if k != "rope_theta"})  # transformers' default base
    assert no_theta.rope.theta == MiniMaxM2Config(**{k: v for k, v in cfg.items() if k != "rope_theta"}
                                                  ).rope_parameters["rope_theta"] == 5e6
    moe = ours.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_size, moe.scoring, moe.shared_expert_ffn_size) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.intermediate_size, "sigmoid", 0)


def test_the_planner_counts_minimax_m2_s_weights_as_the_engine_holds_them():
    config = ModelConfig.parse(known_config("minimax-m2-2l"))
    math = build_model_math(config)
    shapes = [*math.global_shapes().values(),
              *(s for i in range(config.num_layers) for s in math.layer_shapes(i).values())]
    assert ModelSpec.from_hf(config, "minimax").num_params == sum(torch.Size(s).numel() for s in shapes)
    assert round(ModelSpec.from_name("minimax-m2").num_params / 1e9) == 229  # MiniMax's 230B (229B counted)


@pytest.mark.parametrize("edit, message", [
    ({"n_group": 3}, r"n_routed_experts=128 in n_group=3 groups, of which topk_group=1 are chosen, cannot give"),
    ({"n_group": 8, "topk_group": 9}, r"of which topk_group=9 are chosen"),
    ({"n_group": 64, "topk_group": 2}, r"cannot give num_experts_per_tok=8 experts"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be a finite number > 0.0 and <= 1.0, got 1.5"),
    ({"partial_rotary_factor": 0.01}, r"partial_rotary_factor=0.01 rotates 1 of 128 dims; RoPE needs an even number"),
    ({"first_k_dense_replace": 47}, r"first_k_dense_replace must be an integer >= 0 and <= 46, got 47"),
    ({"routed_scaling_factor": 0}, r"routed_scaling_factor must be a finite number > 0.0, got 0"),
])
def test_a_bad_glm_config_is_one_error_naming_the_field(edit, message):
    from policy_search.errors import SpecError

    with pytest.raises(SpecError, match=message):
        ModelConfig.parse({**known_config("glm-4.5-air"), **edit})
