"""A LoRA adapter as PEFT saves it (`adapter_config.json` + `adapter_model.safetensors`), merged into
the base checkpoint's weights as they are read: W + scale * B @ A for every module it adapts,
computed in fp32 from the checkpoint's values, then cast to the compute dtype. The merged weights
then go wherever the policy puts them (compressed, streamed from the disk store) at no cost per pass:
an offloaded engine reads every weight each pass anyway, and a second small matmul per linear
would add launches and bytes to every layer-step. That is `lora=`: one adapter per engine.
Several adapters in one job are served per request instead (`layer_factors`, vLLM's LoRARequest):
each adapter's factors stay on the compute device and its rows get x A.T B.T beside the base
matmul, so requests of every adapter share one stream of the base weights per pass.

scale = lora_alpha / r (PEFT's default), lora_alpha / sqrt(r) with use_rslora. What PEFT can save
that this merge would get wrong is refused, saying what: DoRA (magnitude vectors), fan_in_fan_out
(GPT-2's Conv1D layout), trained biases, modules_to_save (whole replaced modules), per-module
rank or alpha patterns, embedding adapters, and any adapted module this model does not read.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import torch
from safetensors import SafetensorError, safe_open

from flexsarathi.errors import CheckpointError
from flexsarathi.formats.checkpoint import file_identity, require_regular_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<module>.lora_A.weight
# Fields whose non-default values change the merge in ways this module does not compute.
_REFUSED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
            "modules_to_save": (None, []), "rank_pattern": (None, {}), "alpha_pattern": (None, {})}


class LoraAdapter:
    def __init__(self, folder: str):
        self.folder = folder
        self.config = _read_config(os.path.join(folder, CONFIG))
        path = os.path.join(folder, WEIGHTS)
        if not os.path.lexists(path):
            raise CheckpointError(f"no {WEIGHTS} in LoRA adapter folder {folder} (PEFT's save_pretrained writes it)")
        self.path = require_regular_file(path)
        # module -> (A [r, in], B [out, r]) as saved; module -> (dtype, digest) of the base weight PEFT
        # saved beside an adapted embedding or head (save_embedding_layers), to be the checkpoint's own
        self.pairs, self.saved_bases = _read_pairs(self.path)
        r, alpha = self.config["r"], self.config["lora_alpha"]
        self.scale = alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r
        for module, (a, b) in self.pairs.items():
            if a.shape[0] != r or b.shape[1] != r:
                raise CheckpointError(f"{self.path}: {module}'s lora_A is {list(a.shape)} and lora_B "
                                      f"{list(b.shape)}, but {CONFIG} says r = {r}")

    @property
    def nbytes(self) -> int:
        """What it holds for the engine's life: A and B as saved (a saved base weight only as its digest)."""
        return sum(t.numel() * t.element_size() for pair in self.pairs.values() for t in pair)

    @property
    def fingerprint(self) -> str:
        """Its files' identities and the scale: part of the merged checkpoint's fingerprint, so
        that an offload store written with one adapter is never read for another."""
        digest = hashlib.sha256(file_identity(self.path).encode())
        digest.update(json.dumps(self.config, sort_keys=True).encode())
        return digest.hexdigest()[:16]

    def check_targets(self, weight_shapes: dict[str, tuple[int, ...]]) -> None:
        """Every adapted module must be a 2-D weight the model reads ({HF weight name: shape}),
        with A and B of its input and output sizes: one CheckpointError naming the first that is not."""
        for module, (a, b) in sorted(self.pairs.items()):
            shape = weight_shapes.get(f"{module}.weight")
            if shape is None or len(shape) != 2:
                raise CheckpointError(f"LoRA adapter {self.folder} adapts {module}, which this model does not "
                                      f"have as a linear layer (its weights are e.g. "
                                      f"{', '.join(sorted(weight_shapes)[:3])}, ...)")
            if (b.shape[0], a.shape[1]) != tuple(shape):
                raise CheckpointError(f"LoRA adapter {self.folder}: {module} is {list(shape)} in the model, but its "
                                      f"lora_B @ lora_A is {[b.shape[0], a.shape[1]]}: an adapter of another model")

    def merged(self, hf_weight_name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (as read) in `dtype`, with this adapter's update where it adapts that module: one
        fp32 copy, updated in place (its saved base weight, if any, checked against it first)."""
        module = hf_weight_name.removesuffix(".weight")
        pair = self.pairs.get(module) if hf_weight_name.endswith(".weight") else None
        saved = self.saved_bases.get(module)
        if pair is None and saved is None:
            return weight.to(dtype)
        if saved is not None and _digest(weight.to(saved[0])) != saved[1]:  # as precise as the saved copy
            raise CheckpointError(f"LoRA adapter {self.folder} saved {module}'s base weight, and it is not this "
                                  f"checkpoint's (a resized vocabulary, or another base model)")
        merged = weight.to(torch.float32, copy=True)
        if pair is not None:
            a, b = pair
            merged.addmm_(b.float(), a.float(), alpha=self.scale)
        return merged.to(dtype)

    def layer_factors(self, model, dtype: torch.dtype) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Served per request (EngineConfig.enable_lora): per layer of `model` (a ModelMath),
        {weight: (A [R, in], B [out, R])} with B @ A this adapter's update of that stacked weight:
        the A of each adapted part (q, k, v of qkv_proj) stacked, B block-diagonal with each part's
        B * scale in its rows (a part it does not adapt: zeros). In `dtype`, on the CPU. Every
        module it adapts must be a dense layer linear: a CheckpointError names the first that is not."""
        used, layers, stacks = set(), [], model.expert_stacks()
        for layer in range(model.config.num_layers):
            shapes, factors = model.layer_shapes(layer), {}
            for name, parts in model.hf_layer_names(layer).items():
                modules = [hf.removesuffix(".weight") for hf in parts]
                adapted = [i for i, module in enumerate(modules) if module in self.pairs]
                if adapted and name.endswith(".weight") and name not in stacks and len(shapes[name]) == 2:
                    factors[name] = self._stacked(modules, adapted, model.part_rows(name, layer), shapes[name], dtype)
                    used.update(modules[i] for i in adapted)
            layers.append(factors)
        stray = sorted(set(self.pairs) - used)
        if stray:
            raise CheckpointError(f"LoRA adapter {self.folder} adapts {stray[0]}, which is not a dense layer linear "
                                  f"of this model (per-request adapters update attention and MLP projections)")
        return layers

    def _stacked(self, modules: list[str], adapted: list[int], rows: tuple[int, ...], shape: tuple[int, int],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.cat([self.pairs[modules[i]][0].float() for i in adapted])  # [R, in]
        b = torch.zeros(shape[0], a.shape[0])  # [out, R]
        column = 0
        for i in adapted:
            lora_a, lora_b = self.pairs[modules[i]]
            if (lora_b.shape[0], lora_a.shape[1]) != (rows[i], shape[1]):
                raise CheckpointError(f"LoRA adapter {self.folder}: {modules[i]} is {[rows[i], shape[1]]} in the "
                                      f"model, but its lora_B @ lora_A is {[lora_b.shape[0], lora_a.shape[1]]}: "
                                      f"an adapter of another model")
            start, r = sum(rows[:i]), lora_a.shape[0]
            b[start:start + rows[i], column:column + r] = lora_b.float() * self.scale
            column += r
        return a.to(dtype), b.to(dtype)

    def merge_bytes(self) -> int:
        """The most a merge holds beside the read: the fp32 copy and its cast (a saved base's check
        may cast the read to the saved dtype before)."""
        return max((4 + 4 + (4 if m in self.saved_bases else 0)) * a.shape[1] * b.shape[0]
                   for m, (a, b) in self.pairs.items())


def _read_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"no {CONFIG} in {os.path.dirname(path)}: a LoRA adapter is a folder as PEFT's "
                              f"save_pretrained writes it ({CONFIG} + {WEIGHTS})")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(config).__name__}")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise CheckpointError(f"{path}: peft_type {kind!r} is not a LoRA adapter (only LORA is merged)")
    for name, allowed in _REFUSED.items():
        if config.get(name, allowed[0]) not in allowed:
            raise CheckpointError(f"{path}: {name} = {config[name]!r} is not supported (the merge W + scale * B @ A "
                                  f"would not be the adapted model)")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{path}: {name} must be a positive number, got {value!r}")
    return config


def _read_pairs(path: str) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, tuple]]:
    """({module: (A, B)}, {module: (dtype, digest) of its saved base weight}) from PEFT's tensor names; every tensor
    accounted for and finite."""
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, Exception) as exc:  # a corrupt header or a truncated file
        raise CheckpointError(f"cannot read LoRA weights {path}: {exc}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    # a saved base weight (a vocabulary's head: up to GBs) kept only as (dtype, digest): it is compared once
    bases = {}
    for name in [n for n in tensors if n.endswith(".base_layer.weight")]:
        base = tensors.pop(name)
        bases[name.removeprefix(_PREFIX).removesuffix(".base_layer.weight")] = (base.dtype, _digest(base))
    for name, tensor in tensors.items():
        module, _, part = name.removeprefix(_PREFIX).rpartition(".lora_")
        if not module or part not in ("A.weight", "B.weight", "A.default.weight", "B.default.weight"):
            raise CheckpointError(f"{path}: tensor {name} is not a lora_A / lora_B weight (embedding adapters, "
                                  f"magnitude vectors and saved modules are not merged)")
        if tensor.dim() != 2 or not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: tensor {name} must be a finite 2-D float matrix, got "
                                  f"{tensor.dtype} {list(tensor.shape)}")
        halves.setdefault(module, {})[part[0]] = tensor  # as saved: fp32 only for a merge, one at a time
    pairs = {}
    for module, parts in halves.items():
        if set(parts) != {"A", "B"}:
            raise CheckpointError(f"{path}: {module} has lora_{''.join(parts)} but not its other half")
        pairs[module] = (parts["A"], parts["B"])
    if not pairs:
        raise CheckpointError(f"{path} holds no LoRA weights")
    stray = sorted(set(bases) - set(pairs))
    if stray:
        raise CheckpointError(f"{path}: {stray[0]}'s base weight is saved without a LoRA pair for it")
    return pairs, bases


def _digest(tensor: torch.Tensor) -> bytes:
    """sha256 of a tensor's bytes (its values exactly, in its dtype)."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).digest()


def open_adapter(folder: str) -> LoraAdapter:
    if not os.path.isdir(folder):
        raise CheckpointError(f"LoRA adapter {folder} is not a folder (PEFT's save_pretrained writes one: "
                              f"{CONFIG} + {WEIGHTS})")
    return LoraAdapter(folder)
