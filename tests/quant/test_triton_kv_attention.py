"""The compressed-KV decode attention Triton kernel (quant/triton_kv_attention.py) against the exact
softmax in fp64 over the context the gather route builds from the same tables (the cases of
tests/quant/test_cpu_kv_attention.py), run in Triton's interpreter on CPU tensors: the kernel's
indexing (each block's split-half channel lines, the V line's halves and groups, the open block,
the new rows at their source rows, the visible range, GQA, padded heads and tiles) is checked
without a GPU. tests/offload/test_cuda.py runs it compiled, end to end."""
from __future__ import annotations

from quant import QuantConfig
from tests.triton_interpreter import needs_triton, run_interpreted, without_a_gpu


# Runs under TRITON_INTERPRET=1, which must be set before triton is imported: hence a subprocess.
_SCRIPT = """
    import torch
    from quant import triton_kv_attention
    from tests.quant.test_cpu_kv_attention import _assert_exact, _case, _exact

    def as_rows(inputs, gen, dtype, strided):
        # the new rows as rows of the pass's K (T > B rows, in another order; strided as the fused qkv
        # output's K) and of its V codes, with src and position per sequence; the values they read as
        from quant import QuantConfig, quantize, dequantize
        k_new, _, new_pos = inputs.pop("new")
        batch, kv_heads, d = k_new.shape
        src = torch.randperm(batch + 3, generator=gen)[:batch]
        width = 3 if strided else 1
        k_rows = torch.randn(batch + 3, width, kv_heads, d, generator=gen)
        k_rows[src, 0] = k_new
        k_rows = k_rows.to(dtype)[:, 0]
        v_codes = quantize(torch.randn(batch + 3, kv_heads, d, generator=gen) * 3,
                           QuantConfig(bits=4, group_size=inputs["value_group"]))
        v_rows = dequantize(v_codes, torch.float32)
        tables = {"data": v_codes.data.view(batch + 3, -1), "scale": v_codes.scale.view(batch + 3, -1),
                  "minimum": v_codes.minimum.view(batch + 3, -1)}
        src = torch.where(new_pos >= 0, src, torch.full_like(src, -1))
        return (k_rows, tables, src, new_pos), v_rows

    cases = [(4, 4, 16, 16, 16, 37), (8, 2, 32, 64, 16, 150), (2, 1, 8, 4, 8, 9), (32, 32, 128, 64, 64, 144),
             (6, 3, 64, 8, 32, 70), (2, 2, 10, 2, 2, 5), (12, 4, 80, 16, 16, 40)]
    for n, (heads, kv_heads, d, bs, group, length) in enumerate(cases):
        dtype = torch.float16 if n % 2 else torch.float32  # the pool's and the pass's dtype
        gen = torch.Generator().manual_seed(d * 31 + length)
        inputs, context_k, context_v = _case(gen, 5, heads, kv_heads, d, bs, group, length)
        scale, j = d ** -0.5, torch.arange(length)
        if n == 0:  # without new rows: the keys each query sees stop before its new row's position
            lo, hi = inputs["visible"]
            new_pos = inputs.pop("new")[2]
            inputs["visible"] = (lo, torch.where(new_pos >= 0, new_pos, hi))
            out, lse = triton_kv_attention.decode_attention(**inputs, new_rows=None, scale=scale)
            _assert_exact(out, lse, _exact(inputs["q"], context_k, context_v, *inputs["visible"], scale), (5, heads, d))
            continue
        strided = n % 3 == 0
        new_rows, v_rows = as_rows(inputs, gen, dtype, strided)
        inputs["k_open"], inputs["q"] = inputs["k_open"].to(dtype), inputs["q"].to(dtype)
        if strided:  # q as the fused qkv output's: its rows further apart than its heads (read in place)
            wide = torch.randn(5, heads + 2 * kv_heads, d, generator=gen).to(dtype)
            wide[:, :heads] = inputs["q"]
            inputs["q"] = wide[:, :heads]
            assert not inputs["q"].is_contiguous()
        # the reference reads the same numbers: open keys and new rows as rounded to dtype
        opened = (j[None, :] >= inputs["complete_len"][:, None])[..., None, None]
        context_k = torch.where(opened, inputs["k_open"].float()[inputs["residual_ids"]][:, j % bs], context_k)
        k_rows, _, src, new_pos = new_rows
        for b in range(5):
            if new_pos[b] >= 0:
                context_k[b, new_pos[b]], context_v[b, new_pos[b]] = k_rows[src[b]].float(), v_rows[src[b]]
        out, lse = triton_kv_attention.decode_attention(**inputs, new_rows=new_rows, scale=scale)
        _assert_exact(out, lse, _exact(inputs["q"].float(), context_k, context_v, *inputs["visible"], scale),
                      (5, heads, d))
        if strided:  # the same bits as from a contiguous copy of q
            packed = triton_kv_attention.decode_attention(**{**inputs, "q": inputs["q"].contiguous()},
                                                          new_rows=new_rows, scale=scale)
            assert torch.equal(out, packed[0]) and torch.equal(lse, packed[1])
        # new values the pool holds already (stored before attention): read from the pool at their slot, the
        # same bits as the same codes given as the pass's rows
        slot = inputs["slots"][torch.arange(5), new_pos.clamp_min(0)]
        pool_rows = {name: table[slot] for name, table in inputs["v_codes"].items()}
        k_at_src = torch.zeros(5, *k_rows.shape[1:], dtype=k_rows.dtype)
        k_at_src[new_pos >= 0] = k_rows[src[new_pos >= 0]]
        given = triton_kv_attention.decode_attention(**inputs, new_rows=(k_at_src, pool_rows, torch.arange(5), new_pos),
                                                     scale=scale)
        stored = triton_kv_attention.decode_attention(**inputs, new_rows=(k_at_src, None, torch.arange(5), new_pos),
                                                      scale=scale)
        assert all(torch.equal(a, b) for a, b in zip(given, stored))
    # nothing visible: out 0, lse -inf
    gen = torch.Generator().manual_seed(3)
    inputs, _, _ = _case(gen, 3, 4, 2, 16, 16, 16, 20)
    inputs.pop("new")
    inputs["visible"] = (torch.tensor([5, 0, 7]), torch.tensor([5, 20, 2]))
    out, lse = triton_kv_attention.decode_attention(**inputs, new_rows=None, scale=0.25)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 4, 16)) and bool(torch.isneginf(lse[[0, 2]]).all())
    assert bool(torch.isfinite(lse[1]).all())
    print("ok")
"""


@needs_triton
@without_a_gpu
def test_equals_exact_attention_over_the_gathered_context_in_the_interpreter():
    assert run_interpreted(_SCRIPT).strip().endswith("ok")


@needs_triton
def test_covers_only_what_it_computes():
    from quant import triton_kv_attention

    k, v = QuantConfig(bits=4, group_size=64), QuantConfig(bits=4, group_size=64)
    assert triton_kv_attention.covers(k, v, 128)
    assert not triton_kv_attention.covers(k, v, 80)  # V's lines padded past the head
    assert not triton_kv_attention.covers(QuantConfig(bits=8, group_size=64), v, 128)
    assert not triton_kv_attention.covers(k, QuantConfig(bits=4, group_size=64, symmetric=True), 128)
