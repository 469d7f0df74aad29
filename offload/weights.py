"""The protocol between the executor and whatever keeps the weights (offload.tiered_weights'
TieredWeights: everything on the compute device is the case w_gpu = 1)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

Weights = dict[str, torch.Tensor]
# In a layer's weights where it has stacked row blocks (experts) read after routing or computed on
# the cpu tier: an object with load(blocks) and on_cpu(block) (offload.tiered_weights.RowBlockAccess).
ROW_BLOCKS = "row_blocks"


@dataclass(frozen=True)
class RowSplit:
    """A 2-D weight whose rows live in consecutive parts: a weight cut between the gpu tier and the
    others keeps its gpu rows where they are and only the rest is streamed into a working buffer,
    so a buffer holds what is off the GPU (as the planner prices it), not the whole weight, and the
    gpu rows are not copied every layer. A linear is one matmul per part, outputs concatenated
    (flexsarathi/models/layers.py). parts: tensors, QTensors or Int4Packed, [rows_i, in_features]."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(part.shape[0] for part in self.parts), self.parts[0].shape[1])

    def whole(self) -> torch.Tensor:
        """The weight as one new tensor (uncompressed parts only): for inspection, not the hot path."""
        return torch.cat(self.parts)

    def rows(self, start: int, stop: int):
        """Rows [start, stop): a view of one part, or a RowSplit of the parts it spans."""
        pieces, offset = [], 0
        for part in self.parts:
            lo, hi = max(start - offset, 0), min(stop - offset, part.shape[0])
            if lo < hi:
                pieces.append(part[lo:hi] if isinstance(part, torch.Tensor) else part.rows(lo, hi))
            offset += part.shape[0]
        return pieces[0] if len(pieces) == 1 else RowSplit(tuple(pieces))


class LayerWeightStore(Protocol):
    num_layers: int
    prefetch_depth: int  # layers the executor keeps loading ahead of the one it computes

    def global_weights(self) -> Weights:
        """Embeddings, final norm, LM head: on the compute device."""

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer` to the compute device (asynchronous where overlap is on)."""

    def get(self, layer: int) -> Weights:
        """Wait for `layer` and return it on the compute device."""

    def release(self, layer: int) -> None:
        """The pass is done with `layer`: its working buffer may be reused."""

    def reset(self) -> None:
        """A pass was interrupted: finish or cancel loads in flight, free every working buffer."""


@dataclass(frozen=True)
class LoraLinear:
    """A layer weight with LoRA updates for some rows of x (adapters served per request): those rows
    get x @ (W + B A).T, B A being one adapter's update of the weight (its scale folded into B), the
    others x @ W.T (flexsarathi/models/layers.py). updates: (rows, A [r, in], B [out, r]) per adapter
    in the micro-batch; rows: its rows of x [R] on x's device, or None where it is every row."""

    base: Any
    updates: tuple[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.base.shape)


def with_lora(w: Weights, factors: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]],
              rows: dict[int, torch.Tensor | None]) -> Weights:
    """One layer's weights `w` with the updates of each adapter in `rows` ({adapter: its rows, None:
    all}) wrapped around the weights it adapts; factors: {adapter: {weight: (A, B)}} of this layer."""
    updates: dict[str, list] = {}
    for adapter, adapter_rows in rows.items():
        for name, (a, b) in factors[adapter].items():
            updates.setdefault(name, []).append((adapter_rows, a, b))
    return {**w, **{name: LoraLinear(w[name], tuple(u)) for name, u in updates.items()}}

