"""The compressed-KV decode attention kernel (quant/cpu_kv_attention.py) against the exact softmax,
in fp64, over the context the gather route builds from the same tables: quantized blocks read back
through quant.groupwise.dequantize, the open block's full-precision keys, the pass's new row; for
any block table, visible range (sliding windows, nothing visible), GQA and split over threads."""
from __future__ import annotations

import pytest
import torch

from quant import QuantConfig, cpu_kv_attention, dequantize, quantize

needs_kernel = pytest.mark.skipif(not cpu_kv_attention.available(),
                                  reason=f"kernel not available: {cpu_kv_attention.unavailable_reason()}")


def _tables(q, rows: int) -> dict[str, torch.Tensor]:
    return {"data": q.data.view(rows, -1), "scale": q.scale.view(rows, -1), "minimum": q.minimum.view(rows, -1)}


def _case(gen, batch, heads, kv_heads, d, bs, group, length):
    """Random pool tables and one decode step's inputs; the fp64 context each sequence sees."""
    num_blocks = batch * -(-length // bs) + 2
    keys = torch.randn(num_blocks, kv_heads, d, bs, generator=gen) * torch.linspace(0.1, 4, d)[:, None]
    kq = quantize(keys, QuantConfig(bits=4, group_size=bs))
    k_blocks = dequantize(kq, torch.float32).permute(0, 3, 1, 2)  # [blocks, bs, H, d] as stored
    num_slots = num_blocks * bs
    vq = quantize(torch.randn(num_slots, kv_heads, d, generator=gen) * 2 + 0.5, QuantConfig(bits=4, group_size=group))
    values = dequantize(vq, torch.float32)  # [slots, H, d]
    per_seq = -(-length // bs)
    blocks = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)
    j = torch.arange(length)
    slots = blocks[:, j // bs] * bs + j % bs  # block-aligned, as the block manager hands them out
    k_open = torch.randn(batch + 1, bs, kv_heads, d, generator=gen)
    residual_ids = torch.randperm(batch + 1, generator=gen)[:batch]
    complete_len = torch.randint(0, length + 1, (batch,), generator=gen) // bs * bs
    hi = torch.randint(1, length + 1, (batch,), generator=gen)
    lo = torch.minimum(torch.randint(0, length, (batch,), generator=gen), hi - 1)
    lo[0], hi[-1] = 0, length
    new_pos = torch.where(torch.rand(batch, generator=gen) < 0.8, hi - 1, torch.full((batch,), -1))
    k_new, v_new = (torch.randn(batch, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(batch, heads, d, generator=gen)
    context_k = torch.where((j[None, :] < complete_len[:, None])[..., None, None], k_blocks[blocks[:, j // bs], j % bs],
                            k_open[residual_ids][:, j % bs])
    context_v = values[slots].clone()
    for b in range(batch):
        if new_pos[b] >= 0:
            context_k[b, new_pos[b]], context_v[b, new_pos[b]] = k_new[b], v_new[b]
    inputs = dict(k_codes=_tables(kq, num_blocks), blocks=blocks, complete_len=complete_len, k_open=k_open,
                  residual_ids=residual_ids, v_codes=_tables(vq, num_slots), slots=slots, value_group=group, q=q,
                  visible=(lo, hi), new=(k_new, v_new, new_pos))
    return inputs, context_k, context_v


def _exact(q, context_k, context_v, lo, hi, scale):
    """fp64 softmax attention of each query head over keys [lo, hi) (GQA: head h reads KV head h // group)."""
    batch, heads, d = q.shape
    group = heads // context_k.shape[2]
    out, lse = torch.zeros(batch, heads, d, dtype=torch.float64), torch.full((batch, heads), float("-inf"),
                                                                             dtype=torch.float64)
    for b in range(batch):
        if hi[b] <= lo[b]:
            continue
        k = context_k[b, lo[b]:hi[b]].double().repeat_interleave(group, 1)  # [n, heads, d]
        v = context_v[b, lo[b]:hi[b]].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        lse[b] = torch.logsumexp(scores, -1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)
    return out, lse


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d,bs,group,length", [(4, 4, 16, 16, 16, 37), (8, 2, 32, 64, 16, 150),
                                                              (2, 1, 8, 4, 8, 9), (32, 32, 128, 64, 64, 144),
                                                              (6, 3, 64, 8, 32, 70), (2, 2, 10, 2, 2, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_exact_attention_over_the_gathered_context(heads, kv_heads, d, bs, group, length, threads):
    gen = torch.Generator().manual_seed(d * 31 + length)
    inputs, context_k, context_v = _case(gen, 5, heads, kv_heads, d, bs, group, length)
    scale = d ** -0.5
    out, lse = _on_threads(threads, lambda: cpu_kv_attention.decode_attention(**inputs, scale=scale))
    _assert_exact(out, lse, _exact(inputs["q"], context_k, context_v, *inputs["visible"], scale), (5, heads, d))


def _on_threads(threads: int, call):
    """call() with torch (and so the kernel's OpenMP team) on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(previous)


def _assert_exact(out, lse, want, shape):
    """The kernel's fp32 (out, lse) against fp64 `want`: fp32 sums of ~d * length products, a
    relative 1e-5 of the values' scale."""
    want_out, want_lse = want
    assert out.dtype == lse.dtype == torch.float32 and out.shape == shape
    assert torch.allclose(out.double(), want_out, rtol=1e-5, atol=1e-5 * want_out.abs().max().item())
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_query_that_sees_nothing_gets_zero_and_minus_infinity():
    gen = torch.Generator().manual_seed(3)
    inputs, _, _ = _case(gen, 3, 4, 2, 16, 16, 16, 20)
    inputs["visible"] = (torch.tensor([5, 0, 7]), torch.tensor([5, 20, 2]))
    out, lse = cpu_kv_attention.decode_attention(**inputs, scale=0.25)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 4, 16)) and bool(torch.isneginf(lse[[0, 2]]).all())
    assert bool(torch.isfinite(lse[1]).all())


def test_covers_only_what_it_computes():
    k, v = QuantConfig(bits=4, group_size=64), QuantConfig(bits=4, group_size=64)
    assert cpu_kv_attention.covers(k, v, 128, torch.float32) == cpu_kv_attention.available()
    assert not cpu_kv_attention.covers(k, v, 128, torch.bfloat16)
    assert not cpu_kv_attention.covers(k, v, 80, torch.float32)  # V's lines padded past the head
    assert not cpu_kv_attention.covers(QuantConfig(bits=8, group_size=64), v, 128, torch.float32)
    assert not cpu_kv_attention.covers(k, QuantConfig(bits=4, group_size=64, symmetric=True), 128, torch.float32)


# ---- plain pools (K and V in the compute dtype, read in place) ----------------------------------


def _plain_case(gen, batch, heads, kv_heads, d, length, dtype):
    """A plain pool layer [slots, 2, H, d] in `dtype`, block-aligned slot tables, one decode step's
    inputs; the context each sequence sees (its new row where it has one), widened to fp32."""
    num_slots = batch * length + 8
    kv = (torch.randn(num_slots, 2, kv_heads, d, generator=gen) * 3).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:batch * length].view(batch, length)
    hi = torch.randint(1, length + 1, (batch,), generator=gen)
    lo = torch.minimum(torch.randint(0, length, (batch,), generator=gen), hi - 1)
    lo[0], hi[-1] = 0, length
    new_pos = torch.where(torch.rand(batch, generator=gen) < 0.7, hi - 1, torch.full((batch,), -1))
    # the new rows as the pool would store them: representable in its dtype
    k_new, v_new = (torch.randn(batch, kv_heads, d, generator=gen).to(dtype).float() for _ in range(2))
    q = torch.randn(batch, heads, d, generator=gen)
    context_k, context_v = kv[slots, 0].float(), kv[slots, 1].float()  # [B, L, H, d]
    for b in range(batch):
        if new_pos[b] >= 0:
            context_k[b, new_pos[b]], context_v[b, new_pos[b]] = k_new[b], v_new[b]
    return (kv, slots, q, (lo, hi), (k_new, v_new, new_pos)), context_k, context_v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,length", [(4, 4, 16, 37), (8, 2, 32, 150), (2, 1, 8, 9),
                                                     (32, 32, 64, 140), (6, 3, 128, 70)])
@pytest.mark.parametrize("threads", [1, 2])
def test_plain_pool_equals_exact_attention_over_the_gathered_context(dtype, heads, kv_heads, d, length, threads):
    gen = torch.Generator().manual_seed(d * 17 + length)
    args, context_k, context_v = _plain_case(gen, 5, heads, kv_heads, d, length, dtype)
    scale = d ** -0.5
    out, lse = _on_threads(threads, lambda: cpu_kv_attention.plain_decode_attention(*args, scale))
    _assert_exact(out, lse, _exact(args[2], context_k, context_v, *args[3], scale), (5, heads, d))


@needs_kernel
def test_plain_pool_bits_do_not_depend_on_threads_or_on_the_other_sequences():
    """Each sequence's output is summed in one fixed order: alone, in a batch, on 1 or 2 threads (a
    sequence alone on 2 threads has its KV heads split between them)."""
    gen = torch.Generator().manual_seed(11)
    (kv, slots, q, (lo, hi), (k_new, v_new, pos)), _, _ = _plain_case(gen, 6, 8, 2, 64, 90, torch.bfloat16)
    out, lse = _on_threads(2, lambda: cpu_kv_attention.plain_decode_attention(kv, slots, q, (lo, hi),
                                                                              (k_new, v_new, pos), 0.125))
    for b in range(6):
        one = slice(b, b + 1)
        for threads in (1, 2):
            out_b, lse_b = _on_threads(threads, lambda: cpu_kv_attention.plain_decode_attention(
                kv, slots[one], q[one], (lo[one], hi[one]), (k_new[one], v_new[one], pos[one]), 0.125))
            assert torch.equal(out_b[0], out[b]) and torch.equal(lse_b[0], lse[b])


@needs_kernel
def test_plain_pool_query_that_sees_nothing_gets_zero_and_minus_infinity():
    gen = torch.Generator().manual_seed(5)
    (kv, slots, q, _, new), _, _ = _plain_case(gen, 3, 4, 2, 16, 20, torch.float32)
    out, lse = cpu_kv_attention.plain_decode_attention(kv, slots, q, (torch.tensor([5, 0, 7]), torch.tensor([5, 20, 2])),
                                                       new, 0.25)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 4, 16)) and bool(torch.isneginf(lse[[0, 2]]).all())
    assert bool(torch.isfinite(lse[1]).all())


def test_plain_pool_covers_only_what_it_computes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_kv_attention.covers_plain(dtype, 64) == cpu_kv_attention.available()
        assert not cpu_kv_attention.covers_plain(dtype, 60)  # 8 channels per step
    assert not cpu_kv_attention.covers_plain(torch.float64, 64)
    if cpu_kv_attention.available():
        with pytest.raises(ValueError, match="not a case this kernel covers"):
            cpu_kv_attention.plain_decode_attention(torch.zeros(4, 2, 2, 12), torch.zeros(1, 2, dtype=torch.long),
                                                    torch.zeros(1, 2, 12), (torch.zeros(1), torch.ones(1)),
                                                    (torch.zeros(1, 2, 12), torch.zeros(1, 2, 12),
                                                     torch.full((1,), -1)), 1.0)
