"""Pre-quantized mixture-of-experts checkpoints (GPTQ Mixtral, AWQ Qwen2-MoE with its shared expert,
compressed-tensors Qwen3-MoE with a dense layer among sparse ones), laid out as such checkpoints
are: one packed module per expert, the router left in floats. The engine's weights equal the
formats' own dequantization exactly (GPTQ/AWQ: tests/quantized_refs.py, from their authors' packing
code; compressed-tensors: the package's own compressor and decompressor), its logits are within
1e-3 of transformers run on those dequantized weights, its greedy tokens are transformers', and the
experts placed across tiers give the all-on-device tokens."""
from __future__ import annotations

import os

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.models.moe import DOWN, GATE_UP
from flexsarathi.formats.opened_model import open_weight_source
from policy_search import Policy
from quant import dequantize
from tests import conftest
from tests.conftest import build_hf_model
from tests.prompt_logits import prompt_logits
from tests.quantized_refs import awq_tensors, dequantize_ref, draw, gptq_tensors

# Every input dimension a multiple of 32 (the group size here).
_BASE = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "q_mixtral": dict(_BASE, model_type="mixtral", intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                      num_experts_per_tok=2, tie_word_embeddings=False),
    "q_qwen2_moe": dict(_BASE, model_type="qwen2_moe", intermediate_size=64, num_hidden_layers=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                        decoder_sparse_step=1, norm_topk_prob=False, tie_word_embeddings=True),
    "q_qwen3_moe": dict(_BASE, model_type="qwen3_moe", head_dim=16, intermediate_size=64, num_hidden_layers=3,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                        mlp_only_layers=[1], tie_word_embeddings=False),
}
CASES = [("gptq", "q_mixtral", 4, 32, False), ("awq", "q_qwen2_moe", 4, 32, False),
         ("compressed-tensors", "q_qwen3_moe", 4, 32, True)]
PROMPTS = [[1, 5, 9, 17, 33, 2], [7, 3, 88, 41]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """The Linear weights such checkpoints pack: every layer matrix but the routers (`mlp.gate`,
    `block_sparse_moe.gate`) and the shared expert's one-row gate."""
    return (tensor.dim() == 2 and ".layers." in name and not name.endswith((".gate.weight", "shared_expert_gate.weight")))


def _saved_state(kind: str, folder) -> tuple[dict[str, torch.Tensor], object]:
    """The model transformers saves (one packed module per expert, as checkpoints hold them) and its config."""
    from safetensors.torch import load_file

    conftest.TINY_CONFIGS.setdefault(kind, CONFIGS[kind])
    model = build_hf_model(kind, 0)
    model.save_pretrained(folder, safe_serialization=True)
    return load_file(os.path.join(folder, "model.safetensors")), model.config


def _reference_model(folder, config, values: dict[str, torch.Tensor]):
    """transformers' model of `values` (the dequantized weights, fp32)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in values.items()}, os.path.join(folder, "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _packed_checkpoint(method, folder, saved, config, bits, group, sym):
    """GPTQ or AWQ modules of random codes; -> the dequantized values by HF name."""
    from tests.quantized_refs import write_folder

    gen = torch.Generator().manual_seed(1)
    tensors, values = {}, {}
    for name, tensor in saved.items():
        if not _quantized(name, tensor):
            values[name] = tensors[name] = tensor.half()
            continue
        codes, scale, zero = draw(*tensor.shape, bits, group, sym, gen)
        values[name] = dequantize_ref(codes, scale, zero)
        packed = (gptq_tensors(codes, scale, zero, bits, torch.arange(tensor.shape[1]) // group, v1=False)
                  if method == "gptq" else awq_tensors(codes, scale, zero))
        tensors.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in packed.items()})
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": False,
           "checkpoint_format": "gptq_v2"} if method == "gptq" else
          {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    write_folder(str(folder), _Configured(config), tensors, qc)
    return {k: v.float() for k, v in values.items()}


class _Configured:  # what write_folder reads of a model
    def __init__(self, config):
        self.config = config


def _ct_checkpoint(folder, saved, config, bits, group, sym):
    """compressed-tensors' compressor run on the checkpoint's Linear modules (one per expert), each
    holding scale * (q - zero) for random codes; -> the package's own decompression by HF name."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from safetensors.torch import save_file

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                 ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"])
    linears = {n.removesuffix(".weight"): t for n, t in saved.items() if _quantized(n, t)}
    container = _module_tree({n: torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=torch.float16)
                              for n, t in linears.items()})
    apply_quantization_config(container, qconfig)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in linears:
            module = container.get_submodule(name)
            codes, scale, zero = draw(*module.weight.shape, bits, group, sym, gen)
            module.weight_scale.copy_(scale)
            module.weight.copy_(dequantize_ref(codes, scale, zero).half())
    ModelCompressor(quantization_config=qconfig).compress_model(container)
    packed = container.state_dict()
    tensors = {n: t.half() for n, t in saved.items() if not _quantized(n, t)}
    tensors.update(packed)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    config.save_pretrained(folder)
    ModelCompressor(quantization_config=qconfig).update_config(str(folder))
    values = {n: t.float() for n, t in tensors.items() if n in saved}
    for name in linears:
        local = {k.removeprefix(name + "."): v.float() if k.endswith("weight_scale") else v
                 for k, v in packed.items() if k.startswith(name + ".")}
        values[name + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return values


def _module_tree(leaves: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A module whose submodule at each dotted name is the given leaf."""
    root = torch.nn.Module()
    for name, leaf in leaves.items():
        parent = root
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(name.split(".")[-1], leaf)
    return root


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    """(folder, HF values it dequantizes to, transformers' model of those values)."""
    method, kind, bits, group, sym = request.param
    root = tmp_path_factory.mktemp(method)
    saved, config = _saved_state(kind, root / "saved")
    if method == "compressed-tensors":
        values = _ct_checkpoint(root / "ckpt", saved, config, bits, group, sym)
    else:
        values = _packed_checkpoint(method, root / "ckpt", saved, config, bits, group, sym)
    return str(root / "ckpt"), values, _reference_model(root / "ref", config, values)


def test_expert_codes_equal_the_formats_dequantization(checkpoint):
    """Every expert stack (and every other packed weight) as codes in the checkpoint's format,
    dequantizing exactly to the reference; the router read as floats."""
    folder, values, _ = checkpoint
    source = open_weight_source(folder)
    formats = source.quantized_formats()
    assert formats[GATE_UP] is not None and formats[DOWN] is not None and "router.weight" not in formats
    for layer in range(source.config.num_layers):
        names, weights = source.model.hf_layer_names(layer), source.layer_weights(layer, torch.float32)
        for canonical, parts in names.items():
            want = torch.cat([values[n] for n in parts])
            got = weights[canonical]
            got = dequantize(got, torch.float32) if formats.get(canonical) else got
            assert torch.equal(got, want), (layer, canonical)


def test_logits_and_greedy_tokens_match_transformers(checkpoint, tmp_path):
    folder, _, ref = checkpoint
    with LLM(folder, dtype="float32", device="cpu", offload_dir=str(tmp_path)) as llm:
        got = prompt_logits(llm, PROMPTS)
        ours = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with torch.no_grad():
        for ids, rows, tokens in zip(PROMPTS, got, ours):
            assert (rows - ref(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-3
            want = list(ids)
            for _ in range(GREEDY.max_tokens):
                want.append(int(ref(torch.tensor([want])).logits[0, -1].argmax()))
            assert tokens == want[len(ids):]


@pytest.mark.parametrize("policy", [dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3),
                                    dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5, routed_expert_reads=True,
                                         cpu_experts=True, num_gpu_batches=2)], ids=["split", "routed_cpu_experts"])
def test_experts_across_tiers_give_the_all_on_device_tokens(checkpoint, placed_tokens, policy):
    assert placed_tokens(checkpoint[0], **policy) == placed_tokens(checkpoint[0])


@pytest.fixture(scope="module")
def placed_tokens(tmp_path_factory):
    """placed_tokens(folder, **placement) -> greedy tokens, each run once (the all-on-device one is shared)."""
    cache = {}

    def run(folder: str, **placement):
        key = (folder, tuple(sorted(placement.items())))
        if key not in cache:
            p = Policy(gpu_batch_size=2, prefill_budget=5, **placement)
            with LLM(folder, dtype="float32", device="cpu", policy=p,
                     offload_dir=str(tmp_path_factory.mktemp("off"))) as llm:
                cache[key] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return cache[key]

    return run


def test_inspect_tells_the_experts_and_every_layers_bytes(checkpoint, capsys):
    """`flexsarathi inspect`: the experts in the model line; the layer bytes summed over dense and
    sparse layers: 4-bit codes (16 bytes per group of 32) + an fp16 scale + the minimum (fp16 where
    the format is symmetric, else fp32), the router in fp16 (the checkpoint's dtype)."""
    from flexsarathi.cli.main import main

    folder = checkpoint[0]
    source = open_weight_source(folder)
    c, formats = source.config, source.quantized_formats()
    assert main(["inspect", "--model", folder]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(f", {c.moe.num_experts} experts of {c.moe.expert_ffn_size} (top {c.moe.top_k})"
                           + (f" + a shared expert of {c.moe.shared_expert_ffn_size}"
                              if c.moe.shared_expert_ffn_size else "")
                           + f" in {c.moe.sparse_layers(c.num_layers)} of {c.num_layers} layers")
    total = 0
    for layer in range(c.num_layers):
        for name, shape in source.model.layer_shapes(layer).items():
            if len(shape) == 2:
                group = 16 + 2 + (4 if formats[name].minimum_fp32 else 2) if formats.get(name) else None
                total += shape[0] * shape[1] // 32 * group if group else shape[0] * shape[1] * 2
    assert f"engine stores: layer weights {total / 1024:.2f} KiB" in out[-1]
