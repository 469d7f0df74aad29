"""BlockManager bookkeeping against counting by hand: tables laid fastest tier first, each tier one
contiguous range of positions, on-demand growth that keeps that order, nothing over-committed."""
from __future__ import annotations

import pytest
import torch

from flexsarathi.engine.block_manager import TIERS, BlockManager
from flexsarathi.engine.sampling import SamplingParams
from flexsarathi.engine.sequence import Sequence


def seq(seq_id: int, prompt: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, [1] * prompt, SamplingParams(max_tokens=max_tokens), max_len=prompt + max_tokens,
                    stop_ids=frozenset(), generator=torch.Generator())


def tiers_of(blocks: BlockManager, s: Sequence) -> list[str]:
    return [blocks.tier_of(b) for b in s.block_table]


def test_reservation_takes_the_whole_life_fastest_tier_first():
    blocks = BlockManager(4, {"gpu": 2, "cpu": 3, "disk": 4}, num_residual=2)
    a = seq(0, 5, 11)  # 16 tokens: 4 blocks
    blocks.allocate(a)
    assert tiers_of(blocks, a) == ["gpu", "gpu", "cpu", "cpu"]
    assert blocks.num_free == 5 and len(blocks.free_residual) == 1


def test_on_demand_allocates_the_prompt_then_grows_a_block_at_a_time():
    blocks = BlockManager(4, {"gpu": 2, "cpu": 3}, num_residual=2)
    a = seq(0, 5, 11)
    blocks.allocate(a, a.num_prompt_tokens)
    assert len(a.block_table) == 2
    blocks.grow(a, 8)  # still fits two blocks: no-op
    assert len(a.block_table) == 2
    blocks.grow(a, 9)
    assert tiers_of(blocks, a) == ["gpu", "gpu", "cpu"]


def test_growth_never_goes_back_to_a_faster_tier():
    blocks = BlockManager(4, {"gpu": 1, "cpu": 2}, num_residual=2)
    a, b = seq(0, 4, 8), seq(1, 4, 8)
    blocks.allocate(a, 4)  # gpu
    blocks.allocate(b, 4)  # cpu
    blocks.free_blocks(a)  # the gpu block is free again
    blocks.grow(b, 8)  # b continues in cpu, not in gpu
    assert tiers_of(blocks, b) == ["cpu", "cpu"]
    assert not blocks.can_grow(b, 12)  # one gpu block is free, but b's positions go on in cpu
    assert blocks.num_free == 1


def test_watermark_and_residual_rows_limit_admission():
    blocks = BlockManager(4, {"cpu": 4}, num_residual=1)
    a, b = seq(0, 8, 8), seq(1, 4, 4)
    assert blocks.can_allocate(a, 8, watermark=2) and not blocks.can_allocate(a, 8, watermark=3)
    blocks.allocate(a, 8)
    assert not blocks.can_allocate(b, 4)  # blocks are free, but no residual row
    blocks.free_blocks(a)
    assert blocks.num_free == 4 and a.block_table == [] and a.residual_id == -1
    with pytest.raises(RuntimeError, match="no room"):
        blocks.allocate(seq(2, 17, 1), 17)


def test_tier_ids_are_disjoint_ranges():
    blocks = BlockManager(4, {"gpu": 2, "disk": 3}, num_residual=1)
    assert [blocks.tier_of(b) for b in range(5)] == ["gpu", "gpu", "disk", "disk", "disk"]
    assert set(blocks.free) == set(TIERS)


def test_can_allocate_and_has_room_count_blocks_and_rows():
    blocks = BlockManager(4, {"gpu": 1, "cpu": 2}, num_residual=2)
    a = seq(0, 9, 3)  # 12 tokens: 3 blocks for its life, 3 for its 9-token prompt
    assert blocks.can_allocate(a) and blocks.can_allocate(a, 9) and not blocks.can_allocate(a, 13)
    assert blocks.has_room(3, 2) and not blocks.has_room(4, 1) and not blocks.has_room(1, 3)
    blocks.allocate(a, 5)  # ceil(5 / 4) = 2 blocks, one row
    assert blocks.num_free == 1 and blocks.has_room(1, 1) and not blocks.has_room(2, 1)
    assert not blocks.has_room(0, 2)
    assert blocks.can_grow(a, 12) and not blocks.can_grow(a, 13)
    blocks.grow(a, 12)
    assert tiers_of(blocks, a) == ["gpu", "cpu", "cpu"] and blocks.num_free == 0
    with pytest.raises(RuntimeError, match="no room to grow"):
        blocks.grow(a, 13)


def test_a_fork_shares_the_prompt_blocks_and_a_block_is_free_when_its_last_holder_frees_it():
    blocks = BlockManager(4, {"gpu": 3, "cpu": 4}, num_residual=3)
    parent = seq(0, 10, 6)  # prompt: blocks 0, 1 complete, block 2 partial
    blocks.allocate(parent, 10)
    children = [seq(1, 10, 6), seq(2, 10, 6)]
    for child in children:
        blocks.fork(parent, child, num_shared=2, num_tokens=11)
    shared = parent.block_table[:2]
    for child in children:
        assert child.block_table[:2] == shared and child.block_table[2] not in parent.block_table
    assert [blocks.refs[b] for b in shared] == [3, 3]
    assert {blocks.tier_of(c.block_table[2]) for c in children} == {"cpu"}  # the gpu tier is spent
    assert blocks.num_free == 2 and not blocks.free_residual
    blocks.free_blocks(parent)  # its own partial block is free; the shared ones still held
    assert blocks.num_free == 3 and [blocks.refs[b] for b in shared] == [2, 2]
    blocks.free_blocks(children[0])
    assert blocks.num_free == 4 and not any(b in f for f in blocks.free.values() for b in shared)
    blocks.free_blocks(children[1])  # the last holder: the shared blocks are free again
    assert blocks.num_free == blocks.num_blocks and blocks.idle and set(blocks.refs) == {0}
    stale = seq(3, 4, 1)
    stale.block_table, stale.residual_id = list(shared), 0  # a table freed already
    with pytest.raises(RuntimeError, match="freed more often than taken"):
        blocks.free_blocks(stale)


def test_resize_only_while_idle_and_release_all_frees_everything():
    blocks = BlockManager(4, {"cpu": 2}, num_residual=1)
    a = seq(0, 4, 4)
    blocks.allocate(a, 4)
    with pytest.raises(RuntimeError, match="resized while sequences hold blocks"):
        blocks.resize({"gpu": 1, "cpu": 3}, num_residual=2)
    blocks.release_all()  # the holder was dropped (an interrupted batch)
    assert blocks.idle and blocks.num_free == 2 and len(blocks.free_residual) == 1
    blocks.resize({"gpu": 1, "cpu": 3}, num_residual=2)
    assert blocks.num_blocks == 4 and blocks.base == {"gpu": 0, "cpu": 1, "disk": 4}
    b = seq(1, 13, 3)
    blocks.allocate(b)
    assert tiers_of(blocks, b) == ["gpu", "cpu", "cpu", "cpu"] and len(blocks.free_residual) == 1
