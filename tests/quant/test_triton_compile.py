"""The KV cache's Triton kernels compiled for a T4 (sm_75), an A100 (sm_80) and an H100/H200 (sm_90)
without a GPU: Triton lowers them to PTX and its bundled ptxas to a cubin, with the compile-time
constants the launches use (quant/triton_kv_attention.py `constants`, quant/triton_quantize.py
`constants` and `OPTIONS`). The interpreter tests check what the kernels compute; this checks that
the compiler takes them as a GPU machine would, and that the quantize kernel divides as IEEE does
(`div.rn.f32`) with nothing fused into an fma (torch's bits). The GPU itself runs them in
tests/offload/test_cuda.py."""
from __future__ import annotations

import re

import pytest

from quant import QuantConfig
from tests.triton_interpreter import needs_triton

pytestmark = needs_triton
CAPABILITIES = [75, 80, 90]


def _compile(fn, signature: dict, constants: dict, capability: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("heads,dim,group,into_rows", [(32, 128, 64, True), (8, 64, 64, False), (4, 80, 16, False)])
def test_the_quantize_kernel_compiles_with_ieee_division_and_no_fma(capability, dtype, heads, dim, group, into_rows):
    from quant import triton_quantize

    signature = {"x_ptr": f"*{dtype}", "data_ptr": "*u8", "scale_ptr": "*fp16", "minimum_ptr": "*fp16",
                 "flag_ptr": "*u8", "rows_ptr": "*i64", "stride_row": "i64", "stride_head": "i64"}
    kernel = _compile(triton_quantize._quantize_kernel, signature,
                      triton_quantize.constants(QuantConfig(bits=4, group_size=group), heads, dim, into_rows),
                      capability, **triton_quantize.OPTIONS)
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    divisions = re.findall(r"\bdiv\.[a-z0-9.]+", ptx)
    assert divisions and all(d.startswith("div.rn.f32") or ".s" in d or ".u" in d for d in divisions), divisions
    assert not re.search(r"\bfma\.", ptx)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("heads,kv_heads,dim,bs,group,has_new", [
    (32, 32, 128, 64, 64, True), (32, 8, 128, 64, 64, True), (56, 8, 128, 64, 64, False), (12, 4, 80, 16, 16, True)])
def test_the_decode_attention_kernel_compiles(capability, heads, kv_heads, dim, bs, group, has_new):
    from quant import triton_kv_attention

    pointers = {"kd_ptr": "*u8", "ks_ptr": "*fp16", "km_ptr": "*fp16", "blocks_ptr": "*i64", "complete_ptr": "*i64",
                "open_ptr": "*fp16", "residual_ptr": "*i64", "vd_ptr": "*u8", "vs_ptr": "*fp16", "vm_ptr": "*fp16",
                "slots_ptr": "*i64", "lo_ptr": "*i64", "hi_ptr": "*i64", "k_new_ptr": "*fp16", "new_vd_ptr": "*u8",
                "new_vs_ptr": "*fp16", "new_vm_ptr": "*fp16", "new_src_ptr": "*i64", "new_pos_ptr": "*i64",
                "q_ptr": "*fp16", "out_ptr": "*fp16", "lse_ptr": "*fp32"}
    scalars = {"stride_blocks": "i64", "stride_slots": "i64", "stride_k_new": "i64", "stride_q": "i64", "scale": "fp32"}
    kernel = _compile(triton_kv_attention._decode_kernel, {**pointers, **scalars},
                      triton_kv_attention.constants(heads, kv_heads, dim, bs, group, has_new, has_new), capability)
    assert kernel.asm["cubin"]
