"""GGUF block types -> the engine's weights, against the `gguf` package's own `quants.dequantize`.

Exact types: the engine's dequantization of the converted QTensor equals gguf's values bit for bit
(fp32; and fp16/bf16 as their one rounding of it), for codes from `gguf.quants.quantize` and for
random codes drawn directly. K-quants (no quantizer in the package: random codes): the codes with
their exact scales equal gguf's values bit for bit, and the stored form (fp16 scales) stays within
the bound of rounding the scale and minimum to fp16; the measured errors are printed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from flexsarathi.errors import CheckpointError  # noqa: E402
from flexsarathi.formats import gguf_quants as gq  # noqa: E402
from quant import dequantize  # noqa: E402
from tests.gguf_files import random_blocks  # noqa: E402

ROWS, COLS = 12, 512


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", gq.EXACT_TYPES)
@pytest.mark.parametrize("codes_from", ["quantize", "random"])
def test_exact_types_equal_gguf_dequantize_bit_for_bit(type_name, codes_from):
    rng = np.random.default_rng(1)
    if codes_from == "quantize":
        values = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    else:
        raw = random_blocks(type_name, ROWS, COLS, rng, scale=0.01)
    ref = reference(raw, type_name)
    codes = gq.to_codes(raw, type_name, (ROWS, COLS))
    q = gq.to_qtensor(codes, torch.float32)
    assert q.config == gq.CODE_FORMATS[type_name]
    assert q.config.bits == (4 if type_name.startswith("Q4") else 8) and q.config.group_size == 32
    assert np.array_equal(dequantize(q, torch.float32).numpy(), ref)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequantize(q, dtype), torch.from_numpy(ref).to(dtype))
    assert gq.conversion_error(codes, q) == 0.0


@pytest.mark.parametrize("type_name", gq.CONVERTED_TYPES)
def test_k_quants_convert_within_the_fp16_rounding_of_their_scales(type_name):
    rng = np.random.default_rng(2)
    raw = random_blocks(type_name, ROWS, COLS, rng, scale=1e-3)
    ref = reference(raw, type_name)
    codes = gq.to_codes(raw, type_name, (ROWS, COLS))
    assert np.array_equal(gq.exact_values(codes), ref)  # the decoding itself is exact
    q = gq.to_qtensor(codes, torch.float32)
    assert q.config == gq.CODE_FORMATS[type_name]
    engine = dequantize(q, torch.float32).numpy()
    # Bound: a code times half an fp16 ulp of its scale, plus half an ulp of the minimum (+ fp32 rounding).
    group = q.config.group_size
    top = codes.codes.reshape(ROWS, -1, group).max(axis=-1).astype(np.float64)
    bound = top * _half_ulp(codes.scale) + _half_ulp(codes.minimum) + 2.0**-23 * np.abs(ref).reshape(ROWS, -1, group).max(-1)
    err = np.abs(engine - ref).reshape(ROWS, -1, group).max(-1)
    assert (err <= bound).all()
    measured = gq.conversion_error(codes, q)
    print(f"{type_name} -> {q.config.bits}-bit group {group}: max |error| {measured:.3g}, "
          f"relative to max |w| {measured / np.abs(ref).max():.3g}")
    assert 0 < measured <= bound.max()


def _half_ulp(x: np.ndarray) -> np.ndarray:
    half = x.astype(np.float16)
    return np.abs(np.spacing(half).astype(np.float64)) / 2


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"] + list(gq.DEQUANTIZED_TYPES))
def test_other_types_are_gguf_values(type_name):
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    if type_name == "F32":
        raw = values
    elif type_name == "F16":
        raw = values.astype(np.float16)
    elif type_name == "BF16":
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
    else:
        raw = random_blocks(type_name, ROWS, COLS, rng, scale=1e-3)
    got = gq.to_float(raw, type_name, (ROWS, COLS))
    ref = values if type_name == "F32" else reference(raw, type_name) if type_name != "F16" else raw
    assert torch.equal(got.float(), torch.from_numpy(np.asarray(ref, dtype=np.float32)))
    assert gq.to_codes(raw, type_name, (ROWS, COLS)) is None


def test_scales_that_overflow_fp16_minimum_fall_back_to_floats():
    raw = random_blocks("Q8_0", 2, 64, np.random.default_rng(4))
    raw.reshape(-1, 34)[0, :2] = np.array([1000.0], dtype=np.float16).view(np.uint8)  # -128 * 1000 > fp16 max
    assert gq.to_qtensor(gq.to_codes(raw, "Q8_0", (2, 64)), torch.float32) is None


def test_unsupported_type_is_one_clear_error():
    with pytest.raises(CheckpointError, match=r"model.gguf: tensor blk.0.attn_q.weight has GGUF type IQ2_XXS, "
                                              r"which is not supported; supported: F32, F16, BF16, Q4_0"):
        gq.check_type("IQ2_XXS", "blk.0.attn_q.weight", "model.gguf")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_row_chunks_and_odd_block_counts_decode_the_same(type_name, monkeypatch):
    """Rows of 3 blocks (Q4: an odd number of nibble runs, so codes are unpacked and packed again)
    and decoding by chunks of rows give gguf's values too."""
    cols = 3 * (256 if type_name.endswith("_K") else 32)
    raw = random_blocks(type_name, 40, cols, np.random.default_rng(5), scale=1e-3)
    whole = gq.to_codes(raw, type_name, (40, cols))
    monkeypatch.setattr(gq, "_CHUNK_VALUES", 3 * cols)  # 3 rows at a time, the last chunk 1 row
    chunked = gq.to_codes(raw, type_name, (40, cols))
    for field in ("data", "scale", "minimum"):
        assert np.array_equal(getattr(whole, field), getattr(chunked, field))
    assert np.array_equal(gq.exact_values(chunked), reference(raw, type_name))
