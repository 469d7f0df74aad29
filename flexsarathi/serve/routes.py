"""The endpoints: OpenAI's Files API (purpose `batch`), Batches API and model list. Each reads or
changes records in the store (app.state.store) and returns at once; the runner does the work.

Endpoints that only read records in memory are `async` (run on the event loop: no thread hop, the
least time taken from the engine's thread while clients poll); those that read or write files
(upload, create, cancel, delete) are plain functions, run in FastAPI's thread pool."""
from __future__ import annotations

import os
import re
import time
import uuid
from typing import Literal
from urllib.parse import quote, unquote_to_bytes

from fastapi import File, Form, Query, Request, UploadFile
from fastapi.responses import Response, StreamingResponse
from python_multipart.multipart import parse_options_header

from flexsarathi.cli.embedding_requests import EMBEDDINGS_URL
from flexsarathi.serve.batch_job import InputFileError, validate_input
from flexsarathi.serve.schemas import (FINAL_STATUSES, Batch, BatchCreate, BatchErrors, BatchList, FileDeleted,
                                       FileList, FileObject, ModelCard, ModelList, RequestCounts)
from flexsarathi.serve.store import FileTooLarge, StorageFull


SMALL_FILE_BYTES = 1 << 20  # downloads up to this size are answered from one read
DOWNLOAD_CHUNK = 1 << 20


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# ---- files --------------------------------------------------------------------------------------
def upload_file(request: Request, file: UploadFile | str = File(...), purpose: str = Form(...)) -> FileObject:
    if isinstance(file, str):  # a part without filename="...": the multipart parser made it a text field
        raise ApiError(400, "file must be a file part: its Content-Disposition needs filename=\"NAME\" (UTF-8); "
                       "this one has none, or only RFC 5987's filename*=, which multipart/form-data does not "
                       "use (RFC 7578, section 4.2): send the name as filename=\"NAME\"", "file")
    if purpose != "batch":
        raise ApiError(400, f"purpose must be 'batch' (this server runs batches), got {purpose!r}", "purpose")
    limit = request.app.state.max_file_bytes
    try:
        return request.app.state.store.add_upload(file.file, _upload_name(file), purpose, limit)
    except FileTooLarge:
        raise ApiError(413, f"the file is over this server's limit of {limit} bytes (--max-file-mib)",
                       "file", "file_too_large") from None
    except StorageFull as full:
        raise _storage_full(full) from None


def _storage_full(full: StorageFull) -> ApiError:
    """413, a client's to fix as an oversized file is (and not retried, as the openai client retries 5xx):
    the files it keeps here fill the server's quota, and deleting some makes room."""
    pending = f", and {full.pending} more are being uploaded" if full.pending else ""
    return ApiError(413, f"the server's storage limit is {full.limit} bytes (--max-storage-mib): "
                    f"{full.stored} bytes are stored in {full.files} file{'s' * (full.files != 1)} (uploads and "
                    f"batch outputs){pending}, "
                    f"and this file needs at least {full.needed}; nothing was kept. Delete files you no longer "
                    "need (DELETE /v1/files/{file_id}) and upload it again", "file", "storage_limit_exceeded")


def _upload_name(file: UploadFile) -> str:
    """The upload's name as its client wrote it, read from the part's own header: filename="..." as
    UTF-8 (what RFC 7578, browsers, curl and the openai client send), or RFC 5987's filename*= where a
    client sends one beside it (a plain ASCII fallback and the real name). The multipart parser reads
    the name in the charset the request declares, Latin-1 where it does not decode: mojibake, or with
    charset=utf-7 a lone surrogate that made every later listing of files a 500."""
    disposition = file.headers.getlist("content-disposition")[-1].encode("latin-1")  # the parser's, as sent
    extended = _extended_filename(disposition)
    if extended is not None:
        return extended
    name = parse_options_header(disposition)[1].get(b"filename", b"")
    try:
        return name.decode("utf-8") or "upload.jsonl"
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the file name {name[:60]!r} is not UTF-8 (byte {exc.start}): send it UTF-8 "
                       "encoded", "file") from None


def _extended_filename(disposition: bytes) -> str | None:
    """The name in a filename*=CHARSET'LANG'PERCENT-ENCODED parameter (RFC 5987: UTF-8 or ISO-8859-1),
    None without one."""
    unquoted = re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', disposition)  # a quoted name may hold "; filename*="
    found = re.search(rb"(?:^|;)\s*filename\*\s*=\s*([^;\s]*)", unquoted, re.IGNORECASE)
    if found is None:
        return None
    charset, _, rest = found[1].partition(b"'")
    _, quote_seen, encoded = rest.partition(b"'")
    name = ""
    if quote_seen and charset.lower() in (b"utf-8", b"iso-8859-1"):
        try:
            name = unquote_to_bytes(encoded).decode(charset.decode())
        except UnicodeDecodeError:
            pass
    if not name:
        raise ApiError(400, f"filename*={found[1][:80].decode('latin-1')!r} is not RFC 5987's UTF-8''NAME "
                       "(NAME: UTF-8, percent-encoded) or ISO-8859-1''NAME", "file")
    return name


async def list_files(request: Request, purpose: str | None = None, order: Literal["asc", "desc"] = "desc",
               after: str | None = None, limit: int = Query(10_000, ge=1, le=10_000)) -> FileList:
    page, has_more = _page(request.app.state.store.list_files(purpose, order), after, limit)
    return FileList(data=page, has_more=has_more, first_id=page[0].id if page else None,
                    last_id=page[-1].id if page else None)


async def retrieve_file(request: Request, file_id: str) -> FileObject:
    return _file(request, file_id)


async def file_content(request: Request, file_id: str) -> Response:
    found = _file(request, file_id)
    try:  # opened before anything is sent: a delete from now on unlinks a file this download still reads
        data_file = open(request.app.state.store.file_path(found.id), "rb")
    except FileNotFoundError:  # deleted since the lookup
        raise ApiError(404, f"No such File object: {file_id}", "id") from None
    headers = {"content-disposition": _attachment(found.filename)}
    if found.bytes <= SMALL_FILE_BYTES:  # one read from the page cache: no thread hops
        with data_file:
            return Response(data_file.read(), media_type="application/jsonl", headers=headers)
    headers["content-length"] = str(os.fstat(data_file.fileno()).st_size)
    return StreamingResponse(_chunks(data_file), media_type="application/jsonl", headers=headers)


def _chunks(data_file):
    """A file's bytes in chunks (a plain generator: Starlette reads it off the event loop)."""
    with data_file:
        while chunk := data_file.read(DOWNLOAD_CHUNK):
            yield chunk


def _attachment(filename: str) -> str:
    """Content-Disposition for a client's file name, as Starlette's FileResponse writes it: RFC
    5987's percent-encoded form unless quoting leaves the name as it is. Written raw, a character
    beyond Latin-1 fails the response (a 500), a quote ends the name early, and CR or LF (or any
    control character) makes uvicorn drop the connection."""
    encoded = quote(filename)
    return f'attachment; filename="{filename}"' if encoded == filename else f"attachment; filename*=utf-8''{encoded}"


def delete_file(request: Request, file_id: str) -> FileDeleted:
    store = request.app.state.store
    with store.lock:
        _file(request, file_id)
        user = store.batch_using(file_id)
        if user is not None:
            raise ApiError(409, f"file {file_id} is the input of batch {user.id} ({user.status}): cancel it "
                           "or let it end first", "file_id")
        store.delete_file(file_id)
    request.app.state.runner.retry_paused()  # space freed: batches a full disk paused go on
    return FileDeleted(id=file_id)


def _file(request: Request, file_id: str) -> FileObject:
    found = request.app.state.store.get_file(file_id)
    if found is None:
        raise ApiError(404, f"No such File object: {file_id}", "id")
    return found


# ---- batches ------------------------------------------------------------------------------------
def create_batch(request: Request, body: BatchCreate) -> Batch:
    """Validated here (the input file read whole): a file that cannot make a batch gives a failed
    batch with its `errors`; a good one is queued in_progress and its requests run in turn."""
    state = request.app.state
    source = _input_file(state.store, body.input_file_id)
    embeds = state.engine.task == "embed"
    if embeds != (body.endpoint == EMBEDDINGS_URL):
        raise ApiError(400, f"this server {'embeds' if embeds else 'generates'} (flexsarathi serve --task "
                            f"{'embed' if embeds else 'generate'}): its batches are for "
                            f"{EMBEDDINGS_URL if embeds else '/v1/completions or /v1/chat/completions'}", "endpoint")
    batch = Batch(id="batch_" + uuid.uuid4().hex[:24], endpoint=body.endpoint, model=state.engine.model_name,
                  input_file_id=body.input_file_id, completion_window=body.completion_window,
                  status="validating", created_at=int(time.time()), metadata=body.metadata)
    try:
        total = validate_input(state.store.file_path(source.id), source.id, body.endpoint)
        now = int(time.time())
        batch = batch.model_copy(update={"status": "in_progress", "in_progress_at": now,
                                         "request_counts": RequestCounts(total=total)})
    except InputFileError as exc:
        batch = batch.model_copy(update={"status": "failed", "failed_at": int(time.time()),
                                         "errors": BatchErrors(data=exc.errors)})
    with state.store.lock:  # a delete checks for batches under this lock: it now refuses, or it came first
        _input_file(state.store, body.input_file_id)  # not deleted while it was read
        batch = state.store.add_batch(batch)
    state.runner.wake()
    return batch


def _input_file(store, file_id: str) -> FileObject:
    source = store.get_file(file_id)
    if source is None or source.purpose != "batch":
        what = "No such File object" if source is None else f"File with purpose {source.purpose!r}, not 'batch':"
        raise ApiError(400, f"{what} {file_id}", "input_file_id")
    return source


async def retrieve_batch(request: Request, batch_id: str) -> Batch:
    # What clients poll: serialized once by pydantic, without FastAPI validating it again on the way out.
    return Response(_batch(request, batch_id).model_dump_json(), media_type="application/json")


async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> BatchList:
    page, has_more = _page(request.app.state.store.list_batches(), after, limit)
    return BatchList(data=page, has_more=has_more, first_id=page[0].id if page else None,
                     last_id=page[-1].id if page else None)


def cancel_batch(request: Request, batch_id: str) -> Batch:
    batch = _batch(request, batch_id)
    if batch.status in FINAL_STATUSES:
        raise ApiError(409, f"batch {batch_id} is {batch.status}: only a batch that has not ended can be "
                       "cancelled", "batch_id")
    return request.app.state.runner.cancel(batch_id)


def _batch(request: Request, batch_id: str) -> Batch:
    found = request.app.state.store.get_batch(batch_id)
    if found is None:
        raise ApiError(404, f"No such Batch object: {batch_id}", "batch_id")
    return found


async def list_models(request: Request) -> ModelList:
    """The served model and its --lora-modules adapters (a batch line's body.model picks one)."""
    engine, started = request.app.state.engine, request.app.state.started
    return ModelList(data=[ModelCard(id=name, created=started) for name in (engine.model_name, *engine.lora_modules)])


def _page(items: list, after: str | None, limit: int) -> tuple[list, bool]:
    """OpenAI's cursor pagination: the `limit` items after the one whose id is `after`."""
    start = 0
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise ApiError(400, f"after={after!r} names no object of this list", "after")
        start = ids.index(after) + 1
    return items[start:start + limit], start + limit < len(items)


# (method, path, endpoint): app.py registers them, the upload with its own body limit.
ROUTES = (("POST", "/v1/files", upload_file), ("GET", "/v1/files", list_files),
          ("GET", "/v1/files/{file_id}", retrieve_file), ("GET", "/v1/files/{file_id}/content", file_content),
          ("DELETE", "/v1/files/{file_id}", delete_file),
          ("POST", "/v1/batches", create_batch), ("GET", "/v1/batches", list_batches),
          ("GET", "/v1/batches/{batch_id}", retrieve_batch), ("POST", "/v1/batches/{batch_id}/cancel", cancel_batch),
          ("GET", "/v1/models", list_models))
