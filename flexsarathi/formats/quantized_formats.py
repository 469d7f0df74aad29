"""The `quantization_config` of an HF folder (GPTQ, AWQ, compressed-tensors) and the packed int32
layouts of those formats, read into unsigned codes, scales and integer zero points.

Layouts, as their authors' code writes them (cited in
tests/flexsarathi/formats/test_quantized_checkpoint.py, whose reference packers are written
independently of this module):
- GPTQ: `qweight` int32 `[in * bits / 32, out]`, value j of a word at bits `bits * j` (packed along
  the input dimension); `qzeros` int32 `[groups, out * bits / 32]` packed the same way along the
  output; `scales` `[groups, out]`; `g_idx` `[in]`, column j's group (act-order when not j // group).
  v1 checkpoints (checkpoint_format "gptq", AutoGPTQ) store zero - 1 and read (stored & mask) + 1;
  "gptq_v2" (GPTQModel) stores the zero point itself.
- AWQ GEMM: `qweight` int32 `[in, out / 8]` packed along the output dimension, nibble i of a word
  holding column `8 * word + [0, 2, 4, 6, 1, 3, 5, 7][i]`; `qzeros` `[groups, out / 8]` the same;
  `scales` `[groups, out]`; value `scale * (q - zero)`.
- compressed-tensors pack-quantized: `weight_packed` int32 `[out, in * bits / 32]`, element i of
  a row at bits `bits * i` of the row's words, each code stored as `q + 2**(bits - 1)`;
  `weight_scale` `[out, groups]`; asymmetric: `weight_zero_point` packed along the output
  (int32 `[out * bits / 32, groups]`, offset the same way); `weight_shape` `[2]`.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from flexsarathi.errors import CheckpointError

SUPPORTED = ("gptq (4 or 8 bits, groups or channel-wise, with or without desc_act), awq (4-bit GEMM), "
             "compressed-tensors (pack-quantized int4/int8, symmetric or asymmetric, group or channel)")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) held by nibble i of an AWQ GEMM word
_AWQ_UNDO = tuple(AWQ_ORDER.index(k) for k in range(8))  # nibble that holds column k


@dataclass(frozen=True)
class Scheme:
    """How one Linear module's weight is stored."""

    method: str  # "gptq", "awq", "compressed-tensors"
    bits: int
    group_size: int  # -1: channel-wise (one group per row)
    symmetric: bool
    zero_offset: int = 0  # added to stored zero points (GPTQ v1: +1)

    def describe(self) -> str:
        groups = "channel-wise" if self.group_size <= 0 else f"g{self.group_size}"
        return f"int{self.bits} {groups} {'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class ModuleCodes:
    """One module's weight as the checkpoint stores it: value = scale * (code - zero)."""

    codes: torch.Tensor | None  # uint8 [out, in], unsigned; None: given as `pairs`
    scale: torch.Tensor  # [out, groups], the checkpoint's float dtype
    zero: torch.Tensor | int  # [out, groups] integers, or one for all (symmetric)
    g_idx: torch.Tensor | None  # [in] group of each column; None: column // group size
    # 4 bits: uint8 [out, in / 2], byte j holding codes 2j (low nibble) and 2j + 1: the int32 words
    # of GPTQ (once transposed) and compressed-tensors read as bytes
    pairs: torch.Tensor | None = None

    def unpacked(self) -> torch.Tensor:
        """uint8 codes [out, in]."""
        if self.codes is not None:
            return self.codes
        return torch.stack([self.pairs & 0x0F, self.pairs >> 4], dim=-1).reshape(self.pairs.shape[0], -1)


@dataclass(frozen=True)
class QuantMethod:
    """A parsed `quantization_config`: which scheme a module has and a one-line description."""

    name: str
    detail: str
    schemes: tuple[tuple[tuple[str, ...], Scheme], ...]  # (targets, scheme); first match wins
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module: str) -> Scheme | None:
        if any(_matches(t, module) for t in self.ignore):
            return None
        return next((s for targets, s in self.schemes if any(_matches(t, module) for t in targets)), None)


def _matches(target: str, module: str) -> bool:
    if target == "Linear":  # every module read here is a Linear
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _unsupported(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what} is not supported; FlexSarathi reads {SUPPORTED}")


def parse_quantization_config(qc: object, where: str) -> QuantMethod:
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    parsers = {"gptq": _parse_gptq, "awq": _parse_awq, "compressed-tensors": _parse_compressed_tensors}
    if method not in parsers:
        raise _unsupported(where, f"quantization_config quant_method {qc.get('quant_method')!r}")
    return parsers[method](qc, where)


def _bits(value: object, allowed: tuple[int, ...], where: str, method: str) -> int:
    if value not in allowed:
        raise _unsupported(where, f"{method} with bits={value!r}")
    return int(value)


def _group_size(value: object, where: str, method: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1 or (value > 0 and value % 2):
        raise _unsupported(where, f"{method} with group_size={value!r}")
    return value


def _parse_gptq(qc: dict, where: str) -> QuantMethod:
    bits = _bits(qc.get("bits"), (4, 8), where, "gptq")
    group = _group_size(qc.get("group_size", 128), where, "gptq")
    version = str(qc.get("checkpoint_format") or "gptq").lower()
    if version not in ("gptq", "gptq_v2"):
        raise _unsupported(where, f"gptq checkpoint_format {version!r}")
    sym = bool(qc.get("sym", True))
    scheme = Scheme("gptq", bits, group, sym, zero_offset=1 if version == "gptq" else 0)
    detail = f"{scheme.describe()}, desc_act={bool(qc.get('desc_act', False))}, {version}"
    return QuantMethod("gptq", detail, ((("Linear",), scheme),))


def _parse_awq(qc: dict, where: str) -> QuantMethod:
    bits = _bits(qc.get("bits", qc.get("w_bit")), (4,), where, "awq")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), where, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(where, f"awq version {qc.get('version')!r} (only GEMM packing)")
    if not qc.get("zero_point", True):
        raise _unsupported(where, "awq without zero points")
    scheme = Scheme("awq", bits, group, symmetric=False)
    return QuantMethod("awq", f"{scheme.describe()}, GEMM", ((("Linear",), scheme),))


def _parse_compressed_tensors(qc: dict, where: str) -> QuantMethod:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: compressed-tensors quantization_config has no config_groups")
    schemes = []
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        group_fmt = group.get("format") or fmt
        if group_fmt != "pack-quantized":
            raise _unsupported(where, f"compressed-tensors format {group_fmt!r} (group {name})")
        if group.get("input_activations") or weights.get("type", "int") != "int":
            raise _unsupported(where, f"compressed-tensors group {name} (activation or float quantization)")
        bits = _bits(weights.get("num_bits"), (4, 8), where, "compressed-tensors")
        strategy = weights.get("strategy")
        if strategy == "group":
            size = _group_size(weights.get("group_size"), where, "compressed-tensors")
        elif strategy == "channel":
            size = -1
        else:
            raise _unsupported(where, f"compressed-tensors strategy {strategy!r} (group {name})")
        scheme = Scheme("compressed-tensors", bits, size, bool(weights.get("symmetric", True)))
        schemes.append((tuple(group.get("targets") or ("Linear",)), scheme))
    detail = ", ".join(s.describe() for _, s in schemes) + ", pack-quantized"
    return QuantMethod("compressed-tensors", detail, tuple(schemes), tuple(qc.get("ignore") or ()))


# ---- unpacking --------------------------------------------------------------------------------
def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[..., words]` -> uint8 `[..., words * 32 / bits]`: value j of a word at bits `bits * j`."""
    if packed.dtype != torch.int32:
        raise CheckpointError(f"packed weights must be int32, got {packed.dtype}")
    if sys.byteorder != "little":
        raise CheckpointError("packed int32 weights are read on little-endian machines only")
    data = packed.contiguous().view(torch.uint8)  # [..., words * 4]: byte b holds values 2b, 2b + 1
    if bits == 8:
        return data
    return torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(*data.shape[:-1], -1)


def row_bytes(words: torch.Tensor, bits: int, values: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """int32 `[out, words]` packed along each row -> (codes, pairs): 8 bits: the bytes are the codes
    `[out, values]`; 4 bits: the bytes are adjacent pairs `[out, values / 2]` (little-endian words)."""
    if sys.byteorder != "little":
        raise CheckpointError("packed int32 weights are read on little-endian machines only")
    data = words.contiguous().view(torch.uint8)[:, :values * bits // 8]
    data = data if data.is_contiguous() else data.contiguous()
    return (data, None) if bits == 8 else (None, data)


def gptq_codes(t: dict[str, torch.Tensor], scheme: Scheme) -> ModuleCodes:
    qweight = t["qweight"]  # [in * bits / 32, out]: transposed, each row's words hold its values in order
    codes, pairs = row_bytes(qweight.t(), scheme.bits, qweight.shape[0] * 32 // scheme.bits)
    mask = (1 << scheme.bits) - 1
    zero = (unpack_int32(t["qzeros"], scheme.bits) & mask).t().to(torch.int16) + scheme.zero_offset
    return ModuleCodes(codes, t["scales"].t(), zero, t.get("g_idx"), pairs)


def awq_codes(t: dict[str, torch.Tensor], scheme: Scheme) -> ModuleCodes:
    def columns(packed: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> uint8 [rows, out]
        nibbles = unpack_int32(packed, scheme.bits).view(packed.shape[0], -1, 8)
        return nibbles[..., list(_AWQ_UNDO)].reshape(packed.shape[0], -1)

    return ModuleCodes(columns(t["qweight"]).t().contiguous(), t["scales"].t(),
                       columns(t["qzeros"]).t().to(torch.int16), None)


def compressed_tensors_codes(t: dict[str, torch.Tensor], scheme: Scheme) -> ModuleCodes:
    out_features, in_features = (int(v) for v in t["weight_shape"].tolist())
    codes, pairs = row_bytes(t["weight_packed"], scheme.bits, in_features)
    middle = 1 << (scheme.bits - 1)  # stored codes and zero points are offset by it
    zero: torch.Tensor | int = middle
    if not scheme.symmetric:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32:  # packed along the output dimension
            zero = unpack_int32(zp.t(), scheme.bits)[:, :out_features].t().to(torch.int16)
        else:  # stored unpacked, signed
            zero = zp.to(torch.int16) + middle
    return ModuleCodes(codes, t["weight_scale"], zero, t.get("weight_g_idx"), pairs)


# suffixes of each method's tensors (the first: the packed codes, whose presence marks the module
# as quantized) and its reader
TENSORS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",), gptq_codes),
    "awq": (("qweight", "qzeros", "scales"), (), awq_codes),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"), ("weight_zero_point", "weight_g_idx"),
                           compressed_tensors_codes),
}


def packed_shape(method: str, shapes: dict[str, tuple[int, ...]], bits: int) -> tuple[int, int]:
    """[out, in] of a GPTQ or AWQ module's weight from its packed codes' shape (header only; a
    compressed-tensors module says its own in weight_shape: its packed width is rounded up)."""
    per_word = 32 // bits
    if method == "gptq":
        words, out_features = shapes["qweight"]
        return out_features, words * per_word
    in_features, words = shapes["qweight"]  # awq
    return words * per_word, in_features
