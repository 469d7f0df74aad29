"""Paged KV pools: what a stored value reads back as, for plain and compressed pools, in any
store order (one token at a time, chunks crossing block boundaries, interleaved sequences)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from offload.kv_cache import (KVCompression, KVPool, decode_in_pool_tiers, gathered_decodes,
                              gathered_plain_decodes)
from policy_search.model_spec import ModelSpec
from policy_search.working_set import PassTokens, working_set
from tests.live_bytes import LiveBytes

HEADS, DIM, BS = 2, 8, 4


def _pool(compression):
    return KVPool("cpu", 2, 12 * BS, HEADS, DIM, torch.float32, "cpu", block_size=BS,
                  compression=compression, num_residual=3)


@pytest.mark.parametrize("chunks", [[1] * 11, [3, 5, 3], [11], [4, 4, 3], [2, 7, 2]])
def test_compressed_pool_reads_complete_blocks_quantized_and_the_open_block_exactly(chunks):
    comp = KVCompression(bits=4, block_size=BS, value_group=8)
    pool = _pool(comp)
    gen = torch.Generator().manual_seed(0)
    length = sum(chunks)
    k = torch.randn(length, HEADS, DIM, generator=gen) * torch.linspace(0.1, 10, DIM)  # outlier channels
    v = torch.randn(length, HEADS, DIM, generator=gen)
    blocks = [5, 2, 9]  # this sequence's block table (pool blocks)
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(length)])
    other = torch.randn(3, HEADS, DIM, generator=gen)  # another sequence interleaved, residual row 0
    start = 0
    for n in chunks:
        pool.store(1, slots[start:start + n], k[start:start + n], v[start:start + n],
                   torch.full((n,), 2, dtype=torch.long))
        pool.store(1, torch.tensor([0, 1, 2]), other, other, torch.zeros(3, dtype=torch.long))
        start += n
    complete = length // BS * BS
    got_k, got_v = pool.gather(1, slots[None], torch.device("cpu"), torch.tensor([2]), torch.tensor([complete]))
    expected_k = torch.cat([pool.round_trip_k_blocks(k[:complete]), k[complete:]])
    torch.testing.assert_close(got_k[0], expected_k, atol=0, rtol=0)
    torch.testing.assert_close(got_v[0], pool.round_trip_v(v), atol=0, rtol=0)
    # Quantization is real: complete blocks differ from the input but stay within half a step
    # of their (per-channel, per-block) group.
    assert not torch.equal(got_k[0, :complete], k[:complete])
    groups = k[:complete].unflatten(0, (-1, BS))  # [nb, bs, heads, dim]
    step = (groups.amax(1) - groups.amin(1)) / 15  # [nb, heads, dim]
    err = (got_k[0, :complete] - k[:complete]).abs().unflatten(0, (-1, BS))
    assert bool((err <= step[:, None] * 0.5 * 1.01 + 1e-6).all())


def test_plain_pool_is_exact():
    pool = _pool(None)
    k, v = torch.randn(6, HEADS, DIM), torch.randn(6, HEADS, DIM)
    slots = torch.tensor([8, 9, 10, 11, 0, 1])
    pool.store(0, slots, k, v)
    got_k, got_v = pool.gather(0, slots[None], torch.device("cpu"))
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
    # Contexts go into recycled buffers: one still held is not written by the next gather.
    pool.gather(1, slots[None], torch.device("cpu"))
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)


def test_pool_size_accounting_matches_allocation():
    for comp in (None, KVCompression(bits=4, block_size=BS, value_group=8), KVCompression(bits=8, block_size=BS)):
        pool = _pool(comp)
        assert pool.nbytes == KVPool.nbytes_for(2, 12 * BS, HEADS, DIM, torch.float32, comp, num_residual=3)


def test_compressed_gather_holds_no_more_than_the_working_set_charges():
    """A compressed gather's transients (dequantized blocks, K, V, the codes) stay within the
    three K/V-sized tensors per gathered slot that working_set charges (opt-125m's K/V width, bf16,
    the default 4-bit format); the charge leaves room for parts_to_attend's copy of the keys
    after the gather's temporaries are gone. It was ~5.6 before K was written once into its result."""
    spec = ModelSpec.from_name("opt-125m", bytes_per_value=2)
    comp = KVCompression()
    bs = comp.block_size
    pool = KVPool("cpu", 1, 16 * bs, spec.num_kv_heads, spec.head_dim, torch.bfloat16, "cpu", block_size=bs,
                  compression=comp, num_residual=4)
    batch, length = 4, 3 * bs + 5
    slots = torch.arange(16 * bs).view(4, 4 * bs)[:, :length]
    complete_len = torch.tensor([3 * bs, 2 * bs, bs, 0])  # each sequence's open block elsewhere
    pool_storages = [t.untyped_storage().data_ptr() for t in
                     [*pool.k_codes.values(), *pool.v_codes.values(), pool.k_residual, slots]]
    charged = working_set(spec, PassTokens(total=0, widest=0, slice_rows=0, context_slots=batch * length,
                                           attention_slots=0, attention_cells=0, logit_rows=0), compress_kv=True).compute
    assert charged == 3 * batch * length * spec.kv_dim * 2  # the charge: three K/V-sized tensors
    live = LiveBytes(pool_storages)
    with live:
        k, v = pool.gather(0, slots, torch.device("cpu"), torch.arange(batch), complete_len)
    assert k.shape == v.shape == (batch, length, spec.num_kv_heads, spec.head_dim)
    assert live.peak <= charged


@pytest.mark.parametrize("lengths", [[11, 4, 7], [1, 12, 9]])
def test_compressed_gather_on_the_cpu_equals_torchs_route_and_never_overwrites_a_held_context(lengths, monkeypatch):
    """The C kernel (quant/cpu_kv_dequant.py) against the torch route it replaces, on a pool filled
    through store (real quantization, open blocks in the residual rows, shuffled block tables);
    a context gathered earlier and still held keeps its values through later gathers."""
    from quant import cpu_kv_dequant  # noqa: PLC0415

    comp = KVCompression(bits=4, block_size=BS, value_group=8)
    pool = _pool(comp)
    gen = torch.Generator().manual_seed(sum(lengths))
    table = torch.randperm(12, generator=gen).view(3, 4)  # 3 sequences x 4 blocks
    slots = (table[:, :, None] * BS + torch.arange(BS)).flatten(1)  # [3, 16]
    for layer in range(2):
        for row, length in enumerate(lengths):
            for p in range(length):  # one token at a time: blocks complete through the residual row
                kv = torch.randn(2, 1, HEADS, DIM, generator=gen) * 4
                pool.store(layer, slots[row, p:p + 1], kv[0], kv[1], torch.tensor([row]))
    length = max(lengths)
    complete = torch.tensor([n // BS * BS for n in lengths])
    cpu = torch.device("cpu")
    held = pool.gather(0, slots[:, :length], cpu, torch.arange(3), complete)
    snapshot = [t.clone() for t in held]
    fast = [pool.gather(layer, slots[:, :length], cpu, torch.arange(3), complete) for layer in (1, 0)]
    monkeypatch.setattr(cpu_kv_dequant, "covers", lambda *args: False)
    slow = [pool.gather(layer, slots[:, :length], cpu, torch.arange(3), complete) for layer in (1, 0)]
    for got, expected in zip(fast, slow):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(torch.equal(a, b) for a, b in zip(held, snapshot))
    assert torch.equal(held[0], slow[1][0])


def decode_case(compression, lengths: list[int], window: int | None, token_rows: torch.Tensor | None = None):
    """(pool, generator, part, group): layer 1 of a pool filled through store with three sequences of
    `lengths` keys in shuffled blocks, and one decode step of each (its new row at position
    lengths[b]; token_rows: the group's rows of the micro-batch, default 0, 1, 2)."""
    from offload.micro_batch import AttentionGroup, KVPart  # noqa: PLC0415

    pool = _pool(compression)
    gen = torch.Generator().manual_seed(sum(lengths) + (window or 0))
    table = torch.randperm(12, generator=gen).view(3, 4)
    slots = (table[:, :, None] * BS + torch.arange(BS)).flatten(1)  # [3, 16]
    for row, length in enumerate(lengths):
        for p in range(length):
            kv = torch.randn(2, 1, HEADS, DIM, generator=gen) * 4
            pool.store(1, slots[row, p:p + 1], kv[0], kv[1], torch.tensor([row]))
    kv_len = torch.tensor(lengths) + 1  # the decode's new row at position lengths[b]
    width = int(kv_len.max())
    part = KVPart("cpu", slots[:, :width], torch.zeros(3, dtype=torch.long), kv_len, torch.arange(3), torch.arange(3),
                  torch.tensor(lengths), torch.arange(3), torch.tensor([n // BS * BS for n in lengths]))
    rows = torch.arange(3) if token_rows is None else token_rows
    return pool, gen, part, AttentionGroup(rows, 1, torch.tensor(lengths)[:, None], [part])


@pytest.mark.parametrize("compression", [KVCompression(bits=4, block_size=BS, value_group=8), None],
                         ids=["codes", "plain"])
@pytest.mark.parametrize("lengths,window", [([11, 4, 7], None), ([1, 12, 8], None), ([11, 4, 7], 5)])
def test_decode_attention_in_the_pool_equals_gather_then_attend(lengths, window, compression):
    """KVPool.attend_decode (quant/cpu_kv_attention.py: from the codes, or a plain pool's slots in
    place) against the route it replaces: gather_part, parts_to_attend (the new row patched in, V as
    it will read back) and attention.attend, on a pool filled through store; a sliding window hides
    the oldest keys."""
    from flexsarathi.models import attention  # noqa: PLC0415

    pool, gen, part, group = decode_case(compression, lengths, window)
    kv_len = part.kv_len
    assert pool.attends_in_pool(group, part, torch.device("cpu"))
    q = torch.randn(3, 1, 2 * HEADS, DIM, generator=gen)  # GQA: two query heads per KV head
    new_k, new_v = torch.randn(3, HEADS, DIM, generator=gen), torch.randn(3, HEADS, DIM, generator=gen)
    scale = DIM ** -0.5
    out, lse = pool.attend_decode(1, group, part, q, new_k, new_v, scale, window)
    context = pool.gather_part(1, part, torch.device("cpu"))
    [(k, v, rule)] = pool.parts_to_attend(group, part, context, new_k, new_v)
    want_out, want_lse = attention.attend(q, k, v, group.q_pos, kv_len, scale, window, 0, rule)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_which_tiers_attend_a_decode_in_their_pool():
    """decode_in_pool_tiers, the one rule KVPool.attends_in_pool and the working set (engine and
    planner) read: on the CPU a plain pool in memory (a head size the kernel reads: a multiple of 8;
    not on disk: gathered ahead; not inside gathered_plain_decodes), a compressed pool in any tier;
    on a GPU only the gpu tier's compressed pool, where Triton is installed; never a plain one."""
    cpu, cuda, codes = torch.device("cpu"), torch.device("cuda"), KVCompression(bits=4, block_size=BS, value_group=8)
    assert decode_in_pool_tiers(cpu, torch.float32, 64, None) == ("gpu", "cpu")
    assert decode_in_pool_tiers(cpu, torch.bfloat16, 60, None) == ()
    with gathered_plain_decodes():
        assert decode_in_pool_tiers(cpu, torch.float32, 64, None) == ()
    assert decode_in_pool_tiers(cpu, torch.float32, 64, codes) == ("gpu", "cpu", "disk")
    assert decode_in_pool_tiers(cuda, torch.float16, 64, None) == ()
    triton = importlib.util.find_spec("triton") is not None
    assert decode_in_pool_tiers(cuda, torch.float16, 64, codes) == (("gpu",) if triton else ())
    with gathered_decodes():  # none: every decode gathers
        assert [decode_in_pool_tiers(d, torch.float16, 64, c) for d in (cpu, cuda) for c in (None, codes)] == [()] * 4
    pool, _, part, group = decode_case(None, [11, 4, 7], None)  # a plain cpu-tier pool, as the rule says
    assert pool.attends_in_pool(group, part, cpu)
    with gathered_plain_decodes():
        assert not pool.attends_in_pool(group, part, cpu)
