"""Pre-quantized HF checkpoints (GPTQ, AWQ GEMM, compressed-tensors pack-quantized) against their
formats' own dequantization: the engine's weights equal it (exactly where the codes are kept), its
logits are within 1e-3 of transformers run on those dequantized fp32 weights, its greedy tokens are
transformers', every placement gives the all-on-device tokens, and unsupported configs fail clearly.

GPTQ and AWQ checkpoints are packed by tests/quantized_refs.py (written from the authors' packing
code, cited there); compressed-tensors ones by the compressed-tensors package itself."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.checkpoint import open_weight_source
from flexsarathi.errors import CheckpointError
from policy_search.policy import Policy
from quant import dequantize
from tests.conftest import build_hf_model
from tests.prompt_logits import prompt_logits
from tests.quantized_refs import (LINEARS, act_order_g_idx, awq_tensors, dequantize_ref, draw, gptq_tensors,
                                  write_folder)

TINY = {  # every input dimension a multiple of 128 (the largest group size)
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True),
}
PROMPTS = [[1, 5, 9, 17, 33, 2], [7, 3, 88, 41]]
FUSED = {"qkv_proj.weight": LINEARS[:3], "o_proj.weight": LINEARS[3:4], "gate_up_proj.weight": LINEARS[4:6],
         "down_proj.weight": LINEARS[6:]}


def _hf_model(kind: str, seed: int):
    from tests import conftest

    conftest.TINY_CONFIGS.setdefault(f"q_{kind}", TINY[kind])
    return build_hf_model(f"q_{kind}", seed)


def _linear_weights_to_fp16_rest(model, tensors: dict, quantized: set[str]) -> None:
    """The checkpoint keeps every weight it does not quantize in fp16; so does the reference."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.removesuffix(".weight") in quantized and name.endswith(".weight"):
                continue
            param.copy_(param.half().float())
            tensors[name] = param.detach().half()


def packed_checkpoint(folder, kind, method, bits, group, sym, act_order=False, v1=True, seed=0):
    """A GPTQ or AWQ folder of random codes, and the transformers model holding their fp32 values."""
    model = _hf_model(kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors, quantized = {}, set()
    for i, layer in enumerate(model.model.layers):
        for lin in LINEARS:
            module = layer.get_submodule(lin)
            out_features, in_features = module.weight.shape
            g = in_features if group == -1 else group
            codes, scale, zero = draw(out_features, in_features, bits, g, sym, gen,
                                      zero_low=1 if method == "gptq" and v1 else 0)
            g_idx = act_order_g_idx(in_features, g, gen) if act_order else torch.arange(in_features) // g
            with torch.no_grad():
                module.weight.copy_(dequantize_ref(codes, scale, zero, g_idx))
            prefix = f"model.layers.{i}.{lin}"
            quantized.add(prefix)
            packed = (gptq_tensors(codes, scale, zero, bits, g_idx, v1) if method == "gptq"
                      else awq_tensors(codes, scale, zero))
            tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
    _linear_weights_to_fp16_rest(model, tensors, quantized)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    write_folder(str(folder), model, tensors, qc)
    return str(folder), model.eval()


def _reference_layer(model, layer: int, canonical: str) -> torch.Tensor:
    return torch.cat([model.model.layers[layer].get_submodule(m).weight.detach() for m in FUSED[canonical]])


def _check_weights(folder, model, exact: bool = True):
    source = open_weight_source(folder)
    errors = {}
    for i in range(len(model.model.layers)):
        weights = source.layer_weights(i, torch.float32)
        for canonical in FUSED:
            q = weights[canonical]
            assert q.config == source.quantized_formats()[canonical]
            diff = (dequantize(q, torch.float32) - _reference_layer(model, i, canonical)).abs().max().item()
            errors[canonical] = max(errors.get(canonical, 0.0), diff)
    if exact:
        assert all(e == 0.0 for e in errors.values()), errors
    return source, errors


def _check_logits_and_tokens(folder, model, offload_dir):
    with LLM(folder, dtype="float32", device="cpu", offload_dir=str(offload_dir)) as llm:
        got = prompt_logits(llm, PROMPTS)
        ours = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)]
    with torch.no_grad():
        for ids, rows in zip(PROMPTS, got):
            want = model(torch.tensor([ids])).logits[0].float()
            assert (rows - want).abs().max().item() < 1e-3
            assert ours[PROMPTS.index(ids)] == _greedy(model, ids, 6)
    return ours


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, EOS included like any token (as ignore_eos)."""
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


GPTQ_CASES = [  # (model, bits, group, symmetric, v1)
    ("llama", 4, 128, True, True), ("llama", 4, 32, False, True), ("qwen2", 8, 64, False, False),
    ("llama", 4, -1, True, True), ("qwen2", 4, 64, False, False),
]


@pytest.mark.parametrize("kind,bits,group,sym,v1", GPTQ_CASES)
def test_gptq_codes_kept_exactly(tmp_path, kind, bits, group, sym, v1):
    folder, model = packed_checkpoint(tmp_path / "ckpt", kind, "gptq", bits, group, sym, v1=v1)
    source, _ = _check_weights(folder, model)
    assert all(c.minimum_fp32 == (not sym) for c in source.quantized_formats().values())
    _check_logits_and_tokens(folder, model, tmp_path / "off")


@pytest.mark.parametrize("kind,group", [("llama", 64), ("qwen2", 128)])
def test_awq_gemm_codes_kept_exactly(tmp_path, kind, group):
    folder, model = packed_checkpoint(tmp_path / "ckpt", kind, "awq", 4, group, False)
    _check_weights(folder, model)
    _check_logits_and_tokens(folder, model, tmp_path / "off")


def test_gptq_act_order_converted_once_with_measured_error(tmp_path, capfd):
    folder, model = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False, act_order=True)
    source, errors = _check_weights(folder, model, exact=False)
    assert source.quantized_formats()["qkv_proj.weight"].minimum_fp32 is False
    logged = {kind: error for kind, (error, _) in source.log.errors.items()}
    assert logged == pytest.approx(errors, rel=0, abs=0)  # the printed error is the measured one
    printed = capfd.readouterr().err
    assert all(f"gptq checkpoint {folder}: {kind} requantized" in printed for kind in FUSED)
    # min-max requantization reads every value back within half its group's step: a 4-bit step
    # spans the group's range / 15, at most 2 * 0.02 * 15 / 15 here
    assert 0 < max(errors.values()) < 0.5 * 0.04
    # Not the checkpoint's values any more: the engine runs its converted weights, exactly as
    # transformers does on them.
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            weights = source.layer_weights(i, torch.float32)
            for canonical, modules in FUSED.items():
                parts = [layer.get_submodule(m).weight for m in modules]
                values = dequantize(weights[canonical], torch.float32).split([p.shape[0] for p in parts])
                for param, value in zip(parts, values):
                    param.copy_(value)
    _check_logits_and_tokens(folder, model, tmp_path / "off")


def test_gptq_trivial_g_idx_with_desc_act_is_exact(tmp_path):
    folder, model = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 64, False)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"]["desc_act"] = True  # static groups: g_idx is still j // group
    with open(config_path, "w") as f:
        json.dump(config, f)
    source, _ = _check_weights(folder, model)
    assert source.act_order == set()


PLACEMENTS = [dict(w_gpu=0.0, w_cpu=1.0), dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0),
              dict(w_gpu=0.3, w_cpu=0.3, w_disk=0.4)]


def test_every_placement_gives_the_all_on_device_tokens(tmp_path):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def tokens(**fractions):
        policy = Policy(gpu_batch_size=2, **fractions)
        with LLM(folder, dtype="float32", device="cpu", policy=policy, offload_dir=str(tmp_path / "off")) as llm:
            return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    reference = tokens()
    for fractions in PLACEMENTS:
        assert tokens(**fractions) == reference, fractions
    assert tokens(w_gpu=0.0, w_disk=1.0) == reference  # the store written above, reused


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "'float-quantized'"),
])
def test_unsupported_quantization_config_is_one_clear_error(tmp_path, qc, named):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 128, True)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError) as info:
        LLM(folder, dtype="float32", device="cpu")
    message = str(info.value)
    assert named in message and "is not supported" in message
    assert "gptq (4 or 8 bits" in message and "awq (4-bit GEMM)" in message and "pack-quantized" in message
