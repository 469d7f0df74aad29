"""GGUF models end to end: logits against transformers' own GGUF loading (fp32, its dequantized
weights), greedy tokens, the file's codes kept as they are, every placement against the
all-on-device run; qwen3 and the mixture-of-experts architectures against the model each file was
written from, its weights gguf's dequantization of the file's."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.engine.planner_spec import planner_model_spec  # noqa: E402
from policy_search import Policy  # noqa: E402
from quant import QuantConfig  # noqa: E402
from tests.gguf_files import build_model, dequantized_model, write_gguf  # noqa: E402
from tests.prompt_logits import prompt_logits  # noqa: E402
from quant import cpu_int8_matmul  # noqa: E402

# The conversion is checked against transformers at 1e-4: the exact product (dequantize + matmul),
# not the int8 kernel, whose own rounding is bounded in tests/quant/test_cpu_int8_matmul.py.
EXACT_PRODUCT = "dequantize"

EXACT = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
CONVERTED = ["Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]  # Q4_K_M: as llama.cpp's mix (attn_v, ffn_down in Q6_K)
PROMPTS = [[1, 5, 9, 33, 7, 100, 3], [17, 2, 99, 64, 31, 8, 120, 45, 6, 11, 70, 4, 90]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _type_of(weight_type: str):
    if weight_type == "Q4_K_M_layers":  # as real Q4_K_M files: ffn_down Q6_K in some layers only
        return lambda name: "Q6_K" if "attn_v" in name or name.startswith("blk.0.ffn_down") else "Q4_K"
    if weight_type != "Q4_K_M":
        return None
    return lambda name: "Q6_K" if any(p in name for p in ("attn_v", "ffn_down")) else "Q4_K"


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """gguf_model(kind, weight_type) -> (path, transformers' model loaded from it), once each."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def make(kind: str, weight_type: str):
        if (kind, weight_type) not in cache:
            folder = tmp_path_factory.mktemp(f"{kind}-{weight_type}")
            path = folder / "model.gguf"
            write_gguf(build_model(kind), path, weight_type=weight_type, type_of=_type_of(weight_type))
            ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
            cache[kind, weight_type] = (str(path), ref)
        return cache[kind, weight_type]

    return make


def _hf_logits(ref, prompt):
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0]


def _hf_greedy(ref, prompt, n=8):
    """Argmax continuation, EOS included (the engine's ignore_eos)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_hf_logits(ref, ids)[-1].argmax()))
    return ids[len(prompt):]


def _assert_logits_and_greedy_match(llm, ref) -> None:
    """The engine's logits within fp32 rounding (1e-4) of the reference's, and its greedy tokens."""
    for prompt, ours in zip(PROMPTS, prompt_logits(llm, PROMPTS)):
        assert (ours - _hf_logits(ref, prompt)).abs().max().item() < 1e-4
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [_hf_greedy(ref, p) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weight_type", EXACT + CONVERTED)
def test_logits_and_tokens_match_transformers(gguf_model, kind, weight_type):
    """Uncompressed weights: every type's exact values (codes dequantized exactly), so transformers'
    logits to fp32 rounding and its greedy tokens."""
    path, ref = gguf_model(kind, weight_type)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    _assert_logits_and_greedy_match(llm, ref)
    assert llm.engine.source.conversion_errors == {}


@pytest.mark.parametrize("weight_type,quant", [("Q4_K", QuantConfig(bits=4, group_size=32)),
                                               ("Q6_K", QuantConfig(bits=8, group_size=16))])
def test_k_quants_stored_as_converted_codes(gguf_model, weight_type, quant, tmp_path, capfd):
    """Compressed weights in the conversion's format: the codes as the file has them, the sub-block
    scales rounded to fp16 (the measured error, printed), logits near transformers'."""
    path, ref = gguf_model("llama", weight_type)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT,
              policy=Policy(compress_weight=True), weight_quant=quant,
              offload_dir=str(tmp_path))
    error = llm.engine.source.conversion_errors[weight_type]
    assert f"{weight_type} weights convert to {quant.bits}-bit groups of {quant.group_size}" in capfd.readouterr().err
    largest = max(p.abs().max().item() for n, p in ref.named_parameters() if "layers.0." in n and p.dim() == 2)
    assert 0 < error < 1e-3 * largest  # fp16 keeps 11 of the scale's 17 significant bits
    diff = max((ours - _hf_logits(ref, prompt)).abs().max().item()
               for prompt, ours in zip(PROMPTS, prompt_logits(llm, PROMPTS)))
    print(f"{weight_type}: weight error {error:.3g} (max |w| {largest:.3g}), logits within {diff:.3g} of transformers")
    assert diff < 1e-2


def test_mixed_k_quants_take_one_format_per_weight_exactly(gguf_model, tmp_path):
    """Q4_K_M mixes Q4_K and Q6_K within a fused weight (q, k Q4_K beside v Q6_K) and across layers
    (ffn_down): each such weight takes 8-bit groups of 16 in every layer, and its values are
    exactly those of each tensor's own conversion (a 4-bit code is the same 8-bit code, a group of
    32 two groups of 16 with its scale and minimum): nothing is requantized or left in floats."""
    from flexsarathi.formats.gguf_checkpoint import GGUFCheckpoint
    from flexsarathi.formats.gguf_file import gguf_name, qk_heads, unpermute_rows
    from flexsarathi.formats.gguf_quants import to_codes, to_qtensor
    from quant import dequantize

    path, ref = gguf_model("llama", "Q4_K_M_layers")
    ref = copy.deepcopy(ref)  # its weights become the conversion's below
    source = GGUFCheckpoint(path, report=lambda line: None)
    wide, narrow = QuantConfig(bits=8, group_size=16), QuantConfig(bits=4, group_size=32)
    assert source.quantized_formats() == {"qkv_proj.weight": wide, "o_proj.weight": narrow,
                                          "gate_up_proj.weight": narrow, "down_proj.weight": wide}
    for layer in range(source.config.num_layers):
        weights = source.layer_weights(layer, torch.float32)
        for canonical, hf_names in source.model.hf_layer_names(layer).items():
            if canonical not in source.quantized_formats():
                continue
            pieces = []
            for hf in hf_names:  # each tensor converted on its own, in its own format
                t = source.gguf.tensor(gguf_name(hf))
                values = dequantize(to_qtensor(to_codes(t.read(), t.type_name, t.shape), torch.float32), torch.float32)
                heads = qk_heads(t.name, source.config)
                pieces.append(values if heads is None else values[unpermute_rows(t.shape[0], heads)])
            assert weights[canonical].config == source.quantized_formats()[canonical]
            assert torch.equal(dequantize(weights[canonical], torch.float32), torch.cat(pieces)), (layer, canonical)
        _set_fused(ref.model.layers[layer], {k: dequantize(weights[k], torch.float32)
                                             for k in source.quantized_formats()}, source.config)
    # the engine, weights half on disk: transformers' logits on the weights it holds (the conversion's)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT,
              policy=Policy(compress_weight=True, w_gpu=0.5, w_disk=0.5),
              offload_dir=str(tmp_path))
    for prompt, ours in zip(PROMPTS, prompt_logits(llm, PROMPTS)):
        assert (ours - _hf_logits(ref, prompt)).abs().max().item() < 1e-4


def _set_fused(layer, fused: dict[str, torch.Tensor], config) -> None:
    """A transformers llama layer's projections from the engine's fused weights (q/k/v, gate/up rows)."""
    q, kv = config.q_size, config.kv_size
    attn, mlp = layer.self_attn, layer.mlp
    splits = {"qkv_proj.weight": ((attn.q_proj, attn.k_proj, attn.v_proj), (q, kv, kv)),
              "o_proj.weight": ((attn.o_proj,), (fused["o_proj.weight"].shape[0],)),
              "gate_up_proj.weight": ((mlp.gate_proj, mlp.up_proj), (config.intermediate_size,) * 2),
              "down_proj.weight": ((mlp.down_proj,), (fused["down_proj.weight"].shape[0],))}
    with torch.no_grad():
        for name, (modules, sizes) in splits.items():
            for module, rows in zip(modules, fused[name].split(sizes)):
                module.weight.copy_(rows)


@pytest.mark.parametrize("weight_type,quant", [("Q4_0", QuantConfig(bits=4, group_size=32)),
                                               ("Q8_0", QuantConfig(bits=8, group_size=32))])
def test_file_codes_stored_as_they_are(gguf_model, weight_type, quant, tmp_path):
    """With the engine's format set to the file's, placement keeps the codes (no requantization):
    the same logits as transformers to fp32 rounding and the same tokens, with weights on disk."""
    path, ref = gguf_model("llama", weight_type)
    policy = Policy(compress_weight=True, w_gpu=0.3, w_cpu=0.3, w_disk=0.4)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT,
              policy=policy, weight_quant=quant, offload_dir=str(tmp_path))
    _assert_logits_and_greedy_match(llm, ref)


PLACEMENTS = {
    "weights_cpu": dict(w_gpu=0.0, w_cpu=1.0),
    "weights_disk": dict(w_gpu=0.0, w_disk=1.0),
    "weights_30_40_30": dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3),
    "everything_split": dict(w_gpu=0.2, w_cpu=0.4, w_disk=0.4, kv_gpu=0.3, kv_cpu=0.7, cpu_attention=True,
                             act_gpu=0.5, act_cpu=0.5, num_gpu_batches=2),
}


@pytest.fixture(scope="module")
def written_model(tmp_path_factory):
    """written_model(kind, weight_type) -> (path, the transformers model it was written from with
    its weights replaced by gguf's `quants.dequantize` of the file's tensors), once each.

    The reference for qwen3 and the MoE files: transformers' GGUF loader reads none of them right
    (transformers 5.2x: qwen3 without `attention.key_length`, so head_dim 128; qwen2_moe/qwen3_moe
    without the expert widths, so its default sizes, a size-mismatch error; Mixtral's arch `llama`
    as a dense llama with its MLPs left random)."""
    cache = {}

    def make(kind: str, weight_type: str):
        if (kind, weight_type) not in cache:
            path = tmp_path_factory.mktemp(f"{kind}-{weight_type}") / "model.gguf"
            model = build_model(kind)
            write_gguf(model, path, weight_type=weight_type)
            cache[kind, weight_type] = (str(path), dequantized_model(model, path))
        return cache[kind, weight_type]

    return make


@pytest.mark.parametrize("kind,weight_type", [("qwen3", "F32"), ("qwen3", "Q8_0"), ("qwen3_moe", "F32"),
                                              ("qwen3_moe", "Q4_0"), ("qwen2_moe", "F32"), ("qwen2_moe", "Q8_0"),
                                              ("mixtral", "F32"), ("mixtral", "Q4_0"), ("qwen3_moe_k", "Q4_K"),
                                              ("qwen3_moe_k", "Q6_K"), ("glm4_moe", "F32"), ("glm4_moe", "Q4_0")])
def test_qwen3_and_moe_match_the_model_written(written_model, kind, weight_type):
    """qwen3 (head_dim not hidden / heads, q/k norms), qwen3moe, qwen2moe (shared expert, layer 0
    dense), Mixtral (arch llama with experts, q/k permuted), glm4moe (RoPE over half of each head, sigmoid
    routing with its correction bias, a shared expert, the MTP layer counted in block_count): logits to
    fp32 rounding, greedy tokens."""
    path, ref = written_model(kind, weight_type)
    _assert_logits_and_greedy_match(LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT), ref)


@pytest.mark.parametrize("nextn", [1, 0])
def test_a_glm4moe_file_s_mtp_layer_is_left_unread(tmp_path, nextn):
    """The MTP layer's tensors after the model's blocks (blk.3.*, blk.3.nextn.*) load unread where
    nextn_predict_layers counts them; where the metadata does not, they are refused, naming the block."""
    from flexsarathi.errors import CheckpointError

    model = build_model("glm4_moe")
    model.config.num_nextn_predict_layers = nextn
    extra = {"blk.3.attn_norm.weight": np.ones(128, dtype=np.float32),
             "blk.3.nextn.eh_proj.weight": np.zeros((128, 256), dtype=np.float32)}
    path = tmp_path / "glm.gguf"
    write_gguf(model, path, extra=extra)
    if nextn:
        llm = LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
        assert llm.engine.config.num_layers == 3 and llm.engine.config.unread_layers == 1
        _assert_logits_and_greedy_match(llm, dequantized_model(model, path))
    else:
        with pytest.raises(CheckpointError, match="block_count is 3, but the file holds block 3"):
            LLM(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("weight_type", ["F32", "Q4_0", "Q8_0"])
def test_a_gemma3_gguf_runs_as_llama_cpp_reads_it(written_model, weight_type):
    """gemma3 as llama.cpp's converter writes it (norms stored as 1 + w, its sandwich norms' names) and
    its graph reads it (every 6th layer full, the window from the file, linear RoPE scaling on full
    layers only): transformers' logits and greedy tokens for the model the file holds."""
    path, ref = written_model("gemma3", weight_type)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    config = llm.engine.config
    assert config.layer_windows == (5, 5, 5, 5, 5, None) and config.rope_of(5).factor == 2.0
    assert config.rope_of(0).theta == 1e4 and config.attention_scale == 64 ** -0.5
    _assert_logits_and_greedy_match(llm, ref)


@pytest.mark.parametrize("weight_type", ["F32", "Q4_0"])
def test_a_granite_gguf_runs_with_its_scales(written_model, weight_type):
    """granite: a llama file (q/k permuted) with the config's multipliers as granite.*_scale metadata."""
    path, ref = written_model("granite", weight_type)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    assert (llm.engine.config.embedding_multiplier, llm.engine.config.logits_scaling) == (12.0, 8.0)
    _assert_logits_and_greedy_match(llm, ref)


@pytest.mark.parametrize("weight_type", ["F32", "Q4_0"])
def test_a_phi3_gguf_runs_its_fused_tensors(written_model, weight_type):
    """phi3 (Phi-3 / Phi-4): attn_qkv and ffn_up (gate then up) read as the fused weights they are, the
    file's sliding window kept: transformers' logits and greedy tokens for the model the file holds."""
    path, ref = written_model("phi3", weight_type)
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    assert llm.engine.config.sliding_window == 6
    _assert_logits_and_greedy_match(llm, ref)


@pytest.mark.parametrize("weight_type", ["F32", "Q4_0"])
def test_a_mixtral_gguf_with_one_tensor_per_expert_loads(written_model, tmp_path, weight_type):
    """llama.cpp's Mixtral files from before it stacked the experts (April 2024: the first Mixtral
    GGUFs people still have) hold one 2-D tensor per expert, blk.N.ffn_gate.E.weight: the same model
    as the stacked file of the same values, width from the tensors (no expert_feed_forward_length)."""
    from gguf import GGUFReader

    _, ref = written_model("mixtral", weight_type)
    path = tmp_path / "per-expert.gguf"
    write_gguf(build_model("mixtral"), path, weight_type=weight_type, per_expert=True)
    names = {t.name for t in GGUFReader(str(path)).tensors}
    assert "blk.0.ffn_gate.3.weight" in names and not any(n.endswith("_exps.weight") for n in names)
    _assert_logits_and_greedy_match(LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT), ref)


@pytest.mark.parametrize("weight_type,quant", [("Q4_K", QuantConfig(bits=4, group_size=32)),
                                               ("Q6_K", QuantConfig(bits=8, group_size=16))])
def test_k_quant_experts_stored_as_converted_codes(written_model, weight_type, quant, tmp_path, capfd):
    """A K-quant MoE file, compressed: every expert (and matrix) stored as the conversion's codes,
    each value within its group's fp16 rounding of the K-quant's scale and minimum of gguf's
    dequantization, and the engine's logits those of transformers on the weights it stores.
    (Logits against the file's own values would not do: a router near a tie picks other experts.)"""
    from flexsarathi.models.moe import DOWN, GATE_UP
    from quant import dequantize

    path, ref = written_model("qwen3_moe_k", weight_type)
    ref = copy.deepcopy(ref)  # its weights become the stored ones below
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT,
              policy=Policy(compress_weight=True), weight_quant=quant,
              offload_dir=str(tmp_path))
    source = llm.engine.source
    assert f"{weight_type} weights convert to {quant.bits}-bit groups of {quant.group_size}" in capfd.readouterr().err
    assert source.quantized_formats()[GATE_UP] == source.quantized_formats()[DOWN] == quant
    for index, layer in enumerate(ref.model.layers):
        stored = source.layer_weights(index, torch.float32)
        attn, experts = layer.self_attn, layer.mlp.experts
        fused = {"qkv_proj.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                 "o_proj.weight": attn.o_proj.weight, GATE_UP: experts.gate_up_proj.flatten(0, 1),
                 DOWN: experts.down_proj.flatten(0, 1)}
        for name, values in fused.items():
            q = stored[name]
            assert q.config == quant
            # fp16 keeps the K-quant's scale and minimum to half an ulp: 2^-11 of each, times the code
            levels = 2**quant.bits - 1
            bound = (2.0**-11 * (q.scale.float().abs() * levels + q.minimum.float().abs()) + 1e-7)
            bound = bound.repeat_interleave(quant.group_size).view(values.shape)
            got = dequantize(q, torch.float32)
            assert ((got - values.detach()).abs() <= bound).all(), (index, name)
            assert not torch.equal(got, values.detach())  # the conversion did round: the bound is doing work
        with torch.no_grad():  # transformers on the weights the engine stores
            q, kv = llm.engine.config.q_size, llm.engine.config.kv_size
            for module, rows in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                    dequantize(stored["qkv_proj.weight"], torch.float32).split((q, kv, kv))):
                module.weight.copy_(rows)
            attn.o_proj.weight.copy_(dequantize(stored["o_proj.weight"], torch.float32))
            experts.gate_up_proj.copy_(dequantize(stored[GATE_UP], torch.float32).view_as(experts.gate_up_proj))
            experts.down_proj.copy_(dequantize(stored[DOWN], torch.float32).view_as(experts.down_proj))
    for prompt, ours in zip(PROMPTS, prompt_logits(llm, PROMPTS)):
        assert (ours - _hf_logits(ref, prompt)).abs().max().item() < 1e-4


def test_expert_codes_stored_as_they_are(written_model, tmp_path):
    """A Q4_0 MoE file with the engine's format the file's: the experts' (and every matrix's) codes
    kept, no requantization, so the reference's logits to fp32 rounding."""
    from flexsarathi.engine.planner_spec import stored_weight_format
    from flexsarathi.models.moe import DOWN, GATE_UP

    path, ref = written_model("qwen2_moe", "Q4_0")
    quant = QuantConfig(bits=4, group_size=32)  # no disk tier: Q4_0 repacked into split halves of each row
    llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT,
              policy=Policy(compress_weight=True), weight_quant=quant,
              offload_dir=str(tmp_path))
    formats = llm.engine.source.quantized_formats()
    assert formats[GATE_UP] == formats[DOWN] == formats["shared_expert.gate_up_proj.weight"] == quant
    assert formats["gate_up_proj.weight"] == quant  # layer 0's dense MLP
    assert stored_weight_format(llm.engine.source).bits == 4  # the planner sees every layer's kinds
    for prompt, ours in zip(PROMPTS, prompt_logits(llm, PROMPTS)):
        assert (ours - _hf_logits(ref, prompt)).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def placed_run(gguf_model, written_model, tmp_path_factory):
    """placed_run(weight_type, compressed, kind="llama_deep", **placement) -> greedy tokens; the
    all-on-device run once each."""
    cache = {}

    def run(weight_type: str, compressed: bool, kind: str = "llama_deep", **changes):
        key = (kind, weight_type, compressed, tuple(sorted(changes.items())))
        if key not in cache:
            path, _ = (gguf_model if kind == "llama_deep" else written_model)(kind, weight_type)
            quant = dict(weight_quant=QuantConfig(bits=4, group_size=32)) if compressed else {}
            policy = Policy(gpu_batch_size=2, prefill_budget=6, compress_weight=compressed, **changes)
            llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT, policy=policy,
                      offload_dir=str(tmp_path_factory.mktemp("offload")), **quant)
            cache[key] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return cache[key]

    return run


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_K_M"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("compressed", [False, True])
def test_every_placement_gives_the_all_on_device_tokens(placed_run, weight_type, placement, compressed):
    assert placed_run(weight_type, compressed, **PLACEMENTS[placement]) == placed_run(weight_type, compressed)


@pytest.mark.parametrize("compressed", [False, True])
def test_moe_experts_split_across_tiers_give_the_all_on_device_tokens(placed_run, compressed):
    split = PLACEMENTS["weights_30_40_30"]
    assert placed_run("Q4_0", compressed, "qwen3_moe", **split) == placed_run("Q4_0", compressed, "qwen3_moe")


def test_llama3_rope_from_rope_freqs_tensor(tmp_path):
    """llama.cpp stores llama-3 rope scaling as a `rope_freqs.weight` tensor of per-frequency
    divisors (convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, restated here): the
    engine's logits are those of the transformers model it was written from (rope_type llama3)."""
    import math

    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.gguf_files import GGUF_CONFIGS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    cfg = dict(GGUF_CONFIGS["llama"], rope_scaling=rope)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    head_dim = config.hidden_size // config.num_attention_heads
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * 10000.0 ** (i / head_dim)
        if wavelen < 16 / 4.0:
            factors.append(1.0)
        elif wavelen > 16 / 1.0:
            factors.append(8.0)
        else:
            smooth = (16 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = tmp_path / "llama3.gguf"
    write_gguf(model, path, extra={"rope_freqs.weight": np.array(factors, dtype=np.float32)})
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    long_prompt = list(range(3, 43))  # past original_max_position_embeddings: the scaling matters
    for prompt, ours in zip(PROMPTS + [long_prompt], prompt_logits(llm, PROMPTS + [long_prompt])):
        assert (ours - _hf_logits(model, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_K_M"])
def test_inspect_tells_each_weights_gguf_types_and_what_is_stored(gguf_model, weight_type, capsys):
    """`flexsarathi inspect` on a GGUF: the format line with its tensor types (from the headers),
    each layer weight's types over its fused parts (q/k/v; Q4_K_M's Q4_K beside Q6_K), the stored
    format and how it gets there."""
    from collections import Counter

    from gguf import GGUFReader

    from flexsarathi.cli.main import main

    path, _ = gguf_model("llama_deep", weight_type)
    assert main(["inspect", "--model", path]) == 0
    out = capsys.readouterr().out.splitlines()
    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    assert out[1].startswith("format: gguf: llama.cpp llama, 1 file, tensors: "
                             + ", ".join(f"{n} {name}" for name, n in counts.most_common()))
    kinds = {line.split(" [")[0].strip(): line for line in out if line.startswith("  ")}
    if weight_type == "Q4_0":
        assert kinds["qkv_proj.weight"].endswith(": Q4_0 -> 4-bit codes, groups of 32, fp16 scale + fp16 minimum "
                                                 "(codes kept exactly; on the disk tier read from this file)")
    else:
        assert ": Q4_K + Q6_K -> 8-bit codes, groups of 16" in kinds["qkv_proj.weight"]  # v is Q6_K
        assert "K-quant codes converted once at placement" in kinds["qkv_proj.weight"]
        assert ": Q6_K -> " in kinds["down_proj.weight"]


@pytest.mark.skipif(not cpu_int8_matmul.available(), reason="the int8 kernel is not available here")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_1"])
def test_the_int8_kernel_gives_the_exact_products_greedy_tokens(gguf_model, kind, weight_type, tmp_path,
                                                                monkeypatch):
    """Q4_0 / Q4_1 codes (groups of 32: the kernel's per-block path) computed by the engine's default
    CPU path (int8x2) give the greedy tokens of dequantize + matmul."""
    path, _ = gguf_model(kind, weight_type)
    calls = []
    kernel = cpu_int8_matmul.int8_linear
    monkeypatch.setattr(cpu_int8_matmul, "int8_linear", lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))
    tokens = {}
    for mode in ("dequantize", "auto"):
        llm = LLM(path, dtype="float32", device="cpu", cpu_matmul=mode, policy=Policy(compress_weight=True),
                  offload_dir=str(tmp_path))
        tokens[mode] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert llm.engine.cpu_matmul == ("dequantize" if mode == "dequantize" else "int8x2")
    assert tokens["auto"] == tokens["dequantize"]
    assert calls  # the kernel ran (decode passes)


def test_q4_0_weights_on_disk_are_read_from_the_file_itself(tmp_path):
    """Everything on disk: the store links each layer weight's parts to their Q4_0 blocks in the file
    (q/k permuted by llama.cpp included) and writes only the norms; the all-on-device tokens, also
    from the reused store and a split placement's; a file changed in place under the same size and
    mtime (the same store key) fails the linked bytes' crc32 at the first read and the store is
    rebuilt from what the file holds now."""
    from offload.disk_store import DiskStore

    path = tmp_path / "model.gguf"
    write_gguf(build_model("llama"), path, weight_type="Q4_0")

    def run(offload, **placement):
        policy = Policy(gpu_batch_size=2, **placement)
        with LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT, policy=policy,
                 offload_dir=str(tmp_path / offload)) as llm:
            store = llm.engine.weights.store
            key = None if store is None else (store.folder, store.key)
            # Q4_0 kept as the blocks' bytes where a disk tier links them, else repacked (faster kernel layout)
            assert llm.engine.source.quantized_formats()["qkv_proj.weight"].group_halves == (store is not None)
            if store is not None:  # what the free-space check asks for: exactly what is written
                written = sum(store.entry(n).nbytes for n in store.names() if not store.entry(n).linked)
                assert llm.engine.weights.placed.store_bytes == written
            return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], key

    reference, _ = run("all")
    on_disk, (folder, key) = run("disk", w_gpu=0.0, w_disk=1.0)
    assert on_disk == reference
    # the planner prices what the disk tier streams: the file's blocks, 18 bytes per 32 values
    from flexsarathi.engine.planner_spec import planner_model_spec
    from flexsarathi.formats.gguf_file import open_gguf
    spec = planner_model_spec(str(path), dtype="float32")
    layer_file_bytes = sum(t.raw_shape[0] * t.raw_shape[1] for t in open_gguf(str(path)).tensors.values()
                           if t.name.startswith("blk.0.") and t.type_name == "Q4_0")  # uint8 [rows, bytes per row]
    assert spec.layer_matrix_params * spec.weight_format.streamed_bytes_per_value == layer_file_bytes
    assert spec.disk_read_ratio(True) == 18 / 20
    with DiskStore(folder, key) as store:
        linked = [n for n in store.names() if store.entry(n).linked]
        assert all(".blocks" in n and store.entry(n).file == str(path) for n in linked)
        assert len(linked) == 2 * 7  # per layer: q, k, v, o, gate, up, down
        assert all(".small." in n for n in store.names() if n not in linked)
    assert run("disk", w_gpu=0.0, w_disk=1.0)[0] == reference  # the store reused
    split = dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3)
    assert run("split", **split)[0] == reference and run("split", **split)[0] == reference

    from flexsarathi.formats.gguf_file import open_gguf
    q = open_gguf(str(path)).tensor("blk.1.attn_q.weight")
    stat = os.stat(path)
    with open(path, "r+b") as f:  # the codes of q's first rows, each moved
        f.seek(q.offset)
        blocks = bytearray(f.read(4 * q.raw_shape[-1]))
        for start in range(0, len(blocks), 18):
            blocks[start + 2:start + 18] = bytes(b ^ 0x33 for b in blocks[start + 2:start + 18])
        f.seek(q.offset)
        f.write(bytes(blocks))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed, (_, new_key) = run("disk", w_gpu=0.0, w_disk=1.0)
    assert new_key != key  # size and mtime kept: the fingerprint's ctime and inode notice the rewrite
    assert changed == run("fresh")[0]


def test_a_q4_0_scale_beyond_fp16_is_one_clear_error(tmp_path):
    """One block of ffn_down with d = 10000: its values (down to -8d) exceed fp16, which the engine's
    group parameters are: one error naming the tensor, whether the weight would be linked or decoded."""
    import numpy as np

    from flexsarathi.errors import CheckpointError
    from flexsarathi.formats.gguf_file import open_gguf

    path = tmp_path / "model.gguf"
    write_gguf(build_model("llama"), path, weight_type="Q4_0")
    down = open_gguf(str(path)).tensor("blk.1.ffn_down.weight")
    with open(path, "r+b") as f:
        f.seek(down.offset + 18 * 5)  # block 5's scale d
        f.write(np.array([10000.0], dtype=np.float16).tobytes())
    for placement in ({}, dict(w_gpu=0.0, w_disk=1.0)):
        with pytest.raises(CheckpointError, match="blk.1.ffn_down.weight .Q4_0. has a block scale"):
            LLM(str(path), dtype="float32", device="cpu", policy=Policy(**placement), offload_dir=str(tmp_path / "o"))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # llama: an untied output matrix; qwen2: tied to the embedding
def test_a_q4_0_embedding_and_head_stay_the_files_codes(tmp_path, kind):
    """A file whose token embedding and output matrix are Q4_0 (as llama.cpp's Q4_0 files): the engine
    holds them as those codes (5 bits per value: Q4_0's 4.5 and the fp16 minimum, -8 x scale; what the
    memory tracker counts and the planner prices), the embedding's
    looked-up rows dequantized exactly and the head multiplied as a 4-bit weight: transformers' logits
    (its own dequantization of the same file) to fp32 rounding, and its greedy tokens. compress_head
    keeps the file's codes (groups of 32), not a requantization."""
    from transformers import AutoModelForCausalLM

    from quant import QTensor

    path = tmp_path / "model.gguf"
    write_gguf(build_model(kind), path, weight_type="Q4_0", embed_type="Q4_0")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT)
    g = llm.engine.weights.global_weights()
    coded = ["embed_tokens.weight"] + (["lm_head.weight"] if kind == "llama" else [])
    assert "lm_head.weight" in g if kind == "llama" else "lm_head.weight" not in g
    vocab, hidden = g["embed_tokens.weight"].shape
    for name in coded:
        assert isinstance(g[name], QTensor) and g[name].config.bits == 4 and g[name].config.group_size == 32
        assert g[name].nbytes == vocab * hidden * 20 // 32  # per 32 values: 16 bytes of codes, fp16 scale, fp16 minimum
    held = llm.engine.memory.report()["gpu"]["by_what"]["embeddings and head"]
    assert held == sum(g[n].nbytes for n in coded) + g["final_norm.weight"].nbytes
    assert planner_model_spec(str(path), "float32").embedding_bytes == held  # the planner prices what is held
    _assert_logits_and_greedy_match(llm, ref)
    if kind == "llama":
        with LLM(str(path), dtype="float32", device="cpu", cpu_matmul=EXACT_PRODUCT, compress_head=True) as packed:
            head = packed.engine.weights.global_weights()["lm_head.weight"]
            assert head.config == g["lm_head.weight"].config and torch.equal(head.data, g["lm_head.weight"].data)
    llm.close()
