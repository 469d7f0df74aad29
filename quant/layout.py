"""`GroupLayout`: where the groups of a tensor are, derived from its shape and a `QuantConfig`.

Quantization works on a 2-d view `[num_groups, group_size]`: the group dimension is moved last,
padded up to a multiple of `group_size`, and the result cut into rows. This module is the only place
that knows that mapping, so `quantize`, `dequantize` and `QTensor` validation cannot disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quant.config import QuantConfig


@dataclass(frozen=True)
class GroupLayout:
    shape: tuple[int, ...]  # the original shape (may be 0-d)
    group_dim: int  # normalised, non-negative, into `work_shape`
    group_size: int

    @classmethod
    def of(cls, shape: tuple[int, ...] | torch.Size, config: QuantConfig) -> "GroupLayout":
        shape = tuple(int(s) for s in shape)
        ndim = max(len(shape), 1)  # a 0-d tensor is quantized as a 1-element vector
        if not -ndim <= config.group_dim < ndim:
            raise ValueError(
                f"QuantConfig.group_dim={config.group_dim} is out of range for a tensor of shape {shape}"
            )
        return cls(shape=shape, group_dim=config.group_dim % ndim, group_size=config.group_size)

    @property
    def work_shape(self) -> tuple[int, ...]:
        return self.shape or (1,)

    @property
    def group_len(self) -> int:
        """Length of the group dimension before padding."""
        return self.work_shape[self.group_dim]

    @property
    def padded_len(self) -> int:
        return math.ceil(self.group_len / self.group_size) * self.group_size

    @property
    def num_rows(self) -> int:
        """Number of 1-d lines along the group dimension (product of all other dimensions)."""
        return math.prod(self.work_shape) // self.group_len if self.group_len else 0

    @property
    def num_groups(self) -> int:
        return self.num_rows * (self.padded_len // self.group_size)

    @property
    def groups_are_contiguous(self) -> bool:
        """True when `[num_groups, group_size]` is just a view of the tensor (no move, no pad)."""
        return self.group_dim == len(self.work_shape) - 1 and self.padded_len == self.group_len

    def to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """`x` of `shape` -> contiguous `[num_groups, group_size]` (a view when no move or pad is needed)."""
        lines = x.reshape(self.work_shape).movedim(self.group_dim, -1)  # [*rest, group_len]
        pad = self.padded_len - self.group_len
        if pad:
            # Pad with copies of the line's last value: it already belongs to the last group, so
            # the group's min and max (hence its scale) are exactly those of the real values.
            lines = torch.cat([lines, lines[..., -1:].expand(*lines.shape[:-1], pad)], dim=-1)
        return lines.reshape(self.num_groups, self.group_size).contiguous()

    def from_groups(self, groups: torch.Tensor) -> torch.Tensor:
        """`[num_groups, group_size]` -> a tensor of `shape` (a view where possible)."""
        rest = tuple(s for d, s in enumerate(self.work_shape) if d != self.group_dim)
        lines = groups.reshape(*rest, self.padded_len)[..., : self.group_len]  # [*rest, group_len]
        return lines.movedim(-1, self.group_dim).reshape(self.shape)
