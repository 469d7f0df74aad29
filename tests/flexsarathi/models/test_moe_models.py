"""Qwen3 and the mixture-of-experts families (mixtral, qwen2_moe, qwen3_moe) against transformers,
loaded from sharded checkpoints that transformers saves; chunked prefill against whole prefill;
every placement of the experts against the everything-on-the-compute-device run; bad configs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.formats.checkpoint import DummyWeights
from flexsarathi.errors import CheckpointError
from policy_search import Policy
from tests.conftest import MOE_KINDS, build_hf_model
from tests.flexsarathi.models.test_models import (GREEDY, _prompts, assert_chunked_prefill_equals_whole, hf_greedy,
                                                  hf_logits)
from tests.offload.test_policy_matrix import CASES, _check, references, stories_dir_or_none  # noqa: F401 (fixtures)
from tests.prompt_logits import prompt_logits

KINDS = ["qwen3", "qwen3_tied", "gpt_oss", "glm4_moe", "glm4_moe_air", "minimax_m2"] + MOE_KINDS


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """sharded_checkpoint(kind) -> (folder, transformers model), saved in shards of 20 KB (every
    model here spans several files and the experts of one layer straddle them)."""
    cache: dict[str, tuple[str, object]] = {}

    def make(kind: str):
        if kind not in cache:
            model = build_hf_model(kind)
            folder = tmp_path_factory.mktemp(kind)
            model.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
            assert (folder / "model.safetensors.index.json").is_file()
            cache[kind] = (str(folder), model)
        return cache[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(sharded_checkpoint, kind):
    folder, model = sharded_checkpoint(kind)
    llm = LLM(folder, dtype="float32")
    prompts = _prompts(llm.engine.config.vocab_size)
    for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
        torch.testing.assert_close(logits, hf_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(sharded_checkpoint, kind):
    folder, model = sharded_checkpoint(kind)
    llm = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=8))
    prompts = _prompts(llm.engine.config.vocab_size, lengths=(4, 9, 6))
    for ids, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert out.token_ids == hf_greedy(model, ids, GREEDY.max_tokens)


def test_the_configs_cover_what_the_issue_asks(sharded_checkpoint):
    """Several expert counts and top-k, renormalised and not, a shared expert, dense layers among
    sparse ones, tied and untied heads, head_dim independent of hidden / heads."""
    configs = {kind: LLM(sharded_checkpoint(kind)[0], dtype="float32").engine.config for kind in KINDS}
    moes = [c.moe for c in configs.values() if c.moe is not None]
    assert len({(m.num_experts, m.top_k) for m in moes}) >= 4
    assert {m.norm_topk_prob for m in moes} == {True, False}
    assert any(m.shared_expert_ffn_size for m in moes)
    assert any(0 < m.sparse_layers(c.num_layers) < c.num_layers for c in configs.values() if (m := c.moe))
    assert {c.tie_word_embeddings for c in configs.values()} == {True, False}
    assert configs["qwen3"].head_dim * configs["qwen3"].num_heads != configs["qwen3"].hidden_size
    assert [configs["qwen2_moe"].moe.is_sparse(i) for i in range(4)] == [False, True, False, True]
    assert [configs["qwen3_moe_dense_layer"].moe.is_sparse(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("kind", ["qwen3_moe_dense_layer", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("budget", [1, 5])
def test_chunked_prefill_equals_whole_prefill(sharded_checkpoint, kind, budget):
    assert_chunked_prefill_equals_whole(sharded_checkpoint(kind)[0], budget)


# ---- placements: the experts streamed like every other weight ---------------------------------
MOE_CASES = ["weights_cpu", "weights_disk", "weights_30_40_30", "overlap_off", "three_micro_batches_offloaded",
             "block_schedule", "everything_off_gpu"]


@pytest.mark.parametrize("model, case", [("qwen2_moe_deep", case) for case in MOE_CASES] +
                         [("mixtral_deep", case) for case in ("weights_disk", "weights_30_40_30", "block_schedule")])
def test_placement_gives_reference_tokens(references, model, case, tmp_path):  # noqa: F811
    _check(references, model, False, CASES[case], tmp_path)


@pytest.mark.parametrize("model, case", [("qwen2_moe_deep", "weights_30_40_30"), ("qwen2_moe_deep", "block_schedule"),
                                         ("mixtral_deep", "everything_off_gpu")])
def test_compressed_placement_gives_compressed_reference_tokens(references, model, case, tmp_path):  # noqa: F811
    _check(references, model, True, CASES[case], tmp_path)


def test_disk_store_holds_every_expert_checksummed(references, tmp_path):  # noqa: F811
    """The experts are in the store like every weight (their crc32 in the manifest), compressed."""
    folder, prompts, ref_outputs, _, _ = references("qwen2_moe_deep", True)
    llm = LLM(folder, dtype="float32", offload_dir=str(tmp_path),
              policy=Policy(w_gpu=0.0, w_disk=1.0, compress_weight=True, compress_kv=True, gpu_batch_size=2,
                            num_gpu_batches=1, prefill_budget=6))
    manifest = json.loads(next(tmp_path.rglob("manifest.json")).read_text())
    text = json.dumps(manifest)
    for layer in (1, 3, 5):  # the sparse layers
        for name in ("experts.gate_up_proj.weight.data", "experts.down_proj.weight.scale", "small.router.weight"):
            assert f"{layer}.{name}" in text
    assert "crc32" in text
    assert "0.experts" not in text  # a dense layer has none
    del llm


# ---- 4-bit weights in the CPU int4 kernel's layout (bf16): expert row ranges on 64-row blocks ----
KERNEL_MOE = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                  norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def kernel_moe_folder(tmp_path_factory):
    from tests import conftest

    conftest.TINY_CONFIGS["qwen3_moe_blocks64"] = KERNEL_MOE
    folder = tmp_path_factory.mktemp("qwen3_moe_blocks64")
    build_hf_model("qwen3_moe_blocks64").save_pretrained(folder, max_shard_size="200KB")
    return str(folder)


@pytest.mark.parametrize("fractions", [dict(w_gpu=0.0, w_cpu=1.0), dict(w_gpu=0.3, w_cpu=0.3, w_disk=0.4)])
def test_int4_kernel_layout_experts_give_the_on_device_tokens(kernel_moe_folder, fractions, tmp_path):
    from quant.cpu_matmul import kernel_covers_format
    from quant import QuantConfig

    if not kernel_covers_format(QuantConfig(bits=4, group_size=64)):
        pytest.skip("torch's CPU int4 kernel layout is not this machine's")
    base = dict(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=6, compress_weight=True)
    prompts = _prompts(128, lengths=(3, 13, 7, 20))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    # dequantize: the mode that keeps torch's int4 layout (the int8 modes keep rows for our kernel on a VNNI CPU)
    ref = LLM(kernel_moe_folder, dtype="bfloat16", device="cpu", policy=Policy(**base), offload_dir=str(tmp_path / "a"),
              cpu_matmul="dequantize")
    plans = {p.name: p for p in ref.engine.weights.plan.layer(0).tensors}
    assert plans["experts.gate_up_proj.weight"].kernel_layout and plans["experts.gate_up_proj.weight"].blocks == 4
    got = LLM(kernel_moe_folder, dtype="bfloat16", device="cpu", policy=Policy(**base, **fractions),
              offload_dir=str(tmp_path / "b"), cpu_matmul="dequantize")
    assert [o.token_ids for o in got.generate(prompts, params, use_tqdm=False)] == \
        [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]


# ---- configs refused -------------------------------------------------------------------------
def _edited(sharded_checkpoint, tmp_path, kind: str, **changes) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(sharded_checkpoint(kind)[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("field, value", [("scoring_func", "sigmoid"), ("topk_method", "group_limited_greedy"),
                                          ("n_group", 4), ("routed_scaling_factor", 2.5)])
def test_an_unknown_router_option_is_refused_naming_it(sharded_checkpoint, tmp_path, field, value):
    folder = _edited(sharded_checkpoint, tmp_path, "qwen3_moe", **{field: value})
    with pytest.raises(CheckpointError, match=f"router option {field}="):
        LLM(folder, dtype="float32")


@pytest.mark.parametrize("kind, field", [("qwen3_moe", "num_local_experts"), ("qwen2_moe", "num_experts"),
                                         ("mixtral", "num_local_experts")])
def test_more_experts_per_token_than_experts_is_refused(sharded_checkpoint, tmp_path, kind, field):
    folder = _edited(sharded_checkpoint, tmp_path, kind, num_experts_per_tok=7)
    with pytest.raises(CheckpointError, match=f"num_experts_per_tok=7 .*{field}="):
        LLM(folder, dtype="float32")


def test_mlp_only_layers_outside_the_model_is_refused(sharded_checkpoint, tmp_path):
    folder = _edited(sharded_checkpoint, tmp_path, "qwen2_moe", mlp_only_layers=[9])
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        LLM(folder, dtype="float32")


# ---- dummy weights of an MoE shape -----------------------------------------------------------
def test_dummy_weights_of_an_moe_config(sharded_checkpoint):
    from flexsarathi.models.moe import ROUTER
    from quant import QTensor, QuantConfig

    config = json.loads(open(sharded_checkpoint("qwen2_moe")[0] + "/config.json").read())
    source = DummyWeights("tiny-qwen2-moe", config=config, codes=QuantConfig(bits=4, group_size=16))
    assert source.fingerprint.startswith("dummy-tiny-qwen2-moe-")
    for layer in range(source.config.num_layers):
        weights = source.layer_weights(layer, torch.float32)
        shapes = source.model.layer_shapes(layer)
        assert weights.keys() == shapes.keys()
        assert (ROUTER in weights) == (layer in (1, 3))
        for name, w in weights.items():
            assert tuple(w.shape) == shapes[name]
            assert isinstance(w, QTensor) == (len(shapes[name]) == 2 and name not in source.model.resident_weights())
    x = torch.randn(5, source.config.hidden_size)
    plain = DummyWeights("tiny-qwen2-moe", config=config).layer_weights(1, torch.float32)
    out = source.model.post_attention(plain, x, torch.randn(5, source.config.q_size))  # runs: a sparse layer
    assert out.shape == x.shape and torch.isfinite(out).all()


# ---- routed-only reads and CPU expert computation: the all-on-device tokens, flags on and off ---
FLAG_PLACEMENTS = {"cpu": dict(w_gpu=0.0, w_cpu=1.0), "disk": dict(w_gpu=0.0, w_disk=1.0),
                   "split": dict(w_gpu=0.2, w_cpu=0.4, w_disk=0.4)}


# (model, placement, routed_expert_reads, cpu_experts, compressed): each flag on and off over the
# tiers, the split placements with both schedulers; the flags off are the placement tests above.
FLAG_CASES = [("mixtral_deep", "disk", True, False, False), ("mixtral_deep", "cpu", False, True, False),
              ("mixtral_deep", "split", True, True, False), ("mixtral_deep", "split", True, True, True),
              ("qwen2_moe_deep", "disk", True, False, True), ("qwen2_moe_deep", "cpu", True, True, False),
              ("qwen2_moe_deep", "split", True, False, False), ("qwen2_moe_deep", "split", False, True, True)]


@pytest.mark.parametrize("model, placement, routed, cpu, compressed", FLAG_CASES)
def test_routed_reads_and_cpu_experts_give_reference_tokens(references, model, placement, routed, cpu,  # noqa: F811
                                                             compressed, tmp_path):
    folder, prompts, ref_outputs, ref_logits, _ = references(model, compressed)
    scheduler = "block" if placement == "split" and compressed else "decode-maximal"  # both schedulers
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=6, scheduler=scheduler,
                    compress_weight=compressed, compress_kv=compressed, **FLAG_PLACEMENTS[placement])
    llm = LLM(folder, dtype="float32", policy=policy, offload_dir=str(tmp_path), kv_block_size=8,
              routed_expert_reads=routed, cpu_experts=cpu)
    outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)]
    assert outputs == ref_outputs
    for got, ref in zip(prompt_logits(llm, prompts[:3]), ref_logits):
        torch.testing.assert_close(got, ref, atol=1e-3 if compressed else 2e-5, rtol=0)
    stats = llm.engine.weights.stats
    assert stats["expert_loads"] > 0
    experts = llm.engine.config.moe.num_experts
    if cpu and placement == "cpu":  # every expert on the cpu tier: computed there, none read
        assert stats["experts_on_cpu"] > 0 and stats["experts_read"] == 0
    if routed and not (cpu and placement == "cpu"):
        # decode passes of 1-2 rows per micro-batch route to fewer than all experts of a layer
        assert 0 < stats["experts_read"] < stats["expert_loads"] * experts


@pytest.mark.parametrize("at_call", [2, 5])
def test_an_interrupt_between_routed_experts_leaves_no_expert_marked_read(references, tmp_path, monkeypatch,  # noqa: F811
                                                                          at_call):
    """Fault injected: KeyboardInterrupt from an expert's computation while the layer's later
    routed experts are still being read from disk (their reads are in flight when compute starts).
    The next run on the same engine gives the all-on-device tokens: no expert whose reads were
    not waited for counts as in the working buffer, and no read is left writing into it."""
    from flexsarathi.models import moe

    folder, prompts, ref_outputs, _, _ = references("mixtral_deep", False)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=6, w_gpu=0.0, w_disk=1.0)
    llm = LLM(folder, dtype="float32", policy=policy, offload_dir=str(tmp_path), kv_block_size=8,
              routed_expert_reads=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    calls, swiglu = [], moe.swiglu

    def interrupted(*args):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return swiglu(*args)

    monkeypatch.setattr(moe, "swiglu", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(moe, "swiglu", swiglu)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref_outputs
    assert llm.engine.weights.stats["experts_read"] > 0
