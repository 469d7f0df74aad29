"""The C kernels under quant/csrc: compiled once per machine, loaded with ctypes, split over threads.

Each kernel is one C file, compiled with the system's C compiler (`cc`, or $CC) into
~/.cache/flexsarathi/kernels (or $FLEXSARATHI_KERNEL_CACHE), keyed by the source, the flags and the
compiler (atomically: concurrent builders each write a temporary file and rename it). ctypes calls
release the GIL, so `split` runs one share of a call per thread.

A kernel with instruction paths (the int8 GEMM: AVX2, AVX-VNNI, AVX-512 VNNI; `ISA_PATHS`) is built
for the one path chosen at load: the best this CPU's /proc/cpuinfo flags allow, or the one named
by $FLEXSARATHI_INT8_ISA (or `Kernel.for_isa`: tests and benchmarks run each path on one machine).
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
from dataclasses import dataclass
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# AVX2 code; -ffp-contract=off: the stated fp32 arithmetic, with no fused multiply-adds the tests'
# torch references would not have.
# -fopenmp: a kernel's threads are torch's own OpenMP workers (libgomp.so.1 resolves to the copy torch
# loaded; quant/csrc/q4_int8_gemm.c says why that matters).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
LIBS = ("-lm",)  # after the source: expf / logf of the attention kernel

ISA_ENV = "FLEXSARATHI_INT8_ISA"  # auto (default), avx2, avx_vnni or avx512_vnni


@dataclass(frozen=True)
class IsaPath:
    """One instruction path of a kernel: the /proc/cpuinfo flags it needs and what it adds to FLAGS."""
    name: str
    cpu_flags: tuple[str, ...]
    cc_flags: tuple[str, ...]


AVX2 = IsaPath("avx2", ("avx2", "fma", "f16c"), ())
# Best first: the first whose flags this CPU has is the default.
ISA_PATHS = {p.name: p for p in (
    IsaPath("avx512_vnni", AVX2.cpu_flags + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DFS_VNNI=512")),
    IsaPath("avx_vnni", AVX2.cpu_flags + ("avx_vnni",), ("-mavxvnni", "-DFS_VNNI=256")),
    AVX2)}

_pool_lock = threading.Lock()
_pools: dict[int, object] = {}


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc (None: none here)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's flags in /proc/cpuinfo; None where there is no such file (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return frozenset()


def missing_cpu_flags(path: IsaPath, flags: frozenset[str] | None = None) -> list[str]:
    """The flags `path` needs that this CPU lacks ([] where /proc/cpuinfo cannot say and the path
    is AVX2: build() then asks torch)."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return [] if path == AVX2 else list(path.cpu_flags)
    return [f for f in path.cpu_flags if f not in flags]


def choose_isa(name: str | None = None) -> IsaPath:
    """The path named (else $FLEXSARATHI_INT8_ISA, else "auto": the best this CPU has; AVX2 where
    it has none, for build() to refuse). ValueError: an unknown name; RuntimeError: a path whose
    flags this CPU lacks, naming them."""
    name = name or os.environ.get(ISA_ENV) or "auto"
    if name == "auto":
        return next((p for p in ISA_PATHS.values() if not missing_cpu_flags(p)), AVX2)
    if name not in ISA_PATHS:
        raise ValueError(f"{ISA_ENV}={name!r}: not one of auto, {', '.join(ISA_PATHS)}")
    missing = missing_cpu_flags(ISA_PATHS[name])
    if missing:
        raise RuntimeError(f"the {name} path needs the CPU flags {', '.join(missing)}, which this CPU lacks")
    return ISA_PATHS[name]


def build(source: Path, isa: IsaPath = AVX2) -> Path:
    """The compiled kernel's path (for instruction path `isa`), built on first use. RuntimeError
    says why it cannot be had here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"{source.name} is AVX2 code; this machine is {platform.machine()}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(f"{source.name} needs AVX2 (torch reports CPU capability {capability})")
    compiler = c_compiler()
    if not compiler:
        raise RuntimeError(f"no C compiler (cc, gcc or $CC) to build {source.name} with")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    flags = FLAGS + isa.cc_flags
    key = hashlib.sha256(source.read_bytes() + " ".join(flags + LIBS).encode() + version.encode()).hexdigest()[:16]
    folder = Path(os.environ.get("FLEXSARATHI_KERNEL_CACHE")
                  or Path.home() / ".cache" / "flexsarathi" / "kernels")
    target = folder / f"{source.stem}-{isa.name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        built = subprocess.run([compiler, *flags, "-o", temporary, str(source), *LIBS], capture_output=True, text=True)
        if built.returncode != 0:  # a compiler without OpenMP: the same kernels, on the calling thread alone
            serial = [f for f in flags if f != "-fopenmp"]
            built = subprocess.run([compiler, *serial, "-o", temporary, str(source), *LIBS], capture_output=True,
                                   text=True)
        if built.returncode != 0:
            raise RuntimeError(f"building {source.name} with {compiler} failed: {built.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def load(source: Path, signatures: dict[str, list], isa: IsaPath = AVX2) -> tuple[ctypes.CDLL | None, str | None]:
    """(the built and loaded kernel, None), or (None, why not); `signatures`: each function's ctypes
    argument types (all return nothing)."""
    try:
        lib = ctypes.CDLL(str(build(source, isa)))
    except (OSError, RuntimeError) as e:
        return None, str(e)
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib, None


class Kernel:
    """One C file's functions, built and loaded on first use, once per process: `lib()` (a
    RuntimeError that says why where it cannot be had), `available()`, `unavailable_reason()`
    (None where it is loaded; else no AVX2, no compiler, a forced path's missing CPU flags, or the
    build's error); `reset()` forgets the outcome (tests that change the compiler or the path).
    isa_paths=True: the source has instruction paths (ISA_PATHS); `isa` fixes one, else choose_isa()
    picks it at load; `isa_name()` says which ran."""

    def __init__(self, who: str, source: Path, signatures: dict[str, list], isa_paths: bool = False,
                 isa: str | None = None):
        self.who, self.source, self.signatures = who, source, signatures
        self.isa_paths, self.isa = isa_paths, isa
        self._loaded: tuple[ctypes.CDLL | None, str | None] | None = None
        self._path: IsaPath | None = None

    def for_isa(self, name: str) -> "Kernel":
        """The same kernel on instruction path `name` (loaded on first use, unavailable if this CPU lacks it)."""
        if not self.isa_paths:
            raise ValueError(f"{self.who}: {self.source.name} has one instruction path (AVX2)")
        return Kernel(f"{self.who} [{name}]", self.source, self.signatures, True, name)

    def loaded(self) -> tuple[ctypes.CDLL | None, str | None]:
        if self._loaded is None:
            try:
                self._path = choose_isa(self.isa) if self.isa_paths else AVX2
            except RuntimeError as e:
                self._loaded = (None, str(e))
                return self._loaded
            self._loaded = load(self.source, self.signatures, self._path)
        return self._loaded

    def isa_name(self) -> str | None:
        """The instruction path loaded (None: not loaded)."""
        return self._path.name if self.available() else None

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
        self._loaded, self._path = None, None


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
