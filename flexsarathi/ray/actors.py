"""The Ray Data callable classes: each actor owns one LLM, built once from an EngineSpec, and
runs every batch it is given through `LLM.generate_iter(on_error="record")`, so the engine's own
scheduler forms the passes (decode-maximal batching fills each engine) and a request that cannot
run comes back as an output with `.error` instead of failing the batch."""
from __future__ import annotations

import os
import pickle
import time
import warnings
from typing import Iterator

import pyarrow as pa
import ray
import ray.data

from flexsarathi.ray.spec import EngineSpec, claim_offload_folder

FLUSH_S = 1.0  # RequestRunner hands finished requests back at least this often (resume granularity)
STATS_INDEX = -1  # the index of the row that carries a batch's engine statistics


def map_with_engines(dataset, actor_class, constructor_args: tuple, *, actors: int, batch_size: int,
                     num_cpus: float, num_gpus: float, max_tasks_in_flight: int | None = None):
    """dataset.map_batches over a pool of `actors` engines. Ray Data restarts a lost actor and
    retries its batch by default; here a lost actor fails the job at once instead (the CLI keeps
    the finished records and a rerun resumes), so a batch that already handed back some requests
    never runs twice. Ray 2.60 has no named parameter for that yet (its own comment says to pass
    max_restarts=0), so its deprecation notice for the keyword is silenced here."""
    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return dataset.map_batches(
            actor_class, fn_constructor_args=constructor_args, batch_format="pyarrow", batch_size=batch_size,
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=max_tasks_in_flight),
            num_cpus=num_cpus, num_gpus=num_gpus or None, max_restarts=0)


class EngineActor:
    def __init__(self, spec: EngineSpec):
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        if cpus:  # torch threads = the cores Ray gave this actor
            torch.set_num_threads(max(1, int(cpus)))
        self.offload_dir, self._lock_fd = claim_offload_folder(spec.offload_dir)
        self.llm = spec.build(self.offload_dir)
        self.name = f"{ray.util.get_node_ip_address()}:{os.getpid()}"

    def run(self, prompts: list, params, lora_requests: list | None = None) -> Iterator:
        """(index, RequestOutput) as requests finish; (index, EmbeddingRequestOutput) on an engine
        of task "embed" (params: PoolingParams). lora_requests: each prompt's LoRARequest or None."""
        run = self.llm.embed_iter if self.llm.engine.engine_config.task == "embed" else self.llm.generate_iter
        adapters = lora_requests if lora_requests and any(lora_requests) else None
        return run(prompts, params, use_tqdm=False, on_error="record", lora_request=adapters)

    def batch_stats(self) -> dict:
        engine = self.llm.engine
        return {"actor": self.name, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                **self.llm.last_stats}

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


class RequestRunner(EngineActor):
    """`flexsarathi generate --ray`: rows {index, payload = pickle((prompt, SamplingParams, LoRARequest | None))}
    -> rows {index, output = pickle(RequestOutput)}, yielded as requests finish (at most FLUSH_S
    apart), then one row at STATS_INDEX with pickle(batch_stats())."""

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        indices = batch.column("index").to_pylist()
        requests = [pickle.loads(blob) for blob in batch.column("payload").to_pylist()]
        finished, last = [], time.monotonic()
        prompts, params, adapters = (list(column) for column in zip(*requests))
        for i, output in self.run(prompts, params, adapters):
            finished.append((indices[i], pickle.dumps(output)))
            if time.monotonic() - last >= FLUSH_S:
                yield _rows(finished)
                finished, last = [], time.monotonic()
        finished.append((STATS_INDEX, pickle.dumps(self.batch_stats())))
        yield _rows(finished)


def _rows(pairs: list[tuple[int, bytes]]) -> pa.Table:
    return pa.table({"index": pa.array([i for i, _ in pairs], pa.int64()),
                     "output": pa.array([blob for _, blob in pairs], pa.binary())})
