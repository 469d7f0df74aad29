"""Read one tensor of a safetensors file with one `pread` into fresh memory, not through a mapping.

safetensors' `get_tensor` maps the file: every page a load touches stays resident, and counted in
the process's RSS, for as long as the file stays open (the whole checkpoint, once every layer has
been read: 4.9 GB peak RSS for a 4-bit llama-2-7b, scripts/bench_load_quantized.py). Reading each
tensor into its own buffer keeps the resident set to the layer being placed.
"""
from __future__ import annotations

import json
import os
import struct

import torch

from flexsarathi.errors import CheckpointError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class PreadReader:
    """Tensors of safetensors files by name, each read with one pread (headers parsed once per file)."""

    def __init__(self):
        self._files: dict[str, tuple[int, int, dict]] = {}  # path -> (fd, data start, header)

    def _file(self, path: str) -> tuple[int, int, dict]:
        if path not in self._files:
            fd = os.open(path, os.O_RDONLY)
            try:
                (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, length, 8))
            except (struct.error, ValueError, OSError) as exc:
                os.close(fd)
                raise CheckpointError(f"cannot read the safetensors header of {path}: {exc}") from None
            self._files[path] = (fd, 8 + length, header)
        return self._files[path]

    def extent(self, path: str, name: str) -> tuple[str, int, int, str, list[int]]:
        """(path, offset, nbytes, safetensors dtype, shape) of a tensor's bytes in its file, from the header."""
        _, start, header = self._file(path)
        entry = header.get(name)
        if not isinstance(entry, dict) or "data_offsets" not in entry:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        begin, end = entry["data_offsets"]
        return path, start + begin, end - begin, entry.get("dtype"), list(entry.get("shape", []))

    def get(self, path: str, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a contiguous uint8 tensor of the tensor's byte size to read into (e.g. its rows of a
        fused weight), instead of fresh memory."""
        fd, start, header = self._file(path)
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} is missing or of an unknown dtype")
        begin, end = entry["data_offsets"]
        dtype = _DTYPES[entry["dtype"]]
        if out is not None and (out.dtype != torch.uint8 or out.numel() != end - begin or not out.is_contiguous()):
            raise ValueError(f"PreadReader.get({name}): out must be {end - begin} contiguous bytes")
        buffer = torch.empty(end - begin, dtype=torch.uint8) if out is None else out
        view = memoryview(buffer.numpy())
        done = 0
        while done < len(view):  # pread may return fewer bytes than asked
            got = os.preadv(fd, [view[done:]], start + begin + done)
            if got <= 0:
                raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {start + end}")
            done += got
        return buffer.view(dtype).reshape(entry["shape"])

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()
