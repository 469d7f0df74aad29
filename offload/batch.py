"""What the executor needs to run one micro-batch: flattened tokens and attention metadata.

Built by the engine from the scheduler's decision; the executor only moves and computes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionGroup:
    """Sequences attended together, all with their KV in one tier's pool. Every sequence brings
    `num_queries` rows: decodes are grouped (n = 1); a prompt chunk is alone in its group."""

    token_rows: torch.Tensor  # [B * n] rows of the micro-batch, sequence-major
    num_queries: int  # n
    store_slots: torch.Tensor  # [B * n] cache slots where the new rows' K/V are written
    kv_slots: torch.Tensor  # [B, L] cache slots of each sequence's context, padded with slot 0
    kv_len: torch.Tensor  # [B] context length, new tokens included
    q_pos: torch.Tensor  # [B, n] absolute positions of the query rows
    kv_tier: str = "gpu"  # tier whose pool holds these sequences' KV

    @property
    def num_seqs(self) -> int:
        return self.kv_slots.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.num_queries == 1


@dataclass
class MicroBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    groups: list[AttentionGroup]
    logit_rows: torch.Tensor  # [R] rows whose next-token logits are wanted

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def to(self, device: torch.device) -> "MicroBatch":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        groups = [replace(g, token_rows=move(g.token_rows), store_slots=move(g.store_slots),
                          kv_slots=move(g.kv_slots), kv_len=move(g.kv_len), q_pos=move(g.q_pos))
                  for g in self.groups]
        return MicroBatch(move(self.token_ids), move(self.positions), groups, move(self.logit_rows))
