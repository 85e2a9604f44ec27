"""The endpoints of `radixkv.server.app`: generating (``/v1/completions``,
``/v1/chat/completions``: one answer, or server-sent events ending with ``data: [DONE]``;
``n`` choices; a client that goes away has its request aborted) and describing the server
(``/v1/models``, ``/health``, ``/metrics``, the admin ``/flush_cache``).

Owns: the endpoints' bodies, as FastAPI routers. Must not touch: validation and token
ids (`radixkv.server.api.Api`), the engine's internals.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from radixkv.engine.async_engine import AsyncEngine, EngineDead, RequestFailed, merge_choices
from radixkv.engine.request import StepOutput
from radixkv.server.api import Api, Prompt, failure, parse_body
from radixkv.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from radixkv.server.tools import Stream
from radixkv.tokenizer import tokenizer_fingerprint, tokenizer_source
from radixkv.web.serving import until_disconnected


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


# a finished choice: its text, last output, token ids, logprobs (one per token, if asked)
Choice = tuple[str, StepOutput, list[int], list]
# a streamed choice's event (or events: a tool call's several deltas)
Chunk = Callable[[int, StepOutput, bool], dict | list[dict]]
Final = Callable[[list[Choice]], dict]  # the whole answer


async def collect_or_abort(
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
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return list(task.result())


async def read_body(request: Request) -> bytes:
    """The request's body; a client that left before it arrived gets a 400 it will not
    read, not a traceback in the server's log."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise ApiError(400, "the client went away before its body arrived",
                       code="client_disconnected") from None  # fmt: skip


class Prepared(NamedTuple):
    """A request checked off the event loop (`Generating.prepare`)."""

    request: Any  # the validated request model
    prompt: Prompt  # its token ids and prompt-cache spec


class Generating:
    """The two generating endpoints and what they share: parsing off the event loop,
    starting the ``n`` choices, and answering at once or as a stream."""

    def __init__(self, api: Api, model_name: str) -> None:
        self.api, self.model_name = api, model_name

    def routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return router

    async def prepare(
        self, request: Request, model: type[BaseModel], to_ids: Callable[[Any], Prompt]
    ) -> Prepared:
        """The validated request and its prompt's token ids. Parsing, templating and
        tokenizing run off the event loop: a large prompt delays only its own answer,
        never /health or other clients. A client that leaves before its body arrived
        gets a 400 it will not read, not a traceback in the server's log."""
        body = await read_body(request)

        def run() -> Prepared:
            req = parse_body(body, model)
            self.api.check_common(req)
            return Prepared(req, to_ids(req))

        return await asyncio.to_thread(run)

    async def serve(
        self, request: Request, arrival: float, kind: str, prompt: Prompt, req: Any,
        max_tokens: int | None, chunk: Chunk, final: Final, envelope: dict,
    ) -> Response:  # fmt: skip
        """Start the request's choices; answer when they finish, or stream them."""
        api = self.api
        ids, spec = prompt.ids, prompt.cache
        sampling = api.sampling(req, ids, max_tokens, kind)
        if req.prompt_cache_key is not None:
            api.metrics.cache_keys.inc()
        # an agent's session (prompt_cache_key, else the X-Session-ID header routers pin
        # sessions by): read by --eviction-policy session
        key = req.prompt_cache_key or request.headers.get("x-session-id")
        session = api.session(key, req.cache_salt, prompt.tools)
        runs = await api.start_all(ids, sampling, req.n, req.cache_salt, arrival, spec, session)
        if not req.stream:
            try:
                done = await collect_or_abort(request, runs)
            except (EngineDead, RequestFailed) as e:
                raise failure(e) from None
            if done is None:  # the client went away; its choices were aborted
                return Response(status_code=499)
            return JSONResponse(final(done))
        usage = req.stream_options is not None and req.stream_options.include_usage
        events = self.events(runs, chunk, usage, envelope)
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(
        self, runs: list, chunk: Chunk, usage: bool, envelope: dict
    ) -> AsyncIterator[str]:
        """A streamed answer: each choice's outputs as they come, an error event if the
        request fails, the usage if asked (in an event of ``envelope``'s id and object,
        with no choices), then ``[DONE]``."""
        started: set[int] = set()
        lasts: dict[int, StepOutput] = {}
        try:
            async with aclosing(merge_choices(runs)) as merged:
                async for i, out in merged:
                    if i not in started or out.text or out.finished or out.logprobs:
                        made = chunk(i, out, i not in started)
                        for event in made if isinstance(made, list) else [made]:
                            yield _sse(event)
                    started.add(i)
                    lasts[i] = out
        except (EngineDead, RequestFailed) as e:  # an error event ends the stream
            yield _sse(failure(e).body())
            yield "data: [DONE]\n\n"
            return
        if usage:
            last = [lasts[i] for i in sorted(lasts)]
            yield _sse({**envelope, "choices": [], "usage": self.api.usage(last)})
        yield "data: [DONE]\n\n"

    async def completions(self, request: Request) -> Response:
        api, model_name = self.api, self.model_name
        arrival = time.perf_counter()
        req, prompt = await self.prepare(request, CompletionRequest, api.completion_ids)
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
        return await self.serve(
            request, arrival, "completion", prompt, req, max_tokens, chunk, final, head
        )

    async def chat_completions(self, request: Request) -> Response:
        api, model_name = self.api, self.model_name
        arrival = time.perf_counter()
        req, prompt = await self.prepare(request, ChatCompletionRequest, api.chat_ids)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": model_name}
        want_lps = bool(req.logprobs)
        plan = prompt.tools
        streams = [Stream(plan.parser, plan.opening) if plan.parser else None
                   for _ in range(req.n)]  # fmt: skip

        def event(i: int, delta: dict, reason: str | None, lp: dict | None = None) -> dict:
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return {**head, "object": "chat.completion.chunk", "choices": [choice]}

        def chunk(i: int, out: StepOutput, first: bool) -> dict | list[dict]:
            lp = api.chat_logprobs(out.token_ids, out.logprobs or []) if want_lps else None
            stream = streams[i]
            text = out.text if stream is None else stream.feed(api.marked(out.token_ids, out.text))
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if stream is not None and not (text or first or out.finished or lp):
                return []  # held: it may be a call's start
            if stream is None or not out.finished:
                return event(i, delta, out.finish_reason, lp)
            rest, calls = api.stream_end(plan, stream)
            if rest:
                delta["content"] += rest
            events = [event(i, delta, None if calls else out.finish_reason, lp)]
            for k, c in enumerate(calls):
                events.append(event(i, {"tool_calls": [{"index": k, "id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": ""}}]}, None))  # fmt: skip
                events.append(event(i, {"tool_calls": [{"index": k, "function": {
                    "arguments": c.arguments}}]}, None))  # fmt: skip
            if calls:
                events.append(event(i, {}, "tool_calls" if out.finish_reason == "stop" else
                                    out.finish_reason))  # fmt: skip
            return events

        def message(text: str, last: StepOutput, out_ids: list[int]) -> tuple[dict, str | None]:
            content, calls = api.parse_calls(plan, out_ids, text)
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if not calls:
                return msg, last.finish_reason
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]  # fmt: skip
            return msg, "tool_calls" if last.finish_reason == "stop" else last.finish_reason

        def final(done: list[Choice]) -> dict:
            choices = []
            for i, (text, last, out_ids, lps) in enumerate(done):
                lp = api.chat_logprobs(out_ids, lps) if want_lps else None
                msg, reason = message(text, last, out_ids)
                choices.append({"index": i, "message": msg, "logprobs": lp,
                                "finish_reason": reason})  # fmt: skip
            return {**head, "object": "chat.completion", "choices": choices,
                    "usage": api.usage([d[1] for d in done])}  # fmt: skip

        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        envelope = {**head, "object": "chat.completion.chunk"}
        return await self.serve(request, arrival, "chat", prompt, req, max_tokens, chunk, final,
                                envelope)  # fmt: skip


def describing_routes(aeng: AsyncEngine, api: Api, model_name: str) -> APIRouter:
    """``/v1/models`` (with what a router checks: ``radixkv``), ``/health``,
    ``/metrics`` and the admin ``/flush_cache``."""
    app = APIRouter()

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
