"""gpt-oss's expert stacks as checkpoints hold them: MXFP4 blocks decoded bit for bit as transformers
decodes them, a whole MXFP4 checkpoint giving the logits transformers computes from those values,
and damaged or mislabelled stacks refused, each with one error naming the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.stacked_experts import dequantize_mxfp4
from tests.flexsarathi.models.test_models import _prompts, hf_logits
from tests.prompt_logits import prompt_logits

PROJECTIONS = ("gate_up_proj", "down_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decodes_as_transformers_decodes_it(dtype):
    """Every code in both nibbles, scales from tiny to large: the same values, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)  # [E, out, in / 32, 16]
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # 0x00, 0x11, ..., 0xff: each code in both nibbles
    scales = torch.randint(90, 160, (3, 40, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales).to(dtype)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert ours[0, 0, :32].unique().numel() == 15  # the 16 codes of one group: +0 and -0 are one value


def _mxfp4_checkpoint(tiny_checkpoint, tmp_path, seed: int = 0):
    """The tiny gpt_oss checkpoint with its experts' weights as MXFP4 blocks and scales (as OpenAI's
    release stores them), and transformers' model with the values they decode to."""
    folder, model = tiny_checkpoint("gpt_oss")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = tmp_path / "mxfp4"
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(PROJECTIONS)]:
        experts, cols, rows = tensors.pop(name).shape  # [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 126, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            reference.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, reference


def test_an_mxfp4_checkpoint_gives_transformers_logits(tiny_checkpoint, tmp_path):
    folder, reference = _mxfp4_checkpoint(tiny_checkpoint, tmp_path)
    llm = LLM(str(folder), dtype="float32")
    prompts = _prompts(128)
    for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
        torch.testing.assert_close(logits, hf_logits(reference, ids), atol=1e-4, rtol=0)


def _rewrite(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def _set(name: str, value):
    return lambda tensors: tensors.__setitem__(name, value(tensors[name]))


LAYER0 = "model.layers.0.mlp.experts."
FAULTS = {
    "a scale of 255 (E8M0's NaN)": (
        _set(LAYER0 + "down_proj_scales", lambda t: t.index_fill(2, torch.tensor([0]), 255)), "non-finite"),
    "blocks stored as int16": (_set(LAYER0 + "gate_up_proj_blocks", lambda t: t.to(torch.int16)), "not U8"),
    "blocks of another width": (_set(LAYER0 + "gate_up_proj_blocks", lambda t: t[:, :, :, :8].contiguous()),
                                "does not match config.json"),
    "scales missing": (lambda tensors: tensors.pop(LAYER0 + "down_proj_scales"), "is missing"),
    "a stack the config does not describe": (lambda tensors: tensors.__setitem__(
        LAYER0 + "down_proj_bias_blocks", torch.zeros(1, dtype=torch.uint8)), "not used by the model"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_mxfp4_stack_is_refused_naming_it(tiny_checkpoint, tmp_path, fault):
    change, message = FAULTS[fault]
    folder, _ = _mxfp4_checkpoint(tiny_checkpoint, tmp_path)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=message) as caught:
        LLM(str(folder), dtype="float32").generate([[5, 6, 7]], use_tqdm=False)
    assert "model.layers.0" in str(caught.value)


def test_mxfp4_for_a_model_without_expert_stacks_is_refused(tiny_checkpoint, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(tiny_checkpoint("llama_gqa_untied")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(CheckpointError, match="mxfp4 is read for gpt-oss's expert weights only"):
        LLM(str(folder), dtype="float32")
