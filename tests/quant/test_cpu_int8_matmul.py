"""The int8 x 4-bit CPU kernel (quant/cpu_int8_matmul.py) against two references.

- The kernel's own arithmetic, recomputed in float64 from the same rounded x (x's blocks rounded
  in fp32 as the module says: step = max|x| / 127, round half to even): equal up to fp32
  accumulation, which checks every layout's indexing (split halves, adjacent pairs, fp32 minimums,
  each x block size).
- `F.linear(x, dequantize(w))`: within `error_bound` (each x moves by at most half its step, times
  |w - zero|) plus the same fp32 slack.
A NaN or an infinity in x gives NaN outputs; a kernel that cannot be built is refused or skipped
by the engine, never half-used.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from quant import QuantConfig, dequantize, quantize, quantized_linear
from quant import cpu_int8_matmul as k8
from quant import cpu_kernels
from quant.cpu_kernels import ISA_ENV, ISA_PATHS, Kernel, missing_cpu_flags

needs_kernel = pytest.mark.skipif(not k8.available(), reason=f"int8 kernel not available: {k8.unavailable_reason()}")
U_FP32 = 2.0**-24


LAYOUTS = ("line", "pairs", "group")  # split halves of each line, adjacent pairs, split halves of each group


def _weight(n: int, k: int, group: int, seed: int, layout: str = "line", minimum_fp32: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    return quantize(w, QuantConfig(bits=4, group_size=group, adjacent_pairs=layout == "pairs",
                                   group_halves=layout == "group", minimum_fp32=minimum_fp32))


def _zero(q) -> torch.Tensor:
    """float64 [N, K]: each value's group's zero (the value of code 8)."""
    n = q.shape[0]
    zero = q.minimum.double().view(n, -1) + 8 * q.scale.double().view(n, -1)
    return zero.repeat_interleave(q.config.group_size, 1)


def _rounded_x(x: torch.Tensor, block: int, planes: int) -> torch.Tensor:
    """float64 x as the kernel rounds it, in fp32 as quant/csrc/q4_int8_gemm.c does: per block,
    step = max|x| / 127, codes round(x * (127 / max|x|)); with two planes also the residual
    x - codes * step, rounded with step / 254 (codes round(residual * (127 / max|x| * 254)))."""
    xf = x.float().reshape(-1, x.shape[-1])
    blocks = xf.view(xf.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    step = amax / 127
    codes = torch.round(blocks * inverse).clamp(-127, 127)  # torch.round: half to even
    rounded = codes.double() * step.double()
    if planes == 2:
        residual = blocks - codes * step
        fine = torch.round(residual * (inverse * 254)).clamp(-127, 127)
        rounded = rounded + fine.double() * (step / 254).double()
    return rounded.view_as(xf)


def _fp32_slack(x: torch.Tensor, q) -> torch.Tensor:
    """A bound on fp32 accumulation: (K + 3 * groups + 16) * u * sum_k |x| (|w - zero| + |zero|)."""
    xf = x.reshape(-1, x.shape[-1]).double().abs()
    w = dequantize(q, torch.float64)
    zero = _zero(q)
    terms = xf @ ((w - zero).abs() + zero.abs()).T
    k = q.shape[1]
    return (k + 3 * k // q.config.group_size + 16) * U_FP32 * terms + 1e-30


# (N, K, group, code layout, fp32 minimums): 8-row panels and rows left over (13, 21), each x block size
CASES = [(96, 64, 64, "line", False), (64, 128, 32, "line", False), (40, 256, 128, "pairs", False),
         (72, 320, 64, "pairs", True), (16, 1024, 256, "line", True), (8, 192, 64, "line", False),
         (13, 128, 32, "pairs", False), (21, 256, 64, "line", True), (48, 192, 32, "group", False),
         (13, 256, 64, "group", True), (24, 512, 128, "group", False), (9, 256, 128, "group", True)]


@needs_kernel
@pytest.mark.parametrize("n,k,group,layout,m32", CASES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("planes", [1, 2])
def test_kernel_is_its_stated_arithmetic(n, k, group, layout, m32, rows, planes):
    q = _weight(n, k, group, seed=n + k + rows, layout=layout, minimum_fp32=m32)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    got = k8.int8_linear(x, q, planes=planes).double()
    zero = _zero(q)
    centred = dequantize(q, torch.float64) - zero  # scale * (code - 8)
    expected = _rounded_x(x, k8.x_block(q), planes) @ centred.T + x.double() @ zero.T
    assert (got - expected).abs().le(_fp32_slack(x, q)).all()


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_beyond_one_sweep_equal_the_rows_alone(layout):
    """More rows of x than one sweep over the weight holds (256 KiB of int8 x: 128 rows at K = 2048),
    so every panel is packed once and reused across sweeps: the stated arithmetic, and each row bit
    for bit what it is 4 rows at a time (one sweep; a row's sums run in the same order however many
    rows share a panel)."""
    k = 2048
    q = _weight(27, k, 64, seed=11, layout=layout)  # 3 panels of 8 rows and 3 rows left over
    x = torch.randn(2 * (256 * 1024 // k) + 8, k, generator=torch.Generator().manual_seed(12))  # 3 sweeps
    got = k8.int8_linear(x, q)
    zero = _zero(q)
    expected = _rounded_x(x, k8.x_block(q), 1) @ (dequantize(q, torch.float64) - zero).T + x.double() @ zero.T
    assert (got.double() - expected).abs().le(_fp32_slack(x, q)).all()
    assert torch.equal(got, torch.cat([k8.int8_linear(x[i:i + 4], q) for i in range(0, len(x), 4)]))


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_thread_count_gives_the_same_bits(layout):
    """The kernel splits the output columns into ranges its OpenMP threads take in turn, and x's rows
    into per-thread shares for rounding: neither split changes a value's arithmetic, so 1, 2 and 3
    threads give the same bits (decode-sized and multi-sweep x, panels and rows left over). `make
    test` runs with one thread per worker: this test sets the counts itself."""
    q = _weight(8 * 13 + 5, 1024, 64, seed=5, layout=layout)
    previous = torch.get_num_threads()
    try:
        for rows in (6, 2 * (256 * 1024 // 1024) + 3):
            x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
            outputs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outputs.append(k8.int8_linear(x, q, planes=2 if rows == 6 else 1))
            assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), k_units=st.integers(1, 6), group=st.sampled_from([32, 64, 128]),
       rows=st.integers(0, 7), layout=st.sampled_from(LAYOUTS), m32=st.booleans(), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 50.0]), planes=st.sampled_from([1, 2]))
def test_within_the_rounding_bound_of_dequantize_and_matmul(n, k_units, group, rows, layout, m32, seed, spread,
                                                            planes):
    k = 64 * k_units * (2 if group == 128 else 1)
    q = _weight(n, k, group, seed, layout, m32)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g) * spread * torch.rand(rows, 1, generator=g)
    x[:, ::7] *= 20  # outlier channels, as in real activations
    got = k8.int8_linear(x, q, planes=planes).double()
    exact = x.double() @ dequantize(q, torch.float64).T
    assert got.shape == (rows, n)
    assert (got - exact).abs().le(k8.error_bound(x, q, planes) + _fp32_slack(x, q)).all()


@needs_kernel
def test_bias_dtype_and_leading_dimensions():
    q = _weight(64, 128, 64, seed=3)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5))
    plain = k8.int8_linear(x, q)
    assert plain.shape == (2, 3, 64) and plain.dtype == torch.float32
    torch.testing.assert_close(k8.int8_linear(x, q, bias), plain + bias, rtol=0, atol=1e-6)
    half = k8.int8_linear(x.bfloat16(), q)
    assert half.dtype == torch.bfloat16
    # bf16 x is widened exactly, computed as fp32 and rounded once
    assert torch.equal(half, k8.int8_linear(x.bfloat16().float(), q).bfloat16())
    assert k8.int8_linear(torch.empty(0, 128), q).shape == (0, 64)


@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("planes", [1, 2])
def test_a_non_finite_x_gives_nan_never_a_finite_number(bad, planes):
    q = _weight(32, 128, 64, seed=6)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))
    x[1, 70] = bad
    y = k8.int8_linear(x, q, planes=planes)
    assert y[1].isnan().all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


@needs_kernel
def test_quantized_linear_uses_the_kernel_only_inside_int8_mode():
    q = _weight(64, 256, 64, seed=8)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(9))
    exact = F.linear(x, dequantize(q, torch.float32))
    assert torch.equal(quantized_linear(x, q), exact)  # the default: dequantize + matmul
    with k8.cpu_matmul_mode("int8"):
        assert torch.equal(quantized_linear(x, q), k8.int8_linear(x, q))
        with k8.cpu_matmul_mode("dequantize"):
            assert torch.equal(quantized_linear(x, q), exact)
    with k8.cpu_matmul_mode("int8x2"):  # two planes at decode row counts, exact above
        assert torch.equal(quantized_linear(x, q), k8.int8_linear(x, q, planes=2))
        many = torch.randn(k8.INT8X2_MAX_ROWS + 1, 256)
        assert torch.equal(quantized_linear(many, q), F.linear(many, dequantize(q, torch.float32)))
        # a shape the kernel does not cover (K not a multiple of 64) keeps the exact path
        odd = _weight(8, 96, 32, seed=10)
        xo = torch.randn(2, 96)
        assert not k8.covers(xo, odd)
        assert torch.equal(quantized_linear(xo, odd), F.linear(xo, dequantize(odd, torch.float32)))
    assert torch.equal(quantized_linear(x, q), exact)  # the mode does not leak out of the block
    with pytest.raises(ValueError, match="cpu_matmul_mode"):
        with k8.cpu_matmul_mode("fast"):
            pass


def test_a_kernel_that_cannot_be_built_says_why(monkeypatch, tmp_path):
    """Fault injected: a compiler that fails. The kernel is unavailable with the compiler's words;
    the engine's "auto" then computes by dequantizing and "int8" is one clear error."""
    from flexsarathi.engine.llm_engine import resolve_cpu_matmul
    from flexsarathi.errors import FlexSarathiError

    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error: no such compiler today' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setenv("FLEXSARATHI_KERNEL_CACHE", str(tmp_path / "kernels"))
    k8.KERNEL.reset()
    try:
        assert not k8.available()
        reason = k8.unavailable_reason()
        assert "failed" in reason or "AVX2" in reason or "machine" in reason
        if "failed" in reason:
            assert "no such compiler today" in reason
        assert resolve_cpu_matmul("auto") == "dequantize"
        for mode in ("int8", "int8x2"):
            with pytest.raises(FlexSarathiError, match=f"cpu_matmul='{mode}'.*not available"):
                resolve_cpu_matmul(mode)
        with pytest.raises(FlexSarathiError, match="cpu_matmul='fastest'"):
            resolve_cpu_matmul("fastest")
        assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built is left to load
    finally:
        monkeypatch.undo()
        k8.KERNEL.reset()
    assert resolve_cpu_matmul("dequantize") == "dequantize"


def test_group_halves_beyond_128_are_left_to_the_dequantizing_path():
    """Group halves of 256: a 64-code chunk holds codes q and q + 128, two x blocks: not covered,
    so quantized_linear dequantizes instead (exact)."""
    q = _weight(8, 512, 256, seed=5, layout="group")
    x = torch.randn(3, 512)
    assert not k8.covers(x, q) and k8.covers(x, _weight(8, 512, 128, seed=5, layout="group"))
    with k8.cpu_matmul_mode("int8"):
        assert torch.equal(quantized_linear(x, q), torch.nn.functional.linear(x, dequantize(q)))


# ---- instruction paths: AVX-512 VNNI and AVX-VNNI give the AVX2 path's bits -----------------------

VNNI_PATHS = [p for p in ISA_PATHS if p != "avx2"]


def _path_or_skip(isa: str):
    """The kernel on `isa`, or a skip naming the CPU flags this machine lacks for it (and AVX2's)."""
    for name in ("avx2", isa):
        missing = missing_cpu_flags(ISA_PATHS[name])
        if missing:
            pytest.skip(f"this CPU lacks {', '.join(missing)} (the {name} path)")
    kernel = k8.kernel_for(isa)
    if not kernel.available():
        pytest.skip(f"the {isa} path did not load: {kernel.unavailable_reason()}")
    return kernel


@pytest.mark.parametrize("isa", VNNI_PATHS)
@pytest.mark.parametrize("n,k,group,layout,m32", CASES + [(40, 2048, 64, "line", False), (24, 2048, 32, "pairs", True),
                                                          (56, 2048, 128, "group", False)])
def test_every_path_gives_the_avx2_paths_bits(isa, n, k, group, layout, m32):
    """Exact integer block sums, then the same fp32 operations per output: the VNNI paths' outputs
    equal the AVX2 path's bit for bit, at row counts that take the row-by-row tiles (1-3), the
    panels (an odd count of them: the 512-bit path's pairs and one alone; rows 4 and up) and, at K =
    2048, more than one sweep (every panel packed up front), for 1 and 2 planes and 1 and 2 threads."""
    _path_or_skip(isa)
    q = _weight(n, k, group, seed=n + k, layout=layout, minimum_fp32=m32)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 3, 4, 6, 13) + ((2 * (256 * 1024 // k) + 5,) if k == 2048 else ()):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + threads)) * 3
                for planes in (1, 2):
                    want = k8.int8_linear(x, q, planes=planes, isa="avx2")
                    got = k8.int8_linear(x, q, planes=planes, isa=isa)
                    assert torch.equal(got, want), (rows, planes, threads, (got - want).abs().max())
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m32", [False, True])
def test_panels_whose_zeros_are_all_0_give_the_stated_arithmetic_on_every_path(layout, m32):
    """GGUF Q4_0's minimum is -8 * scale, so every zero (the value of code 8) is 0 and the kernel
    leaves the zero's term out of a panel whose rows' zeros are all 0: rows 0-15 and 32-47 here
    (a 512-bit path's panel pair; the AVX2 path's panels of 8), rows 16-31 keep one nonzero zero,
    and the rows left over (48-52) go row by row. Each output is the stated arithmetic, the same bits
    on every path this CPU has, and the same bits 4 rows at a time."""
    k = 512
    q = _weight(53, k, 32, seed=21, layout=layout, minimum_fp32=m32)
    zeroed = torch.cat([torch.arange(0, 16), torch.arange(16, 32)[1:], torch.arange(32, 53)])
    q.minimum.view(53, -1)[zeroed] = (-8 * q.scale.view(53, -1)[zeroed].float()).to(q.minimum.dtype)
    zero = _zero(q)
    assert zero[torch.arange(0, 16)].eq(0).all() and zero[16].ne(0).any()
    x = torch.randn(2 * (256 * 1024 // k) + 8, k, generator=torch.Generator().manual_seed(22)) * 3  # 3 sweeps
    for rows in (6, len(x)):
        got = k8.int8_linear(x[:rows], q)
        expected = (_rounded_x(x[:rows], k8.x_block(q), 1) @ (dequantize(q, torch.float64) - zero).T
                    + x[:rows].double() @ zero.T)
        assert (got.double() - expected).abs().le(_fp32_slack(x[:rows], q)).all()
        for isa in VNNI_PATHS:
            if not missing_cpu_flags(ISA_PATHS[isa]):
                assert torch.equal(k8.int8_linear(x[:rows], q, isa=isa), k8.int8_linear(x[:rows], q, isa="avx2"))
    assert torch.equal(got, torch.cat([k8.int8_linear(x[i:i + 4], q) for i in range(0, len(x), 4)]))


@pytest.mark.parametrize("isa", VNNI_PATHS)
def test_a_vnni_path_gives_nan_for_a_non_finite_x(isa):
    _path_or_skip(isa)
    q = _weight(24, 256, 64, seed=3)
    x = torch.randn(6, 256)
    x[2, 100] = float("inf")
    got = k8.int8_linear(x, q, isa=isa)
    assert got[2].isnan().all() and got[[0, 1, 3, 4, 5]].isfinite().all()
    assert torch.equal(got.nan_to_num(), k8.int8_linear(x, q, isa="avx2").nan_to_num())


def test_the_path_is_chosen_by_the_cpu_flags_or_forced(monkeypatch, tmp_path):
    """Default: the best path this CPU's flags allow; $FLEXSARATHI_INT8_ISA forces one (so the AVX2
    path runs on a VNNI machine too); a forced path whose flags are missing (injected: a CPU without
    avx512_vnni) is unavailable with the flags named; an unknown name is one clear error."""
    monkeypatch.setenv("FLEXSARATHI_KERNEL_CACHE", str(tmp_path / "kernels"))
    kernel = Kernel("int8 test", k8.SOURCE, k8.KERNEL.signatures, isa_paths=True)
    best = next((p for p, path in ISA_PATHS.items() if not missing_cpu_flags(path)), None)
    if best is None:
        pytest.skip("this CPU has none of the paths' flags (avx2, fma, f16c)")
    assert kernel.isa_name() == best
    monkeypatch.setenv(ISA_ENV, "avx2")
    kernel.reset()
    assert kernel.isa_name() == "avx2"
    without_vnni = frozenset(cpu_kernels.cpu_flags() or ()) - {"avx512_vnni"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: without_vnni)
    monkeypatch.setenv(ISA_ENV, "avx512_vnni")
    kernel.reset()
    assert not kernel.available() and "avx512_vnni" in kernel.unavailable_reason()
    monkeypatch.setenv(ISA_ENV, "avx1024")
    kernel.reset()
    with pytest.raises(ValueError, match="FLEXSARATHI_INT8_ISA='avx1024'"):
        kernel.available()
