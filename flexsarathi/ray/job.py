"""The driver of `flexsarathi generate --ray`: the requests (already validated, tokenized and
given their SamplingParams by the CLI) go through a Ray Data pipeline of RequestRunner actors,
and every output comes back to `on_output` as it finishes, which appends its record to the
result file exactly as the single-process run does. Only where requests execute differs."""
from __future__ import annotations

import logging
import math
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Callable

import ray
import ray.data
from tqdm.auto import tqdm

from flexsarathi.errors import FlexSarathiError
from flexsarathi.ray.actors import STATS_INDEX, RequestRunner, map_with_engines
from flexsarathi.ray.spec import EngineSpec

LOCAL_OBJECT_STORE_BYTES = 512 << 20  # requests and outputs are small: token ids and text
BATCH_PER_RUNNING = 8  # default batch: at most 8x the policy's running sequences per actor call


class RayJobError(FlexSarathiError):
    """The Ray job stopped partway (an actor or node lost, an actor that could not start)."""


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None  # None: start a local instance sized to this machine
    actors: int = 1
    gpus_per_actor: float = 0
    cpus_per_actor: float = 1
    batch_size: int | None = None


def default_batch_size(requests: int, actors: int, max_running: int) -> int:
    """The job split evenly over the actors (each engine gets work at once), capped so a batch
    stays a few times what the engine runs at once and late actors can still take work."""
    return max(1, min(math.ceil(requests / actors), BATCH_PER_RUNNING * max_running))


def run_requests(spec: EngineSpec, options: RayOptions, requests: list[tuple[object, object, object]],
                 on_output: Callable[[int, object], None], say=print, progress: bool = True) -> dict:
    """Runs requests [(prompt, SamplingParams or PoolingParams, LoRARequest or None)] on
    options.actors engines; calls on_output(index, RequestOutput) for each as it comes back.
    Returns the job's statistics (the keys of LLM.last_stats, summed over batches; seconds = wall
    time on this driver)."""
    started = connect(options.address)
    try:
        batch = options.batch_size or default_batch_size(len(requests), options.actors,
                                                         _max_running(spec))
        dataset = _pipeline(spec, options, requests, batch)
        say(f"ray: {options.actors} actor(s) x {options.cpus_per_actor:g} CPU, {options.gpus_per_actor:g} GPU; "
            f"{math.ceil(len(requests) / batch)} batches of <= {batch} requests; cluster "
            f"{_cluster_summary()}")
        return _collect(dataset, len(requests), on_output, say, progress)
    finally:
        if started:
            ray.shutdown()


def connect(address: str | None) -> bool:
    """Connects to the cluster at `address`, or starts a local instance; False when this
    process was already connected (a user's program), which then stays connected."""
    if ray.is_initialized():
        return False
    common = dict(log_to_driver=False, logging_level=logging.ERROR)
    try:
        if address is None:
            ray.init(address="local", num_cpus=os.cpu_count(), object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                     include_dashboard=False, **common)
        else:
            ray.init(address=address, **common)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        hint = ("; a cluster with Ray's token authentication needs RAY_AUTH_MODE=token and its token "
                "(~/.ray/auth_token or RAY_AUTH_TOKEN) here" if "Authentication" in repr(exc.__cause__) else "")
        raise FlexSarathiError(f"cannot start or reach {where}: {_first_line(exc)}{hint}") from None
    for name in ("ray", "ray.data"):  # the CLI reports a failure itself, in one line
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return True


def _pipeline(spec: EngineSpec, options: RayOptions, requests: list, batch: int) -> ray.data.Dataset:
    rows = [{"index": i, "payload": pickle.dumps(request)} for i, request in enumerate(requests)]
    dataset = ray.data.from_items(rows, override_num_blocks=math.ceil(len(rows) / batch))  # a block = a batch
    context = dataset.context  # this dataset's own copy: a user's settings stay as they are
    context.enable_progress_bars = False  # the driver shows one bar over requests
    context.print_on_execution_start = False
    context.target_max_block_size = 1  # hand each yielded chunk back at once (no buffering to 128 MiB)
    return map_with_engines(dataset, RequestRunner, (spec,), actors=options.actors, batch_size=batch,
                            num_cpus=options.cpus_per_actor, num_gpus=options.gpus_per_actor,
                            max_tasks_in_flight=1)  # a batch waits for a free engine, not behind a busy one


def _collect(dataset, total: int, on_output, say, progress: bool) -> dict:
    bar = tqdm(total=total, desc="generate (ray)", unit="req", disable=not progress)
    batches: list[dict] = []
    start = time.perf_counter()
    generated, recorded = 0, set()
    try:
        for index, blob in _rows(dataset):
            if index == STATS_INDEX:
                batches.append(pickle.loads(blob))
                continue
            if index in recorded:  # never twice in the output, whatever Ray retried
                continue
            recorded.add(index)
            output = pickle.loads(blob)
            on_output(index, output)
            # an embedding (EmbeddingRequestOutput: one EmbeddingOutput, or None) generates nothing
            generated += sum(len(c.token_ids) for c in output.outputs) if isinstance(output.outputs, list) else 0
            bar.update(1)
            bar.set_postfix_str(f"gen {generated / (time.perf_counter() - start):.1f} tok/s", refresh=False)
    finally:
        bar.close()
    stats = _job_stats(batches, time.perf_counter() - start)
    say(f"ray: {len(batches)} batches on {stats['actors']} actor(s) ({', '.join(stats['devices'])}), "
        f"{stats['nodes']} node(s); seconds = wall time on the driver, actor start-up included")
    return stats


def _rows(dataset):
    """(index, blob) pairs as actors hand them back; a Ray failure becomes RayJobError."""
    batches = iter(dataset.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=0))
    while True:
        try:
            table = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - whatever Ray raised, the job cannot go on
            raise RayJobError(f"the Ray job failed: {_reason(exc)}") from None
        yield from zip(table.column("index").to_pylist(), table.column("output").to_pylist())


def _job_stats(batches: list[dict], seconds: float) -> dict:
    prompt = sum(b["prompt_tokens"] for b in batches)
    generated = sum(b["generated_tokens"] for b in batches)
    memory: dict = {}
    for b in batches:
        for tier, entry in b["memory"].items():
            memory[tier] = {"peak": max(memory.get(tier, {}).get("peak", 0), entry["peak"])}
    actors = {b["actor"] for b in batches}
    return {"requests": sum(b["requests"] for b in batches), "failed": sum(b["failed"] for b in batches),
            "prompt_tokens": prompt, "generated_tokens": generated, "passes": sum(b["passes"] for b in batches),
            "prefix_cache_hit_tokens": sum(b.get("prefix_cache_hit_tokens", 0) for b in batches),
            "seconds": seconds, "tokens_per_s": generated / seconds if seconds else 0.0, "memory": memory,
            "actors": len(actors), "nodes": len({a.rsplit(":", 1)[0] for a in actors}),
            "devices": sorted({f"{b['device']} {b['dtype']}" for b in batches}), "batches": len(batches)}


def _max_running(spec: EngineSpec) -> int:
    from policy_search.policy import Policy

    return Policy.from_dict(spec.policy).max_running


def _cluster_summary() -> str:
    resources = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"{nodes} node(s), {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.ActorDiedError):
        text = str(exc)
        # "pid: 123" / "ip: 1.2.3.4" lines for a lost process, "(pid=123, ip=1.2.3.4, ...)" for a failed start
        pid, ip = (re.search(rf"\b{key}[:=] *([^\s,)]+)", text) for key in ("pid", "ip"))
        where = f"pid {pid[1] if pid else '?'} on {ip[1] if ip else '?'}"
        if exc.actor_init_failed:  # its __init__ raised: the traceback's last line says what
            last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
            return f"an actor ({where}) could not start: {last}"[:400]
        return f"an actor ({where}) died: its process was killed, ran out of memory or crashed, or its node was lost"
    cause = getattr(exc, "cause", None)
    return _first_line(cause if isinstance(cause, BaseException) else exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]
