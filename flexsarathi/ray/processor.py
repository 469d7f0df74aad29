"""`build_processor`: FlexSarathi as a stage of a user's own Ray Data pipeline (the shape of
Ray's `build_llm_processor`): rows with a `prompt` column (text, or a list of token ids) in,
the same rows with the generated columns out (with task="embed": the embedding columns). With
`lora_modules` ({name: adapter folder}), a row's `model` column names the LoRA adapter it runs with
(None or the base model's name: none), as Ray's vLLM processor reads it."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa
import ray.data

from flexsarathi.errors import FlexSarathiError
from flexsarathi.ray.actors import EngineActor, map_with_engines
from flexsarathi.ray.spec import EngineSpec, job_dtype
from flexsarathi.engine.lora_requests import module_requests
from flexsarathi.engine.pooling import BATCH_TASKS, PoolingParams
from flexsarathi.engine.sampling import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason", "num_input_tokens",
                  "num_generated_tokens", "error")
EMBEDDING_COLUMNS = ("embeddings", "num_input_tokens", "error")  # task="embed"


@dataclass(frozen=True)
class Processor:
    """processor(dataset) -> dataset: maps every row through one of `concurrency` engines."""

    spec: EngineSpec
    sampling: SamplingParams | PoolingParams  # PoolingParams: an embedding engine's
    concurrency: int = 1
    num_gpus: float = 0
    num_cpus: float = 1
    batch_size: int = 16
    lora_modules: dict | None = None  # {name: adapter folder} a row's `model` selects

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        return map_with_engines(dataset, PromptProcessor, (self.spec, self.sampling, self.lora_modules),
                                actors=self.concurrency, batch_size=self.batch_size, num_cpus=self.num_cpus,
                                num_gpus=self.num_gpus)


def build_processor(model: str, *, sampling: SamplingParams | dict | None = None, policy=None, hardware=None,
                    workload=None, dtype=None, device=None, offload_dir: str | None = None, concurrency: int = 1,
                    num_gpus: float = 0, num_cpus: float = 1, batch_size: int = 16, seed: int = 0,
                    task: str = "generate", pooling: PoolingParams | dict | None = None,
                    lora_modules: dict[str, str] | None = None) -> Processor:
    """A Processor running `model` on `concurrency` actors (num_gpus / num_cpus each).

    sampling: SamplingParams or its fields as a dict (default SamplingParams()). task="embed": each
    row's embedding instead (EMBEDDING_COLUMNS; pooling: PoolingParams or its fields). policy: a Policy,
    a policy JSON, "auto" (searched here, once, for `hardware` and `workload`) or None (all on
    the compute device). offload_dir: a folder on every node; each actor claims actor-<k> in it.
    batch_size: rows per actor call; the engine's scheduler forms its passes within a batch.
    lora_modules: {name: PEFT adapter folder (the same path on every node)} served per request: a
    row's `model` column names its adapter (generate only)."""
    from flexsarathi.llm import LLM
    from policy_search import HardwareSpec
    from policy_search.policy import Policy

    params = _params_of(task, sampling, pooling)
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FlexSarathiError(f"build_processor({name}=...) must be an integer >= 1, got {value!r}")
    from flexsarathi.formats.opened_model import open_model

    dtype = job_dtype(dtype, open_model(model).source.config.checkpoint_dtype, device, num_gpus)  # one for all actors
    spec_hw = hardware if hardware is None or isinstance(hardware, HardwareSpec) else HardwareSpec.resolve(hardware, "hardware=")
    if policy == "auto":
        policy = LLM.search_policy(model, spec_hw, workload, dtype, task=task)
    elif isinstance(policy, str):
        policy = Policy.load(policy)
    modules = _lora_modules_of(task, lora_modules)
    spec = EngineSpec.of(model, policy, hardware=spec_hw, dtype=dtype, device=device, offload_dir=offload_dir,
                         seed=seed, task=task, **({"enable_lora": True} if modules else {}))
    return Processor(spec, params, concurrency, num_gpus, num_cpus, batch_size, modules)


def _lora_modules_of(task: str, modules) -> dict[str, str] | None:
    """build_processor's lora_modules, checked (their folders read: an adapter of another model fails here)."""
    if not modules:
        return None
    if task != "generate":
        raise FlexSarathiError(f"build_processor(lora_modules=...) serves adapters to generate, not task={task!r}")
    if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                for k, v in modules.items()):
        raise FlexSarathiError("build_processor(lora_modules=...) must be a dict {name: adapter folder}, "
                               f"got {modules!r}")
    from flexsarathi.cli.request_files import adapter_fingerprints  # noqa: PLC0415

    adapter_fingerprints(modules)
    return dict(modules)


def _params_of(task: str, sampling, pooling) -> SamplingParams | PoolingParams:
    """The params every row runs with; FlexSarathiError naming the argument that is wrong."""
    if task not in BATCH_TASKS:  # classification runs through LLM.classify
        raise FlexSarathiError(f"build_processor(task=...) must be one of {', '.join(BATCH_TASKS)}, got {task!r}")
    embeds = task == "embed"
    given, kind, name = (pooling, PoolingParams, "pooling") if embeds else (sampling, SamplingParams, "sampling")
    if (sampling if embeds else pooling) is not None:
        raise FlexSarathiError(f"build_processor({'sampling' if embeds else 'pooling'}=...) does not go with "
                               f"task={task!r}")
    if isinstance(given, dict):
        given = kind(**given)
    if given is not None and not isinstance(given, kind):
        raise FlexSarathiError(f"build_processor({name}=...) must be a {kind.__name__} or a dict, "
                               f"got {type(given).__name__}")
    return given or kind()


class PromptProcessor(EngineActor):
    def __init__(self, spec: EngineSpec, sampling: SamplingParams, lora_modules: dict | None = None):
        super().__init__(spec)
        self.sampling, self.lora_modules = sampling, lora_modules or {}
        self.base_names = {spec.model, os.path.basename(os.path.normpath(spec.model))}

    def _adapters(self, batch: pa.Table) -> list | None:
        """Each row's LoRARequest (None: the base model) from its `model` column; FlexSarathiError
        naming a model that is neither an adapter nor the base model."""
        if not self.lora_modules or "model" not in batch.column_names:
            return None
        named = module_requests(self.lora_modules)
        models = batch.column("model").to_pylist()
        for model in models:
            if model is not None and model not in self.base_names and model not in named:
                raise FlexSarathiError(f"build_processor: a row's model {model!r} is neither the base model nor "
                                       f"one of lora_modules ({', '.join(self.lora_modules)})")
        return [named.get(model) for model in models]

    def __call__(self, batch: pa.Table) -> pa.Table:
        if "prompt" not in batch.column_names:
            raise FlexSarathiError(f"build_processor: rows need a 'prompt' column (text or token ids); "
                                   f"they have {batch.column_names}")
        prompts = batch.column("prompt").to_pylist()
        outputs = dict(self.run(prompts, self.sampling, self._adapters(batch)))
        ordered = [outputs[i] for i in range(len(prompts))]
        if isinstance(self.sampling, PoolingParams):
            return _with_columns(batch, EMBEDDING_COLUMNS, {
                "embeddings": pa.array([o.outputs.embedding if o.error is None else None for o in ordered],
                                       pa.list_(pa.float32())),
                "num_input_tokens": pa.array([len(o.prompt_token_ids) for o in ordered], pa.int64()),
                "error": pa.array([o.error for o in ordered], pa.string())})
        return _with_columns(batch, OUTPUT_COLUMNS, {
            "generated_text": pa.array([o.text if o.error is None else None for o in ordered], pa.string()),
            "generated_token_ids": pa.array([o.token_ids for o in ordered], pa.list_(pa.int64())),
            "finish_reason": pa.array([o.finish_reason for o in ordered], pa.string()),
            "num_input_tokens": pa.array([len(o.prompt_token_ids) for o in ordered], pa.int64()),
            "num_generated_tokens": pa.array([len(o.token_ids) for o in ordered], pa.int64()),
            "error": pa.array([o.error for o in ordered], pa.string())})


def _with_columns(batch: pa.Table, names: tuple, columns: dict) -> pa.Table:
    """The batch's own columns (those of these names replaced) and `columns` after them."""
    kept = batch.drop_columns([c for c in names if c in batch.column_names])
    for name, column in columns.items():
        kept = kept.append_column(name, column)
    return kept
