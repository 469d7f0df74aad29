"""The protocol between the executor and whatever keeps the weights (offload.tiered_weights'
TieredWeights: everything on the compute device is the case w_gpu = 1)."""
from __future__ import annotations

from typing import Protocol

import torch

Weights = dict[str, torch.Tensor]
# In a layer's weights where it has stacked row blocks (experts) read after routing or computed on
# the cpu tier: an object with load(blocks) and on_cpu(block) (offload.tiered_weights.RowBlockAccess).
ROW_BLOCKS = "row_blocks"


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
