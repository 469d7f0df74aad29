import textwrap

import pytest
import torch
import torch.nn.functional as F

from quant import QuantConfig, dequantize, quantize, quantized_linear
from tests.triton_interpreter import needs_triton, run_interpreted, without_a_gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [QuantConfig(), QuantConfig(bits=8, group_size=32, group_dim=0)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_quantized_linear_is_dequantize_then_linear(dtype, config, with_bias):
    weight = torch.randn(48, 100) * 0.1  # [out_features, in_features]; 100 is not a multiple of 64
    q = quantize(weight.to(dtype), config)
    x = torch.randn(2, 3, 100).to(dtype)  # [batch, tokens, in_features]
    bias = torch.randn(48).to(dtype) if with_bias else None
    out = quantized_linear(x, q, bias)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    assert torch.equal(out, F.linear(x, dequantize(q, dtype), bias))


def test_shape_mismatch_is_a_clear_error():
    q = quantize(torch.randn(8, 64), QuantConfig())
    with pytest.raises(ValueError, match=r"x \(2, 32\) does not match a weight of shape \(8, 64\)"):
        quantized_linear(torch.randn(2, 32), q)


CASES = [  # (tokens, out_features, in_features, config)
    (1, 256, 512, QuantConfig()),
    (7, 130, 192, QuantConfig()),
    (70, 96, 256, QuantConfig(bits=8, group_size=32)),
    (5, 64, 128, QuantConfig(bits=4, group_size=128)),
    (3, 33, 100, QuantConfig()),  # odd rows, padded groups: not the kernel's layout -> compiled path
    (3, 64, 96, QuantConfig(group_dim=0)),  # grouped along the output dimension -> compiled path
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cuda_quantized_linear_matches_dequantize_then_linear(case, dtype):
    tokens, out_features, in_features, config = case
    weight = torch.randn(out_features, in_features, device="cuda") * 0.05
    q = quantize(weight.to(dtype), config)
    x = torch.randn(tokens, in_features, device="cuda").to(dtype)
    bias = torch.randn(out_features, device="cuda").to(dtype)
    expected = F.linear(x.float(), dequantize(q, torch.float32), bias.float())
    torch.testing.assert_close(quantized_linear(x, q, bias).float(), expected, rtol=2e-2, atol=2e-2)


@needs_triton
@without_a_gpu
def test_triton_kernel_in_the_interpreter():
    # TRITON_INTERPRET=1 runs the kernel with numpy on CPU tensors: the kernel's indexing (the
    # split-half nibbles, the group of each tile, the masks) is checked without a GPU. It must be set
    # before triton is imported, hence the subprocess.
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from quant import QuantConfig, quantize, dequantize
        from quant import triton_kernels
        torch.manual_seed(0)
        for tokens, rows, cols, config, with_bias in [
            (1, 64, 64, QuantConfig(), False), (5, 130, 192, QuantConfig(), True),
            (33, 70, 256, QuantConfig(bits=8, group_size=32), True), (17, 2, 128, QuantConfig(group_size=128), False),
        ]:
            q = quantize(torch.randn(rows, cols).half(), config)
            x = torch.randn(tokens, cols).half()
            bias = torch.randn(rows).half() if with_bias else None
            assert triton_kernels.supports(x, q)
            got = triton_kernels.dequant_linear(x, q, bias).float()
            expected = F.linear(x.float(), dequantize(q, torch.float32), None if bias is None else bias.float())
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    """)
    run_interpreted(script, timeout=300)


@needs_triton
def test_triton_grid_gives_every_sm_a_program_where_the_output_allows():
    from quant.triton_kernels import block_n_for

    assert block_n_for(7168, 1, 132) == 32  # OPT-30B hidden at decode on an H100: 224 programs
    assert block_n_for(28672, 1, 132) == 64  # fc1: 448 programs at 64 already
    assert block_n_for(1024, 1, 132) == 16  # narrow outputs go to the kernel's smallest tile
    assert block_n_for(8192, 1, 132) == 32 and block_n_for(8192, 1, 108) == 64  # H100, A100
    assert block_n_for(7168, 4, 132) == 64  # 64 rows in 16-row blocks: 448 programs
