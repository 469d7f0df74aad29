"""Weights streamed from a checkpoint's own block-quantized bytes (GGUF's Q4_0 and Q4_1).

Such a file holds, per group of 32 values, one block: the fp16 scale (and, Q4_1, the fp16 minimum),
then the group's 16 code bytes, which are the engine's `QuantConfig.group_halves` codes as they
are. Copying every block into the disk store would write as many bytes as the file holds (on a disk
that writes 3x slower than it reads, loading then costs several reads of the file); instead the store
links each part of the weight to its bytes in the file (offload/store_writer.py `link_bytes`,
checked against their crc32 like any stored tensor) and a layer load reads the rows' blocks into a
staging buffer and splits them into the QTensor's codes, scales and minimums (`split_blocks`): one
pass over memory, on the loading thread, while the file's bytes are all the disk reads.

A weight is the rows of its parts one after another (q/k/v fused by rows); a part's rows may be in
another order in the file (llama.cpp stores q and k with each head's rows permuted): `row_order`
then says which file row each of the part's rows is, and a read covers the whole heads its rows lie
in, then gathers them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.host_buffer import align_up


@dataclass(frozen=True)
class BlockFormat:
    block_bytes: int  # one group's block in the file
    codes_at: int  # where the group's code bytes start in its block (the fp16 scale is at 0)
    minimum_at: int | None  # the fp16 minimum's place; None: the minimum is -zero * scale
    zero: int = 0


BLOCK_FORMATS = {"Q4_0": BlockFormat(18, 2, None, zero=8), "Q4_1": BlockFormat(20, 4, 2)}


@dataclass(frozen=True, eq=False)
class LinkedPart:
    path: str
    offset: int  # of the part's first row in the file
    rows: int
    row_bytes: int
    row_order: torch.Tensor | None = None  # int64 [rows]: the file row of each row; None: the same row
    heads: int = 1  # row_order permutes rows within each of this many equal runs of rows
    crc32: int | None = None  # of the part's bytes, when the source has just read them (to link them)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def file_rows(self, start: int, stop: int) -> tuple[int, int, torch.Tensor | None]:
        """Rows [start, stop) of the part: the file rows [first, end) to read and, where they are
        permuted, the index of each wanted row among those read."""
        if self.row_order is None:
            return start, stop, None
        per_head = self.rows // self.heads
        first, end = start // per_head * per_head, -(-stop // per_head) * per_head
        return first, end, self.row_order[start:stop] - first


@dataclass(frozen=True, eq=False)
class LinkedWeight:
    format: BlockFormat
    parts: tuple[LinkedPart, ...]
    groups_per_row: int

    def pieces(self, start: int, stop: int):
        """(part index, part, part-local rows [a, b), the weight's row where they go) over [start, stop)."""
        at = 0
        for i, part in enumerate(self.parts):
            a, b = max(start, at) - at, min(stop, at + part.rows) - at
            if a < b:
                yield i, part, a, b, at + a
            at += part.rows

    def staging_bytes(self, start: int, stop: int) -> int:
        """Bytes of staging that reading rows [start, stop) needs (each read 4096-aligned)."""
        total = 0
        for _, part, a, b, _ in self.pieces(start, stop):
            first, end, _ = part.file_rows(a, b)
            total += align_up((end - first) * part.row_bytes)
        return total


def linked_key(layer: int, name: str, part: int) -> str:
    return f"{layer}.{name}.blocks{part}"


def split_blocks(blocks: torch.Tensor, fmt: BlockFormat, groups_per_row: int, data: torch.Tensor,
                 scale: torch.Tensor, minimum: torch.Tensor) -> None:
    """uint8 blocks `[rows, groups_per_row * block_bytes]` -> the rows' QTensor components (codes
    uint8 `[rows * groups * (block_bytes - codes_at)]`, fp16 scale and minimum `[rows * groups]`)."""
    rows = blocks.shape[0]
    grouped = blocks.view(rows, groups_per_row, fmt.block_bytes)
    data.view(rows, groups_per_row, -1).copy_(grouped[:, :, fmt.codes_at:])
    halves = blocks.view(torch.int16).view(rows, groups_per_row, fmt.block_bytes // 2)  # the fp16 fields
    scale.view(rows, groups_per_row).copy_(halves[:, :, 0].view(torch.float16))
    if fmt.minimum_at is None:
        torch.mul(scale, -fmt.zero, out=minimum)  # exact: the zero is a power of two
    else:
        minimum.view(rows, groups_per_row).copy_(halves[:, :, fmt.minimum_at // 2].view(torch.float16))


def read_rows(store, layer: int, name: str, weight: LinkedWeight, start: int, stop: int,
              staging: torch.Tensor, outs: list[torch.Tensor]) -> list:
    """Start reading rows [start, stop) of a linked weight into `staging` (uint8, at least
    `weight.staging_bytes(start, stop)`); -> [(future, finish)] where `finish()`, called once the
    future is done, splits them into `outs` (data, scale, minimum of rows [start, stop))."""
    data, scale, minimum = outs
    per_row = [t.numel() // max(1, stop - start) for t in outs]
    reads, at = [], 0
    for i, part, a, b, row in weight.pieces(start, stop):
        first, end, index = part.file_rows(a, b)
        nbytes = (end - first) * part.row_bytes
        blocks = staging[at:at + nbytes].view(end - first, part.row_bytes)
        at += align_up(nbytes)
        future = store.read_range_async(linked_key(layer, name, i), first * part.row_bytes, blocks)
        lo, hi = row - start, row - start + b - a
        views = [t[lo * n:hi * n] for t, n in zip((data, scale, minimum), per_row)]

        def finish(blocks=blocks, index=index, views=views):
            split_blocks(blocks if index is None else blocks[index], weight.format, weight.groups_per_row, *views)
        reads.append((future, finish))
    return reads
