"""LoRA adapters served per request (vLLM's `LoRARequest`, `LLM(model, enable_lora=True)`).

Why in an offloading engine: a pass streams every base weight once whatever its rows are, so
requests of several adapters in one batch share that stream, where one job per merged adapter
(`lora=`) streams the weights once per adapter. An adapter's factors are small (rank r: r * (in +
out) values per linear) and stay on the compute device; a linear then adds each adapter's
x A.T B.T to its own rows (offload/weights.py LoraLinear) beside the base matmul.

Adapters are read when a request first names them and kept while there is room, charged to the
compute device's budget ("LoRA adapters"): where a new one does not fit, the least recently
requested adapters that no unfinished or queued request uses are dropped first (vLLM's LRU of
adapter slots), so a job of many adapters holds those of its current batch, not all it ever named.
A request names an adapter by `lora_int_id` (a positive integer); the same id with another name or
folder is refused, as vLLM refuses it.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats.lora_adapter import open_adapter
from offload.memory import MemoryBudgetError, MemoryTracker


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: which adapter a request runs with. lora_path: a folder PEFT's
    save_pretrained wrote (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise FlexSarathiError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise FlexSarathiError(f"LoRARequest.lora_int_id must be an integer >= 1 (its id in the engine), "
                                   f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise FlexSarathiError(f"LoRARequest.lora_path must be an adapter folder, got {self.lora_path!r}")


def module_requests(modules: dict[str, str]) -> dict[str, LoRARequest]:
    """Named adapters ({name: folder}: --lora-modules, build_processor's lora_modules) as the
    LoRARequests their requests run with, ids in their order (1, 2, ...)."""
    return {name: LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(modules.items())}


@dataclass(frozen=True)
class LoadedAdapter:
    request: LoRARequest
    fingerprint: str  # its files' identities and scale (prefix-cache digests start from it)
    nbytes: int


class LoraAdapters:
    """The adapters one engine serves: `factors[id][layer]` = {weight: (A, B)} on the compute device,
    which the executor reads for the rows of each id (offload/weights.py with_lora)."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device, memory: MemoryTracker, factors: dict,
                 in_use: Callable[[], set[int]]):
        """factors: the dict the executor reads (PassExecutor.lora_factors), filled here; in_use: the
        ids of the adapters that the engine's unfinished and queued requests run with (kept)."""
        self.model, self.dtype, self.device, self.memory = model, dtype, device, memory
        self.factors: dict[int, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = factors
        self.in_use = in_use
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently requested first
        self.requested: set[int] = set()  # since the last batch was added: its sequences are being made

    def load(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter `request` names, read on its first request; FlexSarathiError (CheckpointError) where
        it cannot be served: not an adapter of this model, its id taken by another, no room for it."""
        if not isinstance(request, LoRARequest):
            raise FlexSarathiError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        known = self.loaded.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, os.path.abspath(known.request.lora_path)) != (
                    request.lora_name, os.path.abspath(request.lora_path)):
                raise FlexSarathiError(f"LoRARequest id {request.lora_int_id} is {known.request.lora_name!r} "
                                       f"({known.request.lora_path}) in this engine; {request.lora_name!r} "
                                       f"({request.lora_path}) needs an id of its own")
            self.loaded.move_to_end(request.lora_int_id)
            self.requested.add(request.lora_int_id)
            return known
        adapter = open_adapter(str(request.lora_path))
        layers = adapter.layer_factors(self.model, self.dtype)
        nbytes = sum(t.numel() * t.element_size() for factors in layers for pair in factors.values() for t in pair)
        self._reserve(request, nbytes)
        self.factors[request.lora_int_id] = [{name: (a.to(self.device), b.to(self.device))
                                              for name, (a, b) in factors.items()} for factors in layers]
        loaded = self.loaded[request.lora_int_id] = LoadedAdapter(request, adapter.fingerprint, nbytes)
        self.requested.add(request.lora_int_id)
        return loaded

    def drop_idle(self, keep: set[int]) -> bool:
        """Drops every adapter that neither `keep` nor an unfinished request uses; whether any was."""
        idle = [i for i in self.loaded if i not in keep | self.in_use()]
        for adapter_id in idle:
            self._drop(adapter_id)
        return bool(idle)

    def batch_added(self) -> None:
        """The sequences made since the last call are queued: they (in_use) hold their adapters now."""
        self.requested.clear()

    def _reserve(self, request: LoRARequest, nbytes: int) -> None:
        """Room for `nbytes` of factors, dropping idle adapters (least recently requested first) while
        it is short; FlexSarathiError where it stays short."""
        while True:
            try:
                self.memory.reserve("gpu", nbytes, "LoRA adapters")
                return
            except MemoryBudgetError as short:
                used = self.in_use() | self.requested
                idle = next((i for i in self.loaded if i not in used), None)
                if idle is None:
                    held = f"; the {len(self.loaded)} held are all in use" if self.loaded else ""
                    raise FlexSarathiError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) does not fit "
                                           f"beside the model on the compute device{held}: {short}") from None
                self._drop(idle)

    def _drop(self, adapter_id: int) -> None:
        self.memory.release("gpu", self.loaded.pop(adapter_id).nbytes, "LoRA adapters")
        del self.factors[adapter_id]

    def close(self) -> None:
        """Frees every adapter and its reservation."""
        for adapter_id in list(self.loaded):
            self._drop(adapter_id)

