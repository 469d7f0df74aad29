"""BlockManager bookkeeping against counting by hand: tables laid fastest tier first, each tier one
contiguous range of positions, on-demand growth that keeps that order, nothing over-committed."""
from __future__ import annotations

import pytest
import torch

from flexsarathi.block_manager import TIERS, BlockManager
from flexsarathi.sampling import SamplingParams
from flexsarathi.sequence import Sequence


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
