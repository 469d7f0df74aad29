"""Weight sources: an HF safetensors checkpoint (single or sharded) or deterministic dummy weights.

Both yield weights layer by layer in canonical names (q/k/v and gate/up fused), already cast to
the requested dtype, so that placement can write each layer to its tier and a model larger than
RAM never sits in RAM whole.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import zlib
from abc import ABC, abstractmethod

import torch
from safetensors import SafetensorError, safe_open

from flexsarathi.errors import CheckpointError
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.formats import fp8_blocks, stacked_experts
from flexsarathi.formats.prequantized import ConversionLog
from flexsarathi.formats.safetensors_pread import PreadReader
from flexsarathi.formats.worker_pools import worker_pool
from flexsarathi.models import ModelMath, Weights, build_model_math
from policy_search.model_registry import known_config
from quant import QTensor, QuantConfig
from quant.layout import GroupLayout

DUMMY_PREFIX = "dummy:"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_FLOAT_KINDS = ("F64", "F32", "F16", "BF16")  # safetensors dtypes a plain checkpoint's weights may have
# Tensors a checkpoint may hold that no model reads: the RoPE table older HF llama checkpoints saved.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def require_float_kind(kind: str, name: str, path: str) -> None:
    """One CheckpointError unless a plain (not pre-quantized) weight's safetensors dtype is a float
    the engine casts exactly: integers or bools cast as they are give garbage, fp8 needs its scales."""
    if kind in _FLOAT_KINDS:
        return
    if str(kind).startswith("F8"):
        raise CheckpointError(f"{path}: tensor {name} is stored as {kind}: fp8 checkpoints are read where "
                              "config.json's quantization_config says block-wise fp8 (quant_method fp8, "
                              "weight_block_size) and each weight has its *.weight_scale_inv; this one's does not")
    raise CheckpointError(f"{path}: tensor {name} is stored as {kind}, not as floats ({', '.join(_FLOAT_KINDS)}): "
                          "a checkpoint without a quantization_config in config.json must hold float weights")


def file_identity(path: str) -> str:
    """What tells a weight file's bytes apart between runs, as git's index does: name, size, mtime,
    and ctime and inode, which a rewrite keeping size and mtime (cp -p, rsync -a, os.utime) still
    changes (utime cannot set ctime back). A copied folder rebuilds its store once. Not the device
    number: it can change across reboots and mounts (containers, network file systems), and a 70B
    model's store takes long to rebuild."""
    st = os.stat(path)
    return f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"


def require_regular_file(path: str) -> str:
    """`path` when it is a regular file (or a link to one); else one CheckpointError: reading a FIFO
    or a device would block or never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise CheckpointError(f"cannot read weight file {path}: {exc}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"weight file {path} is not a regular file (a FIFO, device or folder): refused")
    return path


def require_finite(values: torch.Tensor, name: str, where: str, read: torch.Tensor | None = None) -> torch.Tensor:
    """`values` (a weight as the engine will hold it) when every entry is finite; else one
    CheckpointError naming the tensor, where it is, how many entries are NaN or inf and the first.
    read: the tensor as the file holds it, when `values` is its cast (only looked at on failure,
    to tell a damaged checkpoint from a value beyond the dtype's range).

    One sum of the tensor just read, in its own dtype (NaN and inf propagate through it; torch's
    vectorized half sums are ~25x faster than one asking for a float32 result), not a second read
    of the file; only a non-finite sum pays for the element-wise check that locates the entry (a
    sum of finite values that overflows, as float16's can, passes it). Summing each chunk of a
    cast while it is in cache measured slower than cast-then-sum here (Python's per-chunk calls);
    a weight the engine quantizes skips this: its group scales check it (layer_weights' unchecked)."""
    if not values.is_floating_point() or values.numel() == 0:
        return values
    if torch.isfinite(values.sum()):
        return values
    bad = ~torch.isfinite(values)
    if not bad.any():
        return values
    first = tuple(torch.nonzero(bad)[0].tolist())
    nan = int(values.isnan().sum())
    counts = f"{nan} NaN, {int(bad.sum()) - nan} inf"
    dtype = str(values.dtype).removeprefix("torch.")
    if read is not None and read.dtype != values.dtype and bool(torch.isfinite(read).all()):
        raise CheckpointError(f"tensor {name} in {where} has values beyond the range of {dtype} ({counts} after the "
                              f"cast, the first at {list(first)}: {read[first].item()}): load it in a wider dtype "
                              "(--dtype float32 or bfloat16)")
    raise CheckpointError(f"tensor {name} in {where} has non-finite weights ({counts}; the first at {list(first)}): "
                          "the checkpoint is damaged; the engine would compute NaN logits from it")


def _as_read(values: torch.Tensor, *_) -> torch.Tensor:
    """require_finite's stand-in for a weight whose caller checks it (WeightSource.layer_weights)."""
    return values


class WeightSource(ABC):
    """Canonical weights of one model, read one layer at a time."""

    config: ModelConfig
    model: ModelMath  # the family's math, built from config
    # A base model saved without its LM head (an embedding model: Qwen3-Embedding, e5-mistral): it
    # embeds (task="embed") and cannot generate; its config is read as tied (the head never used).
    headless: bool = False

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Identifies the content, so that an offload folder written from it can be reused."""

    @abstractmethod
    def global_weights(self, dtype: torch.dtype) -> Weights: ...

    @abstractmethod
    def layer_weights(self, layer: int, dtype: torch.dtype, unchecked: frozenset[str] = frozenset()) -> Weights:
        """unchecked: canonical names whose values the caller checks itself: the engine quantizes
        them as it places them, and a NaN or inf makes its group's scale non-finite, which
        quantize refuses. A source may leave their finiteness check (a pass over the values) to it."""

    def use_for(self, compress_weight: bool, weights_on_disk: bool = True) -> None:
        """Told by the engine whether its policy stores weights compressed. A source whose codes only
        approximate its values (GGUF's K-quants: their scales rounded) gives them as codes only
        then, else their exact values; every other source gives the same either way. And whether
        any weight is on the disk tier (GGUF: Q4_0/Q4_1 kept as their blocks' bytes, to be linked)."""

    def quantized_formats(self) -> dict[str, QuantConfig | None] | None:
        """A pre-quantized source: canonical 2-D layer weight -> the QuantConfig its QTensors come in
        (None: the compute dtype), stored by the engine as they are (flexsarathi/formats/prequantized.py).
        None: full-precision weights, quantized by the engine with its own format when asked to."""
        return None

    def coded_globals(self) -> frozenset[str]:
        """Global weights (canonical names) that `global_weights` gives as 4-bit QTensors, the
        source's own codes (a GGUF's Q4_0 token embedding and head), from the headers alone."""
        return frozenset(self.global_formats())

    def global_formats(self) -> dict[str, QuantConfig]:
        """{canonical name: format} of the global weights `global_weights` gives as QTensors."""
        return {}

    def load_bytes(self, dtype: torch.dtype, converted: frozenset[str] = frozenset()) -> tuple[int, int]:
        """What reading this source holds beside the weights it has given, from the headers: (the
        largest layer as `layer_weights` gives it, what reading one weight holds besides the
        weights given: one more of the largest layer weight as given (a fused weight's parts beside
        their concatenation, or a weight beside its converted form before that is placed), or of a
        global weight the engine converts (`converted`: a compressed head), plus
        `read_buffer_bytes`). An upper bound: a weight the source gives in a format of its own
        counts in it (`quantized_formats`, `global_formats`), any other in `dtype`."""
        formats = self.quantized_formats() or {}
        layers = [{k: given_bytes(shape, dtype, formats.get(k)) for k, shape in self.model.layer_shapes(i).items()}
                  for i in range(self.config.num_layers)]
        coded = self.global_formats()
        weights = [given_bytes(shape, dtype, coded.get(k)) for k, shape in self.model.global_shapes().items()
                   if k in converted]
        weights += [n for layer in layers for n in layer.values()]
        return max((sum(layer.values()) for layer in layers), default=0), max(weights) + self.read_buffer_bytes(dtype)

    def read_buffer_bytes(self, dtype: torch.dtype) -> int:
        """The most one weight's read holds before it is given (its file bytes, its decoding); by
        default 4 bytes per value of the largest weight (a float32 read or draw)."""
        shapes = [*self.model.global_shapes().values()]
        shapes += [s for i in range(self.config.num_layers) for s in self.model.layer_shapes(i).values()]
        return 4 * max(math.prod(s) for s in shapes)

    def linked_extents(self, layer: int) -> dict[str, dict[str, list[tuple[str, int, int]]]]:
        """Components of the layer's pre-quantized weights whose stored bytes (QTensor `data`,
        `scale`) are exactly byte ranges of the source's files: {canonical name: {component:
        [(path, offset, nbytes), ...] in order}}. The disk store links them instead of copying
        (offload/store_writer.py `link`). Empty: every byte is copied."""
        return {}

    def linked_blocks(self, layer: int) -> dict:
        """Layer weights whose rows lie in the source's files as blocks the engine reads and splits
        (GGUF Q4_0 / Q4_1: {canonical name: offload.linked_blocks.LinkedWeight}), each part's crc32
        set once `layer_weights(layer)` has read it. Empty: none. A source that has any also takes
        `layer_weights(layer, dtype, skip=names)`: those only checksummed, left out."""
        return {}


def given_bytes(shape: tuple[int, ...], dtype: torch.dtype, fmt: QuantConfig | None) -> int:
    """Bytes of a weight of `shape` as a source gives it: in `dtype`, or a 2-D QTensor of `fmt`
    (codes, fp16 scales, minimums)."""
    if fmt is None or len(shape) != 2:
        return math.prod(shape) * dtype.itemsize
    groups = shape[0] * -(-shape[1] // fmt.group_size)
    return groups * (fmt.bytes_per_group + 2 + fmt.minimum_bytes)


class SafetensorsCheckpoint(WeightSource):
    def __init__(self, folder: str, adapter=None):
        """adapter: a formats.lora_adapter.LoraAdapter merged into the weights as they are read."""
        self.folder = folder
        self.adapter = adapter
        self.config = ModelConfig.from_folder(folder)
        self._handles: dict[str, object] = {}  # file path -> open safetensors handle (headers only)
        self._pread = PreadReader()  # tensors' bytes: read into fresh memory, not mapped (safetensors_pread.py)
        self._file_of = self._index_tensors()  # HF tensor name -> file path
        self.fp8_block = fp8_blocks.fp8_blocks(folder)  # a block-wise FP8 checkpoint's blocks, else None
        self.model = build_model_math(self.config)
        heads = ("lm_head.", *{name.removesuffix("weight") for name in self.model.stored_names("lm_head.weight")})
        if not self.config.tie_word_embeddings and not any(n.startswith(heads) for n in self._file_of):
            self.headless = True  # read as tied: the model math then asks for no head of its own
            self.config = dataclasses.replace(self.config, tie_word_embeddings=True)
            self.model = build_model_math(self.config)
        self._validate_shapes()
        self._refuse_unused()
        self.mxfp4_kinds = self._mxfp4_kinds()
        self.log = ConversionLog(self.config.num_layers, f"MXFP4 checkpoint {folder}")
        if adapter is not None:
            adapter.check_targets(self._part_shapes)

    @property
    def fingerprint(self) -> str:
        """Each weight file's `file_identity` (a rewrite keeping size and mtime is noticed; a copied or
        moved folder, new inodes, rebuilds its offload store once, from the same bytes), and the
        merged adapter's."""
        digest = hashlib.sha256()
        for path in sorted(set(self._file_of.values())):
            digest.update(file_identity(path).encode())
        lora = f"-lora-{self.adapter.fingerprint}" if self.adapter is not None else ""
        return f"ckpt-{digest.hexdigest()[:16]}{lora}"

    def _index_tensors(self) -> dict[str, str]:
        index_path = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        if os.path.isfile(index_path):
            files = {name: os.path.join(self.folder, shard) for name, shard in self._weight_map(index_path).items()}
            for shard in sorted(set(files.values())):
                if not os.path.lexists(shard):
                    raise CheckpointError(f"{index_path} lists shard {os.path.basename(shard)}, "
                                          f"which is missing from {self.folder}")
                keys = set(self._open(require_regular_file(shard)).keys())
                wrong = sorted(name for name, path in files.items() if path == shard and name not in keys)
                if wrong:
                    raise CheckpointError(f"{index_path}: weight_map puts tensor {wrong[0]} in shard "
                                          f"{os.path.basename(shard)}, which does not contain it")
            return files
        if os.path.lexists(single):
            return {name: single for name in self._open(require_regular_file(single)).keys()}
        found = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
        if len(found) == 1:
            path = require_regular_file(os.path.join(self.folder, found[0]))
            return {name: path for name in self._open(path).keys()}
        raise CheckpointError(f"no weights in {self.folder}: expected model.safetensors or "
                              "model.safetensors.index.json (only safetensors checkpoints are read)")

    @staticmethod
    def _weight_map(index_path: str) -> dict[str, str]:
        """The index's weight_map {tensor name: shard file name}, or one CheckpointError naming the entry."""
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map must be an object {{tensor: shard file}}, "
                                  f"got {type(weight_map).__name__}")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index_path}: weight_map entry {name!r} names shard {shard!r}, "
                                      "not a file name")
        return weight_map

    def _open(self, path: str):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except (SafetensorError, OSError, Exception) as exc:  # header corrupt / file truncated
                raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from None
        return self._handles[path]

    def _resolve(self, hf_name: str) -> str:
        for candidate in (hf_name, *self.model.stored_names(hf_name)):  # (ModelMath.stored_names)
            if candidate in self._file_of:
                return candidate
        raise CheckpointError(f"tensor {hf_name} is missing from the checkpoint in {self.folder}")

    def _validate_shapes(self) -> None:
        """Check every tensor's shape from the headers before any weight is read; keeps them by the
        HF name the model reads (`_part_shapes`)."""
        self._part_shapes: dict[str, tuple[int, ...]] = {}
        # (names, shapes, the stacks _validate_stacked checks instead) of the globals, then of each layer
        expected = [(self.model.hf_global_names(), self.model.global_shapes(), {})]
        expected += [(self.model.hf_layer_names(i), self.model.layer_shapes(i), self.model.stacked_experts(i))
                     for i in range(self.config.num_layers)]
        for layer in range(self.config.num_layers):
            self._validate_stacked(layer)
        for names, shapes, stacked in expected:
            for canonical, parts in names.items():
                if canonical in stacked:
                    continue
                rows = 0
                for hf_name in parts:
                    name = self._resolve(hf_name)
                    path = self._file_of[name]
                    info = self._open(path).get_slice(name)
                    shape = self._part_shapes[hf_name] = tuple(info.get_shape())
                    if info.get_dtype() in fp8_blocks.FP8_KINDS and self.fp8_block is not None:
                        self._validate_fp8_scale(name, shape)
                    else:
                        require_float_kind(info.get_dtype(), name, path)
                    want = list(shapes[canonical])
                    if len(shape) != len(want) or list(shape[1:]) != want[1:]:
                        raise CheckpointError(
                            f"{path}: tensor {name} has shape {list(shape)}, which does not match "
                            f"config.json (expected [rows, {', '.join(map(str, want[1:]))}] for "
                            f"{canonical} {want})")
                    rows += shape[0]
                if rows != shapes[canonical][0]:
                    raise CheckpointError(
                        f"tensor(s) {', '.join(parts)} in {self.folder} have {rows} rows in total, but "
                        f"config.json implies {shapes[canonical][0]} ({canonical})")

    def _validate_stacked(self, layer: int) -> None:
        """The shapes of the layer's expert stacks (StackedExperts) as stored, floats or MXFP4."""
        names, shapes = self.model.hf_layer_names(layer), self.model.layer_shapes(layer)
        for canonical, how in self.model.stacked_experts(layer).items():
            (hf_name,) = names[canonical]
            form = stacked_experts.stored_form(hf_name, self._file_of, how)
            for suffix, want in stacked_experts.stored_shapes(how, form, self.config.moe.num_experts,
                                                              shapes[canonical]).items():
                name, path = hf_name + suffix, self._file_of[hf_name + suffix]
                info = self._open(path).get_slice(name)
                if form == "float":
                    require_float_kind(info.get_dtype(), name, path)
                elif info.get_dtype() != "U8":
                    raise CheckpointError(f"{path}: MXFP4 tensor {name} is stored as {info.get_dtype()}, not U8")
                if tuple(info.get_shape()) != want:
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(info.get_shape())}, which does not "
                                          f"match config.json (expected {list(want)} for {canonical})")

    def _validate_fp8_scale(self, name: str, shape: tuple[int, ...]) -> None:
        """An FP8 weight's factors are there, float32, one per block."""
        scale = name + fp8_blocks.SCALE
        if scale not in self._file_of:
            raise CheckpointError(f"{self._file_of[name]}: FP8 tensor {name} has no {scale} (its blocks' factors)")
        info = self._open(self._file_of[scale]).get_slice(scale)
        want = fp8_blocks.scale_shape(shape, self.fp8_block) if len(shape) == 2 else None
        if info.get_dtype() != "F32" or tuple(info.get_shape()) != want:
            raise CheckpointError(f"{self._file_of[scale]}: {scale} is {info.get_dtype()} {list(info.get_shape())}; "
                                  f"FP8 tensor {name} {list(shape)} in blocks of {list(self.fp8_block)} needs F32 "
                                  f"{list(want) if want else '[rows, cols] (a matrix)'}")

    def _mxfp4_kinds(self) -> frozenset[str]:
        """The expert stacks the checkpoint holds as MXFP4 blocks (the same kinds in every layer)."""
        per_layer = set()
        for layer in range(self.config.num_layers):
            names = self.model.hf_layer_names(layer)
            per_layer.add(frozenset(c for c, how in self.model.stacked_experts(layer).items()
                                    if stacked_experts.stored_form(names[c][0], self._file_of, how) == "mxfp4"))
        if len(per_layer) > 1:
            raise CheckpointError(f"{self.folder}: some layers hold their experts as MXFP4 blocks, others as floats; "
                                  "one format per tensor kind is supported")
        return per_layer.pop() if per_layer else frozenset()

    def quantized_formats(self) -> dict[str, QuantConfig | None] | None:
        """An MXFP4 checkpoint's expert stacks come as exact 8-bit codes (stacked_experts.MXFP4_CODES),
        its other 2-D layer weights in the compute dtype; None for a float checkpoint."""
        if not self.mxfp4_kinds:
            return None
        resident = self.model.resident_weights()
        return {name: stacked_experts.MXFP4_CODES if name in self.mxfp4_kinds else None
                for name, shape in self.model.weight_kinds().items() if len(shape) == 2 and name not in resident}

    def _read_names(self) -> set[str]:
        """The HF names of every tensor the model reads (before `_resolve`'s prefix fallback)."""
        groups = [self.model.hf_global_names(), *(self.model.hf_layer_names(i) for i in range(self.config.num_layers))]
        names = {hf for names in groups for parts in names.values() for hf in parts}
        if self.fp8_block is not None:  # an FP8 weight's factors
            names |= {name + fp8_blocks.SCALE for name in names}
        for layer in range(self.config.num_layers):  # an expert stack's MXFP4 form
            hf_names = self.model.hf_layer_names(layer)
            names |= {hf_names[c][0] + suffix for c, how in self.model.stacked_experts(layer).items() if not how.bias
                      for suffix in (stacked_experts.BLOCKS, stacked_experts.SCALES)}
        return names

    def _refuse_unused(self) -> None:
        """One CheckpointError when the files hold tensors the model config.json describes does not
        read (from the headers' names only): transformers warns of them; here they mean config.json
        and the weights disagree (more layers, biases it says there are none of), and the model run
        without them would be another model."""
        wanted = self._read_names()
        wanted |= {stored for name in wanted for stored in self.model.stored_names(name)}
        ignorable = {"lm_head.weight", *self.model.stored_names("lm_head.weight")} if self.config.tie_word_embeddings \
            else set()
        unread = self.model.unread_prefixes()
        unused = sorted(n for n in self._file_of if n not in wanted and n not in ignorable
                        and not n.endswith(_IGNORABLE_SUFFIXES) and not n.startswith(unread))
        if not unused:
            return
        layers = [int(p) for n in unused for a, p in zip(n.split("."), n.split(".")[1:])
                  if a == "layers" and p.isdigit()]
        cause = (f"config.json's num_hidden_layers is {self.config.num_layers}, but the files hold layer {max(layers)}"
                 if layers and max(layers) >= self.config.num_layers else
                 "config.json's attention_bias / mlp_bias say there are no biases" if all(
                     n.endswith(".bias") for n in unused) else "config.json does not describe these weights")
        raise CheckpointError(f"{self.folder}: {len(unused)} tensor(s) in the checkpoint are not used by the model "
                              f"config.json describes ({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}): "
                              f"{cause}; refusing to run a model other than the one saved")

    def _read(self, names: dict[str, list[str]], dtype: torch.dtype, unchecked: frozenset[str] = frozenset()) -> Weights:
        out = {}
        for canonical, parts in names.items():
            check = require_finite if canonical not in unchecked else _as_read
            tensors = []
            for hf_name in parts:
                name = self._resolve(hf_name)
                try:
                    read = self._pread.get(self._file_of[name], name)
                except OSError as exc:
                    raise CheckpointError(f"cannot read tensor {name} from {self._file_of[name]}: "
                                          f"{exc}") from None
                if read.dtype == torch.float8_e4m3fn:  # a block-wise FP8 weight (validated): times its factors
                    read = fp8_blocks.dequantize(read, self._pread.get(self._file_of[name + fp8_blocks.SCALE],
                                                                       name + fp8_blocks.SCALE), self.fp8_block)
                value = read.to(dtype) if self.adapter is None else self.adapter.merged(hf_name, read, dtype)
                tensors.append(check(value, name, self._file_of[name], read))
            out[canonical] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return out

    def _read_stacked(self, canonical: str, hf_name: str, how, dtype: torch.dtype, check) -> torch.Tensor | QTensor:
        """An expert stack (StackedExperts) from its stored form: floats in `dtype`, MXFP4 as 8-bit codes."""
        form = stacked_experts.stored_form(hf_name, self._file_of, how)
        suffixes = ("",) if form == "float" else (stacked_experts.BLOCKS, stacked_experts.SCALES)
        parts = {}
        for suffix in suffixes:
            name = hf_name + suffix
            try:
                parts[suffix] = self._pread.get(self._file_of[name], name)
            except OSError as exc:
                raise CheckpointError(f"cannot read tensor {name} from {self._file_of[name]}: {exc}") from None
        name = hf_name + suffixes[0]
        if form == "mxfp4":  # exact 8-bit codes: nothing non-finite but a NaN scale, which this refuses
            codes, error = stacked_experts.mxfp4_codes(parts[stacked_experts.BLOCKS], parts[stacked_experts.SCALES],
                                                       how, dtype, hf_name)
            self.log.record(canonical, error, "MXFP4 -> 8-bit codes")
            return codes
        return check(stacked_experts.assemble(how, parts[""], dtype), name, self._file_of[name])

    def global_weights(self, dtype):
        return self._read(self.model.hf_global_names(), dtype)

    def read_buffer_bytes(self, dtype: torch.dtype) -> int:
        """The largest tensor's bytes in its file where they are cast to `dtype` (read whole, then
        cast; a tensor already in `dtype` is given as read); an FP8 weight's with its float32 product
        (4 bytes a value beside its 1, and as many again where its last blocks are padded)."""
        extents = (self._pread.extent(path, name) for name, path in self._file_of.items())
        most = max((nbytes * (9 if kind in fp8_blocks.FP8_KINDS else 1) for _, _, nbytes, kind, _ in extents
                    if kind != _SAFETENSORS_DTYPES.get(dtype)), default=0)
        if self.adapter is not None:  # a merge holds the weight in fp32 and its cast beside the read
            most += self.adapter.merge_bytes()
        return most

    def layer_weights(self, layer, dtype, unchecked=frozenset()):
        names, stacked = self.model.hf_layer_names(layer), self.model.stacked_experts(layer)
        read = self._read({k: v for k, v in names.items() if k not in stacked}, dtype, unchecked)
        for canonical, how in stacked.items():
            check = require_finite if canonical not in unchecked else _as_read
            read[canonical] = self._read_stacked(canonical, names[canonical][0], how, dtype, check)
        self.log.layer_done(layer)
        return {k: read[k] for k in names}


DRAW_CHUNK = 1 << 24  # values of a dummy tensor drawn from one generator (DummyWeights._make)


class DummyWeights(WeightSource):
    """Random weights of a registered model's real shape (as FlexGen benchmarks): deterministic
    per (model, layer, tensor), generated on demand, so any layer can be regenerated alone."""

    def __init__(self, name: str, seed: int = 0, codes: QuantConfig | None = None, config: dict | None = None):
        """codes: draw each layer's 2-D weights directly as uniformly random codes of that format
        (QTensors) instead of quantizing normal draws: generating and quantizing a 70B layer takes
        tens of seconds on two cores, drawing its codes about one (scripts/bench_70b.py). Other
        weights than the normal draws, so another fingerprint (and disk store). config: an HF
        config dict to use instead of the registered model `name`'s."""
        try:
            hf = known_config(name) if config is None else dict(config)
        except KeyError as exc:
            raise CheckpointError(str(exc.args[0])) from None
        self.name, self.seed, self.codes = name, seed, codes
        self.config = ModelConfig.from_hf(hf, source=f"{DUMMY_PREFIX}{name}")
        self.model = build_model_math(self.config)

    @property
    def fingerprint(self) -> str:
        codes = self.codes
        drawn = f"-codes{codes.bits}g{codes.group_size}d{codes.group_dim}{'s' if codes.symmetric else ''}" if codes else ""
        return f"dummy-{self.name}-seed{self.seed}-chunks{DRAW_CHUNK}{drawn}"

    def _make(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if key.endswith(".bias") or len(shape) == 1:
            return torch.zeros(shape, dtype=dtype)
        # normal draws * 0.02 without a second fp32 temporary (a 70B layer's fused gate/up weight is
        # 1.9 GB in fp32), in chunks of DRAW_CHUNK values, each from its own generator, drawn side by
        # side: one generator draws serially (~200M values/s), so an OPT-30B layer took a second and
        # its 48 layers most of a GPU benchmark's load; a tensor of one chunk is drawn as it always was.
        values = torch.empty(math.prod(shape))

        def draw(start: int) -> None:
            seed = f"{self.seed}:{key}" + (f":{start // DRAW_CHUNK}" if start else "")
            gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
            values[start:start + DRAW_CHUNK].normal_(0.0, 0.02, generator=gen)

        list(worker_pool("dummy-chunk").map(draw, range(0, values.numel(), DRAW_CHUNK)))
        return values.view(shape).to(dtype)

    def global_weights(self, dtype):
        return {k: self._make(k, s, dtype) for k, s in self.model.global_shapes().items()}

    def _draw_codes(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> QTensor:
        """Uniformly random codes, every group with the step that gives the normal draws' std (0.02)
        and its minimum half the code range below 0: values spread evenly around 0."""
        config = self.codes
        groups = GroupLayout.of(shape, config).num_groups
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}:codes".encode()))
        data = torch.randint(0, 256, (groups * config.bytes_per_group,), generator=gen, dtype=torch.uint8)
        levels = 2**config.bits  # a uniform code's std is step * sqrt((levels^2 - 1) / 12)
        step = 0.02 / math.sqrt((levels**2 - 1) / 12)
        scale = torch.full((groups,), step, dtype=torch.float16)
        minimum = torch.full((groups,), -step * (levels - 1) / 2, dtype=torch.float16)
        return QTensor(data=data, scale=scale, minimum=minimum, shape=tuple(shape), dtype=dtype, config=config)

    def layer_weights(self, layer, dtype, unchecked=frozenset()):
        codes = self.codes is not None  # (normal draws and codes are finite: nothing to check)
        resident = self.model.resident_weights()  # routers: never drawn as codes (placed uncompressed)

        def draw(name: str, shape: tuple[int, ...]):
            key = f"{layer}.{name}"
            if codes and len(shape) == 2 and name not in resident:
                return self._draw_codes(key, shape, dtype)
            return self._make(key, shape, dtype)

        # One generator per tensor, so the tensors are drawn side by side (each draw is serial and
        # releases the GIL: a 7B layer's six matrices took ~2 s on one core) with the same values.
        shapes = self.model.layer_shapes(layer)
        drawn = worker_pool("dummy-draw").map(lambda item: draw(*item), shapes.items())
        return dict(zip(shapes, drawn))
