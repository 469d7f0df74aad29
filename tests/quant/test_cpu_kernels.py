"""quant/cpu_kernels.py's `split`: every index of [0, total) covered exactly once, in ranges that
start on multiples of `align`, on at most `parts` threads, whatever the chunking; a worker's error
reaches the caller."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quant.cpu_kernels import split


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 300), parts=st.integers(1, 4), align=st.sampled_from([1, 8]),
       chunks=st.integers(1, 5))
def test_split_covers_each_index_once_on_at_most_parts_threads(total, parts, align, chunks):
    seen, threads, lock = [], set(), threading.Lock()

    def record(start: int, stop: int) -> None:
        assert start % align == 0 and start < stop <= total
        with lock:
            seen.extend(range(start, stop))
            threads.add(threading.get_ident())

    split(record, total, parts, align, chunks_per_part=chunks)
    assert sorted(seen) == list(range(total))
    assert len(threads) <= parts


def test_a_workers_error_reaches_the_caller():
    def fail_on_last(start: int, stop: int) -> None:
        if stop == 64:
            raise ValueError("injected: the last range fails")

    with pytest.raises(ValueError, match="injected"):
        split(fail_on_last, 64, 2, 8, chunks_per_part=4)


def test_a_compiler_without_openmp_still_builds_the_threaded_kernels(tmp_path, monkeypatch):
    """The kernels' threads are OpenMP's; where the compiler refuses -fopenmp (injected: a wrapper
    that fails on it) the kernels with OpenMP loops are built without it and run on the calling thread."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from quant.cpu_kernels import CSRC, build  # noqa: PLC0415

    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler here")
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("FLEXSARATHI_KERNEL_CACHE", str(tmp_path / "kernels"))
    for source in (CSRC / "q4_int8_gemm.c", CSRC / "kv_attention.c"):  # the two with OpenMP loops
        built = build(source)
        needed = subprocess.run(["readelf", "-d", str(built)], capture_output=True, text=True).stdout
        assert built.is_file() and "libgomp" not in needed
