"""The FastAPI application: the routes of routes.py behind a bearer-token check (401) and request
bodies size-limited (413), both checked before a body is read, every error in OpenAI's shape (a
full disk a 507), and the batch runner started and stopped with the application."""
from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

import uvicorn

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from python_multipart.exceptions import MultipartParseError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from flexsarathi.errors import FlexSarathiError, in_chain
from flexsarathi.serve.batch_job import ServeEngine
from flexsarathi.serve.routes import ROUTES, ApiError
from flexsarathi.serve.runner import BatchRunner
from flexsarathi.serve.store import Store, disk_full

# Bodies other than uploads (a batch's creation) are small JSON objects.
MAX_JSON_BYTES = 1 << 20
# multipart framing around the file (boundaries, part headers, the purpose field)
MULTIPART_SLACK = 64 << 10


def create_app(store: Store, engine: ServeEngine, api_key: str | None, max_file_bytes: int) -> FastAPI:
    app = FastAPI(title="FlexSarathi batch server", lifespan=_lifespan)
    app.state.store, app.state.engine, app.state.api_key = store, engine, api_key
    app.state.runner = BatchRunner(store, engine)
    app.state.max_file_bytes, app.state.started = max_file_bytes, int(time.time())
    router = APIRouter()
    for method, path, endpoint in ROUTES:
        router.add_api_route(path, endpoint, methods=[method])
    app.include_router(router)
    app.add_middleware(RequestGate, api_key=api_key, max_file_bytes=max_file_bytes)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for failure in (OSError, FlexSarathiError):
        app.add_exception_handler(failure, _disk_full_or_unexpected)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


class RequestGate:
    """A request without the server's key gets one 401, before any of its body is read (as a route's
    dependency, the check came after FastAPI had read and parsed the body: an unauthenticated upload
    of --max-file-mib was spooled to disk whole before its 401). Bodies over their limit (an
    upload's: the file plus its multipart framing; any other: MAX_JSON_BYTES) get one 413 in
    OpenAI's shape: at once when Content-Length declares one, nothing read, else as the bytes read
    pass it. (FastAPI's own max_body_size answers a declared one in plain text, which the openai
    client cannot read.)"""

    def __init__(self, app, api_key: str | None, max_file_bytes: int):
        self.app, self.api_key, self.max_file_bytes = app, api_key, max_file_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not _authorized(headers.get("authorization", ""), self.api_key):
            return await _error_body(401, "Incorrect or missing API key: send the server's key as 'Authorization: "
                                     "Bearer KEY' (the openai client's api_key)", code="invalid_api_key")(
                scope, receive, send)
        upload = _is_upload(scope["method"], scope["path"])
        limit = self.max_file_bytes + MULTIPART_SLACK if upload else MAX_JSON_BYTES
        declared = headers.get("content-length", "")
        if declared.isdecimal() and int(declared) > limit:
            return await _too_large(upload, self.max_file_bytes)(scope, receive, send)
        received = 0

        async def receive_counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body, or one longer than it declared
                raise HTTPException(413)  # answered by _http_error
            return message

        await self.app(scope, receive_counted, send)


def _is_upload(method: str, path: str) -> bool:
    return method == "POST" and path.rstrip("/") == "/v1/files"


def _too_large(upload: bool, max_file_bytes: int) -> JSONResponse:
    limit = f"{max_file_bytes} bytes (--max-file-mib)" if upload else f"{MAX_JSON_BYTES} bytes"
    return _error_body(413, f"the request body is over this server's limit of {limit}", code="request_too_large")


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.runner.start()
    try:
        yield
    finally:
        await run_in_threadpool(app.state.runner.shutdown)


def _authorized(authorization: str, key: str | None) -> bool:
    """Bearer-token auth, as the openai client sends its api_key (when the server has a key)."""
    if key is None:
        return True
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _error_body(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Framework errors: unknown paths (404), wrong methods (405), bodies over the limit (413), bodies
    that cannot be parsed (400)."""
    if exc.status_code == 413:
        return _too_large(_is_upload(request.method, request.url.path), request.app.state.max_file_bytes)
    cause = exc.__cause__  # FastAPI's "There was an error parsing the body": JSON that json.loads gave up on
    if exc.status_code == 400 and disk_full(cause):  # an upload spooled to a full temporary folder
        return _disk_full_body(disk_full(cause))
    reason = _multipart_reason(exc)
    if exc.status_code == 400 and reason is not None:  # the framework says only "Invalid multipart data."
        return _error_body(400, f"the request body is not valid multipart/form-data: {reason} (offsets count "
                                "bytes of the body, characters are their byte values)")
    if exc.status_code == 400 and isinstance(cause, (RecursionError, ValueError)):
        why = "it nests deeper than the reader allows" if isinstance(cause, RecursionError) else str(cause)
        return _error_body(400, f"the request body is not JSON this server can read: {why.split(';')[0]}")
    return _error_body(exc.status_code, str(exc.detail))


def _multipart_reason(exc: BaseException) -> str | None:
    """python-multipart's own reason ("Expected boundary character 45, got 104 at index 2") where a
    multipart body could not be parsed, from the chain of exceptions under the framework's 400."""
    found = in_chain(exc, lambda e: isinstance(e, MultipartParseError))
    return None if found is None else str(found)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if _is_upload(request.method, request.url.path):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "multipart/form-data":  # else every such body is "file: Field required"
            return _error_body(400, "POST /v1/files takes multipart/form-data (a `file` part with a filename and "
                                    f"a `purpose` field, as the openai client sends); got Content-Type {kind!r}")
        if first["type"] == "missing" and first["loc"][-1] == "file":
            return _error_body(400, "file: Field required: the multipart body has no complete `file` part (a "
                                    "body cut short before a part's closing boundary loses that part)", "file")
    if first["type"] == "json_invalid":  # its loc is ("body", character offset): no field to name
        return _error_body(400, f"the request body is not valid JSON: {first['ctx']['error']} "
                                f"(at character {first['loc'][-1]})")
    where = ".".join(str(part) for part in first["loc"] if part not in ("body", "query", "path"))
    if not where and first["type"] == "string_unicode":  # a field's name (its loc is empty: no field to name)
        return _error_body(400, "a field name of the request body holds a lone surrogate: text must be valid "
                                "Unicode (in JSON, a \\ud800-\\udfff escape only as half of a pair)")
    if not where:  # the body itself: none at all, or JSON that is not an object
        return _error_body(400, "the request body must be a JSON object sent as application/json: "
                                f"{first['msg']}")
    return _error_body(400, f"{where}: {first['msg']}", where)


async def _disk_full_or_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A full disk (ENOSPC, EDQUOT) under a request: 507, the server's condition, not a bug (no
    traceback). Any other failure goes on to _unexpected_error."""
    full = disk_full(exc)
    if full is None:
        raise exc
    return _disk_full_body(full)


def _disk_full_body(full: OSError) -> JSONResponse:
    return _error_body(507, f"the server's disk is full: {full.strerror or full}; this request could not be "
                            "completed (nothing of an upload or a new batch is kept). Delete files you no longer "
                            "need (DELETE /v1/files/{file_id}) or ask the server's operator to free space, then "
                            "retry", code="disk_full")


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: one 500 in OpenAI's shape; its traceback goes to the server's log, never to the client."""
    return _error_body(500, f"internal server error ({type(exc).__name__}): a bug; the server's log has "
                            "its traceback", code="internal_error")


class Server(uvicorn.Server):
    """uvicorn's server that also tells the batch runner to stop the moment Ctrl-C or SIGTERM
    arrives: the running batch stops at its next pass while uvicorn closes its connections (which
    waits for downloads in flight), not only once the application's shutdown is reached."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.runner.request_stop()
        super().handle_exit(sig, frame)
