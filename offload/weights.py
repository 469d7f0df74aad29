"""Where the weights live, and how a layer gets to the compute device.

`ResidentWeights` keeps every weight on the compute device (the everything-on-one-device
reference). Tiered placement implements the same protocol, so the executor's loop is one loop.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

Weights = dict[str, torch.Tensor]


class LayerWeightStore(Protocol):
    num_layers: int

    def global_weights(self) -> Weights:
        """Embeddings, final norm, LM head: on the compute device."""

    def prefetch(self, layer: int) -> None:
        """Start bringing `layer` to the compute device (asynchronous where overlap is on)."""

    def get(self, layer: int) -> Weights:
        """Wait for `layer` and return it on the compute device."""

    def release(self, layer: int) -> None:
        """The pass is done with `layer`: its working buffer may be reused."""


class ResidentWeights:
    def __init__(self, num_layers: int, read_globals: Callable[[], Weights],
                 read_layer: Callable[[int], Weights], device: torch.device):
        self.num_layers = num_layers
        self._globals = {k: t.to(device) for k, t in read_globals().items()}
        self._layers = [{k: t.to(device) for k, t in read_layer(i).items()} for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        tensors = list(self._globals.values()) + [t for w in self._layers for t in w.values()]
        return sum(t.nbytes for t in tensors)

    def global_weights(self) -> Weights:
        return self._globals

    def prefetch(self, layer: int) -> None:
        pass  # already resident

    def get(self, layer: int) -> Weights:
        return self._layers[layer]

    def release(self, layer: int) -> None:
        pass
