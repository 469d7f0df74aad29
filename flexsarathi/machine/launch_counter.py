"""Counting the kernels a piece of PyTorch code launches, on any device (the CPU included).

A decode pass that keeps everything on a GPU is bound by host time per kernel launch, not by bytes
(docs/DESIGN.md, "Decode passes on a GPU"). Under a dispatch mode every aten operator reaches us
after autograd and composite decomposition, as a GPU would run it: an operator that computes or
copies is one launch; a view (`transpose`, `slice`, `view`, ...) and a bare allocation (`empty`) are
none; an operator that may alias (`to`) counts where it made new memory. The same code path run on
the CPU therefore gives the GPU's count, which `scripts/count_launches.py` checks against the CUDA
profiler where a GPU is at hand.

`LaunchCounter` also records each launch as (operator, input shapes, input dtypes, the address of
each input's storage): two steady decode steps of a pass that a CUDA graph can replay issue the same
sequence on the same long-lived buffers, and none of the operators in SYNCS, which wait for the
device (or, `pin_memory`, allocate page-locked memory).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# No kernel: allocation only, or metadata.
_NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
    "lift_fresh", "detach", "alias", "_reshape_alias", "is_pinned", "record_stream", "size", "stride",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
})
# Operators that make the host wait for the device or pin host memory: none may run inside a
# captured pass (its graph would freeze their results).
SYNCS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "_pin_memory", "pin_memory",
                   "equal", "allclose", "masked_select", "unique", "_unique2"})


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _copied(out, inputs) -> bool:
    """Whether an operator that may alias its input (under inference mode `x.float()` and `.to(dtype)`
    reach a dispatch mode as `aten::to`, not decomposed to `_to_copy`) made new memory: a copy
    kernel. A true view shares its input's storage."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    return any(isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in storages
               for t in outs)


class LaunchCounter(TorchDispatchMode):
    """with LaunchCounter() as c: ...; c.launches, c.ops (name, shapes, dtypes, storage addresses)
    per launch, c.syncs."""

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.launches = 0
        self.ops: list[tuple[str, tuple, tuple, tuple]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in SYNCS:
            self.syncs.append(name)
        inputs = (*args, *kwargs.values())
        out = func(*args, **kwargs)
        if name not in _NO_KERNEL and (not func.is_view or _copied(out, inputs)):
            self.record(name, inputs)
        return out

    def record(self, name: str, args) -> None:
        """One launch of `name` with these arguments (their tensors' shapes, dtypes and storages)."""
        self.launches += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((name, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors),
                         tuple(t.untyped_storage().data_ptr() for t in tensors)))



def launched_outside_aten(name: str, fn):
    """fn wrapped to count as one launch for every LaunchCounter active when it is called: a kernel
    launched outside aten (a Triton kernel's Python launch, which no dispatch mode sees). fn runs
    with the dispatch modes off: on a GPU it launches that one kernel; in Triton's interpreter on
    the CPU, the interpreter's own tensor copies are not a GPU's launches. Who wraps such a launch:
    counting_triton_launches."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    def counted(*args, **kwargs):
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, LaunchCounter):
                mode.record(name, (*args, *kwargs.values()))
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return counted


class _CountedKernel:
    """A Triton kernel whose launches (`kernel[grid](...)`) count as one each."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        return launched_outside_aten(self.name, self.kernel[grid])


@contextlib.contextmanager
def counting_triton_launches(*kernels: tuple[object, str]):
    """Inside: each launch of these Triton kernels ((module, attribute name) pairs, e.g.
    (quant.triton_kv_attention, "_decode_kernel")) counts as one for every LaunchCounter active then
    (launched_outside_aten). Process-wide: the module attributes are swapped while inside."""
    originals = [getattr(module, name) for module, name in kernels]
    for (module, name), kernel in zip(kernels, originals):
        setattr(module, name, _CountedKernel(name, kernel))
    try:
        yield
    finally:
        for (module, name), kernel in zip(kernels, originals):
            setattr(module, name, kernel)
