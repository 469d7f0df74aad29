"""`GGUFCheckpoint`: a GGUF file as a weight source (formats/checkpoint.py's contract); with the
tokenizer formats/gguf_tokenizer.py builds from the same file, `LLM("model.gguf")` needs nothing else
(formats/opened_model.py opens both).

Layer matrices of a code-mapped type come as `QTensor`s with their own `QuantConfig` (group 32 or
16: formats/gguf_quants.py; K-quants only for an engine that stores weights compressed, as their
conversion rounds their scales), q/k rows put back in HF order and q/k/v, gate/up fused by rows (each
row's groups are a self-contained byte range, so fusing and reordering rows move codes only). A
mixture-of-experts layer's 3-D expert stacks (llama.cpp's ffn_{gate,up,down}_exps) are read as
[experts * rows, cols] matrices and reordered into models/moe.py's stacked experts the same way;
older files' one 2-D tensor per expert (ffn_gate.E) are fused like any other parts.
Where the engine stores another format it dequantizes them at placement, exactly (offload/
placement.py `flat_components`). A fused weight whose parts differ in format, norms and biases
come as floats: gguf's own dequantization, cast to the dtype; so do the token embedding and the
output head, unless the file holds them as Q4_0 / Q4_1 (kept as those codes: `global_weights`).
"""
from __future__ import annotations

import hashlib
import os
import sys
import zlib
from collections import Counter

import numpy as np
import torch

from flexsarathi.formats.checkpoint import WeightSource, file_identity, require_finite
from flexsarathi.errors import CheckpointError
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.formats.prequantized import SourceDescription, TensorKind, concat_rows
from flexsarathi.models import build_model_math
from flexsarathi.formats.gguf_file import GGUFTensor, gguf_part, hf_config, norm_shift, open_gguf, qk_heads, \
    resolve_part, unpermute_rows
from flexsarathi.formats.gguf_quants import CODE_FORMATS, CONVERTED_TYPES, FLOAT_TYPES, check_type, code_format, \
    common_format, conversion_error, decode_scratch_bytes, \
    to_codes, to_float, to_qtensor, widen
from flexsarathi.formats.worker_pools import worker_pool
from offload.linked_blocks import BLOCK_FORMATS, LinkedPart, LinkedWeight, split_blocks
from quant import QTensor

GLOBAL_MATRICES = ("embed_tokens.weight", "lm_head.weight")  # kept as the file's 4-bit codes where it has them
ERROR_ROWS = 256  # rows of each first-layer K-quant tensor whose conversion error is measured
_INF_BITS = 0x7C00  # fp16 magnitudes at or above: inf, NaN
_MAX_EIGHTH_BITS = int(np.array(65504 / 8, dtype=np.float16).view(np.int16))  # |d| whose -8d fits fp16


class GGUFCheckpoint(WeightSource):
    def __init__(self, path: str, convert_k_quants: bool = True, report=None):
        """convert_k_quants: K-quant matrices as converted codes (for an engine that stores weights
        compressed: far closer than requantizing their values) or as their exact values (False);
        report: where conversion errors are told (default: a line on stderr per K-quant type)."""
        self.path, self.convert_k_quants = path, convert_k_quants
        self.gguf = open_gguf(path)
        self.config = ModelConfig.from_hf(hf_config(self.gguf), source=path)
        self.model = build_model_math(self.config)
        self._report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.conversion_errors: dict[str, float] = {}  # K-quant type -> largest |error| measured
        self._formats = None  # ((convert_k_quants, keep_blocks), quantized_formats()) once computed
        self.keep_blocks = True  # Q4_0/Q4_1 codes as their blocks' bytes (use_for)
        self.keep_global_codes = True  # embedding and head as the file's 4-bit codes (global_weights)
        self._crcs: dict[str, int] = {}  # GGUF tensor name -> crc32 of its bytes as last read
        self._at = {(t.path, t.offset): t for t in self.gguf.tensors.values()}  # a linked part's tensor
        self._validate()
        if "rope_freqs.weight" in self.gguf.tensors:  # llama3-style scaling as llama.cpp stores it
            factors = to_float(*self._raw("rope_freqs.weight")).float()
            self.model.divide_rope_frequencies(factors)

    def use_for(self, compress_weight: bool, weights_on_disk: bool = True) -> None:
        """weights_on_disk: Q4_0/Q4_1 keep their blocks' bytes (the disk tier streams them from this
        file); without a disk tier they are repacked once into the int8 kernel's faster layout."""
        self.convert_k_quants, self.keep_blocks = compress_weight, weights_on_disk

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for part in self.gguf.paths:  # size, mtime, ctime, inode: a rewrite keeping size and mtime noticed
            digest.update(file_identity(part).encode())
        return f"gguf-{digest.hexdigest()[:16]}"

    def _raw(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        t = self.gguf.tensor(name)
        return t.read(), t.type_name, t.shape

    def _parts(self, hf_names: list[str]) -> list[tuple[GGUFTensor, int | None]]:
        """Each HF tensor's GGUF tensor, and its expert where that is a 3-D stack of experts (a
        file with one 2-D tensor per expert: that tensor, as a dense part)."""
        return [resolve_part(self.gguf, gguf_part(name, self.config.model_type)) for name in hf_names]

    def _validate(self) -> None:
        """Every tensor the model needs, in each layer as that layer has it (dense or with experts):
        present, of a supported type, of the config's shape."""
        expected = [(self.model.hf_global_names(), self.model.global_shapes())]
        expected += [(self.model.hf_layer_names(i), self.model.layer_shapes(i)) for i in range(self.config.num_layers)]
        for names, shapes in expected:
            for canonical, hf_names in names.items():
                self._check_parts(canonical, self._parts(hf_names), tuple(shapes[canonical]))
        self._refuse_unused([hf for names, _ in expected for parts in names.values() for hf in parts])

    def _refuse_unused(self, hf_names: list[str]) -> None:
        """One CheckpointError when the file holds tensors the model its metadata describes does not
        read (names only): e.g. {arch}.block_count 3 over 5 blocks would run as another model."""
        read = {t.name for t, _ in self._parts(hf_names)} | {"rope_freqs.weight"}
        mtp = tuple(f"blk.{self.config.num_layers + i}." for i in range(self.config.unread_layers))  # glm4moe's
        unused = sorted(n for n in self.gguf.tensors if n not in read and not n.startswith(mtp))
        if not unused:
            return
        blocks = [int(n.split(".")[1]) for n in unused if n.startswith("blk.") and n.split(".")[1].isdigit()]
        key = f"{self.gguf.architecture}.block_count"
        cause = (f"metadata {key} is {self.config.num_layers}, but the file holds block {max(blocks)}"
                 if blocks and max(blocks) >= self.config.num_layers else
                 "the metadata does not describe these tensors")
        raise CheckpointError(f"{self.path}: {len(unused)} tensor(s) in the file are not used by the model its "
                              f"metadata describes ({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}): "
                              f"{cause}; refusing to run a model other than the one saved")

    def _check_parts(self, canonical: str, parts, want: tuple[int, ...]) -> None:
        experts = self.config.moe.num_experts if self.config.moe else 0
        shapes = []
        for t, expert in parts:
            check_type(t.type_name, t.name, self.path)
            if expert is not None and (len(t.shape) != 3 or t.shape[0] != experts):
                raise CheckpointError(f"{self.path}: {t.name} {list(t.shape)} is not a stack of {experts} experts "
                                      f"[experts, rows, cols] as the metadata implies")
            shape = t.shape[1:] if expert is not None else t.shape
            shapes.append((1, *shape) if len(want) == 2 and len(shape) == 1 else shape)  # qwen2moe's 1-D shared gate
        if any(s[1:] != want[1:] for s in shapes) or sum(s[0] for s in shapes) != want[0]:
            got = ", ".join(dict.fromkeys(f"{t.name} {list(t.shape)}" for t, _ in parts))
            raise CheckpointError(f"{self.path}: {got} do not make {canonical} {list(want)} as the "
                                  f"metadata implies")

    def global_weights(self, dtype):
        """Norms as floats; the token embedding and an untied output matrix as the file's codes where
        it holds them in a 4-bit format of its own (Q4_0, Q4_1: the int8 kernel multiplies the head,
        an embedding's looked-up rows are dequantized: models/layers.py), unless keep_global_codes
        is off; else floats (gguf's dequantization)."""
        out = {}
        for k, parts in self.model.hf_global_names().items():
            fmt = self._global_format(k, parts)
            out[k] = (self._coded(parts, dtype, fmt) if fmt else None) or self._dense(parts, dtype)
        return out

    def global_formats(self) -> dict:
        formats = {k: self._global_format(k, parts) for k, parts in self.model.hf_global_names().items()}
        return {k: fmt for k, fmt in formats.items() if fmt is not None}

    def read_buffer_bytes(self, dtype: torch.dtype) -> int:
        """The largest of: a tensor's bytes as read, beside their decoding before the weight is given:
        float32 values and their q/k row-reordered copy (_dense), or codes as bytes with float32
        group scales and minimums (to_codes) plus the decoding's scratch; nothing for Q4_0 / Q4_1
        blocks kept as such (_split_blocks: split straight into the weight as given)."""
        most, decoding = 0, False
        for t in self.gguf.tensors.values():
            values, raw = int(np.prod(t.shape)), int(np.prod(t.raw_shape)) * t.raw_dtype.itemsize
            fmt = code_format(t.type_name, self.keep_blocks) if t.type_name in CODE_FORMATS else None
            if fmt is not None and fmt.group_halves:
                decoded = 0
            elif fmt is not None:
                decoded, decoding = values * fmt.bits // 8 + values // fmt.group_size * 8, True
            else:
                decoded = 8 * values
            most = max(most, raw + decoded)
        return most + (decode_scratch_bytes() if decoding else 0)

    def _global_format(self, name: str, hf_names: list[str]):
        """The 4-bit format a global matrix's codes keep (no conversion: Q4_0 / Q4_1), else None."""
        if not self.keep_global_codes or name not in GLOBAL_MATRICES:
            return None
        if any(t.type_name in CONVERTED_TYPES for t, _ in self._parts(hf_names)):
            return None
        fmt = self._format(hf_names)
        return fmt if fmt is not None and fmt.bits == 4 else None

    def layer_weights(self, layer, dtype, unchecked=frozenset(), skip=frozenset()):
        """Matrices as codes where the file has them (routers and shared-expert gates, kept resident
        uncompressed, as floats); each weight in its canonical shape. skip: weights of
        `linked_blocks(layer)` the caller only links: their bytes are read for their crc32 (and
        their scales checked) and left out. unchecked: ignored (every weight is checked here: a
        float one by require_finite, block codes by their scales, gguf_quants.py)."""
        shapes, formats = self.model.layer_shapes(layer), self.quantized_formats() or {}
        out, linkable = {}, self.linked_blocks(layer) if skip else {}
        for k, parts in self.model.hf_layer_names(layer).items():
            if k in skip and k in linkable:
                self._checksum(linkable[k])
                continue
            coded = self._coded(parts, dtype, formats[k]) if formats.get(k) else None
            out[k] = coded or self._dense(parts, dtype).reshape(shapes[k])
        return out

    def describe(self) -> SourceDescription:
        """For `flexsarathi inspect`, from the headers alone: each layer weight's GGUF type(s) over
        its parts and layers, the format the engine stores it in, and how it gets there."""
        formats = self.quantized_formats() or {}
        resident = self.model.resident_weights()
        types: dict[str, set[str]] = {}
        for i in range(self.config.num_layers):
            names = self.model.hf_layer_names(i)
            for name, shape in self.model.layer_shapes(i).items():
                if len(shape) == 2:
                    types.setdefault(name, set()).update(t.type_name for t, _ in self._parts(names[name]))
        kinds = []
        for name, found in types.items():
            stored = formats.get(name)
            if stored is None:
                how = ("kept in floats: a router" if name in resident else
                       "as is" if found <= set(FLOAT_TYPES) else "dequantized to floats at placement (exact values)")
            elif found & set(CONVERTED_TYPES):
                how = ("K-quant codes converted once at placement: super-block scales rounded to fp16, the "
                       "largest error against gguf's dequantization printed")
            else:
                how = "codes kept exactly" + (", parts widened to one format" if len(found) > 1 else
                                              "; on the disk tier read from this file" if found <= set(BLOCK_FORMATS) else "")
            kinds.append(TensorKind(name, " + ".join(sorted(found)), stored, how))
        counts = Counter(t.type_name for t in self.gguf.tensors.values())
        parts = len(self.gguf.paths)
        detail = (f"llama.cpp {self.gguf.architecture}, {parts} file{'s' if parts > 1 else ''}, tensors: "
                  + ", ".join(f"{n} {name}" for name, n in counts.most_common()))
        return SourceDescription("gguf", detail, tuple(kinds), sum(os.path.getsize(p) for p in self.gguf.paths))

    def quantized_formats(self) -> dict | None:
        """Per layer matrix (canonical name): the one format its codes take in every layer that has
        it (`common_format`: Q4_K_M's Q4_K and Q6_K parts and layers widened to 8-bit groups of 16),
        or None where some part has no codes. None when no matrix is held as codes. Routers and
        shared-expert gates (kept resident, uncompressed) come as floats."""
        if self._formats is None or self._formats[0] != (self.convert_k_quants, self.keep_blocks):
            seen: dict[str, set] = {}
            resident = self.model.resident_weights()
            for i in range(self.config.num_layers):
                names = self.model.hf_layer_names(i)
                for name, shape in self.model.layer_shapes(i).items():
                    if len(shape) == 2 and name not in resident:
                        seen.setdefault(name, set()).add(self._format(names[name]))
            formats = {name: common_format(found) for name, found in seen.items()}
            self._formats = ((self.convert_k_quants, self.keep_blocks), formats if any(formats.values()) else None)
        return self._formats[1]

    def _format(self, hf_names: list[str]):
        """The format the fused parts' codes take together (as `_coded` fuses them), else None."""
        types = [t.type_name for t, _ in self._parts(hf_names)]
        return common_format(None if t in CONVERTED_TYPES and not self.convert_k_quants else code_format(t, self.keep_blocks)
                             for t in types)

    def _layout(self, hf_names: list[str]) -> tuple[list[GGUFTensor], torch.Tensor | None]:
        """The distinct GGUF tensors of a fused weight (each read once, a 3-D stack as its
        [experts * rows, cols] matrix) and the rows of their concatenation that make the weight, in
        order; None where that is all of them as they are. E.g. gate_up of E experts: expert e's gate
        rows, then its up rows, from ffn_gate_exps and ffn_up_exps."""
        tensors, offsets, total, order = [], {}, 0, []
        for t, expert in self._parts(hf_names):
            if t.name not in offsets:
                offsets[t.name] = total
                tensors.append(t)
                total += _rows(t)
            rows = t.shape[0] if expert is None else t.shape[1]
            start = offsets[t.name] + (0 if expert is None else expert * rows)
            order.append(torch.arange(start, start + rows))
        order = torch.cat(order)
        same = order.numel() == total and bool((order == torch.arange(total)).all())
        return tensors, None if same else order

    def _dense(self, hf_names: list[str], dtype: torch.dtype) -> torch.Tensor:
        tensors, order = self._layout(hf_names)
        pieces = []
        for t in tensors:
            values = to_float(t.read(), t.type_name, t.shape)
            values = values.reshape(_rows(t), t.shape[-1]) if len(t.shape) > 2 else values
            heads = qk_heads(t.name, self.config)
            ordered = values if heads is None else values[unpermute_rows(t.shape[0], heads)]
            ordered = ordered - norm_shift(t.name, self.config) if norm_shift(t.name, self.config) else ordered
            pieces.append(require_finite(ordered.to(dtype), t.name, self.path, ordered))
        values = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return values if order is None else values[order]

    def _coded(self, hf_names: list[str], dtype: torch.dtype, config) -> QTensor | None:
        """The fused weight as one QTensor of `config` (each part widened to it, exactly), or None
        where a part has no codes. Each row's groups are self-contained, so fusing and reordering
        rows move codes only."""
        tensors, order = self._layout(hf_names)
        fmt = _block_format(tensors, order, config)
        if fmt is not None:
            return self._split_blocks(tensors, fmt, dtype, config)
        parts = []
        for t in tensors:
            q = self._qtensor(t, dtype)
            if q is None:
                return None
            parts.append(widen(q, config))
        q = concat_rows(parts)
        return q if order is None else permute_rows(q, order)

    def linked_blocks(self, layer: int) -> dict[str, LinkedWeight]:
        """Layer weights whose every part is one 2-D Q4_0 (or every part Q4_1) tensor, fused in
        order: their rows are read from this file as blocks and split (offload/linked_blocks.py), the
        store links them. A part's crc32 is that of the bytes `layer_weights` last read."""
        formats, out = self.quantized_formats() or {}, {}
        for k, hf_names in self.model.hf_layer_names(layer).items():
            tensors, order = self._layout(hf_names)
            fmt = _block_format(tensors, order, formats.get(k))
            if fmt is None:
                continue
            parts = []
            for t in tensors:
                heads = qk_heads(t.name, self.config)
                parts.append(LinkedPart(t.path, t.offset, t.shape[0], t.raw_shape[-1],
                                        None if heads is None else unpermute_rows(t.shape[0], heads), heads or 1,
                                        self._crcs.get(t.name)))
            out[k] = LinkedWeight(fmt, tuple(parts), tensors[0].shape[1] // 32)
        return out

    def _checksum(self, weight: LinkedWeight) -> None:
        """Read the parts' bytes for their crc32 (recorded for linked_blocks), checking their scales
        as decoding does."""
        for part in weight.parts:
            t = self._at[part.path, part.offset]
            _, crc = self._read_blocks(t, weight.format)
            self._crcs[t.name] = crc.result()

    def _read_blocks(self, t: GGUFTensor, fmt):
        """(the tensor's blocks, uint8 [rows, bytes per row]; the future of their crc32, computed on
        a pool thread beside what the caller does with them), its scales checked."""
        raw = t.read()
        crc = worker_pool("gguf-crc").submit(zlib.crc32, raw)
        blocks = torch.from_numpy(raw)
        if not _blocks_fit(blocks, fmt):
            crc.result()
            raise self._beyond_fp16(t)
        return blocks, crc

    def _beyond_fp16(self, t: GGUFTensor) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: tensor {t.name} ({t.type_name}) has a block scale or minimum that is not finite or "
            f"beyond what the engine's fp16 group parameters hold (|d| <= {65504 / 8:g} for Q4_0): its "
            f"values exceed fp16; such a file is not supported")

    def _split_blocks(self, tensors: list[GGUFTensor], fmt, dtype: torch.dtype, config) -> QTensor:
        """Q4_0 / Q4_1 parts fused by rows, each part's blocks split straight into its rows of the
        fused codes, scales and minimums (q/k rows put back in HF order on the way): the one pass
        over the bytes that linked_blocks' reads make at run time, and their crc32 beside it."""
        rows, cols = sum(t.shape[0] for t in tensors), tensors[0].shape[1]
        groups = cols // config.group_size
        data = torch.empty(rows * cols // 2, dtype=torch.uint8)
        scale, minimum = torch.empty(rows * groups, dtype=torch.float16), torch.empty(rows * groups, dtype=torch.float16)
        at = 0
        for t in tensors:
            (blocks, crc), heads, n = self._read_blocks(t, fmt), qk_heads(t.name, self.config), t.shape[0]
            split_blocks(blocks if heads is None else blocks[unpermute_rows(n, heads)], fmt, groups,
                         data[at * cols // 2:(at + n) * cols // 2], scale[at * groups:(at + n) * groups],
                         minimum[at * groups:(at + n) * groups])
            self._crcs[t.name] = crc.result()
            at += n
        return QTensor(data=data, scale=scale, minimum=minimum, shape=(rows, cols), dtype=dtype, config=config)

    def _qtensor(self, t: GGUFTensor, dtype: torch.dtype) -> QTensor | None:
        if t.type_name in CONVERTED_TYPES and not self.convert_k_quants:
            return None
        codes = to_codes(t.read(), t.type_name, (_rows(t), t.shape[-1]), self.keep_blocks)
        if codes is None:
            return None
        q = to_qtensor(codes, dtype)
        if q is None:  # its values exceed fp16, which the engine's group parameters (and floats) are
            raise self._beyond_fp16(t)
        if t.type_name in CONVERTED_TYPES and t.name.startswith("blk.0."):  # measured on the first layer
            self._tell_error(t.type_name, conversion_error(codes, q, rows=ERROR_ROWS), q.config)
        heads = qk_heads(t.name, self.config)
        return q if heads is None else permute_rows(q, unpermute_rows(t.shape[0], heads))

    def _tell_error(self, type_name: str, error: float, config) -> None:
        first = type_name not in self.conversion_errors
        self.conversion_errors[type_name] = max(error, self.conversion_errors.get(type_name, 0.0))
        if first:
            self._report(f"flexsarathi: {self.path}: {type_name} weights convert to {config.bits}-bit groups of "
                         f"{config.group_size} with fp16 scales: largest |error| against gguf's dequantization "
                         f"{error:.3g} (first {ERROR_ROWS} rows of the first layer's first {type_name} tensor)")


def _block_format(tensors: list[GGUFTensor], order, config):
    """The BlockFormat of a fused weight read as blocks (split into codes, or linked): every part one
    2-D tensor of the same Q4_0 / Q4_1 type, in order, the weight stored in that type's format; else None."""
    types = {t.type_name for t in tensors}
    if order is not None or len(types) != 1 or any(len(t.shape) != 2 for t in tensors):
        return None
    (type_name,) = types
    return BLOCK_FORMATS.get(type_name) if config is not None and config == CODE_FORMATS.get(type_name) else None


def _blocks_fit(blocks: torch.Tensor, fmt) -> bool:
    """Whether Q4_0 / Q4_1 blocks (uint8, rows of whole blocks) hold finite fp16 scales and minimums
    and Q4_0's minimum -8d fits fp16: checked on the fp16 bits (an fp16 isfinite is not vectorised)."""
    fields = blocks.view(torch.int16).view(-1, fmt.block_bytes // 2)
    magnitudes = fields[:, 0] & 0x7FFF
    if fmt.minimum_at is None:
        return bool((magnitudes <= _MAX_EIGHTH_BITS).all())
    return bool((magnitudes < _INF_BITS).all() and ((fields[:, fmt.minimum_at // 2] & 0x7FFF) < _INF_BITS).all())


def _rows(t: GGUFTensor) -> int:
    """Rows of the tensor as a matrix (a 3-D stack [experts, rows, cols]: experts * rows)."""
    return int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else t.shape[0]


def permute_rows(q: QTensor, order: torch.Tensor) -> QTensor:
    """A row-grouped QTensor with its rows in `order` (row i of the result = row order[i])."""
    rows = q.shape[0]
    return QTensor(data=q.data.view(rows, -1)[order].reshape(-1), scale=q.scale.view(rows, -1)[order].reshape(-1),
                   minimum=q.minimum.view(rows, -1)[order].reshape(-1), shape=q.shape, dtype=q.dtype, config=q.config)
