"""`LiveBytes`: the most bytes that tensors created inside it held at once, counted as a caching
allocator holds them (a storage from its allocation until its last tensor is gone)."""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storages_alive() -> set[int]:
    """Data pointers of every tensor alive now (weights, pools, buffers made before a measurement)."""
    gc.collect()
    return {o.untyped_storage().data_ptr() for o in gc.get_objects() if isinstance(o, torch.Tensor)}


class LiveBytes(TorchDispatchMode):
    """Checked after every op, outputs alive; storages the caller names (`existing`, e.g. a pool's
    own, or storages_alive() before the measured call) are not counted, nor are views of them."""

    def __init__(self, existing):
        super().__init__()
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
