"""What a benchmark's bound needs: the model's matmul shapes and FLOPs per pass, this machine's
measured disk and matmul rates, and a record of every pass a run makes. The bound of a pass is
max(disk bytes / disk rate, FLOPs / matmul rate at its token count); bench_offload, bench_70b and
bench_llamacpp print measured time against it.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import torch

from harness import GB, cpu_seconds, drop_cache_of, timed_into

RATE_TOKENS = (1, 8, 32, 128, 512, 1024)


@dataclass(frozen=True)
class Shapes:
    """What the bound needs of the model (of a llama-family or mixture-of-experts planner spec)."""
    layers: int
    hidden: int
    vocab: int
    # (out, in) of the matmuls a token runs through in one layer, as the engine fuses them (with
    # experts: attention and one expert): what the matmul rates are measured on
    matrices: tuple[tuple[int, int], ...]
    active_params: float = 0.0  # matrix parameters one token multiplies per layer (0: the matrices')
    stored_params: float = 0.0  # every matrix parameter of a layer, all experts (0: the matrices')
    q_dim: int = 0  # query heads x head_dim (0: hidden)

    @classmethod
    def of(cls, spec) -> "Shapes":
        h, q, kv, f = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.ffn_size
        if not spec.num_experts:
            return cls(spec.num_layers, h, spec.vocab_size, ((q + 2 * kv, h), (h, q), (2 * f, h), (h, f)), q_dim=q)
        e = spec.expert_ffn_size
        return cls(spec.num_layers, h, spec.vocab_size, ((q + 2 * kv, h), (h, q), (2 * e, h), (h, e)),
                   active_params=spec.layer_active_matrix_params, stored_params=spec.layer_matrix_params, q_dim=q)

    @property
    def measured_params(self) -> int:
        return sum(o * i for o, i in self.matrices)

    @property
    def layer_matrix_params(self) -> float:
        """Every matrix parameter of one layer (all experts): what a pass streams."""
        return self.stored_params or self.measured_params

    def pass_flops(self, tokens: int, attended_keys: int, logit_rows: int) -> float:
        # matmuls: each token's active parameters (its top-k experts only); attention: q.k and p.v
        # over every attended key, 2 FLOPs each per query head dim
        active = self.active_params or self.measured_params
        return (self.layers * (2.0 * active * tokens + 4.0 * (self.q_dim or self.hidden) * attended_keys)
                + 2.0 * self.hidden * self.vocab * logit_rows)


# ---- measured rates ---------------------------------------------------------------------------


@dataclass
class Rates:
    disk_direct: float  # bytes/s, the DiskStore's O_DIRECT reads into aligned buffers
    disk_buffered: float  # bytes/s, cold buffered sequential reads of the same files
    matmul: dict[int, float]  # tokens -> FLOP/s for the layer's matmuls in the run's dtype
    disk_engine_path: float = 0.0  # bytes/s, read_range_async into aligned buffers (as the engine reads)

    @property
    def disk(self) -> float:
        """The fastest way measured to read these bytes from this disk: the bound's bandwidth."""
        return max(self.disk_direct, self.disk_buffered, self.disk_engine_path)

    def rate(self, tokens: int) -> float:
        pts = sorted(self.matmul)
        t = max(tokens, 1)
        if t <= pts[0]:
            return self.matmul[pts[0]]
        if t >= pts[-1]:
            return self.matmul[pts[-1]]
        for lo, hi in zip(pts, pts[1:]):
            if lo <= t <= hi:
                w = (math.log(t) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return math.exp((1 - w) * math.log(self.matmul[lo]) + w * math.log(self.matmul[hi]))
        raise AssertionError

    def balance_tokens(self, shapes: Shapes, disk_bytes: float) -> int:
        """Smallest pass size (multiple of 32) whose matmuls take as long as reading the weights."""
        io_s = disk_bytes / self.disk
        for t in range(32, 8193, 32):
            if shapes.pass_flops(t, 0, 0) / self.rate(t) >= io_s:
                return t
        return 8192

    def bound(self, shapes: Shapes, disk_bytes: float, tokens: int, attended: int, rows: int) -> tuple[float, float]:
        """(I/O seconds, compute seconds) of one pass / forward."""
        return disk_bytes / self.disk, shapes.pass_flops(tokens, attended, rows) / self.rate(tokens)

    def with_best_matmul(self, other: dict[int, float]) -> "Rates":
        """These rates, each token count's matmul rate the faster of this one and `other` (another
        measurement of the same shapes: a busy neighbour can slow a measurement, never speed it up,
        so the faster is nearer what the machine can do, and the bound it gives is the tighter)."""
        return replace(self, matmul={t: max(r, other.get(t, 0.0)) for t, r in self.matmul.items()})


def rebound(passes: list["Pass"], shapes: Shapes, rates: Rates) -> None:
    """Each recorded pass's two halves of the bound again, at `rates`."""
    for p in passes:
        p.io_s, p.compute_s = rates.bound(shapes, p.disk_bytes, p.tokens, p.attended, p.rows)


def cpu_per_gb(fn, *args) -> tuple[float, float]:
    """(bytes/s, process CPU seconds per GB read) of one read-all measurement."""
    c0, w0 = cpu_seconds(), time.perf_counter()
    rate = fn(*args)
    nbytes = rate * (time.perf_counter() - w0)
    return rate, (cpu_seconds() - c0) / (nbytes / GB)


def measure_disk_buffered(files) -> float:
    """Cold buffered sequential reads (4 MiB requests) of `files` after dropping their page cache."""
    drop_cache_of(files)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                total += n
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - start
    drop_cache_of(files)
    return total / elapsed


@torch.inference_mode()
def measure_matmul(matrices, dtype: torch.dtype, rounds: int = 5, seconds_per_round: float = 0.15,
                   row_counts: tuple[int, ...] = RATE_TOKENS) -> dict[int, float]:
    """FLOP/s of one layer's matmuls (`matrices`: (out, in) each) in `dtype` (F.linear, as the engine
    runs them) per row count T (best_rates)."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for o, i in matrices]
    xs = {t: [torch.randn(t, w.shape[1], generator=gen).to(dtype) for w in ws] for t in row_counts}

    def layer(t: int) -> None:
        for w, x in zip(ws, xs[t]):
            torch.nn.functional.linear(x, w)

    return best_rates(layer, 2.0 * sum(w.numel() for w in ws), row_counts, rounds, seconds_per_round)


def best_rates(layer, flops_per_row: float, row_counts, rounds: int, seconds_per_round: float) -> dict[int, float]:
    """FLOP/s of `layer(T)` (one layer's matmuls over T rows) per row count: the best of `rounds`
    short rounds, interleaved over T, after a warm-up call each (oneDNN primitives for every
    shape). Best, not mean: the neighbours' load comes in bursts, and the bound wants what the
    machine can do, not what was left of it at one moment."""
    best = {t: 0.0 for t in row_counts}
    for t in row_counts:
        layer(t)
    for _ in range(rounds):
        for t in row_counts:
            reps, start = 0, time.perf_counter()
            while True:
                layer(t)
                reps += 1
                elapsed = time.perf_counter() - start
                if elapsed > seconds_per_round:
                    break
            best[t] = max(best[t], flops_per_row * t * reps / elapsed)
    return best


# ---- per-pass records -------------------------------------------------------------------------


@dataclass
class Pass:
    tokens: int
    attended: int
    rows: int
    seconds: float
    disk_bytes: float
    io_s: float = 0.0
    compute_s: float = 0.0
    stall_s: float = 0.0  # time the pass waited for weights (ours)
    load_s: float = 0.0  # time spent loading weights (ours, on whichever thread)


def instrument(llm, shapes: Shapes, rates: Rates, disk_bytes_per_pass: int, passes: list[Pass]) -> None:
    """Record every pass: tokens, attended keys, logit rows, time, weight-load and stall time.

    Wraps instance attributes only (the engine is untouched); loads run on the prefetch thread
    with overlap on, so their time is summed separately from the time get() waited for them.
    """
    executor, weights = llm.engine.executor, llm.engine.weights
    run, load, get = executor.run, weights._load, weights.get
    acc = {"load": 0.0, "stall": 0.0}

    def timed_run(micro_batches):
        tokens = sum(mb.num_tokens for mb in micro_batches)
        attended = sum(int((mb.positions + 1).sum()) for mb in micro_batches)
        rows = sum(mb.logit_rows.numel() for mb in micro_batches)
        acc["load"] = acc["stall"] = 0.0
        t = time.perf_counter()
        out = run(micro_batches)
        seconds = time.perf_counter() - t
        io_s, compute_s = rates.bound(shapes, disk_bytes_per_pass, tokens, attended, rows)
        passes.append(Pass(tokens, attended, rows, seconds, disk_bytes_per_pass, io_s, compute_s,
                           acc["stall"], acc["load"]))
        return out

    weights._load, weights.get = timed_into(acc, "load", load), timed_into(acc, "stall", get)
    executor.run = timed_run
