"""`QTensor`: a group-wise quantized tensor, a typed value that can move between devices."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from quant.config import QuantConfig
from quant.layout import GroupLayout


@dataclass(frozen=True, eq=False)
class QTensor:
    # uint8 [num_groups * bytes_per_group]: the codes of all groups as one flat sequence, at 4 bits
    # packed two per byte by `pack_4bit` over that whole sequence.
    data: torch.Tensor
    scale: torch.Tensor  # fp16 [num_groups]: the step between consecutive codes
    minimum: torch.Tensor  # fp16 [num_groups] (fp32 with config.minimum_fp32): the value of code 0
    shape: tuple[int, ...]  # the original shape
    dtype: torch.dtype  # the original dtype, what `dequantize` returns by default
    config: QuantConfig
    # rows [0, N - N % 16) of this 2-D 4-bit weight lie in the int8 kernel's 16-row panels (quant/
    # panels.py: one weight kept resident for it, reordered once at load), the rest row-major
    panels: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.config, QuantConfig):
            raise ValueError(f"QTensor.config must be a QuantConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"QTensor.dtype must be a floating torch.dtype, got {self.dtype!r}")
        layout = self.layout
        expected = {
            "data": (torch.uint8, (layout.num_groups * self.config.bytes_per_group,)),
            "scale": (torch.float16, (layout.num_groups,)),
            "minimum": (torch.float32 if self.config.minimum_fp32 else torch.float16, (layout.num_groups,)),
        }
        where = f"shape {self.shape} with {self.config}"
        for name, (dtype, shape) in expected.items():
            buffer = getattr(self, name)
            if not isinstance(buffer, torch.Tensor):
                raise ValueError(f"QTensor.{name} must be a torch.Tensor, got {type(buffer).__name__}")
            if buffer.dtype != dtype:
                raise ValueError(f"QTensor.{name} must be {dtype}, got {buffer.dtype}")
            if tuple(buffer.shape) != shape:
                raise ValueError(
                    f"QTensor.{name} has shape {tuple(buffer.shape)} ({buffer.numel()} elements) but "
                    f"{where} needs {shape} ({torch.Size(shape).numel()} elements)"
                )
        if self.panels is not False and (self.panels is not True or self.config.bits != 4 or len(self.shape) != 2
                                         or layout.group_dim != 1):
            raise ValueError(f"QTensor.panels is True only for a 2-D 4-bit weight grouped along dim 1, got "
                             f"{self.panels!r} for {where}")
        if not (self.data.device == self.scale.device == self.minimum.device):
            raise ValueError(
                f"QTensor buffers must share one device, got data on {self.data.device}, "
                f"scale on {self.scale.device}, minimum on {self.minimum.device}"
            )

    @property
    def layout(self) -> GroupLayout:
        return GroupLayout.of(self.shape, self.config)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage: codes + scales + minimums."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QTensor":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def clone(self) -> "QTensor":
        """A copy with buffers of its own (e.g. before quant/panels.py reorders one in place)."""
        return self._map(torch.Tensor.clone)

    def pin_memory(self) -> "QTensor":
        return self._map(torch.Tensor.pin_memory)

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in (self.data, self.scale, self.minimum))

    def rows(self, start: int, stop: int) -> "QTensor":
        """Rows [start, stop) along the first dimension of a tensor of 2 or more dimensions grouped
        along its last (a weight's rows; a KV pass's tokens [T, kv_heads, head_dim]), as a view: each
        row's groups (codes packed per line, quant/packing.py), scales and minimums are one run."""
        if self.panels:
            raise ValueError(f"QTensor.rows({start}, {stop}): this weight's rows are stored in panels "
                             f"(quant/panels.py), not one contiguous run each")
        if not self._rows_are_runs() or not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"QTensor.rows({start}, {stop}): needs a tensor of 2 or more dimensions grouped along "
                             f"its last and rows within [0, {self.shape[0] if self.shape else 0}], got shape "
                             f"{self.shape}, group_dim {self.layout.group_dim}")
        groups = self.layout.num_groups // self.shape[0] if self.shape[0] else 0  # per row
        per_byte = groups * self.config.bytes_per_group
        return replace(self, data=self.data[start * per_byte:stop * per_byte],
                       scale=self.scale[start * groups:stop * groups],
                       minimum=self.minimum[start * groups:stop * groups], shape=(stop - start, *self.shape[1:]))

    def take_rows(self, index: torch.Tensor) -> "QTensor":
        """Rows `index` (int64 [R], any order, repeats allowed) along the first dimension, as rows()
        takes them, as a QTensor [R, ...] (a copy): e.g. a quantized embedding's looked-up rows."""
        if not self._rows_are_runs() or self.panels:
            raise ValueError(f"QTensor.take_rows: needs a tensor of 2 or more dimensions grouped along its last, "
                             f"rows not in panels, got shape {self.shape}, group_dim {self.layout.group_dim}, "
                             f"panels={self.panels}")
        rows, index = self.shape[0], index.reshape(-1).to(self.device)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.view(rows, -1).index_select(0, index).reshape(-1)
        return replace(self, data=pick(self.data), scale=pick(self.scale), minimum=pick(self.minimum),
                       shape=(index.numel(), *self.shape[1:]))

    def _rows_are_runs(self) -> bool:
        """Rows along the first dimension are whole runs of groups: the groups lie along the last."""
        return len(self.shape) >= 2 and self.layout.group_dim == len(self.shape) - 1

    def _map(self, fn) -> "QTensor":
        return replace(self, data=fn(self.data), scale=fn(self.scale), minimum=fn(self.minimum))
