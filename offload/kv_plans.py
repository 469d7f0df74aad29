"""Where a compressed KV pool's store and gather read and write, worked out once per pass.

Every layer of a pass stores the same slots and gathers the same contexts, so the index arithmetic of
a compressed pool (which tokens complete their block, which positions read a sequence's open block)
is the same for all of them. Worked out per layer it was about twenty host-side operations per
layer-step, and on a GPU as many small uploads (each a pinned staging copy and a DMA). Here it is
worked out once per pass on the host, from the batch builder's host tensors, and moved to each
device in one packed upload (KVPool.store and KVPool.gather take the plans; without one they make
their own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.streams import to_device


@dataclass(frozen=True)
class StorePlan:
    """One store of T tokens into a compressed pool; index tensors on the pool's device."""

    slots: torch.Tensor  # [T] each token's slot (its V codes' row)
    done_blocks: torch.Tensor | None  # [nb] blocks the store completes; None: it completes none
    done_rows: torch.Tensor | None  # [nb] their sequences' residual rows
    into_block: torch.Tensor | None  # [m] for each token of a completed block: its index in done_blocks,
    into_offset: torch.Tensor | None  # [m] its offset in the block
    from_row: torch.Tensor | None  # [m] and its row of the stored K
    keep_rows: torch.Tensor  # [r] residual row of each token whose block stays open
    keep_offsets: torch.Tensor  # [r] its offset in the block
    keep_src: torch.Tensor | None  # [r] its row of the stored K; None: every row, in order


@dataclass(frozen=True)
class GatherPlan:
    """One part's context [B, L] gathered from a compressed pool."""

    blocks: torch.Tensor  # [B, nb] each sequence's blocks (pool device)
    slots: torch.Tensor  # [B * L] each position's slot (pool device)
    open_rows: torch.Tensor  # [m] residual row of each position read from an open block (pool device)
    open_offsets: torch.Tensor  # [m] its offset there (pool device)
    open_seq: torch.Tensor  # [m] its sequence b (the gathering device)
    open_pos: torch.Tensor  # [m] its position j (the gathering device)


def upload_packed(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host integer tensors on `device` as views of one upload (one staging copy, one DMA); the
    tensors themselves where `device` is the CPU."""
    if device.type == "cpu" or not tensors:
        return tensors
    flat = to_device(torch.cat([t.reshape(-1).long() for t in tensors]), device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def plan_store(slots: torch.Tensor, residual_ids: torch.Tensor, block_size: int, device: torch.device) -> StorePlan:
    """slots, residual_ids: host [T]. A token at the last offset of its block completes it: the block
    is assembled from its residual row (tokens stored by earlier passes) and this store's tokens of it,
    then quantized; the others go into their residual rows."""
    slots, rows = slots.cpu().long(), residual_ids.cpu().long()
    offsets, blocks = slots % block_size, slots // block_size
    done = offsets == block_size - 1
    in_done = torch.zeros_like(done)
    done_parts: list[torch.Tensor | None] = [None] * 5
    if bool(done.any()):  # host tensors: no sync
        done_blocks = blocks[done]
        in_done = torch.isin(blocks, done_blocks)
        into_block = (blocks[in_done][:, None] == done_blocks[None, :]).int().argmax(dim=1)
        done_parts = [done_blocks, rows[done], into_block, offsets[in_done], in_done.nonzero().squeeze(1)]
    keep = (~in_done).nonzero().squeeze(1)
    keep_src = None if keep.numel() == slots.numel() else keep  # None: arange(T), K stored as it is
    host = [slots, *done_parts, rows[keep], offsets[keep], keep_src]
    moved = iter(upload_packed([t for t in host if t is not None], device))
    return StorePlan(*(None if t is None else next(moved) for t in host))


def plan_gather(kv_slots: torch.Tensor, residual_ids: torch.Tensor, complete_len: torch.Tensor, block_size: int,
                pool_device: torch.device, device: torch.device) -> GatherPlan:
    """kv_slots [B, L] (block-aligned: position j of a row is in its block j // block_size), residual_ids
    [B], complete_len [B]: host tensors. Positions from complete_len[b] on read sequence b's residual
    (open) block, position j at its offset j % block_size."""
    kv_slots, length = kv_slots.cpu(), kv_slots.shape[1]
    seq, pos = (torch.arange(length)[None, :] >= complete_len.cpu()[:, None]).nonzero(as_tuple=True)
    on_pool = [kv_slots[:, ::block_size] // block_size, kv_slots.reshape(-1), residual_ids.cpu()[seq],
               pos % block_size]
    if pool_device == device:
        blocks, slots, open_rows, open_offsets, open_seq, open_pos = upload_packed(on_pool + [seq, pos], device)
    else:
        (blocks, slots, open_rows, open_offsets), (open_seq, open_pos) = \
            upload_packed(on_pool, pool_device), upload_packed([seq, pos], device)
    return GatherPlan(blocks, slots, open_rows, open_offsets, open_seq, open_pos)


@dataclass(frozen=True)
class DecodePlan:
    """One decode part attended straight from a compressed pool's codes on its device
    (quant/triton_kv_attention.py); every tensor [B, ...] on that device."""

    blocks: torch.Tensor  # [B, nb] each sequence's blocks
    complete_len: torch.Tensor  # [B] positions before it read quantized blocks, later ones the open block
    residual_ids: torch.Tensor  # [B] each sequence's residual (open block) row
    slots: torch.Tensor  # [B, L] each position's slot (its V codes' row)
    lo: torch.Tensor  # [W, B] the keys [lo, hi) each query sees within the model's W sliding windows
    hi: torch.Tensor  # [B]
    new_src: torch.Tensor  # [B] the micro-batch row whose new K/V sit at new_pos (-1: none)
    new_pos: torch.Tensor  # [B] that row's position in the part (-1: none)
    windows: tuple[int | None, ...] = (None,)  # lo's rows: the windows (None: every earlier key)

    def lo_of(self, window: int | None) -> torch.Tensor:
        """[B] the first key each query sees within `window` (one the plan was made for)."""
        return self.lo[self.windows.index(window)]


def plan_decode(q_pos: torch.Tensor, token_rows: torch.Tensor, part, block_size: int,
                windows: tuple[int | None, ...], device: torch.device) -> DecodePlan:
    """q_pos [B] (the decode rows' positions), token_rows [B] (their rows of the micro-batch) and `part`
    (a KVPart): the batch builder's host tensors; windows: the model's sliding windows (config.windows)."""
    kv_slots, batch = part.kv_slots.cpu(), q_pos.shape[0]
    hi = visible_range(q_pos, part, None)[1]
    lo = torch.stack([visible_range(q_pos, part, window)[0] for window in windows])  # [W, B]
    new_src, new_pos = torch.full((batch,), -1, dtype=torch.long), torch.full((batch,), -1, dtype=torch.long)
    new_src[part.patch_seq] = token_rows.cpu().long()[part.patch_src.cpu().long()]  # group rows -> micro-batch rows
    new_pos[part.patch_seq] = part.patch_pos.cpu().long()
    host = [kv_slots[:, ::block_size] // block_size, part.complete_len, part.residual_ids, kv_slots, lo, hi,
            new_src, new_pos]
    return DecodePlan(*upload_packed([t.cpu().contiguous() for t in host], device), windows=tuple(windows))


def visible_range(q_pos: torch.Tensor, part, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B]: the keys [lo, hi) of `part` (a KVPart) each decode row at q_pos [B] sees (host tensors)."""
    hi = torch.minimum(part.kv_len, q_pos - part.kv_start + 1)
    lo = (q_pos - part.kv_start - sliding_window + 1).clamp_min(0) if sliding_window else torch.zeros_like(hi)
    return lo, hi
