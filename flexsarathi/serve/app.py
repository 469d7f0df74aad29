"""The FastAPI application: the routes of routes.py behind a bearer-token check, request bodies
size-limited by FastAPI's own limit (413), every error in OpenAI's shape, and the batch runner
started and stopped with the application."""
from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

import uvicorn

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from flexsarathi.serve.batch_job import ServeEngine
from flexsarathi.serve.routes import ROUTES, ApiError, upload_file
from flexsarathi.serve.runner import BatchRunner
from flexsarathi.serve.store import Store

# Bodies other than uploads (a batch's creation) are small JSON objects.
MAX_JSON_BYTES = 1 << 20
# multipart framing around the file (boundaries, part headers, the purpose field)
MULTIPART_SLACK = 64 << 10


def create_app(store: Store, engine: ServeEngine, api_key: str | None, max_file_bytes: int) -> FastAPI:
    app = FastAPI(title="FlexSarathi batch server", lifespan=_lifespan, max_body_size=MAX_JSON_BYTES)
    app.state.store, app.state.engine, app.state.api_key = store, engine, api_key
    app.state.runner = BatchRunner(store, engine)
    app.state.max_file_bytes, app.state.started = max_file_bytes, int(time.time())
    router = APIRouter(dependencies=[Depends(require_api_key)])
    for method, path, endpoint in ROUTES:
        limit = max_file_bytes + MULTIPART_SLACK if endpoint is upload_file else None
        router.add_api_route(path, endpoint, methods=[method], max_body_size=limit)
    app.include_router(router)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.runner.start()
    try:
        yield
    finally:
        await run_in_threadpool(app.state.runner.shutdown)


async def require_api_key(request: Request) -> None:
    """Bearer-token auth, as the openai client sends its api_key (when the server has a key)."""
    key = request.app.state.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "Incorrect or missing API key: send the server's key as 'Authorization: Bearer KEY' "
                       "(the openai client's api_key)", code="invalid_api_key")


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _error_body(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Framework errors: unknown paths (404), wrong methods (405), bodies over the limit (413)."""
    message = str(exc.detail)
    if exc.status_code == 413:
        limit = request.app.state.max_file_bytes if request.url.path == "/v1/files" else MAX_JSON_BYTES
        message = f"the request body is over this server's limit of {limit} bytes"
    return _error_body(exc.status_code, message, code="request_too_large" if exc.status_code == 413 else None)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part not in ("body", "query", "path"))
    return _error_body(400, f"{where}: {first['msg']}" if where else first["msg"], where or None)


class Server(uvicorn.Server):
    """uvicorn's server that also tells the batch runner to stop the moment Ctrl-C or SIGTERM
    arrives: the running batch stops at its next pass while uvicorn closes its connections (which
    waits for downloads in flight), not only once the application's shutdown is reached."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.runner.request_stop()
        super().handle_exit(sig, frame)
