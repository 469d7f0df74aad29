"""Round-trip error: every value comes back within half its group's step, plus explicit rounding."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant import QTensor, QuantConfig, dequantize, quantize
from tests import quant_spec

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def per_value(q: QTensor, per_group: torch.Tensor) -> torch.Tensor:
    """fp32 `[num_groups]` -> one entry per value of the original tensor."""
    return q.layout.from_groups(per_group.float()[:, None].expand(-1, q.config.group_size))


def fp32_allowance(q: QTensor, x: torch.Tensor) -> torch.Tensor:
    """Bound on the fp32 arithmetic error on top of the exact `scale / 2`.

    quantize computes the step count `(x - minimum) / scale` with two fp32 roundings, each at most
    2**-24 relative, of a number at most `max_code`: the chosen code may be off by `2 * 2**-24 *
    max_code` steps beyond the half step. dequantize computes `code * scale` exactly in fp32 (at most
    8 + 11 significant bits) and rounds `+ minimum` once: 2**-24 * |result| <= 2**-24 * (|x| + scale).
    We allow twice that: 2**-22 * (max_code * scale + |x| + scale).
    """
    scale = per_value(q, q.scale)
    return 2.0**-22 * ((q.config.max_code + 1) * scale + x.float().abs())


def output_rounding(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """Half an ulp of `dtype` at `magnitude`: the final rounding of the fp32 result to `dtype`."""
    info = torch.finfo(dtype)
    return magnitude * info.eps / 2 + info.smallest_normal * info.eps / 2


def assert_within_bound(x: torch.Tensor, q: QTensor) -> None:
    scale = per_value(q, q.scale)
    exact = scale / 2 + fp32_allowance(q, x)
    error32 = (dequantize(q, torch.float32) - x.float()).abs()
    assert torch.all(error32 <= exact), f"worst excess {(error32 - exact).max().item()}"
    # The default output (x's dtype) adds its own final rounding. An fp16 result is computed in fp32
    # and rounded once (see dequantize), so the same bound holds with half an fp16 ulp more.
    restored = dequantize(q)
    assert restored.dtype == x.dtype and restored.shape == x.shape
    assert torch.isfinite(restored).all()
    error = (restored.float() - x.float()).abs()
    assert torch.all(error <= exact + output_rounding(x.dtype, x.float().abs() + scale))


@st.composite
def tensors(draw):
    ndim = draw(st.integers(1, 4))
    group_axis = draw(st.integers(0, ndim - 1))  # the dimension that gets long enough for many groups
    shape = [draw(st.integers(1, 150 if d == group_axis else 5)) for d in range(ndim)]
    dtype = draw(st.sampled_from(DTYPES))
    style = draw(st.sampled_from(["normal", "log-uniform", "constant", "few values", "offset"]))
    magnitude = draw(st.sampled_from([1e-4, 0.02, 1.0, 300.0, 1e4]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if style == "normal":
        x = torch.randn(shape, generator=generator) * magnitude / 4
    elif style == "log-uniform":  # magnitudes spread over eight decades, both signs
        exponent = torch.rand(shape, generator=generator) * 8 - 4
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        x = sign * magnitude * 10.0**exponent / 1e4
    elif style == "constant":
        x = torch.full(shape, (torch.rand(1, generator=generator).item() * 2 - 1) * magnitude)
    elif style == "few values":  # many groups come out constant
        values = (torch.rand(3, generator=generator) * 2 - 1) * magnitude
        x = values[torch.randint(0, 3, shape, generator=generator)]
    else:  # a narrow range far from zero: the fp16 minimum's rounding matters
        x = magnitude + torch.rand(shape, generator=generator) * magnitude * 1e-3
    return x.clamp(-1e4, 1e4).to(dtype), group_axis


@st.composite
def configs(draw, ndim: int, group_axis: int):
    bits = draw(st.sampled_from([4, 8]))
    sizes = [2, 6, 16, 64] if bits == 4 else [1, 3, 16, 64]
    group_dim = draw(st.sampled_from([group_axis, group_axis - ndim, draw(st.integers(-ndim, ndim - 1))]))
    return QuantConfig(bits=bits, group_size=draw(st.sampled_from(sizes)), group_dim=group_dim,
                       symmetric=draw(st.booleans()))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_round_trip_error_is_within_half_a_step(data):
    x, group_axis = data.draw(tensors())
    config = data.draw(configs(x.dim(), group_axis))
    q = quantize(x, config)
    assert q.shape == tuple(x.shape) and q.dtype == x.dtype
    assert_within_bound(x, q)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_fp16_minimum_and_step_cover_every_group(data):
    # The construction itself: minimum <= group min, and max_code steps reach the group max,
    # checked in fp64 (exact for these fp16 / fp32 operands).
    x, group_axis = data.draw(tensors())
    config = data.draw(configs(x.dim(), group_axis))
    q = quantize(x, config)
    groups = q.layout.to_groups(x).double()
    minimum, scale = q.minimum.double(), q.scale.double()
    assert torch.all(minimum <= groups.amin(dim=-1))
    assert torch.all(minimum + config.max_code * scale >= groups.amax(dim=-1))
    assert torch.all(scale > 0)


@pytest.mark.parametrize("bits", [4, 8])
def test_constant_fp16_groups_come_back_exactly(bits):
    x = torch.tensor([[0.0] * 64, [-3.5] * 64, [65504.0] * 64, [1e-7] * 64], dtype=torch.float16)
    q = quantize(x, QuantConfig(bits=bits))
    assert torch.equal(dequantize(q), x)
    assert torch.all(q.scale > 0)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_keeps_zero_exact(bits):
    x = torch.randn(4, 128)
    x[:, ::3] = 0.0
    q = quantize(x, QuantConfig(bits=bits, symmetric=True))
    assert torch.equal(q.minimum.float(), -(2 ** (bits - 1)) * q.scale.float())
    assert torch.all(dequantize(q)[:, ::3] == 0.0)
    assert_within_bound(x, q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "group_dim"), [((8, 256), -1), ((8, 100), -1), ((70, 6), 0), ((3, 70, 5), 1)])
def test_dequantize_into_out(dtype, shape, group_dim):
    x = torch.randn(shape).to(dtype)
    q = quantize(x, QuantConfig(group_dim=group_dim))
    out = torch.empty(shape, dtype=dtype)
    assert dequantize(q, out=out) is out
    assert torch.equal(out, dequantize(q))


def test_dequantize_rejects_a_wrong_out():
    q = quantize(torch.randn(4, 64), QuantConfig())
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of shape"):
        dequantize(q, out=torch.empty(4, 65))
    with pytest.raises(ValueError, match="out must be"):
        dequantize(q, out=torch.empty(64, 4).t())


def test_quantize_leaves_its_input_alone():
    x = torch.randn(16, 64)
    before = x.clone()
    quantize(x, QuantConfig())
    assert torch.equal(x, before)


def test_scalar_and_empty_tensors():
    scalar = torch.tensor(2.5)
    assert torch.equal(dequantize(quantize(scalar, QuantConfig())), scalar)
    empty = torch.empty(3, 0, 5)
    q = quantize(empty, QuantConfig(group_dim=1))
    assert q.nbytes == 0 and dequantize(q).shape == (3, 0, 5)


def test_to_and_device():
    q = quantize(torch.randn(4, 64), QuantConfig())
    moved = q.to("cpu", non_blocking=True)
    assert moved.device.type == "cpu" and torch.equal(dequantize(moved), dequantize(q))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_round_trip_matches_cpu(dtype):
    # rows over nine decades: thousands of distinct fp32 spans, so a step computed as span * (1 / 15)
    # (CUDA's division by a number) instead of span / 15 would round to another fp16 somewhere
    x = (torch.randn(33, 200) * torch.logspace(-4, 4, 33)[:, None]).to(dtype)
    for config in (QuantConfig(), QuantConfig(bits=8, group_size=32, group_dim=0, symmetric=True)):
        q_cpu = quantize(x, config)
        q_gpu = quantize(x.cuda(), config)
        assert q_gpu.device.type == "cuda"
        assert torch.equal(q_gpu.scale.cpu(), q_cpu.scale) and torch.equal(q_gpu.minimum.cpu(), q_cpu.minimum)
        assert_within_bound(x, q_gpu.to("cpu"))
        torch.testing.assert_close(dequantize(q_gpu).cpu(), dequantize(q_cpu), rtol=0, atol=0)
        pinned = q_cpu.pin_memory()
        assert pinned.is_pinned()
        assert torch.equal(dequantize(pinned.to("cuda", non_blocking=True)).cpu(), dequantize(q_cpu))


class _DivisionsByANumber(torch.overrides.TorchFunctionMode):
    """Records every division whose divisor is a Python number (on CUDA: a multiplication by its
    reciprocal, not the IEEE quotient the CPU and the Triton quantize kernel compute)."""

    DIVISIONS = {torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.div_, torch.Tensor.__truediv__,
                 torch.Tensor.true_divide, torch.Tensor.true_divide_, torch.Tensor.__itruediv__}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DIVISIONS and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            self.seen.append((func.__name__, args[1]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig(bits=8, group_size=32, symmetric=True),
                                    QuantConfig(bits=4, group_size=16, group_dim=0)])
def test_quantize_divides_by_no_python_number(config):
    """The step and the codes are IEEE quotients on every device: quantize divides by tensors only
    (tests/offload/test_cuda.py compares the bits on a GPU)."""
    x = torch.randn(48, 64)
    with _DivisionsByANumber() as mode:
        quantize(x, config)
    assert mode.seen == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "config"), [
    ((37, 64), QuantConfig(bits=4, group_size=16)),
    ((37, 100), QuantConfig(bits=4, group_size=64)),  # padded lines
    ((70, 6), QuantConfig(bits=4, group_size=16, group_dim=0)),  # groups across rows
    ((5, 41, 3), QuantConfig(bits=8, group_size=8, group_dim=1)),
])
def test_dequantize_in_chunks_is_the_exact_affine(monkeypatch, dtype, shape, config):
    """On CPU dequantize works through the lines in chunks (small temporaries); a chunk of a few
    lines, with a ragged last one, must give exactly code * scale + minimum: the product is exact
    in fp32 and the sum is rounded once (float64 holds both exactly), then rounded to `dtype`."""
    import quant.groupwise as groupwise
    from quant.packing import unpack_4bit

    x = (torch.randn(shape) * 3 + 1).to(dtype)
    q = quantize(x, config)
    monkeypatch.setattr(groupwise, "_CPU_CHUNK_VALUES", 300)  # a few lines per chunk
    lines = q.data.view(q.layout.num_rows, -1)
    codes = (unpack_4bit(lines) if config.bits == 4 else lines).reshape(q.layout.num_groups, -1)
    exact = codes.double() * q.scale.double()[:, None] + q.minimum.double()[:, None]
    expected = q.layout.from_groups(exact.float().to(dtype))
    for out in (None, torch.empty(shape, dtype=dtype)):
        got = dequantize(q, dtype, out=out)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, expected)


# ---- tensors of several of dequantize's CPU chunks, against the format's own arithmetic --------
@pytest.mark.parametrize(("shape", "config"), [
    ((1100, 2048), QuantConfig(bits=4, group_size=64)),  # the weight format: 3 chunks, the last ragged
    ((600, 4000), QuantConfig(bits=4, group_size=64)),  # padded lines
    ((2100, 1000), QuantConfig(bits=4, group_size=64, group_dim=0)),  # groups across rows
    ((1100, 2048), QuantConfig(bits=4, group_size=64, adjacent_pairs=True)),
    ((1100, 2048), QuantConfig(bits=4, group_size=32, group_halves=True)),
    ((1100, 2048), QuantConfig(bits=8, group_size=64)),
])
def test_round_trip_over_several_chunks_is_the_formats_arithmetic(shape, config):
    """quantize and dequantize work through a large CPU tensor in chunks of lines (at the real chunk
    size: no constant patched); every chunk's groups must get their own step and minimum. Random
    rows whose magnitudes span six decades (a chunk reading another chunk's steps is far off), for
    each output dtype's path: the step, the minimum and every value read back are exactly those of
    tests/quant_spec.py (fp32, then rounded once to the dtype)."""
    import quant.groupwise as groupwise

    gen = torch.Generator().manual_seed(sum(shape) + config.group_size + config.bits)
    magnitude = 10.0 ** (torch.rand(shape[0], 1, generator=gen) * 6 - 4)  # one per row
    x = torch.randn(shape, generator=gen) * magnitude + torch.randn(shape[0], 1, generator=gen) * magnitude
    q = quantize(x, config)
    line_len = q.layout.padded_len
    assert q.layout.num_rows * line_len > 2 * groupwise._CPU_CHUNK_VALUES  # three chunks or more
    assert q.layout.num_rows % (groupwise._CPU_CHUNK_VALUES // line_len)  # the last one ragged

    codes, step, minimum = quant_spec.quantize_groups(quant_spec.to_groups(x, config.group_size, config.group_dim),
                                                      config.bits)
    assert np.array_equal(q.scale.numpy(), step) and np.array_equal(q.minimum.numpy(), minimum)
    expected = quant_spec.from_groups(quant_spec.read_back(codes, step, minimum), shape, config.group_dim)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        got = dequantize(q, dtype)
        assert got.dtype == dtype and torch.equal(got, expected.to(dtype)), dtype


@pytest.mark.parametrize("config", [QuantConfig(bits=4, group_size=8),
                                    QuantConfig(bits=4, group_size=8, adjacent_pairs=True),
                                    QuantConfig(bits=8, group_size=4)])
def test_rows_of_a_tensor_grouped_along_its_last_dimension_are_the_rows_quantized(config):
    """QTensor.rows / take_rows along the first dimension of a 3-D tensor ([tokens, kv_heads,
    head_dim], as a pass's new V): the same bits as quantizing those rows alone."""
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(0))
    q = quantize(x, config)
    index = torch.tensor([4, 0, 4, 2])
    for got, want in ((q.rows(1, 4), quantize(x[1:4], config)), (q.take_rows(index), quantize(x[index], config))):
        assert got.shape == want.shape
        assert all(torch.equal(a, b) for a, b in ((got.data, want.data), (got.scale, want.scale),
                                                   (got.minimum, want.minimum)))
    with pytest.raises(ValueError, match="grouped along its last"):
        quantize(x, QuantConfig(bits=4, group_size=2, group_dim=1)).rows(0, 1)
