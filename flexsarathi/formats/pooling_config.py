"""How a checkpoint says its embeddings are made (sentence-transformers' files beside the weights, as
vLLM reads them): `modules.json` lists the modules after the model (a Pooling, a Normalize), the
Pooling module's `config.json` its pooling mode. This engine pools the last token (decoder embedding
models: Qwen3-Embedding, e5-mistral, gte-Qwen2); a checkpoint asking for another pooling is refused
rather than embedded another way."""
from __future__ import annotations

import json
import os

from flexsarathi.errors import CheckpointError

_POOLING, _NORMALIZE = "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def embedding_normalized(model: str) -> bool:
    """Whether `model`'s embeddings are L2-normalized: a Normalize module in its modules.json; True
    where it has none (vLLM's default). CheckpointError where its Pooling module pools otherwise
    than by the last token, or its files cannot be read."""
    listing = os.path.join(model, "modules.json")
    if not os.path.isdir(model) or not os.path.isfile(listing):
        return True
    modules = _read(listing)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{listing}: must be a list of module objects (sentence-transformers' modules.json)")
    for module in modules:
        if module.get("type") == _POOLING:
            _check_last_token(os.path.join(model, str(module.get("path", "")), "config.json"))
    return any(module.get("type") == _NORMALIZE for module in modules)


def _check_last_token(path: str) -> None:
    config = _read(path) if os.path.isfile(path) else {}
    modes = [m for m in _MODES if isinstance(config, dict) and config.get(f"pooling_mode_{m}") is True]
    if modes != ["lasttoken"]:
        asked = " + ".join(modes) if modes else "no pooling mode"
        raise CheckpointError(f"{path} asks for {asked}: this engine pools the last token "
                              "(pooling_mode_lasttoken), as decoder embedding models do")


def _read(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
