"""CUDA device and stream discipline for the offload threads; every helper is a no-op on the CPU.

- Threads: CUDA's current device is per thread, so each worker thread (KV/activation I/O, weight
  prefetch) is bound to the engine's device when it starts (`bind_thread`), and the pass runs
  under `device_guard` (kernels, Triton launches and new streams go to `cuda:N`, not `cuda:0`).
- Ordering without host syncs: KV and activation traffic runs on ONE side stream (`IOStream`);
  it waits for compute through events recorded on the compute stream, compute waits for it the
  same way, and a tensor made on one stream and used on the other is marked with `record_stream`
  so the caching allocator does not hand its memory out while the other stream may still read it.
- Host copies: a device -> host copy into pageable memory is a stream synchronization; `to_host`
  copies into pinned memory and waits on an event instead (no stream is drained, and
  `torch.cuda.set_sync_debug_mode("error")` does not count an event wait as a sync).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


def bind_thread(device: torch.device) -> None:
    """ThreadPoolExecutor initializer: this thread's current CUDA device is the engine's. Pass
    `indexed(device)`, made on the engine's thread: a bare "cuda" means that thread's device."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index)


def indexed(device: torch.device) -> torch.device:
    """`device` with its index made explicit ("cuda" -> "cuda:<this thread's current device>")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_guard(device: torch.device):
    """`with device_guard(d):` makes d the current CUDA device for the block (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on `device`'s current stream: what it has queued so far (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(event: torch.cuda.Event | None, device: torch.device) -> None:
    """`device`'s current stream waits (on the GPU, not the host) for `event`."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def used_on(tensors, stream: torch.cuda.Stream | None) -> None:
    """Mark CUDA tensors as used on `stream` (see record_stream); None and CPU tensors are skipped."""
    if stream is None:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, without waiting. A pageable host tensor goes up from a pinned copy (from
    pageable memory the driver may wait for the stream before it stages the bytes)."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU. From CUDA: a non-blocking copy into pinned memory, then a wait on an event
    recorded after it (only this copy and what precedes it on the current stream are waited for)."""
    return to_host_all(t)[0]


def to_host_all(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor on the CPU, as to_host, with one event wait for all of them."""
    on_cuda = [t for t in tensors if t.device.type == "cuda"]
    if not on_cuda:
        return list(tensors)
    hosts = []
    for t in tensors:
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t = host
        hosts.append(t)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(on_cuda[0].device))
    event.synchronize()
    return hosts


class IOStream:
    """The side stream KV and activation loads and stores run on (CUDA); on the CPU it is inert.

    `run(fence, fn, *args)` (on the I/O thread) makes the stream wait for `fence` (an event of the
    compute stream), runs fn with the stream current, and returns (fn's result, an event recorded
    after it) for the compute stream to wait on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, fence: torch.cuda.Event | None, fn, *args):
        """On the I/O thread: inference mode is per thread, so it is entered here for the step."""
        with torch.inference_mode():
            return self._run(fence, fn, *args)

    def _run(self, fence: torch.cuda.Event | None, fn, *args):
        if self.stream is None:
            return fn(*args), None
        with torch.cuda.stream(self.stream):
            if fence is not None:
                self.stream.wait_event(fence)
            result = fn(*args)
            done = torch.cuda.Event()
            done.record(self.stream)
        return result, done
