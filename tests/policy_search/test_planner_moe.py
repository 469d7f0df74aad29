"""Mixture of experts in the planner: shapes, bytes and FLOPs against the real tensors, the touched
fraction, what routed-only reads and CPU experts change in the cost model, the search's choice and
`flexsarathi policy`'s explanation. Expected values are derived here from the formulas' inputs."""
import argparse
import dataclasses
import itertools
import json
from fractions import Fraction

import pytest

from policy_search import HardwareSpec, ModelSpec, Policy, SpecError, Workload, estimate, format_report
from policy_search.hf_config import HFConfig
from policy_search.model_registry import known_config
from policy_search.quant_format import WEIGHT_FORMAT
from policy_search.search import search_detailed
from policy_search.units import GB, GiB

from tests.policy_search.conftest import host_profile

ALL_DISK = dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0, kv_gpu=1.0, kv_cpu=0.0, kv_disk=0.0,
                act_gpu=1.0, act_cpu=0.0, act_disk=0.0)


def mixtral_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Mixtral checkpoint, named as in its safetensors index."""
    h, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "block_sparse_moe.gate.weight": (cfg["num_local_experts"], h)}
        for e in range(cfg["num_local_experts"]):
            x = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {x + "w1.weight": (ffn, h), x + "w2.weight": (h, ffn), x + "w3.weight": (ffn, h)}
    return shapes


def numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def test_mixtral_bytes_are_the_sum_over_its_tensors():
    cfg = known_config("mixtral-8x7b")
    shapes = mixtral_tensor_shapes(cfg)
    spec = ModelSpec.from_name("mixtral-8x7b")
    assert spec.bytes_per_value == 2  # bfloat16
    assert spec.num_params == sum(numel(s) for s in shapes.values())
    assert spec.weight_bytes(False) == 2 * sum(numel(s) for s in shapes.values())
    # 4-bit: the layers' matrices (experts included) group-wise; the routers, which the engine keeps
    # uncompressed on the compute device (resident), and the rest 2 bytes a value
    routers = sum(numel(s) for k, s in shapes.items() if k.endswith("block_sparse_moe.gate.weight"))
    assert routers == spec.num_layers * spec.resident_params
    layer_matrices = sum(numel(s) for k, s in shapes.items() if k.startswith("model.layers.") and len(s) == 2) - routers
    rest = sum(numel(s) for s in shapes.values()) - layer_matrices
    assert spec.weight_bytes(True) == pytest.approx(layer_matrices * WEIGHT_FORMAT.bytes_per_value + 2 * rest,
                                                    rel=1e-12)
    experts = sum(numel(s) for k, s in shapes.items() if ".experts." in k)
    assert spec.num_layers * spec.layer_expert_params == experts
    assert spec.num_layers * spec.layer_expert_bytes(False) == 2 * experts


def test_flops_count_the_top_k_experts_only():
    cfg = known_config("mixtral-8x7b")
    h, ffn, experts, k = (cfg[n] for n in ("hidden_size", "intermediate_size", "num_local_experts",
                                            "num_experts_per_tok"))
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    attention = 2 * h * h + 2 * h * kv
    spec = ModelSpec.from_name("mixtral-8x7b")
    # each token: attention, the router (h x experts) and k of the experts' three matrices
    assert spec.matmul_flops_per_token == 2 * (attention + h * experts + k * 3 * h * ffn)
    assert spec.layer_matrix_params == attention + h * experts + experts * 3 * h * ffn
    # Mistral's figures: 46.7B parameters, 12.9B of them used per token
    assert spec.num_params == pytest.approx(46.7e9, rel=0.002)
    assert spec.num_active_params == pytest.approx(12.9e9, rel=0.005)


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x22b", 141e9, 39e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
    ("qwen3-8b", 8.2e9, 8.2e9), ("qwen3-32b", 32.8e9, 32.8e9),
])
def test_registered_moe_and_qwen3_sizes_match_the_published_ones(name, total, active):
    spec = ModelSpec.from_name(name)
    assert spec.num_params == pytest.approx(total, rel=0.015)
    assert spec.num_active_params == pytest.approx(active, rel=0.03)


def _transformers_params(config_cls, model_cls, cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    config = config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


QWEN2_MOE_SMALL = {  # a shared expert, decoder_sparse_step 2 and a listed dense layer: sparse = layer 1 only
    "model_type": "qwen2_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "num_experts": 6, "num_experts_per_tok": 2,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "max_position_embeddings": 128,
    "tie_word_embeddings": False, "torch_dtype": "float32"}


def test_parameter_counts_equal_transformers_models():
    transformers = pytest.importorskip("transformers")
    cases = [(transformers.MixtralConfig, transformers.MixtralForCausalLM, known_config("mixtral-8x7b")),
             (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, known_config("qwen3-30b-a3b")),
             (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, known_config("qwen3-8b")),
             (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, QWEN2_MOE_SMALL)]
    for config_cls, model_cls, cfg in cases:
        assert ModelSpec.from_config(cfg).num_params == _transformers_params(config_cls, model_cls, cfg), cfg


def test_qwen2_moe_layers_mix_sparse_and_dense():
    cfg = QWEN2_MOE_SMALL
    c = HFConfig.parse(cfg)
    assert [c.moe.is_sparse(i) for i in range(4)] == [False, True, False, False]
    spec = ModelSpec.from_config(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    dense_ffn = 3 * h * cfg["intermediate_size"]
    sparse_ffn = (cfg["num_experts"] * 3 * h * cfg["moe_intermediate_size"] + h * cfg["num_experts"]
                  + 3 * h * cfg["shared_expert_intermediate_size"] + h)  # experts, router, shared + its gate
    assert spec.sparse_layers == 1 and spec.qkv_bias
    assert layers * spec.layer_matrix_params == pytest.approx(
        layers * spec.attention_params + 3 * dense_ffn + sparse_ffn, rel=1e-12)
    routed = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    assert layers * spec.layer_routed_params == pytest.approx(routed, rel=1e-12)
    assert spec.bytes_per_value == 4  # float32
    # a working buffer holds the streamed matrices: the sparse layer's without its router and shared gate
    assert spec.resident_params == h * cfg["num_experts"] + h
    assert spec.largest_layer_weight_bytes(False) == 4 * (spec.attention_params + max(dense_ffn, sparse_ffn - spec.resident_params))


def test_qwen3_head_dim_is_its_own_and_q_k_are_normed():
    cfg = known_config("qwen3-30b-a3b")
    spec = ModelSpec.from_name("qwen3-30b-a3b")
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64 and spec.head_dim == 128
    assert spec.q_dim == 32 * 128 and spec.kv_dim == 4 * 128
    assert spec.layer_vector_params == 2 * cfg["hidden_size"] + 2 * 128  # two norms + q_norm, k_norm
    assert HFConfig.parse(cfg).moe.norm_topk_prob and not HFConfig.parse(known_config("qwen3-8b")).moe


@pytest.mark.parametrize("edit, message", [
    ({"num_experts_per_tok": 9, "num_local_experts": 8}, "num_experts_per_tok=9 must be in"),
    ({"num_experts_per_tok": None}, "'num_experts_per_tok' is missing"),
])
def test_bad_mixtral_configs_name_the_field(edit, message):
    cfg = known_config("mixtral-8x7b") | edit
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_config(cfg)


@pytest.mark.parametrize("name, edit, message", [
    ("qwen3-30b-a3b", {"scoring_func": "sigmoid"}, "router option scoring_func='sigmoid' is not supported"),
    ("mixtral-8x7b", {"routed_scaling_factor": 2.5}, "router option routed_scaling_factor=2.5"),
    ("qwen3-30b-a3b", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_unknown_router_options_are_refused_by_name(name, edit, message):
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_config(known_config(name) | edit)
    # the plain values of those options are the routing these types compute: accepted
    ModelSpec.from_config(known_config(name) | {"scoring_func": "softmax", "routed_scaling_factor": 1.0})


def test_bad_qwen_moe_layer_lists_name_the_field():
    with pytest.raises(SpecError, match="mlp_only_layers must list layer indices in"):
        ModelSpec.from_config(QWEN2_MOE_SMALL | {"mlp_only_layers": [4]})
    with pytest.raises(SpecError, match="'moe_intermediate_size' is missing"):
        ModelSpec.from_config({k: v for k, v in QWEN2_MOE_SMALL.items() if k != "moe_intermediate_size"})


def test_touched_fraction_at_one_row_two_rows_and_many():
    spec = ModelSpec.from_name("mixtral-8x7b")
    k, e = spec.experts_per_token, spec.num_experts
    assert spec.expert_touched_fraction(1) == pytest.approx(k / e)  # one token: exactly its k experts
    # two tokens: an expert is touched by the first or the second (inclusion-exclusion)
    assert spec.expert_touched_fraction(2) == pytest.approx(k / e + k / e - (k / e) ** 2)
    assert spec.expert_touched_fraction(512) == pytest.approx(1.0, abs=1e-12)
    assert spec.expert_touched_fraction(0) == 0.0 and ModelSpec.from_name("llama-2-7b").expert_touched_fraction(8) == 0


def test_touched_fraction_equals_the_exact_mean_over_every_routing():
    """E = 4 experts, top-2, 3 tokens: the mean union size over all C(4,2)^3 routings, exactly."""
    e, k, rows = 4, 2, 3
    choices = list(itertools.combinations(range(e), k))
    total = sum(len(set().union(*pick)) for pick in itertools.product(choices, repeat=rows))
    exact = Fraction(total, len(choices) ** rows * e)
    spec = dataclasses.replace(ModelSpec.from_config(QWEN2_MOE_SMALL), num_experts=e, experts_per_token=k)
    assert spec.expert_touched_fraction(rows) == pytest.approx(float(exact), rel=1e-12)


def test_routed_reads_cut_the_disk_term_by_the_touched_fraction():
    spec = ModelSpec.from_name("mixtral-8x7b")
    hw = HardwareSpec.preset("t4").with_memory(disk=200 * GiB)
    workload = Workload(prompt_len=64, gen_len=8, num_requests=4)
    base = Policy(gpu_batch_size=4, num_gpu_batches=1, scheduler="block", compress_weight=True, **ALL_DISK)
    off = estimate(base, spec, hw, workload)
    on = estimate(base.replace(routed_expert_reads=True), spec, hw, workload)
    # the disk holds the placed bytes: not the routers, which stay on the compute device
    layers, layer_bytes, expert_bytes = spec.num_layers, spec.layer_placed_bytes(True), spec.layer_expert_bytes(True)
    for p_off, p_on in zip(off.passes, on.passes):
        rows = p_off.decode_tokens + p_off.prompt_tokens
        touched = 1 - (1 - 2 / 8) ** rows  # top-2 of 8, every row of the pass
        assert p_off.resources["disk->host"] == pytest.approx(layers * layer_bytes / hw.disk_to_host, rel=1e-9)
        expected = layers * (layer_bytes - expert_bytes + touched * expert_bytes) / hw.disk_to_host
        assert p_on.resources["disk->host"] == pytest.approx(expected, rel=1e-9)
    decode = on.passes[-1]
    assert decode.bound == "disk->host" and decode.decode_tokens == 4
    assert on.throughput > 1.3 * off.throughput


def test_cpu_experts_move_activations_instead_of_experts():
    spec = ModelSpec.from_name("mixtral-8x7b")
    hw = HardwareSpec.preset("t4")
    workload = Workload(prompt_len=64, gen_len=8, num_requests=4)
    placement = dict(ALL_DISK, w_disk=0.0, w_cpu=1.0)
    base = Policy(gpu_batch_size=4, num_gpu_batches=1, scheduler="block", cpu_attention=False, **placement)
    off = estimate(base, spec, hw, workload).passes[-1]
    on = estimate(base.replace(cpu_experts=True), spec, hw, workload).passes[-1]
    layers, tokens = spec.num_layers, off.decode_tokens
    expert_bytes, hidden = spec.layer_expert_bytes(False), spec.hidden_bytes_per_token
    saved = layers * (expert_bytes - tokens * hidden) / hw.host_to_device
    assert off.resources["host->device"] - on.resources["host->device"] == pytest.approx(saved, rel=1e-9)
    assert on.resources["device->host"] - off.resources["device->host"] == pytest.approx(
        layers * tokens * hidden / hw.device_to_host, rel=1e-9)
    # one layer on the CPU: stream the touched experts, multiply each row by its top-k experts
    touched = 1 - (1 - spec.experts_per_token / spec.num_experts) ** tokens
    read = touched * expert_bytes / hw.cpu_memory_bandwidth
    routed_flops = 2 * spec.layer_routed_params * tokens
    assert on.resources["cpu"] == pytest.approx(layers * (read + routed_flops / hw.cpu_matmul_flops), rel=1e-9)
    assert off.resources["cpu"] == 0.0


def test_moe_options_change_nothing_for_a_dense_model(opt13):
    hw = HardwareSpec.preset("t4").with_memory(gpu=1 * GiB)
    workload = Workload(prompt_len=128, gen_len=16)
    base = Policy(gpu_batch_size=8, num_gpu_batches=2, w_gpu=0.2, w_cpu=0.5, w_disk=0.3)
    plain = estimate(base, opt13, hw, workload)
    both = estimate(base.replace(routed_expert_reads=True, cpu_experts=True), opt13, hw, workload)
    assert both == plain


def _disk_bound_host():
    """A host whose weights must stream from a 1 GB/s disk: passes of a few rows are disk-bound."""
    return dataclasses.replace(host_profile(20e9).with_memory(gpu=8 * GiB, cpu=8 * GiB), disk_to_host=1 * GB)


def test_search_reads_only_routed_experts_when_disk_bound():
    spec = ModelSpec.from_name("mixtral-8x7b")
    workload = Workload(prompt_len=64, gen_len=16, num_requests=2)
    chosen = search_detailed(spec, _disk_bound_host(), workload, max_running=2)
    without = search_detailed(spec, _disk_bound_host(), workload, max_running=2, routed_expert_reads=False)
    assert chosen.policy.routed_expert_reads and not without.policy.routed_expert_reads
    assert chosen.policy.w_disk > 0.5 and without.estimate.bound == "disk->host"
    # decode passes read 1 - (3/4)^2 of the experts: well above 1.5x with experts ~95% of the bytes
    assert chosen.estimate.throughput > 1.5 * without.estimate.throughput


def test_search_leaves_moe_options_off_for_dense_models(opt13):
    result = search_detailed(opt13, HardwareSpec.preset("t4").with_memory(gpu=1 * GiB),
                             Workload(prompt_len=128, gen_len=16))
    assert not result.policy.routed_expert_reads and not result.policy.cpu_experts


def test_policy_cli_explains_a_moe_plan(tmp_path, capsys):
    from flexsarathi.cli.policy import add_policy_parser

    profile = tmp_path / "host.json"
    _disk_bound_host().save(profile)
    out_path = tmp_path / "policy.json"
    parser = argparse.ArgumentParser()
    add_policy_parser(parser.add_subparsers())
    args = parser.parse_args(["policy", "--model", "dummy:mixtral-8x7b", "--hardware", str(profile),
                              "--prompt-len", "64", "--gen-len", "16", "--num-requests", "2",
                              "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--dtype", "bfloat16",
                              "--json", str(out_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    spec = ModelSpec.from_name("mixtral-8x7b")
    assert "Experts     8 per layer, top-2, in 32 of 32 layers" in out
    assert "routed FLOPs" in out and "12.88B of 46.70B params" in out
    assert f"{1 - 0.75 ** 2:.1%}" in out  # decode passes: 2 rows touch 43.8% of the experts
    assert "routed expert reads (only touched cpu/disk experts) on: " in out
    assert "routed expert reads on" in out  # the schedule line
    data = json.loads(out_path.read_text())
    assert data["policy"]["routed_expert_reads"] is True
    assert data["experts"]["num_experts"] == 8 and data["experts"]["active_params"] == spec.num_active_params
    assert Policy.load(out_path).routed_expert_reads
    # the options can be fixed from the command line like the other knobs
    args = parser.parse_args(["policy", "--model", "mixtral-8x7b", "--hardware", str(profile), "--prompt-len", "64",
                              "--gen-len", "16", "--num-requests", "2", "--gpu-batch-size", "2", "--num-gpu-batches",
                              "1", "--dtype", "bfloat16", "--no-routed-expert-reads", "--cpu-experts"])
    assert args.func(args) == 0
    assert "routed expert reads off, CPU experts on" in capsys.readouterr().out


def test_cpu_experts_delegate_decode_passes_and_copy_for_prompts():
    """On a T4 the CPU reads a decode pass's few touched experts from memory sooner than they would
    cross PCIe, but multiplies a 128-row prompt through every expert far slower than the copy."""
    from policy_search.cost_model import delegates_experts
    from policy_search.passes import run_shape

    spec, hw = ModelSpec.from_name("mixtral-8x7b"), HardwareSpec.preset("t4")
    workload = Workload(prompt_len=128, gen_len=8, num_requests=4)
    policy = Policy(gpu_batch_size=4, num_gpu_batches=1, scheduler="block", cpu_experts=True,
                    **dict(ALL_DISK, w_disk=0.0, w_cpu=1.0))
    prefill, *decodes = run_shape(policy, workload).passes
    expert_bytes = spec.layer_expert_bytes(False)
    for shape, delegated in ((prefill, False), (decodes[0], True)):
        rows = shape.decode_tokens + shape.prompt_tokens
        touched = 1 - (1 - 2 / 8) ** rows
        cpu = touched * expert_bytes / hw.cpu_memory_bandwidth + 2 * spec.layer_routed_params * rows / hw.cpu_matmul_flops
        assert (cpu < expert_bytes / hw.host_to_device) == delegated
        assert delegates_experts(shape, policy, spec, hw) == delegated
    est = estimate(policy, spec, hw, workload)
    assert est.passes[0].resources["cpu"] == 0.0 < est.passes[1].resources["cpu"]


def test_search_computes_cpu_experts_on_the_cpu_for_small_batches():
    spec, hw = ModelSpec.from_name("mixtral-8x7b"), HardwareSpec.preset("t4")
    workload = Workload(prompt_len=128, gen_len=32, num_requests=4)
    chosen = search_detailed(spec, hw, workload, max_running=4)
    without = search_detailed(spec, hw, workload, max_running=4, cpu_experts=False)
    assert chosen.policy.cpu_experts and chosen.policy.w_cpu > 0.5
    assert chosen.estimate.throughput > 1.3 * without.estimate.throughput
    text = format_report(chosen.policy, chosen.estimate, spec, hw, workload)
    assert "CPU experts (cpu-tier experts computed there) on: " in text
    assert "on the CPU in: decode 1/4, decode 2/4, decode 3/4, decode 4/4; the other passes copy" in text
