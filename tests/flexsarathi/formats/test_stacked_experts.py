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
from flexsarathi.formats.checkpoint import SafetensorsCheckpoint
from flexsarathi.formats.stacked_experts import MXFP4_CODES, mxfp4_codes
from flexsarathi.models.base import StackedExperts
from quant import QTensor, dequantize
from tests.conftest import checkpoint_to_rewrite
from tests.flexsarathi.models.test_models import _prompts, hf_logits
from tests.prompt_logits import prompt_logits

PROJECTIONS = ("gate_up_proj", "down_proj")


def _blocks_and_scales(seed: int = 0, low: int = 90, high: int = 141):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)  # [E, out, in / 32, 16]
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # 0x00, 0x11, ..., 0xff: each code in both nibbles
    return blocks, torch.randint(low, high, (3, 40, 4), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mxfp4_is_held_as_8bit_codes_of_transformers_values_exactly(interleaved):
    """Every code in both nibbles, scales from 2 ** -37 to 2 ** 13: the codes read back transformers'
    decoded values bit for bit for e in [-23, 13], and below it are off by fp16's rounding of the tiny
    scales (the error measured says how much)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    how = StackedExperts(interleaved=interleaved)
    blocks, scales = _blocks_and_scales(low=90, high=141)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, out, in]
    if interleaved:  # per expert: the gate rows (even), then the up rows (odd)
        theirs = torch.cat((theirs[:, 0::2], theirs[:, 1::2]), dim=1)
    codes, error = mxfp4_codes(blocks, scales, how, torch.float32, "w")
    assert codes.config == MXFP4_CODES and codes.shape == (3 * 40, 128)
    ours = dequantize(codes, torch.float32).view(3, 40, 128)
    in_range = ((scales.long() - 127 >= -23) & (scales.long() - 127 <= 13)).repeat_interleave(32, dim=-1)
    if interleaved:
        in_range = torch.cat((in_range[:, 0::2], in_range[:, 1::2]), dim=1)
    assert torch.equal(ours[in_range], theirs[in_range])
    assert not in_range.all() and 0 < error == float((ours - theirs).abs().max()) < 1e-6
    assert ours[0, 0, :32].unique().numel() == 15  # the 16 codes of one group: +0 and -0 one value


def test_a_release_s_scales_give_exact_codes():
    blocks, scales = _blocks_and_scales(low=104, high=141)  # e in [-23, 13]
    assert mxfp4_codes(blocks, scales, StackedExperts(), torch.bfloat16, "w")[1] == 0.0


def _mxfp4_checkpoint(tiny_checkpoint, tmp_path, seed: int = 0):
    """The tiny gpt_oss checkpoint with its experts' weights as MXFP4 blocks and scales (as OpenAI's
    release stores them), and transformers' model with the values they decode to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out, tensors, reference = checkpoint_to_rewrite(tiny_checkpoint, "gpt_oss", tmp_path / "mxfp4")
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
    """Its experts held as exact 8-bit codes (nothing rounded: no error recorded), every other weight as floats."""
    folder, reference = _mxfp4_checkpoint(tiny_checkpoint, tmp_path)
    source = SafetensorsCheckpoint(str(folder))
    weights = source.layer_weights(0, torch.float32)
    stacks = {"experts.gate_up_proj.weight", "experts.down_proj.weight"}
    assert source.mxfp4_kinds == stacks and source.log.errors == {}
    assert {k for k, w in weights.items() if isinstance(w, QTensor)} == stacks
    assert {k for k, c in source.quantized_formats().items() if c == MXFP4_CODES} == stacks
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
    "a scale beyond 2 ** 13": (_set(LAYER0 + "gate_up_proj_scales", lambda t: t.index_fill(1, torch.tensor([3]), 141)),
                               "beyond the 2 \\*\\* 13"),
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


@pytest.mark.parametrize("tier, stat", [("cpu", "experts_on_cpu"), ("disk", "experts_read")])
def test_an_mxfp4_checkpoint_gives_the_all_on_device_tokens_from_another_tier(tiny_checkpoint, tmp_path, tier, stat):
    """Its 8-bit codes stored and computed on the CPU, or streamed from disk expert by expert, as any
    pre-quantized expert's."""
    from flexsarathi import SamplingParams
    from policy_search import Policy

    folder, _ = _mxfp4_checkpoint(tiny_checkpoint, tmp_path)
    prompts, params = _prompts(128), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(str(folder), dtype="float32").generate(prompts, params, use_tqdm=False)]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=6, w_gpu=0.0, **{f"w_{tier}": 1.0})
    llm = LLM(str(folder), dtype="float32", policy=policy, offload_dir=str(tmp_path / "offload"),
              routed_expert_reads=True, cpu_experts=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.engine.weights.stats[stat] > 0
