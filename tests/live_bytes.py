"""`LiveBytes`: the most bytes that tensors created inside it held at once, counted as a caching
allocator holds them (a storage from its allocation until its last tensor is gone)."""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storages_alive() -> dict[int, torch.UntypedStorage]:
    """Every tensor's storage alive now (weights, pools, buffers made before a measurement), by data
    pointer. LiveBytes holds them while it measures: one freed meanwhile (the last step's logits)
    would let a new allocation take its address and pass for it (not counted; peaks that varied run
    to run with the allocator's choices)."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}


class LiveBytes(TorchDispatchMode):
    """Checked after every op, outputs alive; storages the caller names (`existing`, e.g. a pool's
    own, or storages_alive() before the measured call) are not counted, nor are views of them."""

    def __init__(self, existing):
        super().__init__()
        self._held = existing  # storages_alive()'s storages stay alive (their addresses taken) meanwhile
        self.existing, self.storages, self.peak = set(existing), {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.existing:
                storage = t.untyped_storage()
                refs, nbytes = self.storages.get(storage.data_ptr(), ([], 0))
                if not any(r() is not None for r in refs):  # a new allocation at a freed address
                    refs, nbytes = [], storage.nbytes()
                self.storages[storage.data_ptr()] = (refs + [weakref.ref(t)], nbytes)
        live = sum(n for refs, n in self.storages.values() if any(r() is not None for r in refs))
        self.peak = max(self.peak, live)
        return out
