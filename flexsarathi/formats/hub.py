"""Models named as on the Hugging Face Hub: `org/name`, `org/name@revision`, and `org/name:QUANT`
(or a file named with --gguf-file) for a GGUF file inside a repo, resolved through huggingface_hub
to a local folder or file: its cache (HF_HUB_CACHE, or HF_HOME/hub), no network under
HF_HUB_OFFLINE=1, a download with progress bars where a network and no cached copy exist. A local
path of the same spelling wins; `dummy:` names are not hub names."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from flexsarathi.errors import CheckpointError

# A safetensors checkpoint's files (the weights, configs, tokenizer, chat template), not the
# .bin / .pt / .gguf copies a repo may also hold.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt"]
# What a plan of a full-precision checkpoint reads: config.json (the shapes, the dtype).
CONFIG_PATTERNS = ["*.json"]
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's split files


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: str | None = None
    quant: str | None = None  # a GGUF file's quantization (Q4_K_M, ...)

    @classmethod
    def parse(cls, model: str) -> "HubName | None":
        match = _HUB_NAME.match(model)
        return cls(match["repo"], match["revision"], match["quant"]) if match else None


def resolve_model(model: str, gguf_file: str | None = None, config_only: bool = False) -> str:
    """A local path for `model`: itself when it is a path here or `dummy:<name>`, else the
    checkpoint folder (or GGUF file) of the hub repo it names. CheckpointError saying where it
    looked when there is none. config_only (a plan, not a run): of a full-precision checkpoint
    only its JSON files are fetched (the weights of a 70B model are not needed to plan it); a
    pre-quantized one is fetched whole (which modules it packs is read from its files' headers)."""
    if model.startswith("dummy:") or os.path.exists(model):
        if gguf_file is not None:
            raise CheckpointError(f"--gguf-file names a file inside a Hugging Face repo; {model} is not a repo name")
        return model
    name = HubName.parse(model)
    if name is None:
        return model  # neither a path nor a hub name: the checkpoint loader says it does not exist
    if name.quant is None and gguf_file is None:
        if config_only:
            folder = _download(name, model, CONFIG_PATTERNS)
            if not _quantized(folder):
                return folder
        return _download(name, model, CHECKPOINT_PATTERNS)
    return _gguf(name, model, gguf_file)


def _quantized(folder: str) -> bool:
    """Whether the checkpoint's config.json names a quantization (GPTQ, AWQ, compressed-tensors)."""
    from flexsarathi.formats.quantized_checkpoint import read_quantization_config

    return read_quantization_config(folder) is not None


def hub_cache() -> str:
    """Where huggingface_hub keeps repos, read now (a test or a job may set HF_HOME late)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _download(name: HubName, model: str, patterns: list[str]) -> str:
    """The repo's snapshot folder holding the files matching `patterns` (downloaded if missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(name.repo_id, revision=name.revision, cache_dir=hub_cache(),
                                 allow_patterns=patterns, local_files_only=offline())
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as exc:
        raise CheckpointError(_not_found(name, model, exc)) from None


def _not_found(name: HubName, model: str, exc: Exception) -> str:
    revision = f" at revision {name.revision}" if name.revision else ""
    why = ("HF_HUB_OFFLINE=1, so no download was tried" if offline()
           else f"downloading it failed: {' '.join(str(exc).split())[:300]}")
    return (f"model {model!r}: no file or folder {os.path.abspath(model)}, and the Hugging Face repo "
            f"{name.repo_id}{revision} is not in the cache {hub_cache()} ({why})")


def _gguf(name: HubName, model: str, gguf_file: str | None) -> str:
    """The GGUF file of the repo named by --gguf-file or by its quantization (`:Q4_K_M`); for a
    split file, every part is fetched and the first returned (the reader finds the rest)."""
    if gguf_file is not None:
        wanted = [gguf_file]
        split = _SPLIT.search(gguf_file)
        if split:
            wanted = [_SPLIT.sub(f"-{i:05d}-of-{split[2]}.gguf", gguf_file) for i in range(1, int(split[2]) + 1)]
        folder = _download(name, model, wanted)
    else:
        folder = _download(name, model, [f"*{q}*.gguf" for q in {name.quant, name.quant.upper(), name.quant.lower()}])
    found = sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder)
                   for f in files if f.endswith(".gguf"))
    if gguf_file is not None:
        matches = [f for f in found if f == gguf_file]
    else:
        pattern = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(name.quant)}([^A-Za-z0-9]|$)", re.IGNORECASE)
        matches = [f for f in found if pattern.search(os.path.basename(f))]
    firsts = [f for f in matches if not _SPLIT.search(f) or _SPLIT.search(f)[1] == "00001"]
    if len(firsts) != 1:
        what = gguf_file or f"quantization {name.quant}"
        listed = ", ".join(found) or "none"
        raise CheckpointError(f"model {model!r}: {'several' if firsts else 'no'} GGUF files for {what} in "
                              f"{name.repo_id} (cached here: {listed}; cache {hub_cache()})"
                              + ("; name one with --gguf-file" if firsts else ""))
    return os.path.join(folder, firsts[0])

