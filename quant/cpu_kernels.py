"""The C kernels under quant/csrc: compiled once per machine, loaded with ctypes, split over threads.

Each kernel is one C file, compiled with the system's C compiler (`cc`, or $CC) into
~/.cache/flexsarathi/kernels (or $FLEXSARATHI_KERNEL_CACHE), keyed by the source, the flags and the
compiler (atomically: concurrent builders each write a temporary file and rename it). ctypes calls
release the GIL, so `split` runs one share of a call per thread.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# AVX2 code; -ffp-contract=off: the stated fp32 arithmetic, with no fused multiply-adds the tests'
# torch references would not have.
# -fopenmp: a kernel's threads are torch's own OpenMP workers (libgomp.so.1 resolves to the copy torch
# loaded; quant/csrc/q4_int8_gemm.c says why that matters).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
LIBS = ("-lm",)  # after the source: expf / logf of the attention kernel

_pool_lock = threading.Lock()
_pools: dict[int, object] = {}


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc (None: none here)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path) -> Path:
    """The compiled kernel's path, built on first use. RuntimeError says why it cannot be had here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"{source.name} is AVX2 code; this machine is {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"{source.name} needs AVX2 (torch reports CPU capability {capability})")
    compiler = c_compiler()
    if not compiler:
        raise RuntimeError(f"no C compiler (cc, gcc or $CC) to build {source.name} with")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS + LIBS).encode() + version.encode()).hexdigest()[:16]
    folder = Path(os.environ.get("FLEXSARATHI_KERNEL_CACHE")
                  or Path.home() / ".cache" / "flexsarathi" / "kernels")
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        built = subprocess.run([compiler, *FLAGS, "-o", temporary, str(source), *LIBS], capture_output=True, text=True)
        if built.returncode != 0:  # a compiler without OpenMP: the same kernels, on the calling thread alone
            serial = [f for f in FLAGS if f != "-fopenmp"]
            built = subprocess.run([compiler, *serial, "-o", temporary, str(source), *LIBS], capture_output=True,
                                   text=True)
        if built.returncode != 0:
            raise RuntimeError(f"building {source.name} with {compiler} failed: {built.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def load(source: Path, signatures: dict[str, list]) -> tuple[ctypes.CDLL | None, str | None]:
    """(the built and loaded kernel, None), or (None, why not); `signatures`: each function's ctypes
    argument types (all return nothing)."""
    try:
        lib = ctypes.CDLL(str(build(source)))
    except (OSError, RuntimeError) as e:
        return None, str(e)
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib, None


class Kernel:
    """One C file's functions, built and loaded on first use, once per process: `lib()` (a
    RuntimeError that says why where it cannot be had), `available()`, `unavailable_reason()`
    (None where it is loaded; else no AVX2, no compiler, or the build's error); `reset()` forgets
    the outcome (tests that change the compiler)."""

    def __init__(self, who: str, source: Path, signatures: dict[str, list]):
        self.who, self.source, self.signatures = who, source, signatures
        self._loaded: tuple[ctypes.CDLL | None, str | None] | None = None

    def loaded(self) -> tuple[ctypes.CDLL | None, str | None]:
        if self._loaded is None:
            self._loaded = load(self.source, self.signatures)
        return self._loaded

    def lib(self) -> ctypes.CDLL:
        lib, reason = self.loaded()
        if lib is None:
            raise RuntimeError(f"{self.who}: the kernel is not available here: {reason}")
        return lib

    def available(self) -> bool:
        return self.loaded()[0] is not None

    def unavailable_reason(self) -> str | None:
        return self.loaded()[1]

    def reset(self) -> None:
        self._loaded = None


def split(fn, total: int, parts: int, align: int = 1, chunks_per_part: int = 1) -> None:
    """fn(start, stop) over [0, total) on `parts` threads (this one among them), in ranges that are
    multiples of `align`. chunks_per_part > 1: that many ranges per thread, taken in turn as each
    thread finishes its last, so a core slowed by other work (the engine's disk reads, the
    neighbours of a shared machine) takes fewer of them instead of holding the whole call back."""
    if total <= 0:
        return
    pieces = max(1, parts) * max(1, chunks_per_part)
    step = -(-total // pieces)
    step = -(-step // align) * align
    ranges = [(s, min(total, s + step)) for s in range(0, total, step)]
    workers = min(max(1, parts), len(ranges))
    if workers == 1:
        for r in ranges:
            fn(*r)
        return
    queue, lock = iter(ranges), threading.Lock()

    def take_in_turn() -> None:
        while True:
            with lock:
                r = next(queue, None)
            if r is None:
                return
            fn(*r)

    pool = _pool(workers - 1)
    futures = [pool.submit(take_in_turn) for _ in range(workers - 1)]
    try:
        take_in_turn()
    finally:
        for f in futures:
            f.result()


def _pool(workers: int):
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with _pool_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="cpu-kernel")
        return _pools[workers]
