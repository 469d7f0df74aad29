"""`attend` against a naive fp64 softmax, and partial attentions merged exactly."""
from __future__ import annotations

import math

import pytest
import torch

from flexsarathi.models.attention import attend, attend_own_rows, attend_own_rows_by_block, merge_partial_attention


def naive(q, k, v, q_pos, kv_len, scale, offset=0, key_blocks=None):
    """Per sequence, row and head: softmax over the visible keys, in fp64. key_blocks: (size, rule)
    as attend's: only keys in blocks before the query's ("before") or in its own ("same")."""
    batch, n, heads, dim = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(batch, n, heads, dim, dtype=torch.float64)
    lse = torch.full((batch, n, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for i in range(n):
            p = int(q_pos[b, i])
            keys = [j for j in range(int(kv_len[b])) if offset + j <= p]
            if key_blocks is not None:
                size, rule = key_blocks
                keys = [j for j in keys if ((offset + j) // size == p // size) == (rule == "same")]
            if not keys:
                continue
            for h in range(heads):
                kh = k[b, keys, h // group].double()
                scores = kh @ q[b, i, h].double() * scale
                lse[b, i, h] = torch.logsumexp(scores, 0)
                out[b, i, h] = torch.softmax(scores, 0) @ v[b, keys, h // group].double()
    return out, lse


@pytest.mark.parametrize("kernel", ["matmul", "flash", "auto"])
@pytest.mark.parametrize("batch,n,heads,kv_heads,length,offset", [
    (3, 1, 4, 4, 9, 0),      # decodes
    (2, 5, 4, 2, 12, 0),     # prompt chunks, grouped-query
    (2, 20, 4, 2, 30, 0),    # a chunk long enough for the flash kernel under "auto"
    (2, 20, 4, 4, 12, 12),   # a later piece of the context: the first rows see no key
    (1, 300, 2, 1, 300, 0),  # more rows than one query block
])
def test_attend_matches_a_naive_softmax(kernel, batch, n, heads, kv_heads, length, offset):
    g = torch.Generator().manual_seed(batch * 100 + n)
    dim = 8
    q = torch.randn(batch, n, heads, dim, generator=g)
    k = torch.randn(batch, length, kv_heads, dim, generator=g)
    v = torch.randn(batch, length, kv_heads, dim, generator=g)
    kv_len = torch.tensor([length - 2 * b for b in range(batch)])
    q_pos = offset + kv_len[:, None] - n + torch.arange(n)[None, :]  # the last n tokens of each context
    out, lse = attend(q, k, v, q_pos, kv_len, dim ** -0.5, kv_pos_offset=offset, kernel=kernel)
    want_out, want_lse = naive(q, k, v, q_pos, kv_len, dim ** -0.5, offset)
    if offset:
        assert torch.isinf(want_lse).any()  # the case really has blind rows
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,n,heads,kv_heads", [(3, 7, 4, 4), (2, 40, 4, 2), (1, 300, 2, 1)])
def test_whole_prompts_in_one_causal_call_match_a_naive_softmax(dtype, batch, n, heads, kv_heads):
    """attend_own_rows: each sequence's keys are its own query rows (whole prompts)."""
    g = torch.Generator().manual_seed(batch * 100 + n)
    dim = 8
    q, k, v = (torch.randn(batch, n, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    q_pos, kv_len = torch.arange(n).expand(batch, n), torch.full((batch,), n)
    out = attend_own_rows(q, k, v, dim ** -0.5)
    want, _ = naive(q, k, v, q_pos, kv_len, dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("batch,n,heads,kv_heads,block", [(3, 20, 4, 4, 8), (2, 16, 4, 2, 8), (1, 5, 2, 1, 8),
                                                          (2, 70, 4, 2, 32)])
def test_whole_prompts_by_block_equal_the_two_key_rules_merged(batch, n, heads, kv_heads, block):
    """attend_own_rows_by_block: earlier blocks' keys as stored (here: other keys), the own block's
    exact, V shared: what attending "before" over k_before and "same" over k_same and merging gives."""
    g = torch.Generator().manual_seed(batch * 10 + n)
    dim = 8
    q = torch.randn(batch, n, heads, dim, generator=g)
    k_same, k_before, v = (torch.randn(batch, n, kv_heads, dim, generator=g) for _ in range(3))
    q_pos, kv_len = torch.arange(n).expand(batch, n), torch.full((batch,), n)
    parts = [attend(q, keys, v, q_pos, kv_len, dim ** -0.5, key_blocks=(block, rule), kernel="matmul")
             for keys, rule in ((k_before, "before"), (k_same, "same"))]
    want = merge_partial_attention(parts)
    got = attend_own_rows_by_block(q, k_before, k_same, v, block, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["matmul", "flash"])
@pytest.mark.parametrize("rule", ["before", "same"])
@pytest.mark.parametrize("offset,earlier", [(0, 30), (40, 30), (0, 0)])  # (0, 0): a first tile sees nothing "before"
def test_a_long_chunk_under_a_block_rule_matches_a_naive_softmax(kernel, rule, offset, earlier):
    """A chunk of more rows than one flash tile, under a compressed cache's block rules: each tile
    of query rows is attended against only the keys it sees (rows of a tile that see none, and a
    tile whose rows see none: out 0, lse -inf), as the naive softmax over the rule's keys."""
    g = torch.Generator().manual_seed(7)
    batch, n, heads, kv_heads, dim, size = 2, 150, 4, 2, 8, 64
    length = n + earlier  # earlier tokens of the sequence, then the chunk's own
    q = torch.randn(batch, n, heads, dim, generator=g)
    k = torch.randn(batch, length, kv_heads, dim, generator=g)
    v = torch.randn(batch, length, kv_heads, dim, generator=g)
    kv_len = torch.tensor([length, length - min(5, earlier)])
    q_pos = offset + kv_len[:, None] - n + torch.arange(n)[None, :]
    out, lse = attend(q, k, v, q_pos, kv_len, dim ** -0.5, kv_pos_offset=offset, key_blocks=(size, rule),
                      kernel=kernel)
    want_out, want_lse = naive(q, k, v, q_pos, kv_len, dim ** -0.5, offset, key_blocks=(size, rule))
    if rule == "before" and offset == 0:
        assert torch.isinf(want_lse).any()  # rows of a sequence's first block see no key under it
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["matmul", "flash"])
def test_bf16_attention_accumulates_in_fp32(kernel):
    """bf16 inputs: the error against fp64 on the same (rounded) inputs is the output's own
    rounding (half a bf16 ulp, 2^-9 relative), not an accumulation of bf16 roundings."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(shape, generator=g).to(torch.bfloat16)
               for shape in [(2, 24, 4, 64), (2, 200, 2, 64), (2, 200, 2, 64)])
    kv_len = torch.tensor([200, 150])
    q_pos = kv_len[:, None] - 24 + torch.arange(24)[None, :]
    out, lse = attend(q, k, v, q_pos, kv_len, 0.125, kernel=kernel)
    want_out, want_lse = naive(q, k, v, q_pos, kv_len, 0.125)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)
    assert ((out.double() - want_out).abs() <= want_out.abs() * 2 ** -8 + 1e-3).all()


def test_reused_buffers_do_not_leak_between_calls():
    """Host attention copies K/V into reused buffers: an earlier result must not change when a
    later, larger call runs, and a repeat must give the same bits."""
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 6, 4, 8, generator=g),
             torch.randn(2, 6, 4, 8, generator=g)]
    big = [torch.randn(4, 1, 4, 8, generator=g), torch.randn(4, 40, 4, 8, generator=g),
           torch.randn(4, 40, 4, 8, generator=g)]
    args = (torch.tensor([[5], [5]]), torch.tensor([6, 6]), 0.3)
    first, _ = attend(*small, *args)
    kept = first.clone()
    with torch.inference_mode():  # as the engine runs it; the buffers stay usable outside
        attend(*big, torch.full((4, 1), 39), torch.full((4,), 40), 0.3)
    assert torch.equal(first, kept)
    assert torch.equal(attend(*small, *args)[0], kept)


def test_partial_attentions_over_a_split_context_merge_to_the_whole():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k = torch.randn(2, 20, 2, 8, generator=g)
    v = torch.randn(2, 20, 2, 8, generator=g)
    kv_len = torch.tensor([20, 17])
    q_pos = kv_len[:, None] - 3 + torch.arange(3)[None, :]
    whole, _ = attend(q, k, v, q_pos, kv_len, 0.35)
    cut = 7  # keys [0, 7) in one tier, [7, L) in another
    first = attend(q, k[:, :cut], v[:, :cut], q_pos, torch.clamp(kv_len, max=cut), 0.35)
    second = attend(q, k[:, cut:], v[:, cut:], q_pos, kv_len - cut, 0.35, kv_pos_offset=cut)
    torch.testing.assert_close(merge_partial_attention([first, second]), whole, atol=1e-6, rtol=1e-5)
