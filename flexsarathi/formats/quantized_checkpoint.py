"""`QuantizedCheckpoint`: an HF safetensors folder whose config.json has a `quantization_config`
(GPTQ, AWQ GEMM, compressed-tensors pack-quantized), read as a pre-quantized weight source.

Each layer weight comes out as a QTensor of the engine's format holding the checkpoint's own codes
(flexsarathi/formats/prequantized.py): scale fp16, minimum `-scale * zero` (fp32 for asymmetric
formats, where fp16 would round it), groups of the checkpoint's size (channel-wise: one group per
row). Act-order GPTQ (a `g_idx` that is not column // group) mixes groups inside a contiguous run of
columns, which the engine's format cannot hold: those weights are dequantized exactly and quantized
once by the engine's min-max quantizer, the error measured and printed. Weights the checkpoint does
not quantize (embeddings, norms, an ignored lm_head) stay as they are; a quantized lm_head is
dequantized (it is read with the embeddings, which are never streamed).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError

from flexsarathi.formats.checkpoint import SafetensorsCheckpoint, require_finite, require_float_kind
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.prequantized import (ConversionLog, SourceDescription, TensorKind, codes_to_qtensor,
                                             concat_rows, reference_values, requantize)
from flexsarathi.formats.safetensors_pread import PreadReader
from flexsarathi.formats.quantized_formats import TENSORS, ModuleCodes, QuantMethod, Scheme, packed_shape, \
    parse_quantization_config
from quant import QuantConfig

_SCALE_KINDS = ("F16", "BF16", "F32")  # the float dtypes a checkpoint's scales may have
_INT_KINDS = ("I8", "I16", "I32", "I64", "U8")  # compressed-tensors: unpacked zero points, weight_shape
_SCALES = {"gptq": "scales", "awq": "scales", "compressed-tensors": "weight_scale"}  # each method's scales tensor


def read_quantization_config(folder: str) -> dict | None:
    """config.json's `quantization_config`, or None when it has none (or cannot be read: the
    full-precision loader reports that)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return config.get("quantization_config") if isinstance(config, dict) else None


class QuantizedCheckpoint(SafetensorsCheckpoint):
    def __init__(self, folder: str):
        where = os.path.join(folder, "config.json")
        self.method: QuantMethod = parse_quantization_config(read_quantization_config(folder), where)
        self._reader = PreadReader()  # tensors read into fresh memory, not mapped (RSS: one layer)
        super().__init__(folder)  # indexes the files, then _validate_shapes (below)
        self.formats, self.act_order = self._kind_formats()
        self.log = ConversionLog(self.config.num_layers, f"{self.method.name} checkpoint {folder}")

    # ---- the pre-quantized source interface (flexsarathi/formats/prequantized.py) ---------------
    def quantized_formats(self) -> dict[str, QuantConfig | None]:
        return dict(self.formats)

    def describe(self) -> SourceDescription:
        kinds = []
        for name, config in self.formats.items():
            scheme = self._scheme(self._parts_of(name)[0][0])
            source = f"{scheme.describe()} ({self.method.name})" if scheme else str(self.config.checkpoint_dtype)
            how = ("requantized once at placement (act-order g_idx), error measured" if name in self.act_order
                   else "codes kept exactly" + ("; on the disk tier read from the files" if self.method.name ==
                                                "compressed-tensors" else "") if config else "as is")
            kinds.append(TensorKind(name, source, config, how))
        files = {path for path in self._file_of.values()}
        return SourceDescription(self.method.name, self.method.detail, tuple(kinds),
                                 sum(os.path.getsize(p) for p in files))

    # ---- modules ---------------------------------------------------------------------------
    def _scheme(self, hf_name: str) -> Scheme | None:
        """The scheme of the module a `<module>.weight` name belongs to, None when it is stored in
        floats (no packed codes in the files)."""
        module = hf_name.removesuffix(".weight")
        if hf_name == module:
            return None  # a bias
        packed = TENSORS[self.method.name][0][0]
        if f"{module}.{packed}" not in self._file_of and f"{module}.{packed}".removeprefix("model.") not in self._file_of:
            return None
        scheme = self.method.scheme_for(module)
        if scheme is None:
            raise CheckpointError(f"{self.folder}: {module} has packed weights but no scheme of the "
                                  f"quantization_config applies to it")
        return scheme

    def _module_tensors(self, module: str, shapes_only: bool = False, into: dict | None = None) -> dict:
        """into: suffix -> uint8 tensor to read that tensor into (its rows of a fused weight)."""
        required, optional, _ = TENSORS[self.method.name]
        out = {}
        for suffix in required + optional:
            name = f"{module}.{suffix}"
            if suffix in optional and name not in self._file_of and name.removeprefix("model.") not in self._file_of:
                continue
            name = self._resolve(name)
            handle = self._open(self._file_of[name])
            try:
                out[suffix] = (tuple(handle.get_slice(name).get_shape()) if shapes_only
                               else self._reader.get(self._file_of[name], name, (into or {}).get(suffix)))
            except (SafetensorError, RuntimeError, OSError) as exc:
                raise CheckpointError(f"cannot read tensor {name} from {self._file_of[name]}: {exc}") from None
        return out

    def _codes(self, hf_name: str, scheme: Scheme, into: dict | None = None) -> ModuleCodes:
        """A packed module's codes, its scales checked finite (on every path that reads them: placed
        layers and a dequantized lm_head) and a symmetric scheme's stored zero points checked to be 0."""
        module = hf_name.removesuffix(".weight")
        tensors = self._module_tensors(module, into=into)
        zero_point = tensors.get("weight_zero_point")
        if scheme.symmetric and zero_point is not None and bool(zero_point.any()):
            path, name = self._located(f"{module}.weight_zero_point")
            raise CheckpointError(f"{path}: tensor {name} holds zero points other than 0, but quantization_config "
                                  f"makes {module} symmetric ({scheme.describe()}), which reads none (the "
                                  "compressed-tensors package would subtract them): the file and config disagree")
        m = TENSORS[self.method.name][2](tensors, scheme)
        if not bool(torch.isfinite(m.scale).all()):  # small ([rows, groups]): every pass would give NaN
            path, name = self._located(f"{module}.{_SCALES[self.method.name]}")
            raise CheckpointError(f"{path}: the scales of {module} hold a NaN or inf (tensor {name}): the "
                                  "checkpoint's values are damaged (no dtype computes with them)")
        return m

    def _located(self, hf_name: str) -> tuple[str, str]:
        """(file, name in it) of a tensor."""
        name = self._resolve(hf_name)
        return self._file_of[name], name

    def _validate_shapes(self) -> None:
        """Every weight's [out, in] from the headers (packed or not) against config.json."""
        groups = [(self.model.hf_global_names(), self.model.global_shapes())]
        groups += [(self.model.hf_layer_names(i), self.model.layer_shapes(i)) for i in range(self.config.num_layers)]
        for names, shapes in groups:
            for canonical, parts in names.items():
                want = list(shapes[canonical])
                rows = 0
                for hf_name in parts:
                    shape = self._part_shape(hf_name)
                    if len(shape) != len(want) or list(shape[1:]) != want[1:]:
                        origin = f" (read from {self._origin(hf_name)})" if self._scheme(hf_name) else ""
                        raise CheckpointError(f"{self.folder}: {hf_name}{origin} has shape {list(shape)}, which "
                                              f"does not match config.json ([rows, {', '.join(map(str, want[1:]))}] "
                                              f"for {canonical} {want})")
                    rows += shape[0]
                if rows != want[0]:
                    raise CheckpointError(f"{', '.join(parts)} in {self.folder} have {rows} rows in total, but "
                                          f"config.json implies {want[0]} ({canonical})")

    def _part_shape(self, hf_name: str) -> tuple[int, ...]:
        scheme = self._scheme(hf_name)
        if scheme is None:
            name = self._resolve(hf_name)
            info = self._open(self._file_of[name]).get_slice(name)
            require_float_kind(info.get_dtype(), name, self._file_of[name])
            return tuple(info.get_shape())
        module = hf_name.removesuffix(".weight")
        shapes = self._module_tensors(module, True)  # a required tensor missing: one error naming it
        if self.method.name == "compressed-tensors":  # the packed width is rounded up to whole words
            self._check_component(module, "weight_shape", _INT_KINDS, [2], "the compressed-tensors format")
            path, name = self._located(f"{module}.weight_shape")  # read alone: its module's codes are not needed here
            out_features, in_features = (int(v) for v in self._reader.get(path, name).tolist())
        else:
            packed = TENSORS[self.method.name][0][0]
            self._check_component(module, packed, ("I32",), [-1, -1], f"the {self.method.name} format")
            out_features, in_features = packed_shape(self.method.name, shapes, scheme.bits)
        self._check_components(module, scheme, out_features, in_features)
        return out_features, in_features

    def _origin(self, hf_name: str) -> str:
        """Where a packed module's [out, in] comes from, for messages: its packed codes' header (GPTQ,
        AWQ) or its weight_shape tensor (compressed-tensors)."""
        module = hf_name.removesuffix(".weight")
        if self.method.name == "compressed-tensors":
            path, name = self._located(f"{module}.weight_shape")
            return f"{name} = {self._reader.get(path, name).tolist()}"
        path, name = self._located(f"{module}.{TENSORS[self.method.name][0][0]}")
        return f"{name} of shape {self._extent(name)[4]}"

    def _component_specs(self, scheme, out_features: int, in_features: int) -> dict[str, tuple]:
        """suffix -> (allowed safetensors dtypes, shape or None: not checked) of a packed module's tensors."""
        groups = 1 if scheme.group_size <= 0 else -(-in_features // scheme.group_size)
        words = -(-out_features * scheme.bits // 32)
        if self.method.name == "gptq":
            return {"qweight": (("I32",), [in_features * scheme.bits // 32, out_features]),
                    "qzeros": (("I32",), [groups, words]), "scales": (_SCALE_KINDS, [groups, out_features]),
                    "g_idx": (("I32",), [in_features])}
        if self.method.name == "awq":
            return {"qweight": (("I32",), None), "qzeros": (("I32",), [groups, words]),
                    "scales": (_SCALE_KINDS, [groups, out_features])}
        zero = (("I32",), [words, groups]) if not scheme.symmetric else (("I32",) + _INT_KINDS, None)
        return {"weight_packed": (("I32",), [out_features, -(-in_features * scheme.bits // 32)]),
                "weight_scale": (_SCALE_KINDS, [out_features, groups]), "weight_shape": (_INT_KINDS, [2]),
                "weight_g_idx": (("I32",), [in_features]), "weight_zero_point": zero}

    def _check_components(self, module: str, scheme, out_features: int, in_features: int) -> None:
        """Each packed tensor's dtype and shape from its header, before a byte is read: one CheckpointError
        naming the tensor and its file (a wrong one would be misread or fail deep in unpacking)."""
        for suffix, (kinds, shape) in self._component_specs(scheme, out_features, in_features).items():
            name = f"{module}.{suffix}"
            if name not in self._file_of and name.removeprefix("model.") not in self._file_of:
                continue
            self._check_component(module, suffix, kinds, shape,
                                  lambda: f"its module's {out_features}x{in_features} {scheme.describe()} weight "
                                          f"(read from {self._origin(module)}; quantization_config "
                                          f"bits={scheme.bits})")

    def _check_component(self, module: str, suffix: str, kinds: tuple, shape: list[int] | None, needs) -> None:
        """One tensor's dtype and shape (-1: any size) from its header; `needs` (a string, or a callable
        giving one on failure) says what needs that shape."""
        path, _, _, kind, got = self._extent(f"{module}.{suffix}")
        name = self._resolve(f"{module}.{suffix}")
        if kind not in kinds:
            raise CheckpointError(f"{path}: tensor {name} is stored as {kind}; "
                                  f"{self.method.name} stores {suffix} as {' or '.join(kinds)}")
        if shape is not None and (len(got) != len(shape) or any(w not in (-1, g) for g, w in zip(got, shape))):
            want = "a matrix" if shape == [-1, -1] else str(shape)
            raise CheckpointError(f"{path}: tensor {name} has shape {got}, but "
                                  f"{needs() if callable(needs) else needs} needs {want}")

    def _read_names(self) -> set[str]:
        """Every HF name the model reads, with each Linear module's packed tensors."""
        required, optional, _ = TENSORS[self.method.name]
        names = super()._read_names()
        modules = {hf.removesuffix(".weight") for hf in names if hf.endswith(".weight")}
        return names | {f"{m}.{s}" for m in modules for s in required + optional}

    # ---- formats per tensor kind --------------------------------------------------------------
    def _kind_formats(self) -> tuple[dict[str, QuantConfig | None], set[str]]:
        """Per canonical 2-D layer weight: the engine format every layer's copy is stored in (one
        scheme across its parts and layers), and the kinds whose act-order needs a conversion."""
        formats, act_order = {}, set()
        resident = self.model.resident_weights()  # routers: read uncompressed (dequantized if the file packs them)
        for name, shape in self.model.weight_kinds().items():
            if len(shape) != 2 or name in resident:
                continue
            parts = self._parts_of(name)
            seen = {self._scheme(hf) for layer_parts in parts for hf in layer_parts}
            if len(seen) != 1:
                raise CheckpointError(f"{self.folder}: the parts of {name} are stored in different formats "
                                      f"({', '.join(s.describe() if s else 'floats' for s in seen)}); one "
                                      "format per tensor kind is supported")
            scheme = seen.pop()
            if scheme is None:
                formats[name] = None
                continue
            group = shape[1] if scheme.group_size <= 0 else scheme.group_size
            if shape[1] % group:
                raise CheckpointError(f"{self.folder}: {name} has {shape[1]} input features, not a multiple of "
                                      f"the group size {group}")
            if any(self._has_act_order(hf, group) for layer_parts in parts for hf in layer_parts):
                act_order.add(name)
            exact_min = scheme.symmetric or name in act_order  # requantized groups: fp16 min-max
            pairs = scheme.bits == 4 and name not in act_order  # codes kept as the checkpoint's bytes
            formats[name] = QuantConfig(bits=scheme.bits, group_size=group, minimum_fp32=not exact_min,
                                        adjacent_pairs=pairs)
        return formats, act_order

    def _parts_of(self, name: str) -> list[list[str]]:
        """The HF names `name` is made of, in each layer that has it (a mixture-of-experts model's
        dense and sparse layers hold different kinds)."""
        return [names[name] for i in range(self.config.num_layers) if name in (names := self.model.hf_layer_names(i))]

    def _has_act_order(self, hf_name: str, group: int) -> bool:
        module = hf_name.removesuffix(".weight")
        optional = TENSORS[self.method.name][1]
        key = next((f"{module}.{s}" for s in optional if s.endswith("g_idx")), None)
        if key is None or (key not in self._file_of and key.removeprefix("model.") not in self._file_of):
            return False
        name = self._resolve(key)
        g_idx = self._reader.get(self._file_of[name], name)
        groups = -(-g_idx.numel() // group)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise CheckpointError(f"{self._file_of[name]}: tensor {name} holds group {int(g_idx.min())}..."
                                  f"{int(g_idx.max())}, outside the {groups} groups of its {g_idx.numel()} columns")
        return not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group)

    # ---- reading ---------------------------------------------------------------------------
    def _read(self, names: dict[str, list[str]], dtype: torch.dtype, unchecked: frozenset[str] = frozenset()):
        out, plain = {}, {}
        for canonical, parts in names.items():
            config = self.formats.get(canonical)
            if config is not None:
                out[canonical] = self._read_quantized(canonical, parts, config, dtype)
            elif any(self._scheme(hf) for hf in parts):  # a quantized global (lm_head): dequantized
                out[canonical] = torch.cat([self._dequantized(hf, dtype) for hf in parts])
            else:
                plain[canonical] = parts
        for canonical, parts in plain.items():
            names = [self._resolve(hf_name) for hf_name in parts]
            tensors = []
            for name in names:
                read = self._reader.get(self._file_of[name], name)
                cast = read.to(dtype)
                tensors.append(cast if canonical in unchecked else require_finite(cast, name, self._file_of[name], read))
            out[canonical] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return out

    def _read_quantized(self, canonical: str, parts: list[str], config: QuantConfig, dtype: torch.dtype):
        pieces, into = [], self._fused_buffers(parts) if canonical not in self.act_order else [None] * len(parts)
        for hf_name, buffers in zip(parts, into):
            m = self._codes(hf_name, self._scheme(hf_name), buffers)  # scales checked finite
            if canonical in self.act_order:
                q, error = requantize(reference_values(m.unpacked(), m.scale, m.zero, m.g_idx), config, dtype)
                how = f"requantized from act-order groups to {config.bits}-bit groups of {config.group_size}"
            else:
                q, error = codes_to_qtensor(m.codes, m.scale, m.zero, config, dtype, packed=m.pairs)
                how = "codes kept, scale or minimum rounded to the stored dtype"
            self.log.record(canonical, error, how)
            pieces.append(q)
        return concat_rows(pieces)

    def _fused_buffers(self, parts: list[str]) -> list[dict | None]:
        """compressed-tensors: each part's codes (and fp16 scales) read straight into its rows of
        one buffer per kind, so the fused weight's codes are that buffer, not a concatenation."""
        if self.method.name != "compressed-tensors" or len(parts) == 1:
            return [None] * len(parts)
        into = [{} for _ in parts]
        for suffix in ("weight_packed", "weight_scale"):
            sizes = [self._extent(f"{hf.removesuffix('.weight')}.{suffix}")[2] for hf in parts]
            whole = torch.empty(sum(sizes), dtype=torch.uint8)
            for buffers, piece in zip(into, whole.split(sizes)):
                buffers[suffix] = piece
        return into

    def _dequantized(self, hf_name: str, dtype: torch.dtype) -> torch.Tensor:
        m = self._codes(hf_name, self._scheme(hf_name))
        return reference_values(m.unpacked(), m.scale, m.zero, m.g_idx).to(dtype)

    def linked_extents(self, layer):
        """compressed-tensors: a weight's codes are its `weight_packed` words as they lie in the file
        (rows of whole words, no padding), and its scales `weight_scale` where the file holds them in
        fp16: those ranges, part after part, are what the engine stores (q/k/v fused by rows). GPTQ's
        and AWQ's words are transposed or shuffled on the way: copied."""
        if self.method.name != "compressed-tensors":
            return {}
        out = {}
        for canonical, parts in self.model.hf_layer_names(layer).items():
            config = self.formats.get(canonical)
            if config is None or canonical in self.act_order:
                continue
            links = {"data": [], "scale": []}
            for hf_name in parts:
                module = hf_name.removesuffix(".weight")
                out_features, in_features = self._part_shape(hf_name)
                packed = self._extent(f"{module}.weight_packed")
                if links["data"] is not None and packed[2] == out_features * in_features * config.bits // 8:
                    links["data"].append(packed[:3])
                else:
                    links["data"] = None
                scale = self._extent(f"{module}.weight_scale")
                if links["scale"] is not None and scale[3] == "F16":
                    links["scale"].append(scale[:3])
                else:
                    links["scale"] = None
            out[canonical] = {k: v for k, v in links.items() if v}
        return out

    def _extent(self, hf_name: str) -> tuple[str, int, int, str, list[int]]:
        name = self._resolve(hf_name)
        return self._reader.extent(self._file_of[name], name)

    def layer_weights(self, layer, dtype, unchecked=frozenset()):
        weights = super().layer_weights(layer, dtype, unchecked)
        self.log.layer_done(layer)
        return weights
