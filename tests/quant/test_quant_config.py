from dataclasses import replace

import pytest
import torch

from quant import QTensor, QuantConfig, quantize


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, r"QuantConfig.bits must be one of \(4, 8\), got 3"),
        ({"bits": True}, r"QuantConfig.bits must be one of"),
        ({"group_size": 0}, r"QuantConfig.group_size must be a positive integer, got 0"),
        ({"group_size": -64}, r"QuantConfig.group_size must be a positive integer"),
        ({"group_size": 63}, r"QuantConfig.group_size must be even for bits=4, got 63"),
        ({"group_dim": 1.0}, r"QuantConfig.group_dim must be an integer"),
        ({"symmetric": 1}, r"QuantConfig.symmetric must be a bool"),
    ],
)
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantConfig(**kwargs)


def test_defaults_and_odd_group_size_at_8_bits():
    config = QuantConfig()
    assert (config.bits, config.group_size, config.group_dim, config.symmetric) == (4, 64, -1, False)
    assert QuantConfig(bits=8, group_size=63).bytes_per_group == 63


def test_group_dim_out_of_range():
    with pytest.raises(ValueError, match=r"group_dim=2 is out of range for a tensor of shape \(4, 5\)"):
        quantize(torch.zeros(4, 5), QuantConfig(group_dim=2))


def test_non_float_input_is_rejected():
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.zeros(4, 64, dtype=torch.int32), QuantConfig())


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -70000.0])
def test_values_outside_fp16_are_rejected(bad):
    x = torch.zeros(2, 64)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="fit in fp16"):
        quantize(x, QuantConfig())


@pytest.fixture
def q() -> QTensor:
    return quantize(torch.randn(6, 100), QuantConfig(bits=4, group_size=64))  # 12 groups of 64


def test_buffer_shapes(q):
    assert q.data.shape == (12 * 32,)
    assert q.scale.shape == q.minimum.shape == (12,)
    assert q.nbytes == 12 * 32 + 12 * 2 + 12 * 2


@pytest.mark.parametrize(
    ("field", "make", "message"),
    [
        ("data", lambda q: q.data[:-1], r"QTensor.data has shape \(383,\) .* needs \(384,\)"),
        ("scale", lambda q: q.scale[:5], r"QTensor.scale has shape \(5,\) .* needs \(12,\)"),
        ("minimum", lambda q: torch.cat([q.minimum, q.minimum]), r"QTensor.minimum has shape \(24,\) .* needs \(12,\)"),
        ("scale", lambda q: q.scale.float(), r"QTensor.scale must be torch.float16, got torch.float32"),
        ("data", lambda q: q.data.to(torch.int8), r"QTensor.data must be torch.uint8"),
        ("shape", lambda q: (6, 200), r"QTensor.data has shape \(384,\) .* needs \(768,\)"),
        ("config", lambda q: QuantConfig(bits=8), r"QTensor.data has shape \(384,\) .* needs \(768,\)"),
        ("dtype", lambda q: torch.int8, r"QTensor.dtype must be a floating torch.dtype"),
    ],
)
def test_tampered_qtensor_says_which_buffer(q, field, make, message):
    with pytest.raises(ValueError, match=message):
        replace(q, **{field: make(q)})
