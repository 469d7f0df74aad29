"""The planner's view of a model as LLMEngine runs it: the model's shapes, the engine's compute dtype
on the device it will run on, and the weight and KV formats the engine stores (a pre-quantized
checkpoint's own codes, kept as they are). One home for what `LLM(policy="auto")`, `flexsarathi
policy` and the benchmarks hand to policy_search."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype
from flexsarathi.formats.checkpoint import DUMMY_PREFIX, WeightSource
from flexsarathi.formats.opened_model import OpenedModel, open_model
from offload.kv_cache import KVCompression, decode_in_pool_tiers
from policy_search.errors import SpecError
from policy_search.hf_config import read_config_json
from policy_search.model_spec import ModelSpec
from policy_search.quant_format import KV_FORMAT, KVFormat, WeightFormat
from quant.config import WEIGHT_QUANT


@dataclass(frozen=True)
class PlannedModel:
    spec: ModelSpec
    stores_own_codes: bool  # a pre-quantized checkpoint: its codes are stored as they are

    def search_constraints(self, given: dict) -> dict:
        """The search's constraints: a pre-quantized checkpoint keeps 4-bit weights on unless the
        caller says otherwise (its full-precision weights do not exist)."""
        return {"compress_weight": True, **given} if self.stores_own_codes else dict(given)


def planned_model(model: str | OpenedModel, dtype=None, device=None, kv_block_size: int | None = None,
                  weight_quant=WEIGHT_QUANT, kv_bits: int = KV_FORMAT.bits,
                  kv_value_group: int = KV_FORMAT.value_group, compress_head: bool = False) -> PlannedModel:
    """model: a registered name (`opt-30b`, `dummy:opt-30b`), a checkpoint folder, a `.gguf` file, or
    an OpenedModel. device: where the engine will compute (default: this machine's default device)."""
    device = resolve_device(device, check_available=False) if device is not None else resolve_device(None)
    compute = resolve_dtype(dtype, torch.float16, device)  # either half dtype: 2 bytes
    if isinstance(model, str) and not os.path.exists(model):  # a registered shape: nothing to open
        spec, stored, coded = ModelSpec.from_name(model, bytes_per_value=compute.itemsize), None, frozenset()
    elif isinstance(model, str) and _config_only(model):  # a hub repo's JSON files alone (flexsarathi policy)
        spec, stored, coded = _spec_of_config(model, compute.itemsize), None, frozenset()
    else:
        opened = model if isinstance(model, OpenedModel) else open_model(model)
        spec = ModelSpec.from_hf(opened.source.config, _short_name(opened.name), bytes_per_value=compute.itemsize)
        stored, coded = stored_weight_format(opened.source), opened.source.coded_globals()
    kv_format = KVFormat(kv_bits, kv_block_size or KV_FORMAT.block_size, kv_value_group)
    compressed = KVCompression(kv_format.bits, kv_format.block_size, kv_format.value_group)
    spec = dataclasses.replace(
        spec, weight_format=stored or WeightFormat(weight_quant.bits, weight_quant.group_size), kv_format=kv_format,
        decode_in_pool=tuple(decode_in_pool_tiers(device, compute, spec.head_dim, c) for c in (None, compressed)),
        compressed_head=compress_head and not spec.tie_embeddings,
        coded_embedding="embed_tokens.weight" in coded, coded_head="lm_head.weight" in coded)
    return PlannedModel(spec, stored is not None)


def planner_model_spec(model: str | OpenedModel, dtype=None, **options) -> ModelSpec:
    """The planner's ModelSpec of `model` (planned_model's options)."""
    return planned_model(model, dtype, **options).spec


def stored_weight_format(source: WeightSource) -> WeightFormat | None:
    """A pre-quantized source's format as the planner prices it: that of its largest quantized
    tensor kind (channel-wise: one group per row of that kind); None for full-precision sources."""
    formats, shapes = source.quantized_formats() or {}, source.model.weight_kinds()
    quantized = [(shapes[n][0] * shapes[n][1], n, c) for n, c in formats.items() if c is not None]
    if not quantized:
        return None
    name, config = max(quantized, key=lambda item: item[0])[1:]
    return WeightFormat(config.bits, config.group_size, config.minimum_bytes,
                        minimum_streamed=not _streamed_without_minimum(source, name))


def _streamed_without_minimum(source: WeightSource, name: str) -> bool:
    """Whether the disk tier streams `name` from the source's own blocks, which hold no minimum."""
    layer = next((i for i in range(source.config.num_layers) if name in source.model.hf_layer_names(i)), None)
    linked = source.linked_blocks(layer).get(name) if layer is not None else None
    return linked is not None and linked.format.minimum_at is None


def _config_only(folder: str) -> bool:
    """A folder holding config.json and no weights: what `flexsarathi policy` fetches of a hub repo
    (formats/hub.py, CONFIG_PATTERNS)."""
    return (os.path.isdir(folder) and os.path.isfile(os.path.join(folder, "config.json"))
            and not any(name.endswith(".safetensors") for name in os.listdir(folder)))


def _spec_of_config(folder: str, bytes_per_value: int) -> ModelSpec:
    """The shapes of a full-precision checkpoint from its config.json alone; a pre-quantized one
    cannot be priced so (which modules it packs, and how, is in its files' headers)."""
    config, where = read_config_json(folder)
    quantization = config.get("quantization_config")
    if quantization is not None:  # as open_weight_source tells a pre-quantized checkpoint
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise SpecError(f"{where} names a quantization ({method}): its plan reads which modules are packed from "
                        f"the checkpoint's .safetensors files, and {folder} holds none")
    return ModelSpec.from_config(config, name=_short_name(folder), bytes_per_value=bytes_per_value)


def _short_name(model: str) -> str:
    """A model's name in a plan: a dummy's registered name, a hub snapshot folder's repo (`org/name`),
    or a folder's or file's own name."""
    if model.startswith(DUMMY_PREFIX):
        return model.removeprefix(DUMMY_PREFIX)
    path = os.path.normpath(model)
    snapshots = os.path.dirname(path)
    repo = os.path.basename(os.path.dirname(snapshots))
    if os.path.isdir(path) and os.path.basename(snapshots) == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")  # huggingface_hub's layout
    return os.path.basename(path)
