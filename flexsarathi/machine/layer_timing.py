"""Timing primitives the profiler and the CPU dtype choice share: medians of repeated calls and one
decoder layer's matmuls. No engine imports: the engine's dtype rule measures with these."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from policy_search.model_spec import ModelSpec


def median_seconds(fn, repeats: int = 5, warmup: int = 1, budget: float = 2.0) -> float:
    """Median seconds of `fn` after `warmup` calls; slow calls get fewer repeats (at least 3) so
    one figure takes about `budget` seconds at most, whatever the machine."""
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < repeats:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) >= 3 and sum(times) >= budget:
            break
    return statistics.median(times)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_seconds(fn, device: torch.device, replays: int = 20) -> tuple[float, bool]:
    """(seconds the device takes per call of `fn`, whether a CUDA graph timed it). On CUDA, `fn` (which
    must not synchronize) is captured once in a CUDA graph and replayed `replays` times between two
    events: the GPU's own time, with no host launch gap between its kernels, as a large or replayed
    pass sees it (a small call timed from the host measures the launches instead: an opt-125m layer's
    attention came out at 45 GFLOP/s on an H200, 10x below the pass it priced). An `fn` that cannot be
    captured is enqueued `replays` times back to back between the events instead. On the CPU, the
    median of host-timed calls."""
    if device.type != "cuda":
        return median_seconds(fn), False
    fn()  # warm-up: cuBLAS handles, the caching allocator's blocks, Triton's compiles
    torch.cuda.synchronize(device)
    call, graphed = fn, True
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
    except RuntimeError:  # an op that cannot be captured: back-to-back calls instead
        torch.cuda.synchronize(device)
        call, graphed = fn, False
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays, graphed


@dataclass(frozen=True)
class LayerShapes:
    """What the profile measures on: one decoder layer's matrices and its attention heads."""
    matrices: tuple[tuple[int, int], ...]  # (out, in) of each weight matrix, as the engine fuses them
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.matrices)

    @classmethod
    def of(cls, model: ModelSpec | None) -> "LayerShapes":
        if model is None:  # OPT-1.3B: a mid-sized layer that needs offloading on small machines
            h, f = 2048, 8192
            return cls(((3 * h, h), (h, h), (f, h), (h, f)), heads=32, kv_heads=32, head_dim=64)
        h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_size
        up = (2 * f, h) if model.ffn_kind == "gated" else (f, h)  # gate and up fused
        return cls(((q + 2 * kv, h), (h, q), up, (h, f)), heads=model.num_heads,
                   kv_heads=model.num_kv_heads, head_dim=model.head_dim)


def layer_matmuls(device, dtype, shapes: LayerShapes, tokens: int, sync: bool = True):
    """A function running the layer's matmuls over `tokens` rows (each on its own input), then (sync)
    waiting for the device."""
    weights = [torch.randn(shape, dtype=dtype, device=device) for shape in shapes.matrices]
    inputs = [torch.randn(tokens, shape[1], dtype=dtype, device=device) for shape in shapes.matrices]

    def run():
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)
        if sync:
            sync_device(device)

    return run


def layer_matmul_seconds(device, dtype, shapes: LayerShapes, tokens: int, repeats: int = 7) -> float:
    """Typical seconds of the layer's matmuls over `tokens` rows."""
    return median_seconds(layer_matmuls(device, dtype, shapes, tokens), repeats=repeats)
