"""What the executor needs to run one micro-batch: flattened tokens and attention metadata.

Built by the engine from the scheduler's decision; the executor only moves and computes.
A sequence's KV blocks may lie in several tiers' pools (each tier a contiguous range of its
positions); attention then runs per tier ("part") and the parts are merged exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from offload.streams import to_device

# Fields that index a pool: they stay the batch builder's host tensors, and each pool moves them to
# its own device (no-op for the cpu and disk tiers). Moving them to the GPU with the rest made
# every host-tier gather and store copy them back first: a sync behind all queued compute.
POOL_INDEX_FIELDS = frozenset({"kv_slots", "residual_ids", "complete_len", "slots"})


def _move(obj, move):
    changes = {f.name: move(getattr(obj, f.name)) for f in fields(obj)
               if f.name not in POOL_INDEX_FIELDS and isinstance(getattr(obj, f.name), torch.Tensor)}
    return replace(obj, **changes, host=host_of(obj))


def view_in(moved: torch.Tensor, packed: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """The view of `moved` (a contiguous copy of `packed` elsewhere) that `t` is of `packed`, or None
    where t is not a view of packed."""
    if t.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr():
        return None
    return moved.as_strided(t.shape, t.stride(), t.storage_offset() - packed.storage_offset())


def host_of(obj):
    """The batch builder's all-host version of a moved group, part or write (itself if not moved):
    what CPU attention and host-side index arithmetic read, with no device -> host copy."""
    return obj if obj.host is None else obj.host


@dataclass
class KVPart:
    """The keys of a group's sequences that live in one tier."""

    tier: str
    kv_slots: torch.Tensor  # [B, L] slots in that tier's pool, padded with slot 0
    kv_start: torch.Tensor  # [B] position of each sequence's first key in this tier
    kv_len: torch.Tensor  # [B] keys of this tier visible to the group (new tokens included)
    patch_src: torch.Tensor  # [P] group rows (0..B*n-1) whose new K/V belong in this part
    patch_seq: torch.Tensor  # [P] which sequence b of the group
    patch_pos: torch.Tensor  # [P] index into the part's L
    residual_ids: torch.Tensor  # [B] each sequence's residual row (compressed pools)
    complete_len: torch.Tensor  # [B] leading keys of this part in blocks completed before the pass
    # (lo, hi): when the part's whole context is each sequence's own new rows lo..hi-1 (prompt chunks
    # whose keys in this tier all arrive in this pass), in order; the executor then attends them
    # directly instead of gathering slots from the pool and patching every one of them.
    new_rows: tuple[int, int] | None = None
    host: "KVPart | None" = field(default=None, repr=False, compare=False)  # see host_of


@dataclass
class AttentionGroup:
    """Sequences attended together; each brings `num_queries` rows (decodes: 1, grouped; whole
    prompts of one length and one tier layout: grouped; a later prompt chunk: alone)."""

    token_rows: torch.Tensor  # [B * n] rows of the micro-batch, sequence-major
    num_queries: int  # n
    q_pos: torch.Tensor  # [B, n] absolute positions of the query rows
    parts: list[KVPart]
    row_start: int | None = None  # token_rows == row_start + arange(B * n): the executor slices
    host: "AttentionGroup | None" = field(default=None, repr=False, compare=False)  # see host_of

    @property
    def num_seqs(self) -> int:
        return self.q_pos.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.num_queries == 1


@dataclass
class KVWrite:
    """New K/V of `rows` of the micro-batch go to `slots` of `tier`'s pool."""

    tier: str
    rows: torch.Tensor  # [S]
    slots: torch.Tensor  # [S]
    residual_ids: torch.Tensor  # [S] residual row of each token's sequence
    row_start: int | None = None  # rows == row_start + arange(S): the executor slices
    host: "KVWrite | None" = field(default=None, repr=False, compare=False)  # see host_of


@dataclass
class MicroBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    groups: list[AttentionGroup]
    kv_writes: list[KVWrite]
    logit_rows: torch.Tensor  # [R] rows whose next-token logits are wanted
    # the contiguous int64 host tensor that the index fields are views of (the batch builder's):
    # moved to a device in one copy; None: each field moves on its own
    packed: torch.Tensor | None = None
    # LoRA adapters served per request: {adapter id: its rows [R] (None: every row)}; empty: none
    lora_rows: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def to(self, device: torch.device) -> "MicroBatch":
        """On `device` for compute; pool indices stay on the host (POOL_INDEX_FIELDS), and every
        moved group, part and write keeps its host original (host_of). On the CPU: itself. The
        fields that are views of `packed` go up in its one copy (on a GPU each copy of a pageable
        tensor is a pinning and a copy: ~11 per decode micro-batch otherwise)."""
        if torch.device(device).type == "cpu":
            return self
        packed = self.packed
        moved = None if packed is None else to_device(packed, device)

        def move(t: torch.Tensor) -> torch.Tensor:
            view = None if moved is None else view_in(moved, packed, t)
            return to_device(t, device) if view is None else view

        groups = [replace(_move(g, move), parts=[_move(p, move) for p in g.parts]) for g in self.groups]
        return MicroBatch(move(self.token_ids), move(self.positions), groups, [_move(w, move) for w in self.kv_writes],
                          move(self.logit_rows), lora_rows={adapter: None if rows is None else move(rows)
                                                            for adapter, rows in self.lora_rows.items()})
