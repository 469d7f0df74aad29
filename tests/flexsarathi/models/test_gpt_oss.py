"""gpt-oss beyond the family tests (test_moe_models.py compares its logits and tokens with
transformers'): its config read as transformers reads it, attention sinks through every route the
KV cache's placement takes (the all-on-device tokens), its experts on the CPU with their biases,
and the planner counting the weights the engine holds."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.models import build_model_math
from flexsarathi.models.model_config import ModelConfig
from policy_search import Policy
from policy_search.hf_config import HFConfig
from policy_search.model_registry import known_config
from policy_search.model_spec import ModelSpec
from tests.flexsarathi.models.test_moe_models import test_routed_reads_and_cpu_experts_give_reference_tokens
from tests.offload.test_policy_matrix import CASES, _check, references, stories_dir_or_none  # noqa: F401 (fixtures)

_ROPE_KEYS = ("rope_theta", "rope_scaling")


@pytest.mark.parametrize("cfg", [
    known_config("gpt-oss-120b"),  # as transformers 4 wrote it: rope_theta and rope_scaling
    {**{k: v for k, v in known_config("gpt-oss-20b").items() if k not in _ROPE_KEYS + ("layer_types",)},
     "rope_parameters": {**known_config("gpt-oss-20b")["rope_scaling"], "factor": 8.0, "rope_theta": 50000.0}},
    {k: v for k, v in known_config("gpt-oss-20b").items() if k not in _ROPE_KEYS + ("sliding_window",)},
], ids=["transformers 4", "transformers 5, no layer_types", "no rope, no window"])
def test_a_gpt_oss_config_reads_as_transformers_reads_it(cfg):
    """Each layer's window, and the RoPE frequencies and cos/sin factor transformers computes."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs = GptOssConfig(**cfg)
    ours = ModelConfig.parse(dict(cfg))
    assert ours.layer_windows == tuple(theirs.sliding_window if kind == "sliding_attention" else None
                                       for kind in theirs.layer_types)
    assert ours.attention_sinks and ours.qkv_bias and ours.o_bias and ours.norm_eps == theirs.rms_norm_eps
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    math = build_model_math(ours)
    assert torch.equal(math.inv_freq, inv_freq.float())
    assert math._rope_scale[False] == factor
    moe = ours.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_size) == (theirs.num_local_experts, theirs.num_experts_per_tok,
                                                                 theirs.intermediate_size)
    assert (moe.glu_limit, moe.glu_alpha, moe.biases) == (theirs.swiglu_limit, theirs.swiglu_alpha, True)


def test_the_planner_counts_the_weights_the_engine_holds():
    config = ModelConfig.parse(known_config("gpt-oss-20b-2l"))
    math = build_model_math(config)
    shapes = [*math.global_shapes().values(),
              *(s for i in range(config.num_layers) for s in math.layer_shapes(i).values())]
    assert ModelSpec.from_hf(config, "gpt-oss").num_params == sum(torch.Size(s).numel() for s in shapes)
    # the published totals (OpenAI's model card): 20.91B and 116.83B parameters
    assert round(ModelSpec.from_name("gpt-oss-20b").num_params / 1e9, 2) == 20.91
    assert round(ModelSpec.from_name("gpt-oss-120b").num_params / 1e9, 2) == 116.83


def test_a_model_without_sinks_parses_none():
    assert not HFConfig.parse(known_config("mixtral-8x7b")).attention_sinks


# Every route attention takes (plain and 4-bit pools on each tier, the CPU's decode attention, parts
# split over tiers and merged, micro-batches, both schedules), each merging the layer's sinks.
SINK_CASES = ["weights_disk", "kv_cpu", "kv_cpu_cpu_attention", "kv_split_cpu_attention", "kv_split",
              "three_micro_batches_offloaded", "block_schedule", "everything_off_gpu"]


@pytest.mark.parametrize("case", SINK_CASES)
def test_placement_gives_reference_tokens(references, case, tmp_path):  # noqa: F811
    _check(references, "gpt_oss_deep", False, CASES[case], tmp_path)


@pytest.mark.parametrize("case", ["kv_split_cpu_attention", "everything_off_gpu"])
def test_compressed_placement_gives_compressed_reference_tokens(references, case, tmp_path):  # noqa: F811
    _check(references, "gpt_oss_deep", True, CASES[case], tmp_path)


def test_experts_computed_on_the_cpu_take_their_biases(references, tmp_path):  # noqa: F811
    test_routed_reads_and_cpu_experts_give_reference_tokens(references, "gpt_oss_deep", "split", True, True, False,
                                                            tmp_path)


@pytest.mark.parametrize("compressed", [False, True])
def test_the_gpus_decode_route_merges_the_sinks_too(tiny_checkpoint, compressed):
    """Decodes gathered beside their new rows and attended on the compute device (a GPU's route, forced
    on the CPU: one fused masked call for other models, which gives no lse) give transformers' tokens."""
    from offload.kv_cache import gathered_decodes
    from tests.flexsarathi.models.test_models import GREEDY, _prompts, hf_greedy

    folder, model = tiny_checkpoint("gpt_oss")
    prompts = _prompts(128, lengths=(4, 9))
    with gathered_decodes():
        llm = LLM(folder, dtype="float32", policy=Policy(compress_kv=compressed))
        outputs = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.executor.sinks
    if compressed:  # the 4-bit cache's tokens: the plain route's within its rounding
        plain = LLM(folder, dtype="float32", policy=Policy(compress_kv=True))
        assert outputs == [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    else:
        assert outputs == [hf_greedy(model, ids, GREEDY.max_tokens) for ids in prompts]


@pytest.mark.parametrize("edit, message", [
    ({"layer_types": ["sliding_attention"] * 3}, r"layer_types must list one of .* for each of the 24 layers"),
    ({"swiglu_limit": 0}, r"swiglu_limit must be a finite number > 0.0, got 0"),
    ({"sliding_window": 0}, r"sliding_window must be an integer >= 1, got 0"),
])
def test_a_bad_gpt_oss_config_is_one_error_naming_the_field(edit, message):
    from policy_search.errors import SpecError

    with pytest.raises(SpecError, match=message):
        ModelConfig.parse({**known_config("gpt-oss-20b"), **edit})
