"""What checking a disk store costs: read throughput of a store's first read in a process, with the
crc32 check (`DiskStore(verify_reads=True)`, the default) and without, and the alternative of a
full `verify()` when a store is opened for reuse.

    .venv/bin/python scripts/bench_verify.py                  # 1 GiB store in ~/.cache/flexsarathi
    .venv/bin/python scripts/bench_verify.py --gib 2 --folder /mnt/ssd --rounds 5

Every read is cold (the store is dropped from the page cache first) and goes through O_DIRECT in
the engine's pattern: tensors of one layer read in parallel chunks into aligned working buffers.
The with/without reads alternate, round after round, in one process, so a busy neighbour slows
both alike; the ratio is the figure to quote.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib

import harness  # puts the repository root on sys.path (run from a checkout without installing)
import numpy as np
import torch

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from offload.disk_store import DiskStore  # noqa: E402
from offload.host_buffer import aligned_empty  # noqa: E402

TENSOR_BYTES = 32 << 20  # an OPT-6.7B-sized matrix in fp32 is 256 MiB, an OPT-1.3B fc1 32 MiB (fp16)


def write_store(folder: str, total: int) -> list[str]:
    with DiskStore(folder, "bench-verify") as store, store.begin_write(total_bytes=total) as writer:
        names = []
        for i in range(total // TENSOR_BYTES):
            data = torch.from_numpy(np.random.default_rng(i).integers(0, 255, TENSOR_BYTES, dtype=np.uint8))
            writer.add(f"t{i}", data)
            names.append(f"t{i}")
        writer.commit()
    return names


def cold_read_seconds(folder: str, names: list[str], verify: bool) -> float:
    """One pass over every tensor, four in flight (a layer's matrices), by a fresh store object:
    the first read of each tensor in it, so verify=True checks every byte."""
    with DiskStore(folder, "bench-verify", direct_io=True, verify_reads=verify) as store:
        store.drop_page_cache()
        buffers = [aligned_empty((TENSOR_BYTES,), torch.uint8) for _ in range(4)]
        start = time.perf_counter()
        for first in range(0, len(names), 4):
            reads = [store.read_async(name, buf) for name, buf in zip(names[first:first + 4], buffers)]
            for future in reads:
                future.result()
        return time.perf_counter() - start


def full_verify_seconds(folder: str) -> float:
    with DiskStore(folder, "bench-verify", direct_io=True) as store:
        store.drop_page_cache()
        start = time.perf_counter()
        assert store.verify()
        return time.perf_counter() - start


def crc32_rate() -> float:
    buf = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    zlib.crc32(buf)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        zlib.crc32(buf)
        times.append(time.perf_counter() - start)
    return buf.nbytes / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="store size")
    parser.add_argument("--folder", default=os.path.expanduser("~/.cache/flexsarathi"))
    parser.add_argument("--rounds", type=int, default=3)
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    print(f"bench_verify: {cpu_line()}; disk reads and crc32 only (no matmuls)", flush=True)
    work = tempfile.mkdtemp(prefix="bench-verify-", dir=args.folder)
    try:
        total = int(args.gib * (1 << 30)) // TENSOR_BYTES * TENSOR_BYTES
        print(f"writing a {total / 2**30:.2f} GiB store of {TENSOR_BYTES >> 20} MiB tensors in {work} ...", flush=True)
        names = write_store(work, total)
        plain, checked = [], []
        for r in range(args.rounds):
            plain.append(cold_read_seconds(work, names, verify=False))
            checked.append(cold_read_seconds(work, names, verify=True))
            print(f"round {r + 1}: {total / plain[-1] / 1e9:.2f} GB/s unchecked, "
                  f"{total / checked[-1] / 1e9:.2f} GB/s checked", flush=True)
        full = full_verify_seconds(work)
        a, b = statistics.median(plain), statistics.median(checked)
        print(f"cold O_DIRECT read, median of {args.rounds}: {total / a / 1e9:.2f} GB/s unchecked, "
              f"{total / b / 1e9:.2f} GB/s with the crc32 check on first read: {b / a:.3f}x the time")
        print(f"full verify() of the store when reused (the alternative): {full:.2f} s = "
              f"{full / a:.2f}x an unchecked read of it, paid before the first pass")
        crc = crc32_rate()
        print(f"zlib.crc32 on one core: {crc / 1e9:.2f} GB/s")
        rows = [{"round": r + 1, "unchecked_gb_s": total / p / 1e9, "checked_gb_s": total / c / 1e9}
                for r, (p, c) in enumerate(zip(plain, checked))]
        harness.write_result(args, rows, {"checked_over_unchecked_median_seconds": b / a,
                                          "full_verify_over_unchecked_read": full / a},
                             extra={"store_gib": total / 2**30, "full_verify_s": full, "crc32_gb_s": crc / 1e9})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
