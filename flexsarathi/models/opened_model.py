"""A model opened once per job: its weight source and its tokenizer, shared by whoever needs them
(the CLI reads the tokenizer and the weights' fingerprint before it builds the engine)."""
from __future__ import annotations

from dataclasses import dataclass

from flexsarathi.models.checkpoint import WeightSource, open_weight_source
from flexsarathi.models.tokenizer import Tokenizer, load_tokenizer
from quant import QuantConfig


@dataclass(frozen=True)
class OpenedModel:
    name: str  # what the user named: a checkpoint folder, a `.gguf` file or `dummy:<name>`
    source: WeightSource
    tokenizer: Tokenizer | None  # None for dummy models and folders without tokenizer files
    codes: QuantConfig | None = None  # a dummy model's layer matrices drawn in this quantized format


def open_model(model: str, codes: QuantConfig | None = None) -> OpenedModel:
    if model.endswith(".gguf") and codes is None:  # llama.cpp's file: weights and tokenizer in one
        from flexsarathi.models.gguf_checkpoint import GGUFCheckpoint
        from flexsarathi.models.gguf_tokenizer import load_gguf_tokenizer
        return OpenedModel(model, GGUFCheckpoint(model), load_gguf_tokenizer(model))
    source = open_weight_source(model, codes=codes)
    return OpenedModel(model, source, load_tokenizer(model, source.config), codes)
