"""Benchmarks of the quant package: storage size and CPU speed, printed as one table.

    .venv/bin/python scripts/bench_quant.py                    # every section
    .venv/bin/python scripts/bench_quant.py --section speed    # one section (repeatable)

A section is a function `(args) -> list[Row]` registered in SECTIONS; add one (e.g. a quality /
perplexity section) by writing the function and adding it there. Speed is reported as a ratio to a
plain fp16 copy of the same tensor (`dst.copy_(src)`), measured the same way right next to it,
because absolute numbers on a shared 2-core machine move with whatever else runs; every time is the
median of several repeats after a warm-up.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import harness  # puts the repository root on sys.path (run from a checkout without installing)
import torch

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from quant import QuantConfig, dequantize, quantize  # noqa: E402

WEIGHT_SHAPE = (4096, 4096)  # a LLaMA-7B-sized projection [out_features, in_features]
KV_SHAPE = (2048, 32, 128)  # [tokens, kv_heads, head_dim], grouped along head_dim
CONFIGS = {"4-bit g64": QuantConfig(bits=4, group_size=64), "8-bit g64": QuantConfig(bits=8, group_size=64)}


@dataclass
class Row:
    section: str
    what: str
    value: str
    note: str = ""


def bench_size(args: argparse.Namespace) -> list[Row]:
    """Storage bytes (codes + fp16 scale + fp16 minimum) against the fp16 tensor."""
    rows = []
    # The KV cache as the engine stores it: a paged pool (one layer), K per channel over 64-token
    # blocks, V per token along the head dimension. Stored blocks cost 4.5 bits per value; each
    # running sequence also keeps its open block's K in full precision (a working buffer, like the
    # weights' working buffers), shown separately for 8 sequences of 2048 tokens.
    from offload.kv_cache import KVCompression, KVPool

    tokens, heads, head_dim = KV_SHAPE
    seqs = 8
    for bits in (4, 8):
        comp = KVCompression(bits=bits, block_size=64, value_group=64)
        plain = KVPool.nbytes_for(1, seqs * tokens, heads, head_dim, torch.float16, None)
        stored = KVPool.nbytes_for(1, seqs * tokens, heads, head_dim, torch.float16, comp, num_residual=0)
        residual = 64 * heads * head_dim * 2  # one open block's K, fp16
        stored -= residual  # nbytes_for counts at least one open block
        rows.append(Row("size", f"KV blocks as stored, {bits}-bit (K g64 per channel, V g64)",
                        f"{stored / plain:.5f}x fp16", f"{8 * stored / (plain / 2):.3f} bits/value"))
        total = stored + seqs * residual
        rows.append(Row("size", f"KV pool + open blocks, {bits}-bit, {seqs} seqs x {tokens} tokens",
                        f"{total / plain:.5f}x fp16", f"{total / 2**20:.2f} MiB"))
    for tensor_name, shape in (("weight", WEIGHT_SHAPE), ("KV", KV_SHAPE)):
        x = torch.randn(shape, dtype=torch.float16)
        fp16_bytes = x.numel() * x.element_size()
        for config_name, config in CONFIGS.items():
            q = quantize(x, config)
            bits_per_value = 8 * q.nbytes / x.numel()
            rows.append(Row("size", f"{tensor_name} {list(shape)} {config_name}", f"{q.nbytes / fp16_bytes:.5f}x fp16",
                            f"{q.nbytes / 2**20:.2f} MiB, {bits_per_value:.3f} bits/value"))
    return rows


def bench_speed(args: argparse.Namespace) -> list[Row]:
    """quantize / dequantize throughput in GB/s of fp16 data, against an fp16 copy of the same tensor."""
    x = torch.randn(WEIGHT_SHAPE, dtype=torch.float16)
    gb = x.numel() * x.element_size() / 1e9
    dst = torch.empty_like(x)
    copy_s = harness.median_seconds(lambda: dst.copy_(x), args.repeats)
    rows = [Row("speed", f"fp16 copy {list(WEIGHT_SHAPE)}", f"{gb / copy_s:6.2f} GB/s", f"1.00x copy  ({copy_s * 1e3:.2f} ms)")]
    clone_s = harness.median_seconds(lambda: x.clone(), args.repeats)  # what a fresh result costs by itself
    rows.append(Row("speed", "fp16 clone (allocates)", f"{gb / clone_s:6.2f} GB/s",
                    f"{copy_s / clone_s:.2f}x copy  ({clone_s * 1e3:.2f} ms)"))
    for config_name, config in CONFIGS.items():
        q = quantize(x, config)
        timings = {
            "quantize": lambda: quantize(x, config),
            "dequantize(out=)": lambda: dequantize(q, out=dst),  # into a reused buffer, like the copy
            "dequantize": lambda: dequantize(q),  # + allocating (page-faulting) a fresh 32 MiB result
        }
        for op, fn in timings.items():
            seconds = harness.median_seconds(fn, args.repeats)
            rows.append(Row("speed", f"{op} {config_name}", f"{gb / seconds:6.2f} GB/s",
                            f"{copy_s / seconds:.2f}x copy  ({seconds * 1e3:.2f} ms)"))
    return rows


def bench_quality(args: argparse.Namespace) -> list[Row]:
    """Perplexity of stories260K on held-out TinyStories through the engine (fp32 compute), with
    weights and/or KV cache compressed. Weights: groups along the input dimension. KV: V per token
    along the head dimension (8 values per head here); K per channel over one KV block of tokens
    (the block size is the K group: 16 by default, 64 for "g64")."""
    from flexsarathi import LLM
    from flexsarathi.cli.perplexity import perplexity, split_documents
    from policy_search import Policy

    repo = Path(__file__).resolve().parents[1]
    model = repo.parent / "shared" / "models" / "stories260K"
    text = repo.parent / "shared" / "data" / "tinystories_valid_head.txt"
    if not model.is_dir() or not text.is_file():
        return [Row("quality", "stories260K", "skipped", f"{model} or {text} is absent")]
    docs = split_documents(text.read_text(), "<|endoftext|>")

    def ppl(weight: QuantConfig | None, kv_bits: int | None, kv_block: int = 16) -> float:
        policy = Policy(gpu_batch_size=45, prefill_budget=args.prefill_budget,
                        compress_weight=weight is not None, compress_kv=kv_bits is not None)
        options = {"weight_quant": weight} if weight else {}
        if kv_bits:
            options["kv_bits"] = kv_bits
        llm = LLM(str(model), dtype="float32", policy=policy, kv_block_size=kv_block, **options)
        return perplexity(llm, docs)["perplexity"]

    base = ppl(None, None)
    rows = [Row("quality", "fp32", f"{base:.4f}", "perplexity, 45 stories")]
    cases = [
        ("weights 4-bit g64", QuantConfig(4, 64, -1), None, 16, "target <= 3.80"),
        ("KV 4-bit (K g16 per channel)", None, 4, 16, "target within 3%"),
        ("KV 4-bit (K g64 per channel)", None, 4, 64, "target within 3%"),
        ("weights + KV 4-bit (K g16)", QuantConfig(4, 64, -1), 4, 16, "target <= 3.90"),
        ("weights + KV 4-bit (K g64)", QuantConfig(4, 64, -1), 4, 64, "target <= 3.90"),
        ("weights 8-bit g64", QuantConfig(8, 64, -1), None, 16, "target within 0.5%"),
        ("KV 8-bit (K g16)", None, 8, 16, "target within 0.5%"),
        ("weights + KV 8-bit", QuantConfig(8, 64, -1), 8, 16, "target within 0.5%"),
    ]
    for name, weight, kv_bits, kv_block, note in cases:
        value = ppl(weight, kv_bits, kv_block)
        rows.append(Row("quality", name, f"{value:.4f}", f"{100 * (value / base - 1):+.2f}% vs fp32; {note}"))
    # Why weights group along the input dimension: the engine streams row ranges, so it only
    # stores input-dim groups; the output-dim alternative is measured on a fake-quantized copy.
    for dim, label in ((-1, "input"), (0, "output")):
        value = _fake_quantized_perplexity(model, docs, QuantConfig(4, 64, dim))
        rows.append(Row("quality", f"weights 4-bit g64 along the {label} dim (fake-quant)", f"{value:.4f}",
                        f"{100 * (value / base - 1):+.2f}% vs fp32"))
    return rows


def _fake_quantized_perplexity(model: Path, docs: list[str], config: QuantConfig) -> float:
    """Perplexity of a copy of the checkpoint whose layer weights went through quantize/dequantize."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from flexsarathi import LLM
    from flexsarathi.cli.perplexity import perplexity
    from policy_search import Policy

    with tempfile.TemporaryDirectory() as tmp:
        for f in model.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, tmp)
        tensors = load_file(str(model / "model.safetensors"))
        tensors = {k: dequantize(quantize(t, config)) if ".layers." in k and t.dim() == 2 else t
                   for k, t in tensors.items()}
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        llm = LLM(tmp, dtype="float32", policy=Policy(gpu_batch_size=45, prefill_budget=4096))
        return perplexity(llm, docs)["perplexity"]


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "size": bench_size, "speed": bench_speed, "quality": bench_quality}


def print_table(rows: list[Row]) -> None:
    header = Row("section", "what", "value", "note")
    widths = [max(len(getattr(r, f)) for r in [header, *rows]) for f in ("section", "what", "value")]
    for r in [header, *rows]:
        print(f"{r.section:<{widths[0]}}  {r.what:<{widths[1]}}  {r.value:>{widths[2]}}  {r.note}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-budget", type=int, default=64,
                        help="quality: prompt tokens per pass (chunked prefill; results do not depend on it)")
    parser.add_argument("--section", action="append", choices=sorted(SECTIONS), help="default: all sections")
    parser.add_argument("--repeats", type=int, default=21, help="timed repeats per measurement (median)")
    # One thread by default: on a shared 2-core machine a second intra-op thread stalls whenever its
    # core is busy elsewhere (whole scheduler ticks per op), which no median removes.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0: torch's default")
    harness.add_json_option(parser, __file__)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"bench_quant: {cpu_line('float16 (speed sections), float32 (perplexity)')}; median of {args.repeats} repeats")
    rows = [row for name in (args.section or list(SECTIONS)) for row in SECTIONS[name](args)]
    print_table(rows)
    harness.write_result(args, rows)


if __name__ == "__main__":
    main()
