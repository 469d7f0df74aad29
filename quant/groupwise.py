"""`quantize` and `dequantize`: group-wise min-max quantization with a guaranteed error bound.

Every group stores an fp16 `minimum` (the value of code 0) and an fp16 `scale` (the step between
codes), and a value is read back as `code * scale + minimum`. How they are chosen so that every
value comes back within `scale / 2` is in `quant.group_params`.
"""
from __future__ import annotations

import torch

from quant import cpu_weight_dequant
from quant.config import QuantConfig
from quant.group_params import check_representable, scale_and_minimum
from quant.layout import GroupLayout
from quant.packing import pack_4bit, pack_4bit_pairs, unpack_4bit, unpack_4bit_pairs_into
from quant.panels import from_panels
from quant.qtensor import QTensor

_CPU_CHUNK_VALUES = 2**20  # values per chunk in `quantize` on CPU: 4 MiB fp32 temporaries


def quantize(x: torch.Tensor, config: QuantConfig, *, nonfinite: torch.Tensor | None = None) -> QTensor:
    """Quantize a floating tensor of any shape, on its own device, group-wise along `config.group_dim`.

    Values whose group minimum or step do not fit fp16 (inf, NaN, huge) raise ValueError. On CUDA
    that check is a host sync, so a hot path (KV stores) passes `nonfinite`, a bool scalar on x's
    device that is OR-ed with "some group is not representable" and checked where the caller
    syncs anyway (offload/kv_cache.py); on the CPU the check is always immediate."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"quantize needs a floating tensor, got {x.dtype}")
    layout = GroupLayout.of(x.shape, config)
    groups = layout.to_groups(x)  # [num_groups, group_size], x's dtype
    scale = torch.empty(layout.num_groups, dtype=torch.float16, device=x.device)
    minimum = torch.empty_like(scale, dtype=torch.float32 if config.minimum_fp32 else torch.float16)
    codes = torch.empty(layout.num_groups, config.group_size, dtype=torch.uint8, device=x.device)
    # On CPU, chunks of many groups keep the fp32 temporaries small: they stay in cache and are
    # reused by the allocator instead of being page-faulted in afresh (several times the arithmetic
    # on a VM). On CUDA one launch per operation over the whole tensor is fastest.
    # (max(1, ...): an empty tensor has no groups and range() refuses a step of 0.)
    rows_per_chunk = max(1, _CPU_CHUNK_VALUES // config.group_size if x.device.type == "cpu" else layout.num_groups)
    for start in range(0, layout.num_groups, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        _quantize_groups(groups[rows], config, scale[rows], minimum[rows], codes[rows])
    if nonfinite is not None and x.device.type == "cuda":
        nonfinite |= ~(torch.isfinite(scale).all() & torch.isfinite(minimum).all())  # no host sync
    else:
        check_representable(scale, minimum)
    # 4 bits: each line of groups (all groups of one row along the group dimension) is packed on
    # its own, split halves within the line: any set of lines (a row range of a weight, the slots
    # or blocks of a paged KV cache) is a self-contained byte range, and unpacking still streams
    # over runs as long as the line.
    lines = codes.view(layout.num_rows, layout.padded_len)
    if config.group_halves:
        lines = codes  # [num_groups, group_size]: each group packed on its own
    pack = pack_4bit_pairs if config.adjacent_pairs else pack_4bit
    data = (pack(lines) if config.bits == 4 else lines).reshape(-1)
    return QTensor(data=data, scale=scale, minimum=minimum, shape=tuple(x.shape), dtype=x.dtype, config=config)


def _quantize_groups(
    groups: torch.Tensor, config: QuantConfig, scale_out: torch.Tensor, minimum_out: torch.Tensor, codes_out: torch.Tensor
) -> None:
    """`groups` `[rows, group_size]` -> fp16 scale and minimum `[rows]`, uint8 codes `[rows, group_size]`."""
    values = groups.float()  # may be a view of the caller's fp32 tensor: not modified below
    scale, minimum = scale_and_minimum(values, config)
    scale_out.copy_(scale)
    minimum_out.copy_(minimum)
    # The exact step count lies in [0, max_code] and fp32 rounding moves it far less than half a
    # step, so rounding already lands in range; the clamp is a cheap guarantee that codes fit.
    steps = (values - minimum.float()[:, None]).div_(scale.float()[:, None])
    codes_out.copy_(steps.round_().clamp_(0, config.max_code))


def dequantize(q: QTensor, dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`code * scale + minimum` in `dtype` (default: the original dtype), on `q`'s device.

    `out` (contiguous, of `q.shape` and `dtype`) is a preallocated result buffer, e.g. a layer's
    working buffer: when the groups run along the last dimension unpadded it is written in place.
    """
    dtype = q.dtype if dtype is None else dtype
    if q.panels:  # stored for the int8 kernel: its rows back in order first
        q = from_panels(q)
    layout = q.layout
    if out is not None:
        _check_out(out, q, dtype)
    if cpu_weight_dequant.covers(q, dtype):  # one C pass on the CPU, the same bits
        return cpu_weight_dequant.dequantize_into(q, out if out is not None else torch.empty(q.shape, dtype=dtype))
    if out is not None and layout.groups_are_contiguous:
        values = out.view(layout.num_groups, q.config.group_size)
    else:
        values = torch.empty(layout.num_groups, q.config.group_size, dtype=dtype, device=q.device)
    if dtype == torch.float16:
        _codes_as_fp16_subnormals(q, values)  # value c * 2**-24
        per_group_affine_(values, q.scale.float() / 2.0**-24, q.minimum.float())  # c * scale + minimum
    else:
        _dequantize_lines_fp32(q, values)
    result = layout.from_groups(values)  # a view of `values` (a slice or a moved dimension)
    if out is None:
        return result.contiguous()
    if not layout.groups_are_contiguous:
        out.copy_(result)
    return out


def _dequantize_lines_fp32(q: QTensor, values: torch.Tensor) -> None:
    """`values` [num_groups, group_size] (any float dtype but fp16) = code * scale + minimum,
    computed in fp32 (bf16 cannot even hold the fp16 scale and minimum), rounded to fp32, then to `values`.

    On CPU in chunks of whole lines (a line: all groups of one row along the group dimension), so
    the fp32 and unpacked temporaries stay a few MiB, reused rather than freshly mapped and
    page-faulted on every call (docs/DESIGN.md, "Tried": the whole-weight temporary).
    """
    layout = q.layout
    num_rows, line_len = layout.num_rows, layout.padded_len
    groups_per_line = line_len // q.config.group_size
    packed = q.data.view(num_rows, -1 if num_rows else 0)
    lines = values.view(num_rows, line_len)
    multiplier, offset = q.scale.float(), q.minimum.float()
    step = max(1, _CPU_CHUNK_VALUES // max(1, line_len)) if values.device.type == "cpu" else max(1, num_rows)
    # bf16 on CPU also in place: the affine below (batch norm) computes in fp32 and rounds once to
    # bf16, the same bits as an fp32 pass then a cast, without the fp32 round trip through memory
    # (measured: 8192 x 2048 in 5.8 ms instead of 6.4, 1 thread, scripts/bench_quant_cpu.py).
    in_place = values.dtype == torch.float32 or (values.dtype == torch.bfloat16 and values.device.type == "cpu")
    scratch = None if in_place else torch.empty(min(step, num_rows), line_len, dtype=torch.float32,
                                                device=values.device)
    for start in range(0, num_rows, step):
        stop = min(num_rows, start + step)
        codes, target = packed[start:stop], lines[start:stop]
        work = target if in_place else scratch[:stop - start]
        if q.config.adjacent_pairs:
            unpack_4bit_pairs_into(codes, work)  # value c
        elif q.config.group_halves:
            work.view(-1, q.config.group_size).copy_(unpack_4bit(codes.reshape(-1, q.config.group_size // 2)))
        else:
            work.copy_(unpack_4bit(codes) if q.config.bits == 4 else codes)  # value c
        groups = slice(start * groups_per_line, stop * groups_per_line)
        per_group_affine_(work.view(-1, q.config.group_size), multiplier[groups], offset[groups])
        if not in_place:
            target.copy_(work)


def _codes_as_fp16_subnormals(q: QTensor, values: torch.Tensor) -> None:
    """Write each code c into fp16 `values` as the bit pattern c, i.e. the subnormal c * 2**-24.

    That value is exact and linear in c, and needs no int -> fp16 conversion, which torch does not
    vectorise on CPU (it costs several copies' time); the widening and nibble ops below do vectorise.
    """
    layout = q.layout
    bits = values.view(torch.int16).view(layout.num_rows, layout.padded_len)  # one line per row
    packed = q.data.view(layout.num_rows, -1 if layout.num_rows else 0)
    if q.config.bits == 8:
        bits.copy_(packed)
        return
    half = bits.shape[1] // 2
    if q.config.adjacent_pairs:
        pairs = bits.view(layout.num_rows, half, 2)
        low, high = pairs[..., 0], pairs[..., 1]
    elif q.config.group_halves:  # split halves of each group
        groups = bits.view(layout.num_groups, q.config.group_size)
        packed = packed.reshape(layout.num_groups, q.config.group_size // 2)
        low, high = groups[:, :q.config.group_size // 2], groups[:, q.config.group_size // 2:]
    else:
        low, high = bits[:, :half], bits[:, half:]  # see pack_4bit: split halves of each line
    low.copy_(packed)  # uint8 -> int16: the whole byte
    torch.bitwise_right_shift(low, 4, out=high)
    low.bitwise_and_(0x0F)


def per_group_affine_(values: torch.Tensor, multiplier: torch.Tensor, offset: torch.Tensor) -> None:
    """In place, `values[g, :] = values[g, :] * multiplier[g] + offset[g]`, computed in fp32, one rounding.

    `values`: [num_groups, group_size]; `multiplier`, `offset`: fp32 [num_groups]. The product is
    exact in fp32 (a code has at most 8 significant bits, an fp16 scale 11), so the only rounding
    is that of the sum. On CUDA that is one `addcmul`. On CPU `addcmul` with two broadcast operands
    falls back to a scalar loop (and `mul_` then `add_` costs two passes and two fp16 roundings), so
    there it is inference-mode batch norm with the groups as channels, mean 0, variance 1, eps 0
    (1 / sqrt(var + eps) is then exactly 1): the same arithmetic as one vectorised pass.
    """
    num_groups, group_size = values.shape
    if values.numel() == 0:
        return
    if values.device.type != "cpu":
        torch.addcmul(offset[:, None], values, multiplier[:, None], out=values)
        return
    channels = values.view(1, num_groups, group_size)  # [batch=1, channels=num_groups, length]
    mean = torch.zeros_like(multiplier)
    variance = torch.ones_like(multiplier)
    unused = multiplier.new_empty(0)
    torch.ops.aten.native_batch_norm.out(
        channels, multiplier, offset, mean, variance, False, 0.0, 0.0,
        out=channels, save_mean=unused, save_invstd=unused.clone(),
    )


def _check_out(out: torch.Tensor, q: QTensor, dtype: torch.dtype) -> None:
    if tuple(out.shape) != q.shape or out.dtype != dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(
            f"dequantize: out must be a contiguous {dtype} tensor of shape {q.shape} on {q.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
