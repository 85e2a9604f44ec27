"""The OpenAI-compatible HTTP API over an `AsyncEngine`: the app, its error bodies and
its routers.

Endpoints (`radixkv.server.routes`): ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream: true`` as server-sent events ending with ``data:
[DONE]``), Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(`radixkv.server.messages`), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /flush_cache`` (admin). Requests are checked by
`radixkv.server.api`.

Every error is an OpenAI error body (Anthropic's on its paths: `radixkv.web.errors.shaped`)
with a 4xx status (503 with ``Retry-After`` when the waiting queue is full; 500 for an
internal error, naming only its type); a client that goes away has its request aborted
and its KV freed.

Owns: the app: its lifespan (the engine loop), access rules, error handlers and routers.
Must not touch: the endpoints' bodies, the engine's internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.api import Api
from radixkv.server.messages import Messages
from radixkv.server.protocol import ApiError
from radixkv.server.routes import Generating, describing_routes
from radixkv.web.access import Access, AccessMiddleware
from radixkv.web.errors import shaped


def build_app(
    aeng: AsyncEngine, model_name: str, owns_engine: bool = True, access: Access | None = None,
    tool_parser: str = "auto",
) -> FastAPI:
    """The FastAPI app over a started (or, with ``owns_engine``, a not yet started)
    engine loop. With ``owns_engine`` it starts the loop at startup if needed and stops
    it (aborting what is in flight) at shutdown. ``access``: keys, hosts and the body
    limit (`radixkv.web.access`; the default: no API key, admin endpoints refused)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if owns_engine and not aeng.started:
            aeng.start()
        try:
            yield
        finally:
            if owns_engine:
                await aeng.stop()

    aeng.engine.model_identity()  # now, not on the event loop when /v1/models first asks
    app = FastAPI(title="radixkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, access=access or Access())
    api = Api(aeng, model_name, tool_parser)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def _api_error(r: Request, e: ApiError) -> JSONResponse:
        status, body = shaped(e, r.url.path)
        return JSONResponse(body, status_code=status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(r: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        status, body = shaped(ApiError(e.status_code, str(e.detail), kind=kind), r.url.path)
        return JSONResponse(body, status)

    @app.exception_handler(Exception)
    async def _internal(r: Request, e: Exception) -> JSONResponse:
        error = ApiError(500, f"internal error: {type(e).__name__}", kind="server_error")
        status, body = shaped(error, r.url.path)
        return JSONResponse(body, status_code=status)

    app.include_router(Generating(api, model_name).routes())
    app.include_router(Messages(api, model_name).routes())
    app.include_router(describing_routes(aeng, api, model_name))
    return app
