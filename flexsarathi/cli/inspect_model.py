"""`flexsarathi inspect --model PATH`: what a checkpoint is, in a few lines: its format, the
quantization of each layer tensor kind, its bytes, and what the engine will store.

Any weight source works (opened_model.open_model): a source that describes itself (`describe()` ->
flexsarathi/formats/prequantized.SourceDescription: pre-quantized HF folders and GGUF files) is
printed as it says; other sources (full-precision safetensors,
dummy:<name>) get a description from their shapes and dtype. Reads headers only (and GPTQ's small
g_idx tensors), never the weights.
"""
from __future__ import annotations

import argparse
import os

import torch

from flexsarathi.cli.engine_args import add_dtype_arg
from flexsarathi.formats.prequantized import SourceDescription, TensorKind, describe_config
from policy_search.units import fmt_bytes


def add_inspect_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("inspect", help="what a checkpoint is: format, quantization, bytes, what is stored",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file, dummy:<name> or a Hugging Face repo "
                   "(org/name[@revision], org/name:QUANT)")
    add_dtype_arg(p)
    p.set_defaults(func=run_inspect)
    return p


def run_inspect(args) -> int:
    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype
    from flexsarathi.formats.opened_model import open_model

    source = open_model(args.model).source
    # what `generate` computes in on this machine (auto: a half dtype on a GPU, the measured choice on the CPU)
    dtype = resolve_dtype(args.dtype, source.config.checkpoint_dtype, resolve_device(None))
    for line in inspect_lines(args.model, source, dtype):
        print(line)
    return 0


def describe_source(source) -> SourceDescription:
    """The source's own description, or one built from its shapes and checkpoint dtype."""
    describe = getattr(source, "describe", None)
    if describe is not None:
        return describe()
    folder = getattr(source, "folder", None)
    files = None
    if folder is not None:
        files = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    dtype = str(source.config.checkpoint_dtype).removeprefix("torch.")
    codes = getattr(source, "codes", None)  # dummy weights drawn as codes
    mxfp4, formats = getattr(source, "mxfp4_kinds", frozenset()), source.quantized_formats() or {}
    fp8 = getattr(source, "fp8_block", None)  # block-wise FP8: its matrices dequantized as they are read
    stored = f"fp8 e4m3 in blocks of {fp8[0]}x{fp8[1]}" if fp8 else dtype
    resident = source.model.resident_weights()  # routers: never compressed

    def how(name: str) -> str:
        return (("times its blocks' factors; " if fp8 else "") +
                ("kept as is on the compute device: a router" if name in resident else "as is" if mxfp4
                 else "quantized by the engine when the policy compresses weights"))
    kinds = tuple(TensorKind(name, "mxfp4", formats[name], "decoded exactly into 8-bit codes") if name in mxfp4 else
                  TensorKind(name, f"{codes.bits}-bit codes drawn" if codes else stored, None, how(name))
                  for name, shape in source.model.weight_kinds().items() if len(shape) == 2)
    fmt = ("dummy" if folder is None else "safetensors, experts mxfp4" if mxfp4 else
           "safetensors, fp8 blocks" if fp8 else "safetensors")
    detail = f"{dtype}, full precision" + (" but the experts" if mxfp4 else " but the fp8 matrices" if fp8 else "")
    return SourceDescription(fmt, detail, kinds, files)


def inspect_lines(model: str, source, dtype: torch.dtype) -> list[str]:
    c, d = source.config, describe_source(source)
    formats = source.quantized_formats()
    files = f" ({fmt_bytes(d.file_bytes)} of files)" if d.file_bytes is not None else ""
    lines = [f"model: {model}: {c.model_type}, {c.num_layers} layers, hidden {c.hidden_size}, "
             f"{c.num_heads} heads ({c.num_kv_heads} KV), vocab {c.vocab_size}" + _experts(c),
             f"format: {d.format}: {d.detail}{files}"]
    shapes = source.model.weight_kinds()
    for kind in d.kinds:
        stored = describe_config(kind.stored) if kind.stored else str(dtype).removeprefix("torch.")
        lines.append(f"  {kind.name} {list(shapes[kind.name])}: {kind.source_type} -> {stored} ({kind.conversion})")
    total, values, small, largest = _stored_layer_bytes(source.model, c.num_layers, dtype, formats)
    globals_bytes = sum(torch.Size(s).numel() for s in source.model.global_shapes().values()) * dtype.itemsize
    lines.append(f"engine stores: layer weights {fmt_bytes(total)} ({8 * total / values:.2f} bits "
                 f"per weight; up to {fmt_bytes(largest)} streamed per layer and pass when offloaded), norms and "
                 f"biases {fmt_bytes(small)}, embeddings and head {fmt_bytes(globals_bytes)} "
                 f"({str(dtype).removeprefix('torch.')})")
    if formats is None:  # the engine quantizes full-precision weights itself when asked to
        from flexsarathi.engine.llm_engine import WEIGHT_QUANT

        compressed = _stored_layer_bytes(source.model, c.num_layers, dtype, WEIGHT_QUANT)[0]
        lines.append(f"  with compress_weight: {fmt_bytes(compressed)} "
                     f"({describe_config(WEIGHT_QUANT)}, quantized once at placement)")
    return lines


def _experts(c) -> str:
    m = c.moe
    if m is None:
        return ""
    shared = f" + a shared expert of {m.shared_expert_ffn_size}" if m.shared_expert_ffn_size else ""
    return (f", {m.num_experts} experts of {m.expert_ffn_size} (top {m.top_k}){shared} in "
            f"{m.sparse_layers(c.num_layers)} of {c.num_layers} layers")


def _stored_layer_bytes(model, num_layers: int, dtype: torch.dtype, quant) -> tuple[int, int, int, int]:
    """(matrix bytes of every layer, their values, norm and bias bytes of every layer, the largest
    layer's matrix bytes) as placement stores them; layers may differ (dense among sparse)."""
    from offload.placement import WeightPlan

    plan = WeightPlan.make(num_layers=num_layers, layer_shapes=[model.layer_shapes(j) for j in range(num_layers)],
                           dtype=dtype, quant=quant, fractions=(1.0, 0.0, 0.0), overlap=False, prefetch=1)
    values = sum(p.shape[0] * p.shape[1] for layer in plan.layers for p in layer.tensors)
    return (sum(layer.large_bytes for layer in plan.layers), values, plan.small_bytes,
            max(layer.large_bytes for layer in plan.layers))
