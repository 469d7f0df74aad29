"""`flexsarathi profile`: measure this machine into a HardwareSpec JSON that `--hardware` accepts.

Everything is measured on the compute device the engine would use (CUDA when present, else the
CPU, whose "gpu tier" is then host memory): copy bandwidths between tiers, disk read (O_DIRECT,
page cache bypassed) and write (fsync'd), matmul rates for prompt-sized and decode-sized shapes,
attention rates, and dequantization rates. Each figure is the median of a few repeats after a
warm-up; the whole run takes well under two minutes.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch

from flexsarathi.attention import attend
from offload.disk_store import DiskStore, aligned_empty
from policy_search.hardware import HardwareSpec
from quant import QuantConfig, dequantize, quantize


def _median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_bandwidth(src_device, dst_device, nbytes: int, pin: bool) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device, pin_memory=pin and src_device.type == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device, pin_memory=pin and dst_device.type == "cpu")
    src.fill_(1)

    def run():
        dst.copy_(src, non_blocking=True)
        _sync(torch.device("cuda") if "cuda" in (src_device.type, dst_device.type) else torch.device("cpu"))

    return nbytes / _median_seconds(run)


def _matmul_rate(device, dtype, tokens: int, hidden: int) -> float:
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(4 * hidden, hidden, dtype=dtype, device=device)

    def run():
        torch.nn.functional.linear(x, w)
        _sync(device)

    return 2 * tokens * hidden * 4 * hidden / _median_seconds(run)


def _attention_rate(device, dtype, queries: int, context: int, seqs: int, heads: int = 32,
                    head_dim: int = 128) -> float:
    q = torch.randn(seqs, queries, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(seqs, context, heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q_pos = torch.arange(context - queries, context, device=device).expand(seqs, queries)
    kv_len = torch.full((seqs,), context, device=device)

    def run():
        attend(q, k, v, q_pos, kv_len, head_dim ** -0.5)
        _sync(device)

    return 4 * seqs * queries * context * heads * head_dim / _median_seconds(run, repeats=3)


def _dequant_rate(device, values: int = 1 << 22) -> float:
    q = quantize(torch.randn(values // 4096, 4096, dtype=torch.float16, device=device), QuantConfig())
    out = torch.empty(q.shape, dtype=torch.float16, device=device)

    def run():
        dequantize(q, out=out)
        _sync(device)

    return values / _median_seconds(run)


def _disk_bandwidth(folder: str, nbytes: int) -> tuple[float, float]:
    """(read bytes/s with O_DIRECT, write bytes/s fsync'd) of a scratch store in `folder`."""
    work = tempfile.mkdtemp(prefix="profile-", dir=folder)
    try:
        store = DiskStore(work, "profile", direct_io=True)
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        start = time.perf_counter()
        writer = store.begin_write(total_bytes=nbytes)
        writer.add("blob", data)
        writer.commit()
        write = nbytes / (time.perf_counter() - start)
        out = aligned_empty((nbytes,), torch.uint8)
        store.drop_page_cache()
        read = nbytes / _median_seconds(lambda: store.read_into("blob", out), repeats=3)
        store.close()
        return read, write
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo")


def profile_machine(offload_dir: str, dtype: torch.dtype | None = None, disk_bytes: int = 512 << 20,
                    log=print) -> HardwareSpec:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = dtype or (torch.float16 if cuda else torch.bfloat16)
    cpu = torch.device("cpu")
    os.makedirs(offload_dir, exist_ok=True)
    log(f"profiling: compute device {device} ({dtype}), offload folder {offload_dir}")
    h2d = _copy_bandwidth(cpu, device, 256 << 20, pin=cuda)
    d2h = _copy_bandwidth(device, cpu, 256 << 20, pin=cuda)
    log(f"  copies: host->device {h2d / 1e9:.2f} GB/s, device->host {d2h / 1e9:.2f} GB/s")
    disk_read, disk_write = _disk_bandwidth(offload_dir, disk_bytes)
    log(f"  disk: read {disk_read / 1e9:.2f} GB/s (O_DIRECT), write {disk_write / 1e9:.2f} GB/s")
    prefill = _matmul_rate(device, dtype, 512, 2048)
    decode = _matmul_rate(device, dtype, 32, 2048)
    cpu_matmul = prefill if not cuda else _matmul_rate(cpu, torch.float32, 512, 2048)
    log(f"  matmul: prefill {prefill / 1e12:.3f} TFLOP/s, decode {decode / 1e12:.3f} TFLOP/s")
    mem_bw = _copy_bandwidth(device, device, 256 << 20, pin=False) * 2  # read + write
    attn_prefill = _attention_rate(device, dtype, 256, 512, 1)
    attn_decode = _attention_rate(device, dtype, 1, 512, 16)
    cpu_attn = attn_decode if not cuda else _attention_rate(cpu, torch.float32, 1, 512, 16)
    log(f"  attention: prefill {attn_prefill / 1e12:.3f}, decode {attn_decode / 1e12:.4f}, "
        f"CPU decode {cpu_attn / 1e12:.4f} TFLOP/s")
    dequant = _dequant_rate(device)
    cpu_dequant = dequant if not cuda else _dequant_rate(cpu)
    log(f"  dequantize: {dequant / 1e9:.2f} G values/s")
    gpu_memory = torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory()
    return HardwareSpec(
        name=f"profile-{os.uname().nodename}", gpu_memory=gpu_memory, cpu_memory=_host_memory(),
        disk_memory=shutil.disk_usage(offload_dir).free, host_to_device=h2d, device_to_host=d2h,
        disk_to_host=disk_read, host_to_disk=disk_write, gpu_matmul_prefill_flops=prefill,
        gpu_matmul_decode_flops=decode, gpu_memory_bandwidth=mem_bw,
        gpu_attention_prefill_flops=attn_prefill, gpu_attention_decode_flops=attn_decode,
        cpu_matmul_flops=cpu_matmul, cpu_attention_flops=cpu_attn, gpu_dequant_rate=dequant,
        cpu_dequant_rate=cpu_dequant,
        notes=f"measured by flexsarathi profile on {device} with {dtype}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads" + ("" if cuda else "; no CUDA: the gpu tier is host memory"))
