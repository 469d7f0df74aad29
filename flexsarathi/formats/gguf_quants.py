"""GGUF tensors -> the engine's weights: pure functions of a tensor's raw blocks.

Block types whose codes the engine's group-wise format holds exactly (value = scale * code +
minimum, fp16 scale and minimum, computed in fp32: quant/groupwise.py) become `QTensor`s with no
round trip through floats:

| GGUF | its value | engine format | exact? |
|---|---|---|---|
| Q4_0 | d * (q - 8), q 4-bit | 4-bit, group 32, group halves: scale d, minimum -8d | yes |
| Q4_1 | d * q + m | 4-bit, group 32, group halves: scale d, minimum m | yes |
| Q5_0 | d * (q - 16), q 5-bit | 8-bit, group 32: scale d, minimum -16d | yes |
| Q5_1 | d * q + m, q 5-bit | 8-bit, group 32 | yes |
| Q8_0 | d * q, q int8 | 8-bit, group 32: code q + 128, minimum -128d | yes |
| Q4_K | d*sc * q - dmin*m per 32 | 4-bit, group 32: scale fp16(d*sc), minimum fp16(-dmin*m) | no |
| Q5_K | as Q4_K, q 5-bit | 8-bit, group 32 | no |
| Q6_K | d*sc * (q - 32) per 16, q 6-bit | 8-bit, group 16: scale fp16(d*sc), minimum -32 * that | no |

Q4_0's and Q4_1's code bytes are kept as they are (`QuantConfig.group_halves`: byte j of a block
holds codes j and j + 16) where the engine streams them from the file (a disk tier), so decoding
only separates each block's scale from its codes; otherwise (`keep_blocks=False`) and for the other
4-bit types they are repacked to split halves of each row, the int8 CPU kernel's faster layout.

"exact": the products d*q are exact in fp32 and so is -8d in fp16 (a power of two), so the
engine's dequantization gives gguf's own `quants.dequantize` bit for bit (a block whose -8d or
-128d would overflow fp16 has values beyond fp16: `to_qtensor` says None, the source one clear
error). The K-quants' sub-block scale d*sc
has up to 17 significant bits, fp16 keeps 11: the conversion rounds it, and `conversion_error`
measures what that costs against the exact values. Other types gguf can dequantize (Q2_K, Q3_K,
IQ4_NL, IQ4_XS) become float tensors through `gguf.quants.dequantize`.

Every format is min-max (`symmetric=False`): the minimum is stored either way, and one config per
(bits, group) lets a file that mixes Q4_0, Q4_1 and Q4_K tensors stay one format; where a fused
weight or its layers mix bit widths or groups (Q4_K_M: Q4_K beside Q6_K), `common_format` and
`widen` give them the widest bits and smallest group, exactly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from flexsarathi.errors import CheckpointError
from flexsarathi.formats.worker_pools import MAX_WORKERS, worker_pool
from quant import QTensor, QuantConfig, pack_4bit, unpack_4bit

FLOAT_TYPES = ("F32", "F16", "BF16")
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
CONVERTED_TYPES = ("Q4_K", "Q5_K", "Q6_K")
DEQUANTIZED_TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
SUPPORTED_TYPES = FLOAT_TYPES + EXACT_TYPES + CONVERTED_TYPES + DEQUANTIZED_TYPES
QK_K = 256  # values per K-quant super-block
_CHUNK_VALUES = 2**22  # values decoded at a time
# A chunk's decoding holds up to this many bytes per value of it (its blocks' copy, the nibble runs
# split and joined, the scales): a whole Q4_0 tensor's decoding (16M and 525M values, two workers,
# up to three chunks in flight) peaked 3.9 and 3.2 bytes per chunk value above its results.
_SCRATCH_PER_VALUE = 3


def decode_scratch_bytes() -> int:
    """The most `to_codes` holds besides its input and its results: a chunk on the calling thread
    and one per worker of the decoding pool."""
    return (1 + min(MAX_WORKERS, os.cpu_count() or 1)) * _CHUNK_VALUES * _SCRATCH_PER_VALUE


@dataclass(frozen=True)
class Codes:
    """A tensor as group-wise codes: value = scale * code + minimum, per group along the rows."""

    data: np.ndarray  # uint8 [rows, bytes per row]: the codes as the engine stores them (4-bit: quant/packing.py)
    scale: np.ndarray  # fp32 [rows, cols / group]: exact (before the fp16 rounding of QTensor)
    minimum: np.ndarray  # fp32 [rows, cols / group]
    config: QuantConfig

    @property
    def codes(self) -> np.ndarray:
        """uint8 [rows, cols], one code per value."""
        return codes_of(torch.from_numpy(self.data), self.config).numpy()


def check_type(type_name: str, tensor: str, where: str) -> None:
    if type_name not in SUPPORTED_TYPES:
        raise CheckpointError(f"{where}: tensor {tensor} has GGUF type {type_name}, which is not supported; "
                              f"supported: {', '.join(SUPPORTED_TYPES)}")


def to_float(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's values as gguf's own dequantization gives them: F16 and BF16 as they are, every
    quantized type in fp32 (`gguf.quants.dequantize`, the reference)."""
    if type_name in ("F32", "F16"):
        dtype = np.float32 if type_name == "F32" else np.float16
        # GGUFTensor.read's array is the caller's own: used as it is; a read-only one (a map) copied
        values = raw if raw.flags.writeable and raw.dtype == dtype else np.array(raw, dtype=dtype)
        return torch.from_numpy(values).reshape(shape)
    if type_name == "BF16":
        return torch.from_numpy(np.array(raw, dtype=np.uint8).view(np.int16)).view(torch.bfloat16).reshape(shape)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(np.asarray(raw), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)


def code_format(type_name: str, keep_blocks: bool = True) -> QuantConfig | None:
    """The engine format a code-mapped type becomes: Q4_0/Q4_1 as their blocks' bytes (group halves)
    or, keep_blocks=False, repacked into split halves of each row (the int8 CPU kernel's faster
    layout: ~10% at groups of 32, docs/BENCHMARKS.md)."""
    config = CODE_FORMATS.get(type_name)
    return replace(config, group_halves=False) if config is not None and not keep_blocks else config


def to_codes(raw: np.ndarray, type_name: str, shape: tuple[int, ...], keep_blocks: bool = True) -> Codes | None:
    """The codes of a matrix of a code-mapped type (EXACT_TYPES, CONVERTED_TYPES), else None; a
    3-D stack [experts, rows, cols] as its [experts * rows, cols] matrix (each row's blocks are its own).

    Decoded by chunks of rows into preallocated results: the temporaries stay a few MiB however
    large the tensor (a 70B layer's 8192 x 28672 matrix is 235M values)."""
    if type_name not in _DECODERS or len(shape) < 2:
        return None
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = raw.reshape(rows, -1)
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    first = _decode_rows(raw[:step], type_name, cols, keep_blocks)
    if step >= rows:
        return first
    out = Codes(*(np.empty((rows, *getattr(first, f).shape[1:]), dtype=getattr(first, f).dtype)
                  for f in ("data", "scale", "minimum")), first.config)

    def decode(start: int) -> None:  # numpy's array operations release the GIL: chunks run side by side
        part = first if start == 0 else _decode_rows(raw[start:start + step], type_name, cols, keep_blocks)
        for f in ("data", "scale", "minimum"):
            getattr(out, f)[start:start + step] = getattr(part, f)

    list(worker_pool("gguf-decode").map(decode, range(0, rows, step)))
    return out


def _decode_rows(raw: np.ndarray, type_name: str, cols: int, keep_blocks: bool = True) -> Codes:
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, _BLOCK_BYTES[type_name])
    # per block: 4-bit: nibble runs [n, runs, width], 8-bit: codes [n, values]; [n, groups per block] x 2
    codes, scale, minimum, config = _DECODERS[type_name](blocks)
    if config.group_halves and keep_blocks:  # the blocks' code bytes as they are
        data = codes.reshape(rows, -1)
    elif config.bits == 4:
        if config.group_halves:  # Q4_0/Q4_1 repacked: each block's 16 bytes are one nibble run
            codes, config = codes.reshape(-1, 1, 16), replace(config, group_halves=False)
        runs = codes.reshape(rows, -1, codes.shape[-1])
        data = _pack_runs(runs)
        if data is None:
            data = pack_4bit(torch.from_numpy(_unpack_runs(runs).reshape(rows, cols))).numpy()
    else:
        data = codes.reshape(rows, cols)
    return Codes(data, scale.reshape(rows, -1).astype(np.float32), minimum.reshape(rows, -1).astype(np.float32),
                 config)


def _pack_runs(runs: np.ndarray) -> np.ndarray | None:
    """GGUF's nibble runs -> the engine's packed line, without unpacking to codes.

    `runs` [rows, k, w]: run r's byte j holds value 2w*r + j (low nibble) and 2w*r + w + j (high).
    The engine's byte i of a line holds values i (low) and i + cols/2 (high): when cols/2 is a
    whole number of runs, the first half of the runs supplies the low nibbles and the second half
    the high ones, run by run. None otherwise (an odd number of runs)."""
    rows, k, w = runs.shape
    if k % 2:
        return None
    if w % 8 == 0:  # eight bytes at a time (a byte-wise mask keeps each nibble in its byte), long inner loops
        words = np.ascontiguousarray(runs).view(np.uint64)  # [rows, k, w / 8]
        first, second = words[:, : k // 2].reshape(rows, -1), words[:, k // 2:].reshape(rows, -1)
        low = second & _LOW_NIBBLES
        low <<= 4
        low |= first & _LOW_NIBBLES
        high = first >> 4
        high &= _LOW_NIBBLES
        high |= second & ~_LOW_NIBBLES
        out = np.empty((rows, k // 2, 2, w // 8), dtype=np.uint64)
        out[:, :, 0], out[:, :, 1] = low.reshape(rows, k // 2, -1), high.reshape(rows, k // 2, -1)
        return out.view(np.uint8).reshape(rows, -1)
    first, second = runs[:, : k // 2], runs[:, k // 2:]
    out = np.empty((rows, k // 2, 2, w), dtype=np.uint8)
    low, high = out[:, :, 0], out[:, :, 1]  # engine bytes 2w*r + j and 2w*r + w + j
    np.bitwise_and(first, 0x0F, out=low)
    low |= second << 4
    np.right_shift(first, 4, out=high)
    high |= second & 0xF0
    return out.reshape(rows, -1)


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _unpack_runs(runs: np.ndarray) -> np.ndarray:
    """Nibble runs [..., k, w] -> codes [..., k * 2w]: each run's low nibbles, then its high ones."""
    out = np.empty((*runs.shape[:-1], 2, runs.shape[-1]), dtype=np.uint8)
    np.bitwise_and(runs, 0x0F, out=out[..., 0, :])  # two plain passes (a broadcast shift is 4x slower)
    np.right_shift(runs, 4, out=out[..., 1, :])
    return out.reshape(*runs.shape[:-2], -1)


def to_qtensor(codes: Codes, dtype: torch.dtype) -> QTensor | None:
    """`Codes` as the engine's QTensor (fp16 scale and minimum); None where one would overflow fp16."""
    with np.errstate(over="ignore"):  # checked below
        scale, minimum = codes.scale.astype(np.float16), codes.minimum.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        return None
    rows = codes.data.shape[0]
    cols = codes.data.shape[1] * (2 if codes.config.bits == 4 else 1)
    return QTensor(data=torch.from_numpy(codes.data).reshape(-1), scale=torch.from_numpy(scale).reshape(-1),
                   minimum=torch.from_numpy(minimum).reshape(-1), shape=(rows, cols), dtype=dtype,
                   config=codes.config)


def common_format(configs) -> QuantConfig | None:
    """The one format every config in `configs` converts to exactly: the most bits and the smallest
    group (a 4-bit code is the same 8-bit code; a group split in two keeps its scale and minimum in
    both halves), as where Q4_K_M mixes Q4_K (4-bit, 32) and Q6_K (8-bit, 16) tensors in one fused
    weight or across layers. None where one has no codes or the groups do not nest."""
    configs = set(configs)
    if not configs or None in configs:
        return None
    if len(configs) == 1:
        return next(iter(configs))
    group = min(c.group_size for c in configs)
    if any(c.group_size % group or c.symmetric or c.minimum_fp32 or c.adjacent_pairs for c in configs):
        return None
    return QuantConfig(bits=max(c.bits for c in configs), group_size=group)


def codes_of(data: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """A matrix's stored code bytes `[rows, bytes per row]` -> uint8 codes `[rows, cols]` (GGUF's
    formats: 8 bits, 4-bit split halves of each row or of each group)."""
    if config.bits == 8:
        return data
    if config.group_halves:
        half = config.group_size // 2
        return unpack_4bit(data.reshape(-1, half)).reshape(data.shape[0], -1)
    return unpack_4bit(data)


def widen(q: QTensor, config: QuantConfig) -> QTensor:
    """`q` in `config` (its `common_format` with others), holding exactly the same values."""
    if q.config == config:
        return q
    rows, cols = q.shape
    data = q.data
    if q.config.bits != config.bits or q.config.group_halves != config.group_halves:  # recoded, code by code
        codes = codes_of(q.data.view(rows, -1), q.config)
        data = (codes if config.bits == 8 else pack_4bit(codes)).reshape(-1)
    split = q.config.group_size // config.group_size
    scale, minimum = (t.view(rows, -1).repeat_interleave(split, dim=1).reshape(-1) for t in (q.scale, q.minimum))
    return QTensor(data=data, scale=scale, minimum=minimum, shape=q.shape, dtype=q.dtype, config=config)


def exact_values(codes: Codes) -> np.ndarray:
    """fp32 [rows, cols]: the codes with their exact (unrounded) scales: gguf's values."""
    group = codes.config.group_size
    values = codes.codes
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // group, group).astype(np.float32)
    return (grouped * codes.scale[..., None] + codes.minimum[..., None]).reshape(rows, cols)


def conversion_error(codes: Codes, qtensor: QTensor, rows: int | None = None) -> float:
    """Largest |engine value - gguf value| over the tensor's first `rows` rows (default: all; 0.0 for
    the exact types)."""
    from quant import dequantize

    n = qtensor.shape[0] if rows is None else min(rows, qtensor.shape[0])
    if n == 0:
        return 0.0
    head = QTensor(data=qtensor.data.view(qtensor.shape[0], -1)[:n].reshape(-1),
                   scale=qtensor.scale.view(qtensor.shape[0], -1)[:n].reshape(-1),
                   minimum=qtensor.minimum.view(qtensor.shape[0], -1)[:n].reshape(-1),
                   shape=(n, qtensor.shape[1]), dtype=qtensor.dtype, config=qtensor.config)
    exact = exact_values(Codes(codes.data[:n], codes.scale[:n], codes.minimum[:n], codes.config))
    return float(np.abs(dequantize(head, torch.float32).numpy() - exact).max())


# ---- block decoders: uint8 blocks [n, block bytes] -> (4-bit: nibble runs [n, runs, width], 8-bit: codes
# [n, values]; scale, minimum [n, groups]; config)

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as fp32 [n, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [n, k * width] -> codes [n, 2 * k * width]: per run of `width` bytes, its low nibbles, then its high ones."""
    return _unpack_runs(qs.reshape(qs.shape[0], -1, width)).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray, values: int) -> np.ndarray:
    """Q5_0/Q5_1: bit j of a little-endian uint32 is value j's fifth bit -> [n, values] of 0/16."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")[:, :values]
    return bits << 4


def _q4_0(b):
    d = _f16(b, 0)
    return b[:, 2:], d, -8 * d, CODE_FORMATS["Q4_0"]


def _q4_1(b):
    return b[:, 4:], _f16(b, 0), _f16(b, 2), CODE_FORMATS["Q4_1"]


def _q5_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6], 32)
    return q, d, -16 * d, QuantConfig(bits=8, group_size=32)


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | _high_bits(b[:, 4:8], 32)
    return q, _f16(b, 0), _f16(b, 2), QuantConfig(bits=8, group_size=32)


def _q8_0(b):
    d = _f16(b, 0)
    q = b[:, 2:] ^ np.uint8(0x80)  # int8 x as uint8 x + 128
    return q, d, -128 * d, QuantConfig(bits=8, group_size=32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per block (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    return b[:, 16:144].reshape(-1, 4, 32), d * sc, -(dmin * mn), QuantConfig(bits=4, group_size=32)


def _q5_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:176], 32)  # [n, 256]: sub-block j's low nibbles
    # bit j of qh[i] is the fifth bit of value i of sub-block j
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low | (high.reshape(-1, QK_K) << 4)
    return q, d * sc, -(dmin * mn), QuantConfig(bits=8, group_size=32)


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b, 208)
    low = _nibbles(ql, 64).reshape(n, 2, 4, 32)  # per half of 128 values: 4 runs of 32 low nibbles
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).reshape(n, QK_K)
    scale = d * sc  # [n, 16]: one per 16 values
    return q, scale, -32 * scale, QuantConfig(bits=8, group_size=16)


# The engine format each code-mapped type becomes (what its decoder returns).
CODE_FORMATS = {**{t: QuantConfig(bits=4, group_size=32, group_halves=True) for t in ("Q4_0", "Q4_1")},
                "Q4_K": QuantConfig(bits=4, group_size=32),
                **{t: QuantConfig(bits=8, group_size=32) for t in ("Q5_0", "Q5_1", "Q8_0", "Q5_K")},
                "Q6_K": QuantConfig(bits=8, group_size=16)}
_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176,
                "Q6_K": 210}
