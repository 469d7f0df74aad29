"""Splitting a checkpoint's own blocks (GGUF Q4_0 / Q4_1) into the engine's QTensor components:
dequantized, they are gguf's own dequantization of the same bytes, bit for bit; rows permuted in
the file come back in the weight's order; reads through a store that links the file return them."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from offload.disk_store import DiskStore
from offload.host_buffer import aligned_empty
from offload.linked_blocks import BLOCK_FORMATS, LinkedPart, LinkedWeight, linked_key, read_rows, split_blocks
from quant import QTensor, QuantConfig, dequantize

gguf = pytest.importorskip("gguf")


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row]: gguf's own quantization of random values."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def _split(blocks: np.ndarray, type_name: str, cols: int) -> QTensor:
    rows = blocks.shape[0]
    fmt = BLOCK_FORMATS[type_name]
    data = torch.empty(rows * cols // 2, dtype=torch.uint8)
    scale, minimum = torch.empty(rows * cols // 32, dtype=torch.float16), torch.empty(rows * cols // 32, dtype=torch.float16)
    split_blocks(torch.from_numpy(blocks.copy()), fmt, cols // 32, data, scale, minimum)
    return QTensor(data, scale, minimum, (rows, cols), torch.float32, QuantConfig(bits=4, group_size=32, group_halves=True))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_split_blocks_dequantize_as_gguf_does(type_name):
    blocks = _blocks(type_name, 12, 256, seed=1)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(dequantize(_split(blocks, type_name, 256), torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("direct_io", [False, True])
def test_rows_read_through_a_linking_store_are_the_weights_rows(tmp_path, direct_io):
    """A weight of two parts, the first stored with each head's rows permuted: any row range, read
    through the store's links and split, is those rows of the weight (the parts' dequantized rows
    in the weight's order)."""
    heads, per_head, cols = 3, 4, 128
    first, second = _blocks("Q4_0", heads * per_head, cols, 2), _blocks("Q4_0", 5, cols, 3)
    order = torch.arange(heads * per_head).view(heads, per_head // 2, 2).transpose(1, 2).reshape(-1)
    path = tmp_path / "model.bin"
    header = b"x" * 37  # the parts start at unaligned offsets, as in a GGUF file
    path.write_bytes(header + first.tobytes() + second.tobytes())
    row_bytes = first.shape[1]
    parts = (LinkedPart(str(path), len(header), heads * per_head, row_bytes, order, heads),
             LinkedPart(str(path), len(header) + first.nbytes, 5, row_bytes))
    weight = LinkedWeight(BLOCK_FORMATS["Q4_0"], parts, cols // 32)
    gq = gguf.GGMLQuantizationType.Q4_0
    want = torch.cat([torch.from_numpy(gguf.quants.dequantize(first, gq))[order],
                      torch.from_numpy(gguf.quants.dequantize(second, gq))])
    with DiskStore(tmp_path / "store", "k", direct_io=direct_io) as store:
        with store.begin_write() as writer:
            for i, (part, raw) in enumerate(zip(parts, (first, second))):
                writer.link_bytes(linked_key(0, "w", i), [(part.path, part.offset, part.nbytes)], zlib.crc32(raw))
            writer.commit()
        for start, stop in [(0, 17), (1, 3), (5, 14), (12, 17), (11, 13)]:
            n = stop - start
            outs = [torch.empty(n * cols // 2, dtype=torch.uint8), torch.empty(n * cols // 32, dtype=torch.float16),
                    torch.empty(n * cols // 32, dtype=torch.float16)]
            staging = aligned_empty((weight.staging_bytes(start, stop),), torch.uint8)
            for future, finish in read_rows(store, 0, "w", weight, start, stop, staging, outs):
                future.result()
                finish()
            q = QTensor(*outs, (n, cols), torch.float32, QuantConfig(bits=4, group_size=32, group_halves=True))
            assert torch.equal(dequantize(q), want[start:stop]), (start, stop)
