"""Pre-quantized weights: how a weight source hands the engine codes that it stores as they are.

The interface (`WeightSource` in flexsarathi/formats/checkpoint.py; HF GPTQ/AWQ/compressed-tensors folders
in flexsarathi/formats/quantized_checkpoint.py; GGUF files may implement the same):

- `source.quantized_formats()` -> `{canonical 2-D layer weight name: QuantConfig | None}`: the
  format each layer weight comes in, the same for every layer (placement cuts every layer alike);
  None: that weight comes in the compute dtype. A full-precision source returns None instead of a
  dict, and the engine quantizes with its own `weight_quant` when the policy compresses weights.
- `source.layer_weights(layer, dtype)` yields, for every name with a format, a `QTensor` of exactly
  that `QuantConfig` (and `dtype` as its dtype); placement writes its codes, scales and minimums
  into the store without a round trip through floats.
- `source.describe()` -> `SourceDescription`, what `flexsarathi inspect` prints.

Sources build their QTensors from unsigned integer codes with `codes_to_qtensor` (value =
`scale * (code - zero)`): exact where the engine's format holds the checkpoint's numbers (fp16
scale, integer zero point: the minimum `-scale * zero` in fp32 with `QuantConfig.minimum_fp32`),
otherwise rounded, with the error measured. 4-bit codes whose bytes already hold adjacent pairs
(GPTQ's and compressed-tensors' int32 words) are passed as `packed=` with
`QuantConfig.adjacent_pairs` and stored without a copy; formats that hold `code * scale + minimum`
with an fp16 minimum use `affine_to_qtensor`. Where the codes cannot be kept at all (act-order
groups), `requantize` converts the exact dequantized values once; `ConversionLog` gathers the
measured errors per tensor kind and prints them once every layer has been read.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from quant import QTensor, QuantConfig, dequantize, pack_4bit, quantize
from quant.packing import pack_4bit_pairs, unpack_4bit_pairs_into


@dataclass(frozen=True)
class TensorKind:
    """One canonical layer weight as a checkpoint holds it and as the engine will store it."""

    name: str  # canonical, e.g. "qkv_proj.weight"
    source_type: str  # as the checkpoint holds it, e.g. "int4 g128 asym (gptq)"
    stored: QuantConfig | None  # the engine's format; None: the compute dtype
    conversion: str  # "codes kept (exact)", "requantized once (act-order)", "fp16 as is", ...


@dataclass(frozen=True)
class SourceDescription:
    format: str  # "gptq", "awq", "compressed-tensors", "safetensors", "dummy", "gguf", ...
    detail: str  # one line: bits, groups, symmetry, version
    kinds: tuple[TensorKind, ...]
    file_bytes: int | None  # the files' bytes on disk; None: generated weights


def describe_config(config: QuantConfig | None) -> str:
    if config is None:
        return "compute dtype"
    minimum = "fp32" if config.minimum_fp32 else "fp16"
    return f"{config.bits}-bit codes, groups of {config.group_size}, fp16 scale + {minimum} minimum"


def codes_to_qtensor(codes: torch.Tensor | None, scale: torch.Tensor, zero: torch.Tensor | int,
                     config: QuantConfig, dtype: torch.dtype, *,
                     packed: torch.Tensor | None = None) -> tuple[QTensor, float]:
    """uint8 codes `[out, in]` (unsigned, < 2**bits), scale `[out, groups]` (any float dtype), zero
    point `[out, groups]` or one integer -> (QTensor of `config` reading back `scale * (code - zero)`,
    the largest absolute difference from that value computed in fp32: 0.0 when exact).
    `packed`: instead of `codes`, uint8 `[out, in * bits / 8]` already in the config's byte layout
    (4 bits: `adjacent_pairs`), stored without a copy.

    Exact when the scale converts to fp16 exactly and the minimum `-scale * zero` does in the
    config's minimum dtype (fp32 always does: 11 + 9 significant bits at most)."""
    out_features = scale.shape[0]
    in_features = codes.shape[1] if codes is not None else packed.shape[1] * 8 // config.bits
    if in_features % config.group_size or scale.shape != (out_features, in_features // config.group_size):
        raise ValueError(f"codes {tuple(codes.shape)} and scale {tuple(scale.shape)} do not match "
                         f"groups of {config.group_size}")
    scale16 = scale if scale.dtype == torch.float16 else scale.to(torch.float16)
    minimum, min_exact = _minimum(scale16, zero, config)
    data = packed.reshape(-1) if packed is not None else pack_lines(codes.contiguous(), config)
    q = QTensor(data=data, scale=scale16.reshape(-1), minimum=minimum.reshape(-1),
                shape=(out_features, in_features), dtype=dtype, config=config)
    if min_exact and (scale.dtype == torch.float16 or torch.equal(scale16.float(), scale.float())):
        return q, 0.0
    codes = codes if codes is not None else unpack_lines(packed, config)
    reference = reference_values(codes, scale.float(), torch.as_tensor(zero, dtype=torch.float32))
    return q, float((dequantize(q, torch.float32) - reference).abs().max())


def _minimum(scale16: torch.Tensor, zero: torch.Tensor | int, config: QuantConfig) -> tuple[torch.Tensor, bool]:
    """(`-scale * zero` in the config's minimum dtype, whether exactly). Checked only where it can
    round: fp32 holds the product of an fp16 scale and a zero point below 2**13 exactly, and fp16
    that of one zero point for all groups that is a power of two (a symmetric format's)."""
    if isinstance(zero, torch.Tensor):
        low, high = zero.aminmax() if zero.numel() else (torch.tensor(0), torch.tensor(0))
        if low == high:  # one zero point for all groups (symmetric)
            zero = int(low)
    # fp32 arithmetic: fp16 elementwise ops are not vectorised on CPUs without AVX-512 FP16
    product = -(scale16.float() * torch.as_tensor(zero, dtype=torch.float32))  # exact in fp32
    if isinstance(zero, int) and zero > 0 and zero & (zero - 1) == 0 and not config.minimum_fp32:
        # a power of two: exact in fp16 too, unless it overflows
        return product.to(torch.float16), bool(product.abs().max() <= torch.finfo(torch.float16).max)
    if config.minimum_fp32:
        return product, True
    minimum = product.to(torch.float16)
    return minimum, torch.equal(minimum.float(), product)


def affine_to_qtensor(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, config: QuantConfig,
                      dtype: torch.dtype) -> QTensor:
    """Codes already of the engine's form `code * scale + minimum` (e.g. GGUF Q4_1/Q5_1-style blocks
    with an fp16 minimum): uint8 codes `[out, in]`, fp16 scale and minimum `[out, groups]` (fp32
    minimum with `config.minimum_fp32`) -> QTensor, no conversion at all."""
    return QTensor(data=pack_lines(codes.contiguous(), config), scale=scale.reshape(-1),
                   minimum=minimum.reshape(-1), shape=tuple(codes.shape), dtype=dtype, config=config)


def pack_lines(codes: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """uint8 codes `[out, in]`, one line of groups per row -> flat QTensor.data of `config`."""
    if config.bits == 8:
        return codes.reshape(-1)
    return (pack_4bit_pairs(codes) if config.adjacent_pairs else pack_4bit(codes)).reshape(-1)


def unpack_lines(packed: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """uint8 `[out, in * bits / 8]` in `config`'s byte layout (adjacent pairs at 4 bits) -> codes `[out, in]`."""
    if config.bits == 8:
        return packed
    codes = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.uint8)
    unpack_4bit_pairs_into(packed, codes)
    return codes


def reference_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `[out, in]` = `scale * (code - zero)` with column j in group `g_idx[j]` (default
    j // group size): the checkpoint's own dequantization, what conversions are measured against."""
    out_features, in_features = codes.shape
    if g_idx is None:
        g_idx = torch.arange(in_features) // (in_features // scale.shape[1])
    zero = torch.as_tensor(zero, dtype=torch.float32).expand(scale.shape)
    return (codes.float() - zero[:, g_idx]) * scale.float()[:, g_idx]


def requantize(values: torch.Tensor, config: QuantConfig, dtype: torch.dtype) -> tuple[QTensor, float]:
    """fp32 `[out, in]` -> (QTensor of `config` by the engine's min-max `quantize`, the largest
    absolute difference from `values`)."""
    q = quantize(values, config)
    error = float((dequantize(q, torch.float32) - values).abs().max())
    return replace(q, dtype=dtype), error


def concat_rows(parts: list[QTensor]) -> QTensor:
    """QTensors `[out_i, in]` of one config -> `[sum out_i, in]` (q/k/v fused): each row is its own
    line of groups, so codes, scales and minimums simply follow one another."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return QTensor(data=_joined([p.data for p in parts]), scale=_joined([p.scale for p in parts]),
                   minimum=_joined([p.minimum for p in parts]),
                   shape=(sum(p.shape[0] for p in parts), first.shape[1]), dtype=first.dtype,
                   config=first.config)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Flat tensors one after another: a view where they already lie end to end in one buffer (parts
    read into their rows of a fused weight), else a concatenation."""
    first = tensors[0]
    storage = first.untyped_storage()
    end_to_end = all(t.is_contiguous() and t.dim() == 1 and t.dtype == first.dtype and
                     t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors) and all(
        b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(tensors, tensors[1:]))
    if not end_to_end:
        return torch.cat(tensors)
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (total,))


@dataclass
class ConversionLog:
    """Largest measured conversion error per tensor kind; one line each printed (to `stream`) once
    the last layer has been read, and kept in `errors` for callers and tests."""

    num_layers: int
    what: str  # e.g. "gptq" (names the checkpoint in the printed lines)
    stream: object = None  # None: sys.stderr
    errors: dict[str, tuple[float, str]] = field(default_factory=dict)  # kind -> (max error, how)
    _printed: bool = False

    def record(self, kind: str, error: float, how: str) -> None:
        if error > 0 or kind in self.errors:
            previous = self.errors.get(kind, (0.0, how))[0]
            self.errors[kind] = (max(previous, error), how)

    def layer_done(self, layer: int) -> None:
        if layer != self.num_layers - 1 or self._printed:
            return
        self._printed = True
        for kind, (error, how) in sorted(self.errors.items()):
            print(f"{self.what}: {kind} {how}: max |error| {error:.3g} against the checkpoint's own "
                  f"dequantization (fp32)", file=self.stream or sys.stderr, flush=True)
