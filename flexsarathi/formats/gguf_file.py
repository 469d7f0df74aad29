"""A GGUF file (llama.cpp's format; single or split `-00001-of-0000N.gguf`): its metadata, its
tensors as memory-mapped raw blocks, and the model it describes as an HF `config.json` dict.

Read with the `gguf` package's `GGUFReader` (memory-mapped, from the llama.cpp authors): the
container has versions, alignment rules and value types that the package keeps up with. Every
failure to read is one `CheckpointError` naming the file. The tensors' names and the q/k row order
are llama.cpp's (`convert_hf_to_gguf.py`); `gguf_part` and `unpermute_rows` turn them back into
the HF checkpoint's, as transformers' GGUF loader does (an expert's matrix: its slice of the layer's
3-D stack).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from flexsarathi.errors import CheckpointError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# general.architecture -> the engine's model_type (its families: policy_search/hf_config.py);
# llama.cpp writes Mixtral as `llama` with `llama.expert_count` experts (`model_type`)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                 "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "phi3": "phi3",
                 "granite": "granite", "glm4moe": "glm4_moe"}
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID: glm4moe's (llama.cpp's default for it)
# Model types whose q/k rows llama.cpp's converter permutes into the interleaved RoPE layout: its
# LlamaModel's (Mixtral included); qwen2/qwen3 keep HF's row order.
PERMUTED_QK = ("llama", "mixtral", "granite")  # granite: convert_hf_to_gguf.py's GraniteModel is a LlamaModel
# Whether the top-k routing weights are renormalised, where the file has no
# `{arch}.expert_weights_norm`: llama.cpp's graphs fix it per architecture (llama, i.e. Mixtral,
# and qwen3moe renormalise, qwen2moe does not), as transformers' GGUF loader assumes for qwen3_moe.
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX: the only routing these model types compute


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType name: F32, F16, BF16, Q4_0, Q4_K, ...
    shape: tuple[int, ...]  # logical shape in torch order ([rows, cols] for a matrix)
    raw_dtype: np.dtype  # of `read()`: the values' (F32/F16) or uint8 for blocks
    raw_shape: tuple[int, ...]  # of `read()`: the values' shape or [rows, bytes per row]
    offset: int  # of the data in the file
    path: str

    def read(self) -> np.ndarray:
        """The tensor's bytes, read from the file (not through the reader's map: the pages of a
        mapped file stay in the process's resident set, a whole model's worth by the last layer)."""
        count = int(np.prod(self.raw_shape))
        try:
            with open(self.path, "rb") as f:
                data = np.fromfile(f, dtype=self.raw_dtype, count=count, offset=self.offset)
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {self.name} from {self.path}: {exc.strerror}") from None
        if data.size != count:
            raise CheckpointError(f"{self.path} is truncated: tensor {self.name} ends past the end of the file")
        return data.reshape(self.raw_shape)


class GGUFFile:
    """Metadata (from the first part) and the tensors of every part of one GGUF model."""

    def __init__(self, path: str):
        self.paths = split_parts(path)
        self.path = self.paths[0]
        readers = [_open_reader(p) for p in self.paths]
        self.metadata = _metadata(readers[0], self.path)
        self.tensors: dict[str, GGUFTensor] = {}
        for reader, part in zip(readers, self.paths):
            for t in reader.tensors:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data.dtype,
                                                  tuple(t.data.shape), int(t.data_offset), part)
        count = metadata_value(self, "split.count", self.metadata.get("split.count"), int)
        if count is not None and count != len(self.paths):
            raise CheckpointError(f"{self.path} says the model is split in {count} files, "
                                  f"found {len(self.paths)}")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path} has no general.architecture: not a model GGUF")
        return arch

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name} is missing from {self.path}")
        return self.tensors[name]


@functools.lru_cache(maxsize=4)
def _open(path: str, stamp: tuple | None) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The file parsed once per (path, size, mtime): the weight source, the tokenizer and the
    planner share it."""
    st = os.stat(path) if os.path.isfile(path) else None
    return _open(os.path.realpath(path), (st.st_size, st.st_mtime_ns) if st else None)


def split_parts(path: str) -> list[str]:
    """All parts of a split GGUF (given any one of them), or [path]."""
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file {path} does not exist")
    match = SPLIT_RE.match(path)
    if not match:
        return [path]
    count = int(match["count"])
    parts = [f"{match['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(f"split GGUF {path}: part(s) {', '.join(missing)} are missing")
    return parts


@functools.cache
def _checked_reader():
    """GGUFReader that first checks each tensor's data lies within the file, naming the first that does not
    (the reader itself fails on a short one with a reshape error naming none)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                try:
                    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    continue  # an unknown type: the reader's own error
                end = int(start_offs) + int(offset[0]) + int(np.prod(dims.astype(object))) * size // block
                if end > len(self.data):
                    tensor = bytes(name).decode(errors="replace")
                    raise CheckpointError(f"{self.data.filename} is not a readable GGUF file: truncated, "
                                          f"tensor {tensor} ends at byte {end}, past the end of the file "
                                          f"({len(self.data)} bytes)")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _open_reader(path: str):
    try:
        return _checked_reader()(path)
    except CheckpointError:
        raise
    except IndexError:  # a field read from an empty slice of the file: its header runs past the end
        raise CheckpointError(f"{path} is not a readable GGUF file: its header (metadata and tensor list) reads "
                              f"past the end of the file ({os.path.getsize(path)} bytes): truncated, or a length "
                              "or count in it is corrupt") from None
    except Exception as exc:  # bad magic, truncated data, unknown version: all ValueError-ish
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated?): "
                              f"{type(exc).__name__}: {exc}") from None


def _metadata(reader, path: str) -> dict:
    """key -> a Python value (str, int, float, bool, or a list of them)."""
    out = {}
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):  # the container's own header fields
                continue
            out[key] = field.contents()
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read metadata: {type(exc).__name__}: {exc}") from None
    return out


def hf_config(gguf: GGUFFile) -> dict:
    """The model as an HF config.json dict (what policy_search/hf_config.py parses)."""
    arch, meta = gguf.architecture, gguf.metadata
    model_type = gguf_model_type(gguf)

    def get(key: str, default=None, kind=int):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gguf.path}: metadata {arch}.{key} is missing")
        return metadata_value(gguf, f"{arch}.{key}", value, kind)

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    for key, value in (("attention.head_count", heads), ("block_count", layers)):
        if value < 1:
            raise CheckpointError(f"{gguf.path}: metadata {arch}.{key} is {value}; it must be at least 1")
    head_dim = get("attention.key_length", 0) or get("rope.dimension_count", 0)
    token = {k: metadata_value(gguf, f"tokenizer.ggml.{k}_token_id", meta.get(f"tokenizer.ggml.{k}_token_id"), int)
             for k in ("bos", "eos", "eot", "eom")}
    cfg = {
        "model_type": model_type,
        "vocab_size": gguf.tensor("token_embd.weight").shape[0],
        "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim or hidden // heads,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon", 1e-5, float)),
        "rope_theta": _decimal(get("rope.freq_base", 10000.0, float)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": arch in ("llama", "glm4moe") and "blk.0.attn_q.bias" in gguf.tensors,
        "torch_dtype": _checkpoint_dtype(gguf),
        "bos_token_id": token["bos"],
        # end of generation: EOS, and the end-of-turn tokens chat models stop at (llama-3's <|eot_id|>)
        "eos_token_id": list(dict.fromkeys(token[k] for k in ("eos", "eot", "eom") if token[k] is not None)),
    }
    cfg.update(_rope_scaling(gguf, arch))
    if arch == "glm4moe":
        cfg.update(_glm4_moe_fields(gguf, cfg, get))
    if model_type in MOE_TYPES:
        cfg.update(_moe_fields(gguf, arch, get))
    if arch == "gemma3":
        cfg.update(_gemma3_fields(gguf, cfg, get))
    if arch == "phi3":
        cfg.update(_phi3_fields(gguf, cfg, get))
    if arch == "granite":  # its config's multipliers, as the converter renames them (1: none)
        cfg.update({hf: _decimal(get(key, 1.0, float)) for hf, key in (
            ("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
            ("logits_scaling", "logit_scale"), ("attention_multiplier", "attention.scale"))})
    return cfg


def _glm4_moe_fields(gguf: GGUFFile, cfg: dict, get) -> dict:
    """GLM-4.5 (convert_hf_to_gguf.py's Glm4MoeModel; llama.cpp's glm4moe graph): block_count counts the
    MTP layer(s) after the model's own (`nextn_predict_layers`), left unread; RoPE over
    `rope.dimension_count` of each head; q/k norms where the file has them."""
    nextn = get("nextn_predict_layers", 0)
    if not 0 <= nextn < cfg["num_hidden_layers"]:
        raise CheckpointError(f"{gguf.path}: metadata glm4moe.nextn_predict_layers={nextn} leaves no layer of "
                              f"glm4moe.block_count={cfg['num_hidden_layers']}")
    return {"num_hidden_layers": cfg["num_hidden_layers"] - nextn, "num_nextn_predict_layers": nextn,
            "partial_rotary_factor": get("rope.dimension_count", cfg["head_dim"]) / cfg["head_dim"],
            "use_qk_norm": "blk.0.attn_q_norm.weight" in gguf.tensors}


def _phi3_fields(gguf: GGUFFile, cfg: dict, get) -> dict:
    """Phi-3 / Phi-4 (convert_hf_to_gguf.py's Phi3MiniModel): a window where `attention.sliding_window`
    is above 0; RoPE over part of each head (`rope.dimension_count` below head_dim) and the long-context
    RoPE (its `rope_factors_long` / `rope_factors_short` tensors) are refused by the config parser and
    here, by name."""
    if "rope_factors_long.weight" in gguf.tensors or "rope_factors_short.weight" in gguf.tensors:
        raise CheckpointError(f"{gguf.path}: phi3's long-context RoPE (longrope: tensors rope_factors_long / "
                              "rope_factors_short) is not supported")
    window = get("attention.sliding_window", 0)
    rotary = get("rope.dimension_count", cfg["head_dim"])
    return {"sliding_window": window or None, "partial_rotary_factor": rotary / cfg["head_dim"]}


def _gemma3_fields(gguf: GGUFFile, cfg: dict, get) -> dict:
    """What llama.cpp's gemma3 graph takes from the file or fixes itself (llama-model.cpp): the window;
    which layers slide (the file's `sliding_window_pattern` flags, else every 6th layer full); the
    sliding layers' RoPE base (`rope.freq_base_swa`, else 10000); scores scaled by 1/sqrt(hidden / heads)
    for the 27B (62 layers), else 1/sqrt(head_dim) (google's gemma_pytorch config, as llama.cpp)."""
    sliding = gguf.metadata.get("gemma3.attention.sliding_window_pattern")
    kinds = {} if sliding is None else {"layer_types": [
        "sliding_attention" if metadata_value(gguf, "gemma3.attention.sliding_window_pattern", flag, bool)
        else "full_attention" for flag in sliding]}
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    scalar = cfg["hidden_size"] // heads if layers == 62 else cfg["head_dim"]
    key = "gemma3.final_logit_softcapping"
    softcap = metadata_value(gguf, key, gguf.metadata.get(key), float)
    return {"sliding_window": get("attention.sliding_window"), "sliding_window_pattern": 6, **kinds,
            "rope_local_base_freq": _decimal(get("rope.freq_base_swa", 10000.0, float)),
            "query_pre_attn_scalar": scalar, "final_logit_softcapping": None if softcap is None else _decimal(softcap),
            "rms_norm_eps": _decimal(get("attention.layer_norm_rms_epsilon", 1e-6, float)),
            "rope_theta": _decimal(get("rope.freq_base", 1e6, float))}


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


def metadata_value(gguf: GGUFFile, key: str, value, kind):
    """`value` of metadata `key` (None: absent, passed through) checked to be of `kind` (int, float, bool,
    str); one CheckpointError naming the file and the key where it is not."""
    if value is None:
        return None
    numeric = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    ok = {int: numeric, float: numeric or isinstance(value, (float, np.floating)),
          bool: isinstance(value, (bool, np.bool_)), str: isinstance(value, str)}[kind]
    if not ok:
        raise CheckpointError(f"{gguf.path}: metadata {key} is {value!r} ({type(value).__name__}), "
                              f"not {_KIND_NAMES[kind]}")
    return kind(value)


def gguf_model_type(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)} (llama with experts: mixtral)")
    if arch == "llama" and metadata_value(gguf, "llama.expert_count", gguf.metadata.get("llama.expert_count"), int):
        return "mixtral"
    return ARCHITECTURES[arch]


def sparse_layers(gguf: GGUFFile, num_layers: int) -> list[int]:
    """The layers with experts: those with a router (llama.cpp's graphs decide it the same way)."""
    return [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in gguf.tensors]


def _moe_fields(gguf: GGUFFile, arch: str, get) -> dict:
    """The experts as the HF config has them. A layer is sparse where it has a router; the dense
    ones become `mlp_only_layers` (decoder_sparse_step 1), so the engine plans each layer as the
    file has it. Widths from the metadata llama.cpp writes, else from the tensors."""
    experts, layers = get("expert_count"), get("block_count") - get("nextn_predict_layers", 0)
    sparse = sparse_layers(gguf, layers)
    if experts < 1 or not sparse:
        raise CheckpointError(f"{gguf.path}: metadata {arch}.expert_count={experts} but no layer has experts "
                              f"(tensors blk.N.ffn_gate_inp.weight, blk.N.ffn_*_exps.weight)")
    scoring = SIGMOID_GATING if arch == "glm4moe" else SOFTMAX_GATING  # what these model types compute
    gating = get("expert_gating_func", scoring)
    if gating != scoring:
        raise CheckpointError(f"{gguf.path}: metadata {arch}.expert_gating_func={gating} is not supported for "
                              f"{arch} (only {scoring}: {'sigmoid' if scoring == SIGMOID_GATING else 'softmax'} "
                              "scores)")
    first = sparse[0]
    width = metadata_value(gguf, f"{arch}.expert_feed_forward_length",
                           gguf.metadata.get(f"{arch}.expert_feed_forward_length"), int)
    if width is None:  # a 3-D stack [experts, width, hidden], or expert 0's own [width, hidden] (older files)
        width = resolve_part(gguf, GGUFPart(f"blk.{first}.ffn_gate_exps.weight", 0))[0].shape[-2]
    width = int(width)
    fields = {"num_experts_per_tok": get("expert_used_count")}
    if arch == "glm4moe":  # its leading dense layers, the others sparse; weights scaled, maybe renormalised
        dense = get("leading_dense_block_count", 0)
        if sparse != list(range(dense, layers)):
            raise CheckpointError(f"{gguf.path}: metadata {arch}.leading_dense_block_count={dense} says layers "
                                  f"{dense}..{layers - 1} have experts; the file's are {sparse}")
        return {**fields, "n_routed_experts": experts, "moe_intermediate_size": width, "first_k_dense_replace": dense,
                "n_shared_experts": get("expert_shared_count", 0),
                "norm_topk_prob": get("expert_weights_norm", False, bool),
                "routed_scaling_factor": _decimal(get("expert_weights_scale", 1.0, float))}
    if arch == "llama":  # Mixtral: every layer sparse, the experts as wide as intermediate_size
        if len(sparse) != layers:
            raise CheckpointError(f"{gguf.path}: mixtral (llama with experts) needs experts in every layer; "
                                  f"layers {sorted(set(range(layers)) - set(sparse))} have none")
        return {**fields, "num_local_experts": experts, "intermediate_size": width}
    shexp = gguf.tensors.get(f"blk.{first}.ffn_up_shexp.weight")
    return {**fields, "num_experts": experts, "moe_intermediate_size": width,
            "norm_topk_prob": get("expert_weights_norm", NORM_TOPK[arch], bool),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length",
                                                   shexp.shape[0] if shexp else 0),
            "decoder_sparse_step": 1, "mlp_only_layers": sorted(set(range(layers)) - set(sparse))}


def _decimal(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07): the value the converted config.json had."""
    return float(str(np.float32(value)))


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict:
    meta = gguf.metadata
    kind = metadata_value(gguf, f"{arch}.rope.scaling.type", meta.get(f"{arch}.rope.scaling.type", "none"), str)
    if kind == "none":
        return {}
    if kind != "linear":
        raise CheckpointError(f"{gguf.path}: rope scaling {kind!r} is not supported (none or linear)")
    factor = metadata_value(gguf, f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scaling.factor"), float)
    if factor is None:
        raise CheckpointError(f"{gguf.path}: metadata {arch}.rope.scaling.type is linear but "
                              f"{arch}.rope.scaling.factor is missing")
    return {"rope_scaling": {"rope_type": "linear", "factor": _decimal(factor)}}


def _checkpoint_dtype(gguf: GGUFFile) -> str:
    """The dtype the file's weights are closest to: its float matrices' (F32, BF16), else float16
    (F16 weights, and quantized ones: their scales are fp16)."""
    types = {t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2}
    if types == {"F32"}:
        return "float32"
    return "bfloat16" if "BF16" in types else "float16"


# HF checkpoint names (what models/llama.py and models/moe.py ask for) -> GGUF names, llama.cpp's tensor map.
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
                "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # phi3's own fused ones
# One expert's matrix (qwen's names, Mixtral's w1/w3/w2) -> the 3-D tensor [experts, rows, cols]
# that llama.cpp stacks every expert of the layer into.
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
# Model types' own names beside those: gemma3's sandwich norms (llama.cpp's gemma3 tensors; ffn_norm is the
# pre-MLP norm there too); glm4moe's MLP norm and shared experts (its router's correction bias: _CORRECTION_BIAS)
_OWN_LAYER_NAMES = {
    "gemma3_text": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"},
    "glm4_moe": {"post_attention_layernorm": "post_attention_norm", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                 "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}}
_CORRECTION_BIAS = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")


@dataclass(frozen=True)
class GGUFPart:
    """Where an HF tensor is in the file: a whole tensor, or expert `expert`'s slice of a 3-D one."""
    name: str
    expert: int | None = None


def gguf_part(hf_name: str, model_type: str = "llama") -> GGUFPart:
    """`model.layers.3.self_attn.q_proj.weight` -> blk.3.attn_q.weight;
    `model.layers.3.mlp.experts.5.up_proj.weight` -> expert 5 of blk.3.ffn_up_exps.weight."""
    if hf_name in _GLOBAL_NAMES:
        return GGUFPart(_GLOBAL_NAMES[hf_name])
    if correction := _CORRECTION_BIAS.match(hf_name):
        return GGUFPart(f"blk.{correction[1]}.exp_probs_b.bias")
    match = _LAYER_RE.match(hf_name)
    expert = _EXPERT_RE.match(match[2]) if match else None
    if expert and expert[2] in _EXPERT_NAMES:
        return GGUFPart(f"blk.{match[1]}.{_EXPERT_NAMES[expert[2]]}.{match[3]}", int(expert[1]))
    names = {**_LAYER_NAMES, **_OWN_LAYER_NAMES.get(model_type, {})}
    if not match or match[2] not in names:
        raise CheckpointError(f"no GGUF tensor corresponds to {hf_name}")
    return GGUFPart(f"blk.{match[1]}.{names[match[2]]}.{match[3]}")


def resolve_part(gguf: GGUFFile, part: GGUFPart) -> tuple[GGUFTensor, int | None]:
    """The file's tensor for `part` and the expert to take from it. Files that llama.cpp wrote
    before it stacked experts (April 2024, e.g. the first Mixtral GGUFs) hold one 2-D tensor per
    expert, `blk.N.ffn_gate.E.weight`: that tensor whole, where the 3-D stack is absent."""
    if part.expert is not None and part.name not in gguf.tensors:
        per_expert = part.name.replace("_exps.", f".{part.expert}.")
        if per_expert in gguf.tensors:
            return gguf.tensor(per_expert), None
    return gguf.tensor(part.name), part.expert


def gguf_name(hf_name: str, model_type: str = "llama") -> str:
    """The GGUF tensor that holds `hf_name` (an expert's: the layer's 3-D stack)."""
    return gguf_part(hf_name, model_type).name


def norm_shift(gguf_tensor_name: str, config) -> float:
    """What llama.cpp's converter added to this tensor's values: gemma3's norms are stored as 1 + w
    (its RMSNorm scales by the weight; Gemma's by 1 + weight)."""
    return 1.0 if config.model_type == "gemma3_text" and gguf_tensor_name.endswith("norm.weight") else 0.0


def qk_heads(gguf_tensor_name: str, config) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (None: not permuted)."""
    part = gguf_tensor_name.split(".")[2] if gguf_tensor_name.startswith("blk.") else ""
    if config.model_type not in PERMUTED_QK or part not in ("attn_q", "attn_k"):
        return None
    return config.num_heads if part == "attn_q" else config.num_kv_heads


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: HF row i is GGUF row `order[i]`.

    llama.cpp stores each head's rows as (pair index d, half h) (the interleaved RoPE layout) where
    HF has (half h, pair index d): transformers' `_reverse_permute_weights`."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)
