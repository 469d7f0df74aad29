"""The V-rows quantize Triton kernel (quant/triton_quantize.py) against quant.groupwise.quantize, bit
for bit (codes, scales, minimums), run in Triton's interpreter on CPU tensors: lines of one to many
groups, heads that are not powers of two, fp32 / fp16 / bf16 inputs over nine decades, constant
groups, strided rows; and a non-finite or out-of-range group raises, or sets the caller's flag
without raising. A GPU runs the compiled kernel against torch's quantize (tests/offload/test_cuda.py)."""
from __future__ import annotations

from quant import QuantConfig
from tests.triton_interpreter import needs_triton, run_interpreted, without_a_gpu


_SCRIPT = """
    import warnings
    import torch
    from quant import QuantConfig, quantize
    from quant import triton_quantize
    warnings.simplefilter("ignore")  # numpy's warnings on the padding lanes' inf - inf
    gen = torch.Generator().manual_seed(0)
    for t, h, d, g in [(1, 1, 8, 8), (5, 2, 16, 16), (3, 4, 64, 64), (7, 2, 128, 64), (4, 3, 80, 16), (2, 2, 10, 2),
                       (6, 1, 128, 32), (3, 2, 96, 48), (40, 2, 32, 8)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            wide = torch.randn(t, h, 2 * d, generator=gen) * torch.logspace(-6, 3, t)[:, None, None]
            x = wide[..., :d].to(dtype) if dtype == torch.float32 else wide.to(dtype)[..., :d]  # strided rows
            if t == 40:  # heads of a fused projection's output: [T, H, d] whose rows are wider than H * d
                x = torch.randn(t, 3 * h * d, generator=gen).to(dtype)[:, h * d:2 * h * d].view(t, h, d)
            x[0, 0, :g] = 0.37  # a constant group
            x[-1, -1, :] = -1e-8
            config = QuantConfig(bits=4, group_size=g)
            want, got = quantize(x, config), triton_quantize.quantize_lines(x, config)
            for name in ("data", "scale", "minimum"):
                assert torch.equal(getattr(want, name), getattr(got, name)), (t, h, d, g, dtype, name)
            assert got.shape == want.shape and got.config == config
    # straight into a pool's tables at each token's slot: those rows hold quantize's bytes, the others stay
    for heads, dim, group in [(2, 16, 8), (3, 64, 64)]:
        config = QuantConfig(bits=4, group_size=group)
        x = torch.randn(5, heads, dim, generator=gen).half()
        tables = {"data": torch.full((9, heads * dim // 2), 7, dtype=torch.uint8),
                  "scale": torch.full((9, heads * dim // group), 3.0, dtype=torch.float16)}
        tables["minimum"] = tables["scale"].clone()
        before = {name: table.clone() for name, table in tables.items()}
        rows = torch.tensor([6, 0, 3, 8, 2])
        assert triton_quantize.quantize_lines(x, config, into=(tables, rows)) is None
        want = quantize(x, config)
        for name, table in tables.items():
            assert torch.equal(table[rows], getattr(want, name).view(5, -1)), name
            kept = torch.tensor([r not in rows.tolist() for r in range(9)])
            assert torch.equal(table[kept], before[name][kept]), name
    config = QuantConfig(bits=4, group_size=16)
    for bad in (float("nan"), float("inf"), 1e6):
        x = torch.randn(2, 2, 16)
        x[1, 0, 3] = bad
        try:
            triton_quantize.quantize_lines(x, config)
            raise AssertionError(f"{bad}: no error")
        except ValueError:
            pass
        flag = torch.zeros((), dtype=torch.bool)
        triton_quantize.quantize_lines(x, config, nonfinite=flag)
        assert bool(flag), bad
    flag = torch.zeros((), dtype=torch.bool)
    triton_quantize.quantize_lines(torch.randn(3, 2, 16) * 1000, config, nonfinite=flag)
    assert not bool(flag)
    print("ok")
"""


@needs_triton
@without_a_gpu
def test_the_same_bits_as_torchs_quantize_in_the_interpreter():
    assert run_interpreted(_SCRIPT).strip().endswith("ok")


@needs_triton
def test_covers_the_v_format_only():
    from quant import triton_quantize

    assert triton_quantize.covers(QuantConfig(bits=4, group_size=64), 128)
    assert not triton_quantize.covers(QuantConfig(bits=4, group_size=64), 80)  # groups do not tile the head
    assert not triton_quantize.covers(QuantConfig(bits=8, group_size=64), 128)
    assert not triton_quantize.covers(QuantConfig(bits=4, group_size=64, symmetric=True), 128)
    assert not triton_quantize.covers(QuantConfig(bits=4, group_size=64, minimum_fp32=True), 128)
