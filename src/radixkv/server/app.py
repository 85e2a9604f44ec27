"""The OpenAI-compatible HTTP API over an `AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /flush_cache``.

``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens served from
the prefix cache. A request's ``cache_salt`` becomes its cache namespace: requests with
different salts never share a cached token (unsalted ones share only with each other).

Every error is an OpenAI error body with a 4xx status (503 with ``Retry-After`` when the
waiting queue is full); a client that goes away has its request aborted and its KV freed.

Owns: the endpoints, request validation, streaming and ``n`` choices. Must not touch:
the engine's internals (it talks to `AsyncEngine`; tokenizing off the loop uses only
what `radixkv.engine.engine` states thread-safe).
"""

from __future__ import annotations

import asyncio
import json
import re
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
from starlette.requests import ClientDisconnect

from radixkv.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestFailed,
    merge_choices,
)
from radixkv.engine.output import choice_sampling, usage
from radixkv.engine.request import CacheSpec, SamplingParams, StepOutput
from radixkv.engine.scheduler import DoesNotFit
from radixkv.server import prompt_cache
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import (
    MAX_CACHE_KEY,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from radixkv.tokenizer import tokenizer_fingerprint, tokenizer_source
from radixkv.web.access import Access, AccessMiddleware

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # when the request names none
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id, as ASCII digits
RETRY_AFTER_S = 1


# a request's prompt: its token ids, and what it asks of the prompt cache (if anything)
Prompt = tuple[list[int], CacheSpec | None]


def _validation_error(e: ValidationError) -> ApiError:
    """The deepest of pydantic's errors (a union tries each branch: the one that got
    furthest says what is wrong), its location without branch labels (``str``,
    ``list[ContentPart]``); ``param`` the top-level field."""
    errors = e.errors()

    def where(err: Any) -> list[str]:
        return [str(x) for x in err.get("loc", ()) if not _BRANCH.fullmatch(str(x))]

    err = max(errors, key=lambda x: len(where(x)))
    loc = where(err)
    param = loc[0] if loc else None
    return ApiError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}", param)


# pydantic's location labels for a union's branches and validators, not fields
_BRANCH = re.compile(r"function-.*|str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*")


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    messages = data.get("messages")
    if isinstance(messages, list):  # counted before validating them one by one
        parts = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"),
                    list) else 1 for m in messages)  # fmt: skip
        if parts > MAX_CONTENT_PARTS:
            raise ApiError(400, f"messages: {parts:,} messages and content parts, more than "
                           f"the {MAX_CONTENT_PARTS:,} a request may hold", "messages")  # fmt: skip
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
        refused = req.refused_field()
        if refused is not None:
            raise ApiError(400, f"{refused} is not supported by this server", refused,
                           "unsupported_parameter")  # fmt: skip
        if not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.n > self.aeng.max_queue:  # its choices wait as n requests: they never fit
            raise ApiError(400, f"n must be at most {self.aeng.max_queue} on this server "
                           f"(--max-queue), got {req.n}", "n")  # fmt: skip
        if not 0 <= req.temperature <= 2:
            raise ApiError(400, f"temperature must be in [0, 2], got {req.temperature}",
                           "temperature")  # fmt: skip
        if not 0 < req.top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(req, name) <= 2:
                raise ApiError(400, f"{name} must be in [-2, 2], got {getattr(req, name)}", name)
        if not req.repetition_penalty > 0:
            raise ApiError(400, f"repetition_penalty must be > 0, got {req.repetition_penalty}",
                           "repetition_penalty")  # fmt: skip
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise ApiError(400, f"seed must be in [-2**63, 2**64), got {req.seed}", "seed")
        vocab = self.engine.config.vocab_size
        if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:  # each entry costs every step
            raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens",
                           "logit_bias")  # fmt: skip
        for token, bias in (req.logit_bias or {}).items():
            # ASCII digits only, and few of them: "²" is a digit to str.isdigit but not to
            # int(), and int() of a 5,000-digit key raises (both used to answer 500)
            if not (_TOKEN_ID.fullmatch(token) and int(token) < vocab) or not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias maps token ids in [0, {vocab}) to biases in "
                               f"[-100, 100]; got {token!r}: {bias}", "logit_bias")  # fmt: skip
        if req.cache_salt is not None and not req.cache_salt:
            raise ApiError(400, "cache_salt must be a non-empty string", "cache_salt")
        key = req.prompt_cache_key
        if key is not None and not 0 < len(key) <= MAX_CACHE_KEY:
            raise ApiError(400, f"prompt_cache_key must be 1 to {MAX_CACHE_KEY} characters",
                           "prompt_cache_key")  # fmt: skip
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")

    @staticmethod
    def logprobs_count(req: Any) -> int | None:
        """Top alternatives per token to report (``None``: no logprobs)."""
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            n = (req.top_logprobs or 0) if req.logprobs else None
            name = "top_logprobs"
        else:
            n, name = req.logprobs, "logprobs"
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", name)
        return n

    def _sampling(self, req: Any, ids: list[int], max_tokens: int | None, kind: str) -> Any:
        limit = self.engine.scheduler.max_tokens()  # read-only: safe off the engine thread
        if max_tokens is None:  # the default, shortened to what fits
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS[kind], limit - len(ids)))
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        try:
            self.engine.scheduler.check_fits(len(ids), max_tokens)
        except DoesNotFit as e:
            raise ApiError(
                400,
                f"This model's maximum context length is {e.limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                "max_tokens" if len(ids) < e.limit else "prompt",
                "context_length_exceeded",
            ) from None
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(
                max_tokens, req.temperature, req.top_p, req.seed, stop, req.ignore_eos,
                req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                tuple((int(t), b) for t, b in (req.logit_bias or {}).items()),
                self.logprobs_count(req),
            )  # fmt: skip
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def _encode(self, prompt: Any, chat: bool) -> list[int]:
        if isinstance(prompt, str) or chat:
            texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
            per_token = getattr(self.engine.tokenizer, "max_token_chars", None)
            limit = self.engine.scheduler.max_tokens()
            # a prompt's tokens cover at most per_token characters each, so this many
            # characters cannot fit: refuse before tokenizing
            if per_token and sum(map(len, texts)) > limit * per_token:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens; the prompt "
                    f"has over {limit} tokens.",
                    "messages" if chat else "prompt",
                    "context_length_exceeded",
                )
        try:
            ids = self.engine.encode(prompt, chat)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", "messages" if chat else "prompt")
        return ids

    def completion_ids(self, req: CompletionRequest) -> Prompt:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "a batch of prompts is not supported: send one", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        ids = self._encode(prompt, chat=False)
        return ids, prompt_cache.cache_spec(req, len(ids), [])

    def chat_ids(self, req: ChatCompletionRequest) -> Prompt:
        if not req.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        for i, m in enumerate(req.messages):
            if m.role in ("tool", "function") or m.tool_calls or m.function_call:
                raise ApiError(400, f"messages[{i}]: tool calls and tool results are not "
                               "supported by this server", "messages")  # fmt: skip
            if m.content is None:
                raise ApiError(400, f"messages[{i}]: content is missing", "messages")
        cuts = prompt_cache.breakpoints(req)  # refuses too many before rendering
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = self._encode(messages, chat=True)  # marked at the system message's end
        marks = prompt_cache.positions(self.engine, req, ids, cuts)
        return ids, prompt_cache.cache_spec(req, len(ids), marks)

    # --- running ----------------------------------------------------------------------------
    async def first(self, outputs: AsyncIterator[StepOutput]) -> StepOutput:
        """A request's first output: a refusal becomes an HTTP error here, before any
        response starts."""
        try:
            return await anext(outputs)
        except QueueFull as e:
            raise ApiError(
                503,
                f"the server is busy ({e}); retry later",
                code="queue_full",
                kind="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except (EngineDead, RequestFailed) as e:
            raise failure(e) from None
        except DoesNotFit as e:
            raise ApiError(400, str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:  # the engine refused the request: no one field to name
            raise ApiError(400, str(e)) from None

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

    async def start_all(
        self,
        ids: list[int],
        sampling: SamplingParams,
        n: int,
        salt: str | None,
        arrival: float,
        cache: CacheSpec | None = None,
    ) -> list[tuple[StepOutput | None, AsyncIterator[StepOutput]]]:
        """Submit the ``n`` choices as one group (choice ``i`` seeded ``seed + i``; they
        share the prompt's KV through the cache; they count as ``n`` against the queue,
        and hold at most their share of the running slots) and wait for the first
        choice's first output. The group is taken or refused as a whole (a refusal is
        every choice's first item), so that one output decides the response's status;
        the other choices may still wait for a slot (a group holds at most its share),
        and waiting for theirs too held a stream's first token back until the first
        choices had finished. A refusal aborts them all. Returns (first output or None,
        the rest) per choice."""
        samplings: list[SamplingParams | None] = [choice_sampling(sampling, i) for i in range(n)]
        submitted = await self.aeng.submit_choices(ids, samplings, salt, chat=False, cache=cache)
        outputs = [self.timed(o, arrival) for o in submitted]
        try:
            first = await self.first(outputs[0])
        except BaseException:
            for o in outputs:
                await o.aclose()  # type: ignore[attr-defined]
            raise
        return [(first, outputs[0])] + [(None, o) for o in outputs[1:]]

    @staticmethod
    def usage(lasts: list[StepOutput]) -> dict[str, Any]:
        """The prompt counted once (the choices share it), every choice's completion."""
        return usage(lasts)

    # --- logprobs in OpenAI's two shapes ----------------------------------------------------
    def _token(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def completion_logprobs(self, ids: list[int], lps: list, offset: int) -> dict | None:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        tokens = [self._token(t) for t in ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{self._token(t): v for t, v in alts} for _, alts in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list) -> dict:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}``."""

        def entry(token: int, lp: float) -> dict:
            text = self._token(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [
            {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in alts]}
            for t, (lp, alts) in zip(ids, lps, strict=True)
        ]
        return {"content": content, "refusal": None}


def failure(e: EngineDead | RequestFailed) -> ApiError:
    """What a request that failed after it was taken answers: 500 when it failed alone
    (the engine goes on), 503 when the engine is not running."""
    if isinstance(e, RequestFailed):
        return ApiError(500, f"the request failed: {e}", code="request_failed",
                        kind="server_error")  # fmt: skip
    return ApiError(503, str(e), code="engine_dead", kind="server_error")


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# a finished choice: its text, last output, token ids, logprobs (one per token, if asked)
Choice = tuple[str, StepOutput, list[int], list]


async def _collect_or_abort(
    request: Request, runs: list[tuple[StepOutput | None, AsyncIterator[StepOutput]]]
) -> list[Choice] | None:
    """All outputs of a non-streamed request's choices; a client that disconnects first
    cancels them (each is aborted and its KV freed)."""

    async def collect(first: StepOutput | None, outputs: AsyncIterator[StepOutput]) -> Choice:
        async with aclosing(outputs):
            last = first if first is not None else await anext(outputs)
            text, ids, lps = [last.text], list(last.token_ids), list(last.logprobs or ())
            while not last.finished:
                last = await anext(outputs)
                text.append(last.text)
                ids += last.token_ids
                lps += last.logprobs or ()
        return "".join(text), last, ids, lps

    task = asyncio.ensure_future(asyncio.gather(*(collect(f, o) for f, o in runs)))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return list(task.result())


def build_app(
    aeng: AsyncEngine, model_name: str, owns_engine: bool = True, access: Access | None = None
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
        prompt: Prompt,
        req: Any,
        max_tokens: int | None,
        chunk: Callable[[int, StepOutput, bool], dict],
        final: Callable[[list[Choice]], dict],
    ) -> Response:
        ids, spec = prompt
        sampling = api._sampling(req, ids, max_tokens, kind)
        if req.prompt_cache_key is not None:
            api.metrics.cache_keys.inc()
        runs = await api.start_all(ids, sampling, req.n, req.cache_salt, arrival, spec)
        if not req.stream:
            try:
                done = await _collect_or_abort(request, runs)
            except (EngineDead, RequestFailed) as e:
                raise failure(e) from None
            if done is None:  # the client went away; its choices were aborted
                return Response(status_code=499)
            return JSONResponse(final(done))
        usage = req.stream_options is not None and req.stream_options.include_usage

        async def events() -> AsyncIterator[str]:
            started: set[int] = set()
            lasts: dict[int, StepOutput] = {}
            try:
                async with aclosing(merge_choices(runs)) as merged:
                    async for i, out in merged:
                        if i not in started or out.text or out.finished or out.logprobs:
                            yield _sse(chunk(i, out, i not in started))
                        started.add(i)
                        lasts[i] = out
            except (EngineDead, RequestFailed) as e:  # an error event ends the stream
                yield _sse(failure(e).body())
                yield "data: [DONE]\n\n"
                return
            if usage:
                last = [lasts[i] for i in sorted(lasts)]
                yield _sse({**chunk(0, runs[0][0], False), "choices": [],
                            "usage": api.usage(last)})  # fmt: skip
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def prepare(
        request: Request, model: type[BaseModel], to_ids: Callable[[Any], Prompt]
    ) -> tuple[Any, Prompt]:
        """The validated request and its prompt's token ids. Parsing, templating and
        tokenizing run off the event loop: a large prompt delays only its own answer,
        never /health or other clients. A client that leaves before its body arrived
        gets a 400 it will not read, not a traceback in the server's log."""
        try:
            body = await request.body()
        except ClientDisconnect:
            raise ApiError(400, "the client went away before its body arrived",
                           code="client_disconnected") from None  # fmt: skip

        def run() -> tuple[Any, Prompt]:
            req = _parse(body, model)
            api._check_common(req)
            return req, to_ids(req)

        return await asyncio.to_thread(run)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req, prompt = await prepare(request, CompletionRequest, api.completion_ids)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": model_name}
        want_lps = req.logprobs is not None
        sent: dict[int, int] = {}  # characters streamed per choice (logprobs' text_offset)

        def choice(i: int, text: str, reason: str | None, ids: list[int], lps: list) -> dict:
            at = sent.get(i, 0)
            sent[i] = at + len(text)
            lp = api.completion_logprobs(ids, lps, at) if want_lps else None
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

        def chunk(i: int, out: StepOutput, _first: bool) -> dict:
            c = choice(i, out.text, out.finish_reason, out.token_ids, out.logprobs or [])
            return {**head, "choices": [c]}

        def final(done: list[Choice]) -> dict:
            choices = []
            for i, (text, last, out_ids, lps) in enumerate(done):
                choices.append(choice(i, text, last.finish_reason, out_ids, lps))
            return {**head, "choices": choices, "usage": api.usage([d[1] for d in done])}

        max_tokens = req.max_tokens
        return await serve(request, arrival, "completion", prompt, req, max_tokens, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req, prompt = await prepare(request, ChatCompletionRequest, api.chat_ids)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}
        want_lps = bool(req.logprobs)

        def chunk(i: int, out: StepOutput, first: bool) -> dict:
            text = out.text
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            lp = api.chat_logprobs(out.token_ids, out.logprobs or []) if want_lps else None
            choice = {"index": i, "delta": delta, "logprobs": lp,
                      "finish_reason": out.finish_reason}  # fmt: skip
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        def final(done: list[Choice]) -> dict:
            choices = []
            for i, (text, last, out_ids, lps) in enumerate(done):
                lp = api.chat_logprobs(out_ids, lps) if want_lps else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": last.finish_reason})  # fmt: skip
            return {**head, "object": "chat.completion", "choices": choices,
                    "usage": api.usage([d[1] for d in done])}  # fmt: skip

        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        return await serve(request, arrival, "chat", prompt, req, max_tokens, chunk, final)

    def card() -> dict:
        engine = aeng.engine
        return {
            "id": model_name,
            "object": "model",
            "created": api.created,
            "owned_by": "radixkv",
            "max_model_len": engine.scheduler.max_tokens(),
            # what a router checks before it routes here (radixkv route)
            "radixkv": {
                "page_size": engine.cache.page_size,
                # the most pages its KV pool holds: a router never believes it holds more
                "kv_blocks": engine.mgr.allocator.size // engine.cache.page_size,
                # what its KV events' blocks are: pages (each with the run before it), a
                # recurrent model's checkpoints or the pages whose sliding window is held
                # (each alone: a servable prefix's end; Engine.event_blocks)
                "events": engine.event_blocks,
                "tokenizer": tokenizer_fingerprint(engine.tokenizer),
                # what a router without --model loads to tokenize as this worker does
                # (byte, smollm2 or a path on this machine, as vLLM's card shows its root)
                "tokenizer_source": tokenizer_source(engine.tokenizer),
                # weights, config, dtype, page size and tokenizer as 32 hex digits:
                # workers with equal ones compute the same KV for the same tokens
                "model": engine.model_identity().hex(),
            },
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist; this server serves "
                           f"`{model_name}`.", "model", "model_not_found")  # fmt: skip
        return card()

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
