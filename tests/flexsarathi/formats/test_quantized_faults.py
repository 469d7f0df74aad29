"""Damaged AWQ and compressed-tensors checkpoints: one fault each (a wrong dtype, a wrong or truncated
shape, weight_shape that disagrees with the packed words, a NaN or inf scale, zero points a symmetric
scheme does not read) is one CheckpointError at load naming the file, the module and the tensor, not
an IndexError or a view error deep in unpacking, nor a model that loads wrong. The undamaged
checkpoints the faults are made in load exactly (the GPTQ faults: test_quantized_checkpoint.py)."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.errors import CheckpointError
from tests.flexsarathi.formats.test_quantized_checkpoint import (_check_logits_and_tokens, _check_weights,
                                                                 _edit_tensors, check_against_the_package,
                                                                 ct_checkpoint, packed_checkpoint)
from tests.quantized_refs import awq_tensors, dequantize_ref, draw

Q = "model.layers.0.self_attn.q_proj"  # [128, 128]: 4 groups of 32
DOWN = "model.layers.1.mlp.down_proj"  # [128, 256]: 8 groups of 32


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    """A valid AWQ GEMM checkpoint (llama, int4 g32) and the transformers model of its values."""
    return packed_checkpoint(tmp_path_factory.mktemp("awq") / "ckpt", "llama", "awq", 4, 32, False)


@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """A valid compressed-tensors pack-quantized checkpoint (llama, int4 g32 asymmetric)."""
    return ct_checkpoint(tmp_path_factory.mktemp("ct") / "ckpt", "llama", 4, 32, False)[0]


@pytest.fixture(scope="module")
def ct_sym(tmp_path_factory):
    return ct_checkpoint(tmp_path_factory.mktemp("ct_sym") / "ckpt", "llama", 4, 32, True)[0]


def _damaged(pristine: str, tmp_path, name: str, edit) -> tuple[str, str]:
    """A copy of `pristine` with tensor `name` replaced by edit(it) -> (folder, its safetensors file)."""
    folder = str(tmp_path / "damaged")
    shutil.copytree(pristine, folder)
    return folder, _edit_tensors(folder, lambda t: t.update({name: edit(t.get(name))}))


def _refused(folder: str, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        LLM(folder, dtype="float32", device="cpu")
    assert all(f in str(info.value) for f in fragments), (str(info.value), fragments)


def _set(index, value):
    def edit(t):
        t = t.clone()
        t[index] = value
        return t
    return edit


def test_the_undamaged_awq_checkpoint_loads_exactly(awq, tmp_path):
    folder, model = awq
    _check_weights(folder, model)
    _check_logits_and_tokens(folder, model, tmp_path / "off")


def test_the_undamaged_compressed_tensors_checkpoint_equals_the_package(ct, tmp_path):
    check_against_the_package(ct, "llama", 4, False, tmp_path / "off")


AWQ_WHY = "int4 g32 asym weight (read from {m}.qweight of shape {packed}; quantization_config bits=4) needs"
AWQ_FAULTS = {  # id: (module, suffix, edit, fragments of the message; {p}: the file, {m}: the module)
    "qweight-dtype": (Q, "qweight", lambda t: t.long(), ["{p}: tensor {m}.qweight is stored as I64; awq stores "
                                                         "qweight as I32"]),
    "qzeros-dtype": (Q, "qzeros", lambda t: t.long(), ["{p}: tensor {m}.qzeros is stored as I64; awq stores "
                                                       "qzeros as I32"]),
    "scales-dtype": (DOWN, "scales", lambda t: t.int(), ["{p}: tensor {m}.scales is stored as I32; awq stores "
                                                         "scales as F16 or BF16 or F32"]),
    "scales-shape": (Q, "scales", lambda t: t[:, :-1], ["{p}: tensor {m}.scales has shape [4, 127], but its module's "
                                                        "128x128 " + AWQ_WHY.format(m=Q, packed=[128, 16]) +
                                                        " [4, 128]"]),
    "qzeros-groups": (DOWN, "qzeros", lambda t: t[:-1], ["{p}: tensor {m}.qzeros has shape [7, 16], but its module's "
                                                         "128x256 " + AWQ_WHY.format(m=DOWN, packed=[256, 16]) +
                                                         " [8, 16]"]),
    # a column of words short: the module's [out, in] comes from qweight, so its qzeros no longer fit,
    # and the message says where that [out, in] came from
    "qweight-columns": (Q, "qweight", lambda t: t[:, :-1], ["{p}: tensor {m}.qzeros has shape [4, 16], but its "
                                                            "module's 120x128 " +
                                                            AWQ_WHY.format(m=Q, packed=[128, 15]) + " [4, 15]"]),
    "qweight-rows": (Q, "qweight", lambda t: t[:-1], ["{m}.weight (read from {m}.qweight of shape [127, 16]) has "
                                                      "shape [128, 127], which does not match config.json"]),
    "qweight-flat": (Q, "qweight", lambda t: t.reshape(-1), ["{p}: tensor {m}.qweight has shape [2048], but the awq "
                                                             "format needs a matrix"]),
    "scales-nan": (DOWN, "scales", _set((3, 5), float("nan")), ["{p}: the scales of {m} hold a NaN or inf "
                                                                "(tensor {m}.scales)"]),
    "scales-inf": (Q, "scales", _set((0, 0), float("-inf")), ["{p}: the scales of {m} hold a NaN or inf "
                                                              "(tensor {m}.scales)"]),
}


@pytest.mark.parametrize("fault", AWQ_FAULTS)
def test_a_damaged_awq_component_is_one_clear_error(awq, tmp_path, fault):
    module, suffix, edit, fragments = AWQ_FAULTS[fault]
    folder, path = _damaged(awq[0], tmp_path, f"{module}.{suffix}", edit)
    _refused(folder, *(f.format(p=path, m=module) for f in fragments))


def _quantized_lm_head(tensors, gen) -> tuple[torch.Tensor, ...]:
    """lm_head stored as AWQ codes instead of fp16 -> its codes, scales and zeros."""
    codes, scale, zero = draw(96, 128, 4, 32, False, gen)
    del tensors["lm_head.weight"]
    tensors.update({f"lm_head.{k}": v for k, v in awq_tensors(codes, scale, zero).items()})
    return codes, scale, zero


def test_a_quantized_lm_head_is_read_exactly_and_its_scales_checked(awq, tmp_path):
    """The lm_head is dequantized with the embeddings rather than placed as codes: its scales are
    checked on that path too (a NaN there loaded and made every logit NaN)."""
    pristine, model = awq
    folder = str(tmp_path / "lm_head")
    shutil.copytree(pristine, folder)
    drawn = []
    path = _edit_tensors(folder, lambda t: drawn.extend(_quantized_lm_head(t, torch.Generator().manual_seed(5))))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.lm_head.weight.copy_(dequantize_ref(*drawn))
    _check_logits_and_tokens(folder, reference, tmp_path / "off")

    _edit_tensors(folder, lambda t: t.update({"lm_head.scales": _set((1, 40), float("nan"))(t["lm_head.scales"])}))
    _refused(folder, f"{path}: the scales of lm_head hold a NaN or inf (tensor lm_head.scales)")


CT_WHY = "int4 g32 asym weight (read from {m}.weight_shape = {shape}; quantization_config bits=4) needs"
CT_FAULTS = {  # id: (module, suffix, edit, fragments of the message)
    "packed-dtype": (Q, "weight_packed", lambda t: t.long(), ["{p}: tensor {m}.weight_packed is stored as I64; "
                                                              "compressed-tensors stores weight_packed as I32"]),
    # weight_packed's shape was not checked: a truncated one failed in unpacking (AttributeError,
    # a QTensor size error) and one with a word too many per row loaded
    "packed-columns": (Q, "weight_packed", lambda t: t[:, :-1], ["{p}: tensor {m}.weight_packed has shape [128, 15], "
                                                                 "but its module's 128x128 " +
                                                                 CT_WHY.format(m=Q, shape=[128, 128]) + " [128, 16]"]),
    "packed-rows": (DOWN, "weight_packed", lambda t: t[:-1], ["{p}: tensor {m}.weight_packed has shape [127, 32], but "
                                                              "its module's 128x256 " +
                                                              CT_WHY.format(m=DOWN, shape=[128, 256]) + " [128, 32]"]),
    "packed-flat": (Q, "weight_packed", lambda t: t.reshape(-1), ["{p}: tensor {m}.weight_packed has shape [2048], "
                                                                  "but its module's 128x128"]),
    "packed-extra-word": (Q, "weight_packed", lambda t: torch.cat([t, t[:, :1]], 1),
                          ["{p}: tensor {m}.weight_packed has shape [128, 17], but its module's 128x128"]),
    "scale-dtype": (Q, "weight_scale", lambda t: t.int(), ["{p}: tensor {m}.weight_scale is stored as I32; "
                                                           "compressed-tensors stores weight_scale as F16 or BF16"]),
    "scale-shape": (DOWN, "weight_scale", lambda t: t[:, :-1], ["{p}: tensor {m}.weight_scale has shape [128, 7], but "
                                                                "its module's 128x256 " +
                                                                CT_WHY.format(m=DOWN, shape=[128, 256]) + " [128, 8]"]),
    "scale-nan": (Q, "weight_scale", _set((7, 2), float("nan")), ["{p}: the scales of {m} hold a NaN or inf "
                                                                  "(tensor {m}.weight_scale)"]),
    "scale-inf": (DOWN, "weight_scale", _set((0, 7), float("inf")), ["{p}: the scales of {m} hold a NaN or inf "
                                                                     "(tensor {m}.weight_scale)"]),
    "shape-dtype": (Q, "weight_shape", lambda t: t.float(), ["{p}: tensor {m}.weight_shape is stored as F32; "
                                                             "compressed-tensors stores weight_shape as I8"]),
    # weight_shape was read before its shape was checked: ValueError (unpacking) or TypeError (int(list))
    "shape-three": (Q, "weight_shape", lambda t: torch.cat([t, t[:1]]), [
        "{p}: tensor {m}.weight_shape has shape [3], but the compressed-tensors format needs [2]"]),
    "shape-matrix": (Q, "weight_shape", lambda t: t[None], ["{p}: tensor {m}.weight_shape has shape [1, 2], but the "
                                                            "compressed-tensors format needs [2]"]),
    "shape-values": (Q, "weight_shape", lambda t: torch.tensor([128, 64]), [
        "{p}: tensor {m}.weight_packed has shape [128, 16], but its module's 128x64 " +
        CT_WHY.format(m=Q, shape=[128, 64]) + " [128, 8]"]),
    "zero-point-shape": (Q, "weight_zero_point", lambda t: t[:, :-1], [
        "{p}: tensor {m}.weight_zero_point has shape [16, 3], but its module's 128x128 " +
        CT_WHY.format(m=Q, shape=[128, 128]) + " [16, 4]"]),
    "zero-point-unpacked": (DOWN, "weight_zero_point", lambda t: torch.zeros(128, 8, dtype=torch.int8), [
        "{p}: tensor {m}.weight_zero_point is stored as I8; compressed-tensors stores weight_zero_point as I32"]),
    "g-idx-range": (Q, "weight_g_idx", lambda t: torch.full((128,), 9, dtype=torch.int32), [
        "{p}: tensor {m}.weight_g_idx holds group 9...9, outside the 4 groups of its 128 columns"]),
}


@pytest.mark.parametrize("fault", CT_FAULTS)
def test_a_damaged_compressed_tensors_component_is_one_clear_error(ct, tmp_path, fault):
    module, suffix, edit, fragments = CT_FAULTS[fault]
    folder, path = _damaged(ct, tmp_path, f"{module}.{suffix}", edit)
    _refused(folder, *(f.format(p=path, m=module) for f in fragments))


def test_symmetric_zero_points_must_be_zero(ct_sym, tmp_path):
    """A symmetric scheme stores no zero points (the package drops them); a file that holds some
    anyway: zeros change nothing and load, others would be subtracted by the package's own
    decompression but not by a symmetric reader: refused, naming the tensor."""
    name = f"{DOWN}.weight_zero_point"
    folder, _ = _damaged(ct_sym, tmp_path / "zeros", name, lambda _: torch.zeros(128, 8, dtype=torch.int8))
    check_against_the_package(folder, "llama", 4, True, tmp_path / "off")
    folder, path = _damaged(ct_sym, tmp_path / "ones", name, lambda _: torch.ones(128, 8, dtype=torch.int8))
    _refused(folder, f"{path}: tensor {name} holds zero points other than 0, but quantization_config makes "
                     f"{DOWN} symmetric (int4 g32 sym)")
