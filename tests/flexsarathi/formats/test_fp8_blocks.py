"""Block-wise FP8 checkpoints (DeepSeek's format: Qwen3-FP8, GLM-4.5-FP8, MiniMax-M2): weights times their
blocks' factors bit for bit as transformers dequantizes them, a whole FP8 checkpoint giving the logits
transformers computes from those values, and each fault one error naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.fp8_blocks import dequantize
from tests.conftest import checkpoint_to_rewrite
from tests.flexsarathi.models.test_models import _prompts, hf_logits
from tests.prompt_logits import prompt_logits

E4M3_MAX = 448.0


def _quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] as e4m3 codes and one float32 factor per block (its largest value over 448)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp_min(1e-12) / E4M3_MAX
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).to(
                torch.float8_e4m3fn)
    return codes, scale


def _transformers_dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(codes, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_dequantize_as_transformers_dequantizes_them(dtype):
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 64)  # blocks of very different ranges
    codes, scale = _quantized(weight, (16, 32))
    assert torch.equal(dequantize(codes, scale, (16, 32)).to(dtype), _transformers_dequantized(codes, scale, dtype))


def test_partial_last_blocks_take_their_blocks_factors():
    """Shapes the blocks do not divide (transformers refuses them): the last row and column blocks are
    partial and each value takes its block's factor, as the whole-block result on the padded weight."""
    weight = torch.randn(40, 50)
    codes, scale = _quantized(weight, (16, 32))  # a 3 x 2 grid over 48 x 64
    padded = torch.zeros(48, 64, dtype=torch.float8_e4m3fn)
    padded[:40, :50] = codes
    expected = _transformers_dequantized(padded, scale, torch.float32)[:40, :50]
    assert torch.equal(dequantize(codes, scale, (16, 32)), expected)


def _fp8_checkpoint(tiny_checkpoint, tmp_path, block=(16, 16)):
    """The tiny llama checkpoint with its layers' matrices as e4m3 blocks and their factors, and
    transformers' model holding the values they dequantize to."""
    out, tensors, reference = checkpoint_to_rewrite(tiny_checkpoint, "llama_gqa_untied", tmp_path / "fp8")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        codes, scale = _quantized(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = codes, scale
        with torch.no_grad():
            reference.get_parameter(name).copy_(_transformers_dequantized(codes, scale, torch.float32))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    return out, reference


def test_an_fp8_checkpoint_gives_transformers_logits(tiny_checkpoint, tmp_path):
    folder, reference = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    llm = LLM(str(folder), dtype="float32")
    prompts = _prompts(128)
    for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
        torch.testing.assert_close(logits, hf_logits(reference, ids), atol=1e-4, rtol=0)


def _edit(folder, tensors=None, quantization=None):
    if tensors is not None:
        stored = load_file(folder / "model.safetensors")
        tensors(stored)
        save_file(stored, folder / "model.safetensors")
    if quantization is not None:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = quantization(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))


Q = "model.layers.0.self_attn.q_proj.weight"
FAULTS = {
    "factors missing": (dict(tensors=lambda t: t.pop(Q + "_scale_inv")), "has no .*q_proj.weight_scale_inv"),
    "factors of another grid": (dict(tensors=lambda t: t.__setitem__(Q + "_scale_inv", torch.ones(3, 3))),
                                r"needs F32 \[2, 2\]"),
    "factors as float16": (dict(tensors=lambda t: t.__setitem__(Q + "_scale_inv", t[Q + "_scale_inv"].half())),
                           "is F16"),
    "an infinite factor": (dict(tensors=lambda t: t[Q + "_scale_inv"].fill_(float("inf"))), "non-finite"),
    "per-tensor scales": (dict(quantization=lambda q: {k: v for k, v in q.items() if k != "weight_block_size"}),
                          "per-tensor FP8 scales are not supported"),
    "e5m2": (dict(quantization=lambda q: {**q, "fmt": "e5m2"}), "fmt 'e5m2' is not supported"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_fp8_checkpoint_is_one_error_naming_what(tiny_checkpoint, tmp_path, fault):
    edit, message = FAULTS[fault]
    folder, _ = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    _edit(folder, **edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(folder), dtype="float32").generate([[5, 6, 7]], use_tqdm=False)


def test_fp8_weights_without_an_fp8_config_are_refused(tiny_checkpoint, tmp_path):
    folder, _ = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="F8_E4M3: fp8 checkpoints are read where .*quantization_config"):
        LLM(str(folder), dtype="float32")
