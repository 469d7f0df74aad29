"""flexsarathi/engine/micro_batch_builder.py and KVPool.parts_to_attend against arithmetic done by hand over a
real BlockManager: slots are block_table * block_size + offset (local to the block's tier), logit
rows follow the items, decodes group by power-of-two context, a table crossing tiers gives one KV
part per tier. What a pool hands attention is the stored K/V (plain pools: bitwise; compressed:
quant's dequantize of what was stored, exactly), and attending its parts then merging equals a
naive softmax over the whole reference context."""
from __future__ import annotations

import math

import pytest
import torch

from flexsarathi.models.attention import attend, merge_partial_attention
from flexsarathi.engine.micro_batch_builder import build_micro_batch
from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.sampling import SamplingParams
from flexsarathi.engine.scheduler import WorkItem
from flexsarathi.engine.sequence import Sequence
from offload.kv_cache import KVCompression, KVPool
from quant import dequantize, quantize

BS, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
SCALE = DIM ** -0.5


def make_seq(seq_id: int, prompt: int, outputs: int = 0, prompt_logprobs: int | None = None) -> Sequence:
    params = SamplingParams(max_tokens=32, prompt_logprobs=prompt_logprobs)
    return Sequence(seq_id, list(range(3, 3 + prompt)), params, max_len=prompt + 32, stop_ids=frozenset(),
                    generator=torch.Generator(), output_token_ids=[7] * outputs)


def admitted(blocks: BlockManager, seq: Sequence, tokens: int) -> Sequence:
    blocks.allocate(seq, tokens)
    return seq


def local_slot(blocks: BlockManager, seq: Sequence, pos: int) -> tuple[str, int]:
    """(tier, slot in that tier's pool) of a position, by hand."""
    block = seq.block_table[pos // BS]
    tier = blocks.tier_of(block)
    return tier, (block - blocks.base[tier]) * BS + pos % BS


def row_positions(items: list[WorkItem]) -> list[tuple[Sequence, int]]:
    return [(item.seq, p) for item in items for p in range(item.start, item.end)]


# ---- the micro-batch ---------------------------------------------------------------------------
def test_writes_and_context_slots_are_block_table_arithmetic():
    blocks = BlockManager(BS, {"gpu": 3, "cpu": 4, "disk": 4}, num_residual=3)
    a = admitted(blocks, make_seq(0, 6), 8)  # gpu, gpu
    b = admitted(blocks, make_seq(1, 13), 16)  # gpu, cpu, cpu, cpu
    c = admitted(blocks, make_seq(2, 9, outputs=3), 16)  # cpu, disk, disk, disk
    items = [WorkItem(a, 0, 6), WorkItem(b, 3, 13), WorkItem(c, 11, 12)]
    mb, _ = build_micro_batch(items, blocks)
    assert_slots_are_table_arithmetic(mb, items, blocks)


def assert_slots_are_table_arithmetic(mb, items: list[WorkItem], blocks: BlockManager) -> None:
    """Every written row and every key of every part at the slot its block table gives (local_slot)."""
    rows = row_positions(items)
    written = {}
    for write in mb.kv_writes:
        for row, slot, rid in zip(write.rows.tolist(), write.slots.tolist(), write.residual_ids.tolist()):
            seq, pos = rows[row]
            written[row] = (write.tier, slot)
            assert rid == seq.residual_id
    assert written == {row: local_slot(blocks, seq, pos) for row, (seq, pos) in enumerate(rows)}
    for group in mb.groups:
        members = [rows[r][0] for r in group.token_rows[::group.num_queries].tolist()]
        for part in group.parts:
            for b, seq in enumerate(members):
                for j in range(int(part.kv_len[b])):
                    pos = int(part.kv_start[b]) + j
                    assert local_slot(blocks, seq, pos) == (part.tier, int(part.kv_slots[b, j]))


def test_slots_follow_a_table_that_grows_or_is_replaced():
    """The builder reuses a sequence's slot map while its table only grows (SlotMap.of): a decode
    past its table's last block, and the sequence readmitted (preempted) into other blocks with a
    table of the same length, give their table's slots, not the cached ones."""
    blocks = BlockManager(BS, {"gpu": 3, "cpu": 6}, num_residual=3)
    seq = admitted(blocks, make_seq(0, 7, outputs=1), 8)  # gpu, gpu

    def check():
        items = [WorkItem(seq, seq.num_tokens - 1, seq.num_tokens)]
        mb, _ = build_micro_batch(items, blocks)
        assert_slots_are_table_arithmetic(mb, items, blocks)
        assert [int(p.kv_len[0]) for p in mb.groups[0].parts] == [
            sum(1 for pos in range(seq.num_tokens) if local_slot(blocks, seq, pos)[0] == tier)
            for tier in dict.fromkeys(blocks.tier_of(b) for b in seq.block_table)]

    check()
    for _ in range(6):  # into a third gpu block at 9 tokens, then a cpu one at 13
        seq.output_token_ids.append(7)
        blocks.grow(seq, seq.num_tokens)
        check()
    assert [blocks.tier_of(b) for b in seq.block_table] == ["gpu", "gpu", "gpu", "cpu"]
    table = list(seq.block_table)
    blocks.free_blocks(seq)
    admitted(blocks, make_seq(1, 5), 8)  # takes freed blocks first
    admitted(blocks, seq, seq.num_tokens)
    assert len(seq.block_table) == len(table) and seq.block_table != table
    check()


def test_logit_rows_follow_the_items_that_sample_or_want_prompt_logprobs():
    blocks = BlockManager(BS, {"gpu": 16}, num_residual=4)
    a = admitted(blocks, make_seq(0, 6), 8)  # whole prompt: samples its last row
    b = admitted(blocks, make_seq(1, 9, prompt_logprobs=0), 12)  # a later chunk: every row
    c = admitted(blocks, make_seq(2, 8), 8)  # a first chunk, no logprobs: no row
    d = admitted(blocks, make_seq(3, 5, outputs=2), 8)  # a decode
    items = [WorkItem(a, 0, 6), WorkItem(b, 4, 9), WorkItem(c, 0, 3), WorkItem(d, 6, 7)]
    mb, spans = build_micro_batch(items, blocks)
    assert mb.logit_rows.tolist() == [5, 6, 7, 8, 9, 10, 14]
    assert [(s.item, s.offset, s.count) for s in spans] == [(items[0], 0, 1), (items[1], 1, 5), (items[3], 6, 1)]
    assert mb.token_ids.tolist() == [t for item in items for t in item.seq.token_ids(item.start, item.end)]
    assert mb.positions.tolist() == [p for _, p in row_positions(items)]


def test_decodes_group_by_power_of_two_context_and_by_tiers():
    blocks = BlockManager(BS, {"gpu": 10, "cpu": 10}, num_residual=8)
    # Context of each decode (its own token included), in admission order: 3..9 fill 9 gpu blocks,
    # 7 then takes the last gpu block and one cpu block, 16 and 17 are all cpu. So 3 and 4 share a
    # group, 5 and 8 too; 7 (gpu + cpu) is apart from them, 9 (gpu) apart from 16 (cpu).
    lengths = [3, 4, 5, 8, 9, 7, 16, 17]
    seqs = [admitted(blocks, make_seq(i, n - 1, outputs=1), n) for i, n in enumerate(lengths)]
    items = [WorkItem(s, s.num_tokens - 1, s.num_tokens) for s in seqs]
    mb, _ = build_micro_batch(items, blocks)
    by_key: dict[tuple, list[int]] = {}
    for row, s in enumerate(seqs):
        tiers = tuple(dict.fromkeys(blocks.tier_of(b) for b in s.block_table))
        by_key.setdefault((tiers, math.ceil(math.log2(s.num_tokens))), []).append(row)
    assert sorted(sorted(g.token_rows.tolist()) for g in mb.groups) == sorted(by_key.values())
    assert sorted(by_key.values()) == [[0, 1], [2, 3], [4], [5], [6], [7]]  # the hand count of the comment
    assert all(g.is_decode and g.q_pos.flatten().tolist() == [items[r].start for r in g.token_rows.tolist()]
               for g in mb.groups)


def test_a_table_crossing_tiers_gives_one_part_per_tier():
    blocks = BlockManager(BS, {"gpu": 1, "cpu": 2, "disk": 4}, num_residual=2)
    seq = admitted(blocks, make_seq(0, 13), 16)  # gpu [0, 4), cpu [4, 12), disk [12, 16)
    mb, _ = build_micro_batch([WorkItem(seq, 6, 13)], blocks)
    (group,) = mb.groups
    got = [(p.tier, int(p.kv_start[0]), int(p.kv_len[0]), p.new_rows) for p in group.parts]
    # Only the disk part's keys are all new (positions 12.. of the chunk 6..12: row 6 of it).
    assert got == [("gpu", 0, 4, None), ("cpu", 4, 8, None), ("disk", 12, 1, (6, 7))]
    cpu = group.parts[1]
    assert cpu.patch_pos.tolist() == [2, 3, 4, 5, 6, 7] and cpu.patch_src.tolist() == [0, 1, 2, 3, 4, 5]
    assert cpu.complete_len.tolist() == [0] and group.parts[0].complete_len.tolist() == [4]
    writes = {w.tier: w.rows.tolist() for w in mb.kv_writes}
    assert writes == {"cpu": [0, 1, 2, 3, 4, 5], "disk": [6]}


@pytest.mark.parametrize("upto", [0, 5, 64])
def test_whole_prompts_of_one_length_and_tier_layout_are_one_group(upto):
    """Whole prompts of up to `upto` tokens group by length and tier layout (where the executor
    attends such a group in one causal call); a later chunk stays alone, its keys not all new."""
    blocks = BlockManager(BS, {"gpu": 4, "cpu": 7}, num_residual=5)
    a, b = (admitted(blocks, make_seq(i, 6), 8) for i in (0, 1))  # gpu
    c = admitted(blocks, make_seq(2, 6), 8)  # cpu: another layout
    d = admitted(blocks, make_seq(3, 5), 8)  # cpu: another length
    e = admitted(blocks, make_seq(4, 9), 12)  # cpu
    items = [WorkItem(a, 0, 6), WorkItem(b, 0, 6), WorkItem(c, 0, 6), WorkItem(d, 0, 5), WorkItem(e, 4, 9)]
    mb, _ = build_micro_batch(items, blocks, group_prompts_upto=upto)
    got = sorted((g.token_rows.tolist()[::g.num_queries], g.num_queries, [(p.tier, p.new_rows) for p in g.parts])
                 for g in mb.groups)
    apart = [([0], 6, [("gpu", (0, 6))]), ([6], 6, [("gpu", (0, 6))])]
    together = [([0, 6], 6, [("gpu", (0, 6))])]
    assert got == sorted((together if upto >= 6 else apart) + [([12], 6, [("cpu", (0, 6))]), ([18], 5, [("cpu", (0, 5))]),
                                                                 ([23], 5, [("cpu", None)])])
    if upto >= 6:
        (pair,) = [g for g in mb.groups if g.num_seqs == 2]
        assert pair.row_start == 0 and pair.q_pos.tolist() == [list(range(6))] * 2


# ---- KVPool.parts_to_attend over passes the builder made ---------------------------------------
COMPRESSION = KVCompression(bits=4, block_size=BS, value_group=DIM)


def stored_k(k: torch.Tensor) -> torch.Tensor:
    """K [L, kvh, d] as quant reads back its complete blocks: one group per channel per block."""
    n = k.shape[0] // BS * BS
    blocks = k[:n].unflatten(0, (-1, BS)).permute(0, 2, 3, 1)  # [nb, kvh, d, bs]
    back = dequantize(quantize(blocks, COMPRESSION.k_config()), k.dtype)
    return torch.cat([back.permute(0, 3, 1, 2).reshape(n, KV_HEADS, DIM), k[n:]])


def stored_v(v: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(v, COMPRESSION.v_config(DIM)), v.dtype)


class Passes:
    """Two sequences over gpu/cpu/disk pools, run as a chunked prefill, a mixed pass and a decode
    pass; every pass's parts come from KVPool.parts_to_attend as the executor calls it."""
    tiers = {"gpu": 1, "cpu": 2, "disk": 6}
    group_prompts_upto = 0  # build_micro_batch's

    def __init__(self, compression, folder):
        self.blocks = BlockManager(BS, self.tiers, num_residual=2)
        self.a, self.b = self.sequences()
        self.pools = {t: KVPool(t, 1, n * BS, KV_HEADS, DIM, torch.float32, "cpu", block_size=BS,
                                compression=compression, num_residual=2, folder=folder if t == "disk" else None)
                      for t, n in self.tiers.items()}
        gen = torch.Generator().manual_seed(0)
        scales = torch.linspace(0.1, 5, DIM)  # outlier channels, as real K has
        self.k = {s.seq_id: torch.randn(16, KV_HEADS, DIM, generator=gen) * scales for s in (self.a, self.b)}
        self.v = {s.seq_id: torch.randn(16, KV_HEADS, DIM, generator=gen) for s in (self.a, self.b)}
        self.gen = gen

    def sequences(self) -> tuple[Sequence, Sequence]:
        return (admitted(self.blocks, make_seq(0, 6, outputs=2), 8),  # gpu [0, 4), cpu [4, 8)
                admitted(self.blocks, make_seq(1, 13, outputs=1), 16))  # cpu [0, 4), disk [4, 16)

    def schedule(self) -> list[list[WorkItem]]:
        a, b = self.a, self.b
        return [[WorkItem(a, 0, 6), WorkItem(b, 0, 5)], [WorkItem(b, 5, 13), WorkItem(a, 6, 7)],
                [WorkItem(a, 7, 8), WorkItem(b, 13, 14)]]

    def run(self, items: list[WorkItem]):
        """Yields (group, members, q_group, [(part, triples)]) of one pass, then stores its K/V."""
        mb, _ = build_micro_batch(items, self.blocks, self.group_prompts_upto)
        rows = row_positions(items)
        new_k = torch.stack([self.k[s.seq_id][p] for s, p in rows])  # [T, kvh, d]
        new_v = torch.stack([self.v[s.seq_id][p] for s, p in rows])
        q = torch.randn(len(rows), HEADS, DIM, generator=self.gen)
        for group in mb.groups:
            members = [rows[r][0] for r in group.token_rows[::group.num_queries].tolist()]
            k_rows, v_rows = new_k[group.token_rows], new_v[group.token_rows]
            parts = []
            for part in group.parts:
                pool = self.pools[part.tier]
                gathered = pool.parts_to_attend(group, part, pool.gather_part(0, part, torch.device("cpu")),
                                                k_rows, v_rows)
                if part.new_rows is not None:  # the executor's shortcut: no gather, the same values
                    direct = pool.parts_to_attend(group, part, None, k_rows, v_rows)
                    assert all(torch.equal(x, y) for t, u in zip(direct, gathered) for x, y in zip(t[:2], u[:2]))
                parts.append((part, gathered))
            yield group, members, q[group.token_rows].unflatten(0, (group.num_seqs, group.num_queries)), parts
        for w in mb.kv_writes:
            self.pools[w.tier].store(0, w.slots, new_k[w.rows], new_v[w.rows], w.residual_ids)


class GroupedPasses(Passes):
    """Two whole prompts of one length and one tier, attended as one group (the executor's
    causal-call grouping), then two decode passes."""
    tiers = {"gpu": 6, "cpu": 1, "disk": 1}
    group_prompts_upto = 64

    def sequences(self) -> tuple[Sequence, Sequence]:
        return (admitted(self.blocks, make_seq(0, 7, outputs=2), 9),  # gpu [0, 9)
                admitted(self.blocks, make_seq(1, 7, outputs=2), 9))  # gpu [0, 9)

    def schedule(self) -> list[list[WorkItem]]:
        a, b = self.a, self.b
        return [[WorkItem(a, 0, 7), WorkItem(b, 0, 7)], [WorkItem(a, 7, 8), WorkItem(b, 7, 8)],
                [WorkItem(a, 8, 9), WorkItem(b, 8, 9)]]


SCENARIOS = [Passes, GroupedPasses]


def visible_keys(group, part, b: int, rule: str | None) -> list[int]:
    """Indices j into the part's keys that some query of sequence b sees under the key rule."""
    start, length = int(part.kv_start[b]), int(part.kv_len[b])
    queries = group.q_pos[b].tolist()
    seen = set()
    for qp in queries:
        for j in range(length):
            pos = start + j
            if pos <= qp and (rule is None or (rule == "before") == (pos // BS < qp // BS)):
                seen.add(j)
    return sorted(seen)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plain_pool_parts_are_the_stored_k_v_bitwise(tmp_path, scenario):
    passes = scenario(None, str(tmp_path))
    for items in passes.schedule():
        for group, members, _, parts in passes.run(items):
            for part, triples in parts:
                ((keys, values, rule),) = triples
                assert rule is None
                for b, seq in enumerate(members):
                    start, length = int(part.kv_start[b]), int(part.kv_len[b])
                    assert torch.equal(keys[b, :length], passes.k[seq.seq_id][start:start + length])
                    assert torch.equal(values[b, :length], passes.v[seq.seq_id][start:start + length])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_compressed_pool_parts_are_quants_dequantize_of_what_was_stored(tmp_path, scenario):
    passes = scenario(COMPRESSION, str(tmp_path))
    checked = {"stored before the pass": 0, "completed in the pass": 0, "own block": 0}
    decodes = {"one part": 0}
    for items in passes.schedule():
        for group, members, _, parts in passes.run(items):
            for part, triples in parts:
                # Prompt rows: the two key rules; decode rows: one part, no rule (their one query's
                # keys already read as it sees them).
                rules = [rule for _, _, rule in triples]
                assert rules == ([None] if group.is_decode else [(BS, "before"), (BS, "same")])
                decodes["one part"] += group.is_decode
                for (keys, values, key_rule), b in ((t, b) for t in triples for b in range(len(members))):
                    seq, start = members[b].seq_id, int(part.kv_start[b])
                    rule = key_rule[1] if key_rule else None
                    own_block = int(group.q_pos[b, -1]) // BS * BS  # the (last) query's block
                    ref_v = stored_v(passes.v[seq])
                    for j in visible_keys(group, part, b, rule):
                        # Earlier blocks as quant stores them; the query's own block exact; V always stored.
                        exact = rule == "same" or (rule is None and start + j >= own_block)
                        ref_k = passes.k[seq] if exact else stored_k(passes.k[seq])
                        assert torch.equal(keys[b, j], ref_k[start + j]), (seq, start + j, rule)
                        assert torch.equal(values[b, j], ref_v[start + j]), (seq, start + j, rule)
                        kind = ("own block" if exact else "stored before the pass"
                                if j < int(part.complete_len[b]) else "completed in the pass")
                        checked[kind] += 1
    assert all(checked.values()) and decodes["one part"], (checked, decodes)


def reference_attention(q: torch.Tensor, q_pos: list[int], k: torch.Tensor, v: torch.Tensor,
                        compressed: bool) -> torch.Tensor:
    """Naive softmax, query by query: q [n, heads, d] at q_pos over the sequence's K/V [L, kvh, d]."""
    out = torch.empty_like(q)
    for i, qp in enumerate(q_pos):
        keys = k[:qp + 1].clone()
        values = stored_v(v)[:qp + 1] if compressed else v[:qp + 1]
        if compressed:
            own = qp // BS * BS
            keys[:own] = stored_k(k)[:own]
        keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, heads, d]
        values = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[i], keys) * SCALE, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", weights, values)
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("compression", [None, COMPRESSION], ids=["plain", "compressed"])
def test_attending_the_parts_and_merging_equals_the_whole_reference_context(tmp_path, compression, scenario):
    passes = scenario(compression, str(tmp_path))
    for items in passes.schedule():
        for group, members, q_group, parts in passes.run(items):
            outs = [attend(q_group, keys, values, group.q_pos, part.kv_len, SCALE, None, part.kv_start, rule)
                    for part, triples in parts for keys, values, rule in triples]
            merged = merge_partial_attention(outs)  # [B, n, heads, d]
            for b, seq in enumerate(members):
                ref = reference_attention(q_group[b], group.q_pos[b].tolist(), passes.k[seq.seq_id],
                                          passes.v[seq.seq_id], compression is not None)
                torch.testing.assert_close(merged[b], ref, atol=1e-5, rtol=1e-5)


def test_every_index_but_the_padded_context_slots_is_a_view_of_one_packed_tensor():
    """The builder makes one int64 tensor per micro-batch (IndexPack) and every index field a view of
    it, so a GPU takes them in one copy (MicroBatch.to); only each part's [B, L] context slots,
    padded from the slot maps' tensors, are their own. Whole prompts, a chunk across tiers and a
    decode, as in the tests above."""
    blocks = BlockManager(BS, {"gpu": 3, "cpu": 6, "disk": 4}, num_residual=6)
    a = admitted(blocks, make_seq(0, 6), 8)
    b = admitted(blocks, make_seq(1, 13), 16)
    c = admitted(blocks, make_seq(2, 9, outputs=3), 16)
    d = admitted(blocks, make_seq(3, 6), 8)
    items = [WorkItem(a, 0, 6), WorkItem(b, 3, 13), WorkItem(c, 11, 12), WorkItem(d, 0, 6)]
    mb, _ = build_micro_batch(items, blocks, group_prompts_upto=8)
    storage = mb.packed.untyped_storage().data_ptr()
    fields = [(mb, f) for f in ("token_ids", "positions", "logit_rows")]
    fields += [(w, f) for w in mb.kv_writes for f in ("rows", "slots", "residual_ids")]
    for g in mb.groups:
        fields += [(g, "token_rows"), (g, "q_pos")]
        fields += [(p, f) for p in g.parts for f in ("kv_start", "kv_len", "patch_src", "patch_seq", "patch_pos",
                                                      "residual_ids", "complete_len")]
    assert sorted(g.num_queries for g in mb.groups) == [1, 6, 6, 10] and len(mb.kv_writes) == 3  # every tier
    for obj, f in fields:
        t = getattr(obj, f)
        assert t.dtype == torch.long and t.untyped_storage().data_ptr() == storage, (type(obj).__name__, f)
    assert_slots_are_table_arithmetic(mb, items, blocks)
