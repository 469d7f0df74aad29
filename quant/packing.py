"""Two 4-bit codes per byte, split-half along the last dimension.

For `n` codes, byte `i` holds code `i` in its low nibble and code `i + ceil(n / 2)` in its high
nibble. Why not adjacent pairs: unpacking is then two flat operations over contiguous memory
(`packed & 15` -> first half, `packed >> 4` -> second half) instead of a strided interleave, and
that is what makes `dequantize` run near copy speed on a CPU with eager torch ops. `quantize` packs
each line of groups on its own (the groups of one row along the group dimension, `[num_rows,
padded_len]` -> `[num_rows, padded_len / 2]`), so any run of rows (weight rows, KV slots or blocks)
is a self-contained byte range, while the runs stay long enough for fast unpacking.
"""
from __future__ import annotations

import torch


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], `[..., n]` -> uint8 `[..., ceil(n / 2)]`.

    An odd `n` leaves the last byte's high nibble zero; `unpack_4bit(packed, n)` drops it again.
    """
    _check_uint8("pack_4bit", codes)
    n = codes.shape[-1]
    half = (n + 1) // 2
    low, high = codes[..., :half], codes[..., half:]
    if n % 2:
        high = torch.nn.functional.pad(high, (0, 1))
    # The mask keeps a stray code > 15 from spilling into its partner's nibble.
    return torch.bitwise_and(low, 0x0F).bitwise_or_(high << 4)


def unpack_4bit(packed: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """uint8 `[..., m]` -> uint8 codes `[..., length]` (default `2 * m`)."""
    _check_uint8("unpack_4bit", packed)
    full = 2 * packed.shape[-1]
    length = full if length is None else length
    if not full - 1 <= length <= full:
        raise ValueError(f"unpack_4bit: {packed.shape[-1]} bytes hold {full - 1} or {full} codes, not {length}")
    codes = torch.empty(*packed.shape[:-1], full, dtype=torch.uint8, device=packed.device)
    unpack_4bit_into(packed, low_out=codes[..., : packed.shape[-1]], high_out=codes[..., packed.shape[-1] :])
    return codes[..., :length]


def unpack_4bit_into(packed: torch.Tensor, low_out: torch.Tensor, high_out: torch.Tensor) -> None:
    """Write the low and high nibbles of `packed` into two preallocated integer tensors of its shape."""
    torch.bitwise_and(packed, 0x0F, out=low_out)
    torch.bitwise_right_shift(packed, 4, out=high_out)


def pack_4bit_pairs(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], `[..., n]` (n even) -> `[..., n / 2]`, byte j = code 2j | code 2j+1 << 4."""
    _check_uint8("pack_4bit_pairs", codes)
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return torch.bitwise_and(pairs[..., 0], 0x0F).bitwise_or_(pairs[..., 1] << 4)


def unpack_4bit_pairs_into(packed: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 `[..., m]` -> `out` `[..., 2m]` (any dtype that holds 0..15): the inverse of pack_4bit_pairs."""
    pairs = out.view(*out.shape[:-1], packed.shape[-1], 2)
    pairs[..., 0].copy_(packed & 0x0F)
    pairs[..., 1].copy_(packed >> 4)


def _check_uint8(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8:
        raise ValueError(f"{name} needs a uint8 tensor, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError(f"{name} needs at least one dimension")
