"""The OpenAI-compatible HTTP API over an `AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /flush_cache``.

``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens served from
the prefix cache. A request's ``cache_salt`` becomes its cache namespace: requests with
different salts never share a cached token (unsalted ones share only with each other).

Every error is an OpenAI error body with a 4xx status (503 with ``Retry-After`` when the
waiting queue is full); a client that goes away has its request aborted and its KV freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv.engine.async_engine import AsyncEngine, EngineDead, QueueFull
from radixkv.engine.request import SamplingParams, StepOutput
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import (
    MAX_STOP_STRINGS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # when the request names none
RETRY_AFTER_S = 1


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith("function-")]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return ApiError(400, f"{where}: {err.get('msg', 'invalid value')}", param)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise _validation_error(e) from None


class Api:
    """The request handling, separate from the routes so it reads top to bottom."""

    def __init__(self, aeng: AsyncEngine, model_name: str) -> None:
        self.aeng, self.engine, self.model_name = aeng, aeng.engine, model_name
        self.metrics = ServerMetrics(aeng.engine, model_name)
        self.created = int(time.time())

    # --- validation -------------------------------------------------------------------------
    def _check_common(self, req: Any) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist; this server serves `{self.model_name}`.",
                "model",
                "model_not_found",
            )
        if req.n != 1:
            raise ApiError(400, "n > 1 is not supported: send one request per choice", "n")
        if req.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", "logprobs")
        if req.cache_salt is not None and not req.cache_salt:
            raise ApiError(400, "cache_salt must be a non-empty string", "cache_salt")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")

    def _sampling(self, req: Any, ids: list[int], max_tokens: int | None, kind: str) -> Any:
        limit = self.engine.scheduler.max_tokens()
        if max_tokens is None:  # the default, shortened to what fits
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS[kind], limit - len(ids)))
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if len(ids) + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                "max_tokens" if len(ids) < limit else "prompt",
                "context_length_exceeded",
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(
                max_tokens, req.temperature, req.top_p, req.seed, stop, req.ignore_eos
            )
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def _encode(self, prompt: Any, chat: bool) -> list[int]:
        try:
            ids = self.engine.encode(prompt, chat)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", "messages" if chat else "prompt")
        return ids

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        if req.echo or (req.best_of or 1) > 1 or req.suffix:
            raise ApiError(400, "echo, best_of and suffix are not supported", "echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "a batch of prompts is not supported: send one", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return self._encode(prompt, chat=False)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        if req.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if req.top_logprobs:
            raise ApiError(400, "logprobs are not supported", "top_logprobs")
        if not req.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return self._encode(messages, chat=True)

    # --- running ----------------------------------------------------------------------------
    async def start(
        self, ids: list[int], sampling: SamplingParams, salt: str | None, arrival: float
    ) -> tuple[StepOutput, AsyncIterator[StepOutput]]:
        """Submit the request and wait for its first output, so that a refusal becomes
        an HTTP error before any response starts. Returns (first output, the rest)."""
        submitted = await self.aeng.submit(ids, sampling, None, salt, chat=False)
        outputs = self.timed(submitted, arrival)
        try:
            first = await anext(outputs)
        except QueueFull as e:
            raise ApiError(
                503,
                f"the server is busy ({e}); retry later",
                code="queue_full",
                kind="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead", kind="server_error") from None
        except ValueError as e:
            raise ApiError(400, str(e), "max_tokens") from None
        return first, outputs

    async def timed(
        self, outputs: AsyncIterator[StepOutput], arrival: float
    ) -> AsyncIterator[StepOutput]:
        """Pass outputs through, observing TTFT, inter-token and end-to-end latency."""
        last = None
        async with aclosing(outputs):
            async for out in outputs:
                now = time.perf_counter()
                if out.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if out.finished:
                    self.metrics.e2e.observe(now - arrival)
                yield out

    @staticmethod
    def usage(out: StepOutput) -> dict[str, Any]:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.output_tokens,
            "total_tokens": out.prompt_tokens + out.output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_or_abort(
    request: Request, first: StepOutput, outputs: AsyncIterator[StepOutput]
) -> tuple[str, StepOutput] | None:
    """All outputs of a non-streamed request; a client that disconnects first cancels
    it (the request is aborted and its KV freed)."""
    if first.finished:
        return first.text, first

    async def collect() -> tuple[str, StepOutput]:
        text, last = [first.text], first
        async with aclosing(outputs):
            async for out in outputs:
                text.append(out.text)
                last = out
        return "".join(text), last

    task = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def build_app(aeng: AsyncEngine, model_name: str, owns_engine: bool = True) -> FastAPI:
    """The FastAPI app over a started (or, with ``owns_engine``, a not yet started)
    engine loop. With ``owns_engine`` it starts the loop at startup if needed and stops
    it (aborting what is in flight) at shutdown."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if owns_engine and not aeng.started:
            aeng.start()
        try:
            yield
        finally:
            if owns_engine:
                await aeng.stop()

    app = FastAPI(title="radixkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    api = Api(aeng, model_name)
    app.state.api = api

    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_r: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind=kind).body(), e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_r: Request, e: Exception) -> JSONResponse:
        body = ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body()
        return JSONResponse(body, status_code=500)

    async def serve(
        request: Request,
        arrival: float,
        kind: str,
        ids: list[int],
        req: Any,
        max_tokens: int | None,
        chunk: Callable[[str, str | None, bool], dict],
        final: Callable[[str, StepOutput], dict],
    ) -> Response:
        sampling = api._sampling(req, ids, max_tokens, kind)
        first, outputs = await api.start(ids, sampling, req.cache_salt, arrival)
        if not req.stream:
            done = await _collect_or_abort(request, first, outputs)
            if done is None:  # the client went away; its request was aborted
                return Response(status_code=499)
            return JSONResponse(final(*done))
        usage = req.stream_options is not None and req.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            async with aclosing(outputs):
                yield _sse(chunk(first.text, first.finish_reason, True))
                out = first
                while not out.finished:
                    out = await anext(outputs)
                    if out.text or out.finished:
                        yield _sse(chunk(out.text, out.finish_reason, False))
                if usage:
                    yield _sse({**chunk("", None, False), "choices": [], "usage": api.usage(out)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, CompletionRequest)
        api._check_common(req)
        ids = api.completion_ids(req)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}

        def chunk(text: str, reason: str | None, _first: bool) -> dict:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return {**head, "choices": [choice]}

        def final(text: str, last: StepOutput) -> dict:
            return {**chunk(text, last.finish_reason, False), "usage": api.usage(last)}

        return await serve(request, arrival, "completion", ids, req, req.max_tokens, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(request, ChatCompletionRequest)
        api._check_common(req)
        ids = api.chat_ids(req)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}

        def chunk(text: str, reason: str | None, first: bool) -> dict:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        def final(text: str, last: StepOutput) -> dict:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": last.finish_reason}  # fmt: skip
            return {**head, "object": "chat.completion", "choices": [choice],
                    "usage": api.usage(last)}  # fmt: skip

        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        return await serve(request, arrival, "chat", ids, req, max_tokens, chunk, final)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": model_name,
            "object": "model",
            "created": api.created,
            "owned_by": "radixkv",
            "max_model_len": aeng.engine.scheduler.max_tokens(),
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if not aeng.alive:
            return JSONResponse({"status": "dead", "error": repr(aeng.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(api.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        try:
            return {"flushed_tokens": await aeng.flush_cache()}
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead", kind="server_error") from None

    return app
