"""One batch through the machinery of `flexsarathi generate`: its input file read by the same parser
(request_files), each request prepared and recorded by generate's own functions, the records
appended to a ResultFile (flushed one by one, resumed after a crash with no request run twice).
Only the ends differ: the engine is the server's, built once, and the result file is split into
OpenAI's output file (successes) and error file when the batch ends."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

from flexsarathi.cli.embedding_requests import job_lines, run_lines
from flexsarathi.cli.generate import _prepare, _recorder, request_chunks
from flexsarathi.cli.request_files import (BatchRequest, error_record, is_error_record, read_requests, request_url,
                                          route_to_adapters)
from flexsarathi.cli.result_file import ResultFile
from flexsarathi.errors import FlexSarathiError
from flexsarathi.serve.schemas import Batch, BatchError, BatchErrors, RequestCounts
from flexsarathi.serve.store import Store

MAX_REQUESTS = 50_000  # per batch, OpenAI's limit
# A batch's creation reads its input file whole, and the parsed requests hold about 4x the file's
# bytes (44.2 MiB of requests: 187 MiB; a 200 MiB upload, --max-file-mib's default: ~850 MiB).
# Creates run in FastAPI's thread pool (40 threads): at most this many read at once, the others wait
# their turn, so many parallel creates of large files cannot exhaust the server's memory together.
READING_AT_ONCE = 2
_reading = threading.BoundedSemaphore(READING_AT_ONCE)


@dataclass(frozen=True)
class ServeEngine:
    """What every batch of one server runs on."""

    llm: object  # flexsarathi.LLM, built once at startup
    model_name: str  # as records and /v1/models name it (the checkpoint folder's name, as generate writes)
    meta: dict  # what produced a result file (model, weights, dtype, seed, sampling): a restart must match
    sampling: dict  # SamplingParams defaults for fields a request body leaves out
    seed: int  # a request without its own seed samples with one derived from this and its custom_id
    tool_call_parser: str | None = None  # the format tool calls are read in (None: the chat template's)
    task: str = "generate"  # "embed": an embedding engine, its batches for /v1/embeddings
    lora_modules: dict = field(default_factory=dict)  # --lora-modules {name: folder}: a body's model selects one


class InputFileError(FlexSarathiError):
    """The input file as a whole cannot make a batch: the Batch object's `errors`."""

    def __init__(self, errors: list[BatchError]):
        super().__init__("; ".join(e.message for e in errors[:3]))
        self.errors = errors


def read_batch_requests(path: str, file_id: str) -> list[BatchRequest]:
    """The input file's requests, one per non-blank line, in OpenAI Batch format. A line that cannot
    run is a request with its error (it becomes an error record); InputFileError when the file
    cannot be read at all."""
    try:
        _, requests = read_requests(path, "openai")
    except FlexSarathiError as exc:
        message = str(exc).replace(f"--input {path}", f"input file {file_id}")
        raise InputFileError([BatchError(code="invalid_file", message=message)]) from None
    return requests


def validate_input(path: str, file_id: str, endpoint: str) -> int:
    """The number of requests in a batch's input file; InputFileError with every line that makes
    it unusable (OpenAI's batch `errors`): no request, too many, a custom_id used twice, a line
    for another endpoint than the batch's. At most READING_AT_ONCE run at once."""
    with _reading:
        return _count_requests(read_batch_requests(path, file_id), file_id, endpoint)


def _count_requests(requests: list[BatchRequest], file_id: str, endpoint: str) -> int:
    errors = []
    if not requests:
        errors.append(BatchError(code="empty_file", message=f"input file {file_id} has no request"))
    if len(requests) > MAX_REQUESTS:
        errors.append(BatchError(code="too_many_requests", message=f"input file {file_id} has "
                                 f"{len(requests)} requests; a batch holds at most {MAX_REQUESTS}"))
    first_line: dict[str, int] = {}
    for req in requests:
        if req.id is not None and first_line.setdefault(req.key, req.line) != req.line:
            errors.append(BatchError(code="duplicate_custom_id", param="custom_id", line=req.line,
                                     message=f"custom_id {req.id!r} on line {req.line} was used on line "
                                             f"{first_line[req.key]}: custom_ids must be unique"))
        url = request_url(req)
        if req.error is None and url != endpoint:
            errors.append(BatchError(code="mismatched_endpoint", param="url", line=req.line,
                                     message=f"line {req.line} is for {url}, the batch for {endpoint}"))
    if errors:
        raise InputFileError(errors)
    return len(requests)


def run_batch(engine: ServeEngine, store: Store, batch: Batch, stop: Callable[[], bool]) -> bool:
    """Run the batch's requests that its result file lacks, a chunk of them at a time (generate's
    request_chunks: a batch of 50,000 lines of n = 1024 would hold 51 million sequences at once);
    True when every one has a record, False when `stop` ended it at a pass boundary (the finished
    records are kept). A record that cannot be written (a full disk) raises: the engine's run is
    closed, nothing left queued, and the records before it stay whole (a torn last line is cut off
    when the file is opened again)."""
    requests = read_batch_requests(store.file_path(batch.input_file_id), batch.input_file_id)
    route_to_adapters(requests, engine.lora_modules, {engine.model_name, engine.meta["model"]})
    out = open_results(engine, store, batch.id)
    try:
        store.update_batch(batch.id, request_counts=RequestCounts(
            total=len(requests), completed=len(out.done) - out.errors, failed=out.errors))
        record = _recorder("openai", out, engine.llm.tokenizer, engine.model_name)
        for chunk in request_chunks([r for r in requests if r.key not in out.done]):
            if not _run_chunk(engine, store, batch.id, chunk, out, record, stop):
                return False
        return True
    finally:
        out.close()


def _run_chunk(engine: ServeEngine, store: Store, batch_id: str, chunk: list[BatchRequest], out: ResultFile,
               record, stop: Callable[[], bool]) -> bool:
    """One chunk's requests: their records written as they finish; False where `stop` ended it."""
    params = {r.key: _prepare(r, engine.llm.tokenizer, engine.sampling, engine.seed, engine.tool_call_parser)
              for r in chunk}
    for req in chunk:
        if req.error:  # a line that cannot run: its error record, as generate writes it
            out.append(error_record("openai", req, req.error))
            store.count_requests(batch_id, failed=1)
    runnable = [r for r in chunk if not r.error]
    finished = 0
    for failed in run_lines(engine.llm, job_lines(engine.task, runnable), params, record, use_tqdm=False, stop=stop,
                            lora_modules=engine.lora_modules):
        store.count_requests(batch_id, completed=1 - failed, failed=failed)
        finished += 1
    return finished == len(runnable)


def open_results(engine: ServeEngine, store: Store, batch_id: str) -> ResultFile:
    """The batch's result file, resumed where it ends (a torn last line cut off and redone)."""
    path = store.results_path(batch_id)
    meta = {**engine.meta, "batch": batch_id}
    try:
        with open(path + ".meta.json", encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = meta  # a new batch (ResultFile refuses a result file whose meta was lost)
    changed = sorted(k for k in set(meta) | set(old) if meta.get(k) != old.get(k))
    if changed:
        diffs = "; ".join(f"{k}: {old.get(k)!r} -> {meta.get(k)!r}" for k in changed)
        raise FlexSarathiError(f"its finished records were written by a server with another configuration "
                               f"({diffs}); restart the server with that configuration to finish it")
    return ResultFile(path, "openai", meta)


def finalize(engine: ServeEngine, store: Store, batch_id: str, status: str,
             errors: list[BatchError] | None = None) -> Batch:
    """End a batch in `status`: its result file split into the output file (successes) and the
    error file, each made only when it has a record; the counts recounted from the file."""
    lines = {False: [], True: []}
    if os.path.exists(store.results_path(batch_id)):
        open_results(engine, store, batch_id).close()  # cuts a torn last line (a kill -9 mid-append)
        with open(store.results_path(batch_id), "rb") as f:
            for raw in f:
                lines[is_error_record(json.loads(raw))].append(raw)
    files = {kind: store.add_output(batch_id, kind, b"".join(lines[failed])).id if lines[failed] else None
             for kind, failed in (("output", False), ("error", True))}
    counts = store.get_batch(batch_id).request_counts
    fields = {"status": status, "output_file_id": files["output"], "error_file_id": files["error"],
              "request_counts": RequestCounts(total=max(counts.total, len(lines[False]) + len(lines[True])),
                                              completed=len(lines[False]), failed=len(lines[True]))}
    if errors:
        fields["errors"] = BatchErrors(data=errors)
    return store.update_batch(batch_id, **fields)
