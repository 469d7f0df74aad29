"""Opening a model: the one place that tells model kinds apart (a checkpoint folder, pre-quantized or
not, a `.gguf` file, `dummy:<name>`) and opens its weight source and tokenizer once per job, shared
by whoever needs them (the CLI reads the tokenizer and the weights' fingerprint before it builds the
engine; the planner reads the config)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from flexsarathi.errors import CheckpointError
from flexsarathi.formats.checkpoint import DUMMY_PREFIX, DummyWeights, SafetensorsCheckpoint, WeightSource
from flexsarathi.formats.lora_adapter import open_adapter
from flexsarathi.formats.quantized_checkpoint import QuantizedCheckpoint, read_quantization_config
from flexsarathi.formats.tokenizer import Tokenizer, load_tokenizer
from quant import QuantConfig


@dataclass(frozen=True)
class OpenedModel:
    name: str  # what the user named: a checkpoint folder, a `.gguf` file or `dummy:<name>`
    source: WeightSource
    tokenizer: Tokenizer | None  # None for dummy models and folders without tokenizer files
    codes: QuantConfig | None = None  # a dummy model's layer matrices drawn in this quantized format
    lora: str | None = None  # the LoRA adapter folder merged into its weights (formats/lora_adapter.py)


MODEL_FORMS = "a checkpoint folder (config.json + safetensors), a .gguf file or dummy:<name>"


def open_model(model: str, codes: QuantConfig | None = None, lora: str | None = None) -> OpenedModel:
    """lora: a LoRA adapter folder to merge into the weights (full-precision checkpoints only)."""
    is_folder = os.path.isdir(model)
    if not model.startswith(DUMMY_PREFIX) and not is_folder:
        _refuse_path(model)
    if model.endswith(".gguf") and codes is None and not is_folder:  # llama.cpp's file: weights and tokenizer in one
        from flexsarathi.formats.gguf_checkpoint import GGUFCheckpoint
        from flexsarathi.formats.gguf_tokenizer import load_gguf_tokenizer
        _refuse_adapter(lora, model, "a GGUF file's")
        return _with_context(OpenedModel(model, GGUFCheckpoint(model), load_gguf_tokenizer(model)))
    source = open_weight_source(model, codes=codes, lora=lora)
    return _with_context(OpenedModel(model, source, load_tokenizer(model, source.config), codes, lora))


def _refuse_adapter(lora: str | None, model: str, whose: str) -> None:
    if lora is not None:
        raise CheckpointError(f"a LoRA adapter is merged into full-precision weights; {model} holds {whose} "
                              "quantized or drawn ones (give the full-precision base checkpoint)")


def _with_context(opened: OpenedModel) -> OpenedModel:
    """The tokenizer told the model's context: a text too long to fit it is refused before encoding."""
    if opened.tokenizer is not None:
        opened.tokenizer.context_tokens = opened.source.config.max_position_embeddings
    return opened


def open_weight_source(model: str, codes: QuantConfig | None = None, lora: str | None = None) -> WeightSource:
    """The weights alone of a checkpoint folder or `dummy:<name>` (see policy_search.model_registry);
    codes: a dummy model's layer matrices drawn directly in that quantized format (DummyWeights);
    lora: a LoRA adapter folder merged into a full-precision checkpoint's weights."""
    if model.startswith(DUMMY_PREFIX):
        _refuse_adapter(lora, model, "a dummy model's")
        return DummyWeights(model[len(DUMMY_PREFIX):], codes=codes)
    if codes is not None:
        raise CheckpointError(f"weights drawn as quantized codes are for dummy models only, not {model}")
    quantization = read_quantization_config(model)
    if quantization is not None and not _read_as_floats(quantization):  # GPTQ, AWQ, compressed-tensors
        _refuse_adapter(lora, model, "a pre-quantized checkpoint's")
        return QuantizedCheckpoint(model)
    source = SafetensorsCheckpoint(model, adapter=None if lora is None else open_adapter(lora))
    if _mxfp4(quantization) and not source.model.stacked_experts(0):
        raise CheckpointError(f"{model}: quantization_config mxfp4 is read for gpt-oss's expert weights only, and "
                              f"this is a {source.config.model_type} model")
    return source


def _read_as_floats(quantization) -> bool:
    """A quantization SafetensorsCheckpoint reads: MXFP4 experts (their exact 8-bit codes) and
    block-wise FP8 (formats/fp8_blocks.py: times their factors, then the run dtype)."""
    return _method(quantization) in ("mxfp4", "fp8")


def _mxfp4(quantization) -> bool:
    """An MXFP4 checkpoint (gpt-oss as OpenAI releases it): its experts' blocks are decoded as they are
    read (formats/stacked_experts.py), every other weight is floats."""
    return _method(quantization) == "mxfp4"


def _method(quantization) -> str | None:
    """A quantization_config's quant_method, lower-cased (None: not a config object)."""
    return str(quantization.get("quant_method", "")).lower() if isinstance(quantization, dict) else None


def _refuse_path(model: str) -> None:
    """A model path that is no folder: fine when it is a .gguf file; else one error saying what
    it is and what a model can be."""
    if not os.path.exists(model):
        raise CheckpointError(f"model {model} does not exist; a model is {MODEL_FORMS}")
    if not os.path.isfile(model):
        raise CheckpointError(f"model {model} is neither a folder nor a file; a model is {MODEL_FORMS}")
    try:
        with open(model, "rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise CheckpointError(f"cannot read model {model}: {exc.strerror}") from None
    if head[:4] == b"GGUF":
        if model.endswith(".gguf"):
            return
        what = "a GGUF file not named .gguf (rename it or link it as NAME.gguf)"
    elif model.endswith(".gguf"):
        what = f"named .gguf but not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')"
    elif len(head) == 9 and head[8:9] == b"{" and model.endswith(".safetensors"):
        what = "one safetensors file: give the folder that holds it with its config.json"
    else:
        what = f"a file of {os.path.getsize(model)} bytes, not a checkpoint"
    raise CheckpointError(f"model {model} is {what}; a model is {MODEL_FORMS}")
