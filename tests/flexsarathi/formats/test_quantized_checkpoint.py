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
from flexsarathi.formats.opened_model import open_weight_source
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


@pytest.mark.parametrize("make", ["gptq-int4-asym", "ct-int8-sym"])
def test_every_placement_gives_the_all_on_device_tokens(tmp_path, make):
    if make == "gptq-int4-asym":  # adjacent-pair codes, fp16 scales, fp32 minimums
        folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    else:  # byte codes, fp16 scales and minimums, channel-wise on qwen2 (biases)
        folder, _ = ct_checkpoint(tmp_path / "ckpt", "qwen2", 8, -1, True)
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


# ---- compressed-tensors: the package compresses a transformers-built model and is the reference ----
CT_CASES = [  # (model, bits, group (-1: channel-wise), symmetric)
    ("llama", 4, 32, True), ("qwen2", 4, 64, False), ("llama", 4, 128, False), ("llama", 8, 128, True),
    ("qwen2", 8, -1, False), ("llama", 4, -1, True),
]


def ct_checkpoint(folder, kind, bits, group, sym, seed=0):
    """compressed-tensors' compressor run on a transformers model (fp16) whose Linear weights are
    scale * (q - zero) for random codes; -> (folder, fp16 model as compressed)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    model = _hf_model(kind, seed).half()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym,
                            strategy="channel" if group == -1 else "group", group_size=None if group == -1 else group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    gen = torch.Generator().manual_seed(seed + 1)
    middle = 2 ** (bits - 1)
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in LINEARS:
                module = layer.get_submodule(lin)
                out_features, in_features = module.weight.shape
                codes, scale, zero = draw(out_features, in_features, bits, in_features if group == -1 else group,
                                          sym, gen)
                module.weight_scale.copy_(scale)
                if not sym:
                    module.weight_zero_point.copy_((zero - middle).to(module.weight_zero_point.dtype))
                module.weight.copy_(dequantize_ref(codes, scale, zero).half())
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    os.makedirs(folder, exist_ok=True)
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              os.path.join(folder, "model.safetensors"))
    model.config.save_pretrained(folder)
    compressor.update_config(str(folder))
    assert ct.__version__
    return str(folder), model


def _ct_reference(folder, kind: str, bits: int, sym: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every Linear weight from the saved tensors, with
    the scales in `dtype` (fp32: exact scale * (q - zero))."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        scheme = QuantizationScheme.model_validate(json.load(f)["quantization_config"]["config_groups"]["group_0"])
    saved = load_file(os.path.join(folder, "model.safetensors"))
    out = {}
    for name in [n.removesuffix(".weight_packed") for n in saved if n.endswith(".weight_packed")]:
        local = {k.removeprefix(name + "."): v for k, v in saved.items() if k.startswith(name + ".")}
        local["weight_scale"] = local["weight_scale"].to(dtype)
        out[name] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    return out


@pytest.mark.parametrize("kind,bits,group,sym", CT_CASES)
def test_compressed_tensors_equal_the_packages_decompression(tmp_path, kind, bits, group, sym):
    folder, _ = ct_checkpoint(tmp_path / "ckpt", kind, bits, group, sym)
    check_against_the_package(folder, kind, bits, sym, tmp_path / "off")


def check_against_the_package(folder, kind: str, bits: int, sym: bool, offload_dir) -> None:
    """A compressed-tensors folder of `ct_checkpoint`: the engine's weights are the package's own
    decompression (scales in fp32 and fp16), its logits and greedy tokens transformers' on them."""
    ref32 = _ct_reference(folder, kind, bits, sym, torch.float32)
    ref16 = _ct_reference(folder, kind, bits, sym, torch.float16)
    source = open_weight_source(folder)
    assert all(c.bits == bits and c.minimum_fp32 == (not sym) for c in source.quantized_formats().values())
    reference = _hf_model(kind, 0)
    for i, layer in enumerate(reference.model.layers):
        weights = source.layer_weights(i, torch.float32)
        for canonical, modules in FUSED.items():
            names = [f"model.layers.{i}.{m}" for m in modules]
            q = weights[canonical]
            assert torch.equal(dequantize(q, torch.float32), torch.cat([ref32[n] for n in names]))
            assert torch.equal(dequantize(q, torch.float16), torch.cat([ref16[n] for n in names]))
            with torch.no_grad():
                for n, m in zip(names, modules):
                    layer.get_submodule(m).weight.copy_(ref32[n])
    _fp16_rest_from(folder, reference)
    _check_logits_and_tokens(folder, reference, offload_dir)


def _fp16_rest_from(folder, model) -> None:
    """The reference model's unquantized weights: the checkpoint's fp16 ones."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(folder, "model.safetensors"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in saved:
                param.copy_(saved[name].float())


def test_planner_prices_the_bytes_the_engine_stores(tmp_path):
    from flexsarathi.engine.planner_spec import planner_model_spec

    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    spec = planner_model_spec(folder, dtype="float32")
    assert (spec.weight_format.bits, spec.weight_format.group_size, spec.weight_format.minimum_bytes) == (4, 32, 4)
    with LLM(folder, dtype="float32", device="cpu", policy=Policy(w_gpu=0.0, w_cpu=1.0)) as llm:
        plan = llm.engine.weights.plan
        stored = sum(p.bytes_on("cpu") for p in plan.tensors)  # one layer's matrices
    assert stored == spec.layer_matrix_params * spec.weight_format.bytes_per_value


def test_inspect_names_format_kinds_and_bytes(tmp_path, capsys):
    from flexsarathi.cli.main import main

    folder, _ = packed_checkpoint(tmp_path / "ckpt", "qwen2", "awq", 4, 64, False)
    assert main(["inspect", "--model", folder]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("format: awq: int4 g64 asym, GEMM (")
    assert any(line.startswith("  qkv_proj.weight [256, 128]: int4 g64 asym (awq) -> 4-bit codes, groups of 64, "
                               "fp16 scale + fp32 minimum (codes kept exactly)") for line in out)
    # 4 bits + (2 + 4) bytes per 64 values = 4.75 bits per weight
    assert "(4.75 bits per weight;" in out[-1]
    assert main(["inspect", "--model", "dummy:llama-2-7b"]) == 0
    out = capsys.readouterr().out
    assert "format: dummy: float16, full precision" in out and "with compress_weight: 3.39 GiB" in out


def test_truncated_quantized_checkpoint_is_one_clear_error(tmp_path):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 128, True)
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 64, False)])
def test_compressed_tensors_codes_on_disk_are_linked_not_copied(tmp_path, bits, group, sym):
    """Everything on disk: the store links each layer weight's codes and fp16 scales to their
    bytes in the checkpoint (writing only the minimums and small tensors) and gives the all-on-device
    tokens; a checkpoint changed in place under the same size and mtime (so the same store key) fails
    the linked bytes' crc32 at the first read and the store is rebuilt from what the file holds now."""
    from flexsarathi.formats.safetensors_pread import PreadReader
    from offload.disk_store import DiskStore

    folder, _ = ct_checkpoint(tmp_path / "ckpt", "llama", bits, group, sym)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def tokens(offload_dir, **fractions):
        policy = Policy(gpu_batch_size=2, **fractions)
        with LLM(folder, dtype="float32", device="cpu", policy=policy, offload_dir=str(offload_dir)) as llm:
            return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm
    reference, _ = tokens(tmp_path / "off0")
    on_disk, llm = tokens(tmp_path / "off", w_gpu=0.0, w_cpu=0.0, w_disk=1.0)
    assert on_disk == reference
    store = DiskStore(llm.engine.weights.store.folder, llm.engine.weights.store.key)
    checkpoint = os.path.join(folder, "model.safetensors")
    linked = {name: store.entry(name) for name in store.names() if store.entry(name).linked}
    assert set(linked) == {f"{i}.{w}.{c}" for i in range(2) for w in FUSED for c in ("data", "scale")}
    assert all(e.file == checkpoint for entry in linked.values() for e in entry.extents)
    written = sum(store.entry(name).nbytes for name in store.names() if name not in linked)
    assert written < sum(entry.nbytes for entry in linked.values()) / 4  # the minimums, norms: small
    assert llm.engine.weights.placed.store_bytes == written  # what the free-space check asked for
    store.close()

    path, offset, nbytes, _, _ = PreadReader().extent(checkpoint, "model.layers.1.mlp.down_proj.weight_packed")
    stat = os.stat(checkpoint)
    with open(checkpoint, "r+b") as f:  # every code of one row of down_proj moved by one step
        f.seek(offset)
        row = bytearray(f.read(256 * bits // 8))
        f.seek(offset)
        f.write(bytes(b ^ 0x11 for b in row))
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed, again = tokens(tmp_path / "off", w_gpu=0.0, w_cpu=0.0, w_disk=1.0)
    # size and mtime kept: the fingerprint's ctime and inode notice the rewrite, so another store
    # (the store's own check of linked extents: tests/offload/test_disk_store.py)
    assert again.engine.weights.store.key != llm.engine.weights.store.key
    assert changed == tokens(tmp_path / "off1")[0]  # a fresh engine on the file as it is now


GPTQ_Q = "model.layers.0.self_attn.q_proj"


def _edit_tensors(folder: str, edit) -> str:
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.mark.parametrize("suffix, edit, message", [
    ("qweight", lambda t: t.long(), "is stored as I64; gptq stores qweight as I32"),
    ("qzeros", lambda t: t.long(), "is stored as I64; gptq stores qzeros as I32"),
    ("scales", lambda t: t.int(), "is stored as I32; gptq stores scales as F16 or BF16 or F32"),
    ("g_idx", lambda t: t.float(), "is stored as F32; gptq stores g_idx as I32"),
    ("scales", lambda t: t[:, :-1], r"has shape \[\d+, \d+\], but its module's .* needs \[\d+, \d+\]"),
    ("qzeros", lambda t: t[:, :-1], r"has shape \[\d+, \d+\], but its module's .* needs \[\d+, \d+\]"),
    ("g_idx", lambda t: torch.cat([t[:-1], torch.tensor([99], dtype=t.dtype)]), "holds group 0...99, outside"),
])
def test_a_damaged_gptq_component_is_one_clear_error(tmp_path, suffix, edit, message):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    name = f"{GPTQ_Q}.{suffix}"
    path = _edit_tensors(folder, lambda t: t.update({name: edit(t[name])}))
    with pytest.raises(CheckpointError, match=f"{path}: tensor {name} {message}"):
        LLM(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_is_refused_at_load(tmp_path, value):
    """A NaN scale made every request fail with "the pass overflowed <dtype>; --dtype float32 may avoid
    it": a load error naming the module instead."""
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    name = f"{GPTQ_Q}.scales"

    def damage(t):
        scales = t[name].clone()
        scales[0, 0] = value
        t[name] = scales

    _edit_tensors(folder, damage)
    with pytest.raises(CheckpointError, match=f"the scales of {GPTQ_Q} hold a NaN or inf"):
        LLM(folder, dtype="float32", device="cpu")


def test_gptq_bits_that_disagree_with_the_data_name_a_stored_tensor(tmp_path):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 8, -1, False)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["bits"] = 4
    json.dump(config, open(path, "w"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model\.layers\.0\.\S+\.qzeros has shape "
                                              r".*quantization_config bits=4\) needs"):
        LLM(folder, dtype="float32", device="cpu")


def test_a_plain_weight_of_a_quantized_checkpoint_must_be_floats(tmp_path):
    folder, _ = packed_checkpoint(tmp_path / "ckpt", "llama", "gptq", 4, 32, False)
    name = "model.layers.0.input_layernorm.weight"
    path = _edit_tensors(folder, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=f"{path}: tensor {name} is stored as I8, not as floats"):
        LLM(folder, dtype="float32", device="cpu")
