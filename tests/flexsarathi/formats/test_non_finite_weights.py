"""A NaN or inf in a checkpoint's weights is one CheckpointError naming the tensor, whichever pass
finds it: the source's check as it casts a tensor (safetensors, a quantized checkpoint's float
tensors, a GGUF's float tensors), or quantize's own check of the group scales where the engine
compresses the weight as it places it (the source then leaves that weight to it: no pass of its
own over those values). A finite tensor is never refused, e.g. an fp16 one whose sum overflows.
(tests/flexsarathi/cli/test_cli_faults.py: the same through `flexsarathi generate`.)"""
from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import flexsarathi.formats.checkpoint as checkpoint
from flexsarathi import LLM
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.checkpoint import SafetensorsCheckpoint
from policy_search import Policy

BROKEN = "model.layers.1.mlp.up_proj.weight"
COMPRESSED = Policy(compress_weight=True)


def rewritten(stories_dir, folder, change) -> str:
    """stories260K with its tensors passed through change(dict of tensors) before saving."""
    shutil.copytree(stories_dir, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def one_entry(value: float):
    def change(tensors):
        tensors[BROKEN][3, 5] = value
    return change


def non_finite_error(model: str, value: float) -> str:
    counts = "1 NaN, 0 inf" if math.isnan(value) else "0 NaN, 1 inf"
    return (f"tensor {BROKEN} in {model}/model.safetensors has non-finite weights ({counts}; the first at [3, 5]): "
            "the checkpoint is damaged; the engine would compute NaN logits from it")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_compressed_weight_is_checked_by_its_group_scales_not_by_a_pass_of_its_own(
        stories_dir, tmp_path, monkeypatch, value):
    model = rewritten(stories_dir, tmp_path / "m", one_entry(value))
    summed = []  # the tensors the source's own check passed over, in order
    real = checkpoint.require_finite

    def recorded(values, name, *args):
        summed.append(name)
        return real(values, name, *args)

    monkeypatch.setattr(checkpoint, "require_finite", recorded)
    with pytest.raises(CheckpointError) as refused:
        LLM(model, dtype="float32", policy=COMPRESSED)
    assert str(refused.value) == non_finite_error(model, value)
    # layer 0 was placed before layer 1 failed: its norms were checked by the source, its matrices
    # (quantized as they were placed) were not; layer 1's were, once, to name the bad entry.
    layer0 = [name for name in summed if name.startswith("model.layers.0.")]
    assert layer0 and all(name.endswith("layernorm.weight") for name in layer0)
    assert summed.count(BROKEN) == 1


def test_the_same_checkpoint_uncompressed_is_checked_by_the_source(stories_dir, tmp_path):
    model = rewritten(stories_dir, tmp_path / "m", one_entry(math.inf))
    with pytest.raises(CheckpointError) as refused:
        LLM(model, dtype="float32")
    assert str(refused.value) == non_finite_error(model, math.inf)


def test_a_finite_weight_beyond_fp16_scales_is_one_error_saying_so(stories_dir, tmp_path):
    model = rewritten(stories_dir, tmp_path / "m", one_entry(1e6))  # finite in fp32; its group's step is not in fp16
    with pytest.raises(CheckpointError, match=r"^weight gate_up_proj.weight of layer 1 cannot be quantized: .*; its values are "
                                              r"finite in float32, but beyond what 4-bit groups' fp16 scales hold"):
        LLM(model, dtype="float32", policy=COMPRESSED)
    with LLM(model, dtype="float32") as llm:  # uncompressed it loads
        assert llm.engine.dtype == torch.float32


def test_a_finite_fp16_tensor_whose_sum_overflows_is_not_refused(stories_dir, tmp_path):
    def large(tensors):
        for name in list(tensors):
            tensors[name] = tensors[name].half()
        tensors[BROKEN] = torch.full_like(tensors[BROKEN], 60000.0)  # the largest fp16 is 65504

    model = rewritten(stories_dir, tmp_path / "m", large)
    stored = load_file(f"{model}/model.safetensors")[BROKEN]
    assert torch.isinf(stored.sum()) and torch.isfinite(stored).all()  # the case the element-wise look settles
    source = SafetensorsCheckpoint(model)
    gate_up = source.layer_weights(1, torch.float16)["gate_up_proj.weight"]  # [gate rows; up rows]
    assert torch.equal(gate_up[stored.shape[0]:], stored)


def test_a_nan_in_a_gguf_float_tensor_is_one_error_naming_it(tmp_path):
    pytest.importorskip("gguf")
    from tests.gguf_files import build_model, write_gguf

    model = build_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = math.nan
    (path,) = write_gguf(model, tmp_path / "m.gguf", weight_type="F32")
    with pytest.raises(CheckpointError, match=r"^tensor blk\.1\.ffn_up\.weight in .*m\.gguf has non-finite weights "
                                              r"\(1 NaN, 0 inf; the first at \[3, 5\]\)"):
        LLM(str(path), dtype="float32")


def test_a_nan_in_a_gptq_checkpoints_float_tensor_is_one_error_naming_it(tmp_path):
    from tests.flexsarathi.formats.test_quantized_checkpoint import packed_checkpoint

    folder, _ = packed_checkpoint(tmp_path / "gptq", "llama", "gptq", bits=4, group=128, sym=True)
    name = "model.layers.1.post_attention_layernorm.weight"  # kept in fp16 beside the codes
    tensors = load_file(f"{folder}/model.safetensors")
    tensors[name][7] = -math.inf
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"^tensor {name} in .* has non-finite weights \(0 NaN, 1 inf; "
                                              r"the first at \[7\]\)"):
        LLM(folder, dtype="float32")
