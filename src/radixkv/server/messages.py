"""Anthropic's Messages API: ``POST /v1/messages`` (an answer, or its event stream) and
``POST /v1/messages/count_tokens``, over the same engine, template, tool parsers and
prompt cache as the OpenAI routes. Responses are built from the ``anthropic`` package's
own types (``Message``, ``Usage``, the ``Raw*Event`` classes), so their shapes are
Anthropic's.

**Prompt caching, as Anthropic defines it.** Each ``cache_control`` marks the prefix that
ends with its block (`radixkv.web.anthropic`); the prefix is retained for its ttl (5
minutes, or an hour) through `radixkv.kvcache.retention`, per ``cache_salt``, refreshed by
every request that asks for it or hits it. Automatic prefix caching applies as always.
``usage``: ``cache_read_input_tokens`` the prompt tokens found cached;
``cache_creation_input_tokens`` those written from there up to the last breakpoint (split
by the ttl of the breakpoint each lies before, in ``cache_creation``); ``input_tokens`` the
rest, so the three add up to the prompt. A stream's ``message_start`` carries them.

Owns: the Messages endpoints' bodies. Must not touch: validation shared with the OpenAI
routes (`radixkv.server.api`, `radixkv.server.chat`), the engine's internals.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.engine.async_engine import EngineDead, RequestFailed, merge_choices
from radixkv.engine.request import CacheSpec, SamplingParams, StepOutput
from radixkv.server import chat
from radixkv.server.api import Api, failure, parse_body
from radixkv.server.chat import ToolPlan
from radixkv.server.protocol import ApiError
from radixkv.server.routes import collect_or_abort, read_body
from radixkv.server.tools import Call, Stream
from radixkv.web import anthropic as wire

PING_S = 15.0  # a stream waiting this long for a token sends a ping (Anthropic's keepalive)


class Prepared(NamedTuple):
    req: Any  # a wire.MessagesRequest
    ids: list[int]
    plan: ToolPlan
    marks: list[tuple[int, float]]  # breakpoints: (prompt position, seconds)


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_unset=True)


def usage(first: StepOutput, marks: list[tuple[int, float]], output_tokens: int) -> Any:
    """Anthropic's ``usage`` (see the module docstring)."""
    from anthropic.types import CacheCreation, Usage

    n = first.prompt_tokens
    read = min(first.cached_tokens, n)
    split = {300.0: 0, 3600.0: 0}
    at = read
    for pos, seconds in sorted(marks):
        if pos > at:
            split[3600.0 if seconds >= 3600 else 300.0] += pos - at
            at = pos
    created = split[300.0] + split[3600.0]
    return Usage(
        input_tokens=n - read - created, output_tokens=output_tokens,
        cache_creation_input_tokens=created, cache_read_input_tokens=read,
        cache_creation=CacheCreation(ephemeral_5m_input_tokens=split[300.0],
                                     ephemeral_1h_input_tokens=split[3600.0]),
    )  # fmt: skip


def session_key(header: str | None, metadata: Any) -> str | None:
    """The agent session a request belongs to: Claude Code's ``X-Claude-Code-Session-Id``
    header, else the ``session_id`` in ``metadata.user_id`` (Claude Code's JSON there),
    else ``metadata.user_id`` itself (an end user's conversations, as one session)."""
    if header:
        return header
    user = metadata.user_id if metadata is not None else None
    if not user:
        return None
    try:
        found = json.loads(user).get("session_id") if user.startswith("{") else None
    except (ValueError, AttributeError, RecursionError):
        found = None
    return found if isinstance(found, str) and found else user


def stop_reason(last: StepOutput, calls: list[Call]) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished answer."""
    if calls:
        return "tool_use", None
    if last.finish_reason == "length":
        return "max_tokens", None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    return "end_turn", None


def _tool_use(c: Call) -> Any:
    from anthropic.types import ToolUseBlock

    return ToolUseBlock(type="tool_use", id="toolu_" + c.id.removeprefix("call_"), name=c.name,
                        input=json.loads(c.arguments))  # fmt: skip


class Messages:
    """The two endpoints."""

    def __init__(self, api: Api, model_name: str) -> None:
        self.api, self.model_name = api, model_name

    def routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/messages", self.create, methods=["POST"])
        router.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])
        return router

    # --- reading a request ----------------------------------------------------------------
    async def read(self, request: Request, model: type) -> Prepared:
        """The checked request and its prompt, off the event loop."""
        body = await read_body(request)
        return await asyncio.to_thread(self.prepare, body, model)

    def prepare(self, body: bytes, model: type) -> Prepared:
        req = parse_body(body, model)
        if not req.messages:
            raise ApiError(400, "messages: at least one message is required", "messages")
        if req.model != self.model_name:
            raise ApiError(404, f"model: {req.model}: this server serves {self.model_name!r}",
                           "model", "model_not_found")  # fmt: skip
        if req.cache_salt is not None and not req.cache_salt:
            raise ApiError(400, "cache_salt must be a non-empty string", "cache_salt")
        c = wire.to_chat(req)
        tools = [t["function"] for t in c.tools or ()]
        chat.check_tools(tools, "tools", "parameters", wire.MAX_TOOLS)
        plan = chat.plan(self.api.tool_parser, tools, c.choice, c.parallel)
        chat.check_answers(c.messages)
        ids = self.api.chat_encode(c.messages, c.tools, plan, "messages", c.prefill)
        marks = self.positions(req, c, ids)
        return Prepared(req, ids, plan, marks)

    def positions(self, req: Any, c: wire.Chat, ids: list[int]) -> list[tuple[int, float]]:
        """Where each breakpoint's prefix ends in ``ids``, with its seconds."""
        engine, out = self.api.engine, []
        for mark in c.breakpoints:
            head = wire.cut_chat(req, mark.where)
            pos = len(ids) if head is None else engine.rendered_prefix(head[0], ids, head[1])
            if pos > 0:
                out.append((pos, mark.seconds))
        return out

    def sampling(self, req: Any, ids: list[int]) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0 <= temperature <= 1:
            raise ApiError(400, f"temperature: must be in [0, 1], got {temperature}",
                           "temperature")  # fmt: skip
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise ApiError(400, f"top_p: must be in (0, 1], got {top_p}", "top_p")
        stops = req.stop_sequences or []
        if len(stops) > wire.MAX_STOP_SEQUENCES or not all(
                0 < len(s) <= wire.MAX_STOP_CHARS for s in stops):  # fmt: skip
            raise ApiError(400, f"stop_sequences: 1 to {wire.MAX_STOP_SEQUENCES} strings of 1 "
                           f"to {wire.MAX_STOP_CHARS} characters", "stop_sequences")  # fmt: skip
        self.api.fits(ids, req.max_tokens, "messages")
        return SamplingParams(req.max_tokens, temperature, top_p, None, tuple(stops))

    # --- the endpoints --------------------------------------------------------------------
    async def count_tokens(self, request: Request) -> dict:
        p = await self.read(request, wire.CountTokensRequest)
        return {"input_tokens": len(p.ids)}

    async def create(self, request: Request) -> Response:
        api, arrival = self.api, time.perf_counter()
        p = await self.read(request, wire.MessagesRequest)
        sampling = self.sampling(p.req, p.ids)
        spec = CacheSpec(retain=tuple(p.marks)) if p.marks else None
        headers = request.headers
        key = session_key(headers.get("x-claude-code-session-id") or headers.get("x-session-id"),
                          p.req.metadata)  # fmt: skip
        session = api.session(key, p.req.cache_salt, p.plan)
        runs = await api.start_all(p.ids, sampling, 1, p.req.cache_salt, arrival, spec, session)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if p.req.stream:
            events = self.events(p, mid, runs)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            done = await collect_or_abort(request, runs)
        except (EngineDead, RequestFailed) as e:
            raise failure(e) from None
        if done is None:
            return Response(status_code=499)
        text, last, out_ids, _ = done[0]
        first = runs[0][0] or last
        content, calls = api.parse_calls(p.plan, out_ids, text)
        return JSONResponse(_dump(self.message(mid, p, first, last, content, calls)))

    def message(self, mid: str, p: Prepared, first: StepOutput, last: StepOutput | None,
                content: str | None, calls: list[Call]) -> Any:  # fmt: skip
        """The answer (``last`` None: as a stream's ``message_start`` shows it)."""
        from anthropic.types import Message, TextBlock

        blocks: list[Any] = []
        if last is not None:
            if content:
                blocks.append(TextBlock(type="text", text=content, citations=None))
            blocks += [_tool_use(c) for c in calls]
        reason, seq = stop_reason(last, calls) if last is not None else (None, None)
        out = last.output_tokens if last is not None else 0
        return Message(id=mid, type="message", role="assistant", model=self.model_name,
                       content=blocks, stop_reason=reason, stop_sequence=seq,
                       usage=usage(first, p.marks, out))  # fmt: skip

    async def events(self, p: Prepared, mid: str, runs: list) -> AsyncIterator[str]:
        """The answer as Anthropic streams it (see `Streamer`)."""
        streamer = Streamer(self, p, mid)
        try:
            async with aclosing(merge_choices(runs)) as merged:
                async for _, out in _with_pings(merged):
                    for event in streamer.feed(out):
                        yield event
        except (EngineDead, RequestFailed) as e:
            error = failure(e)
            yield _sse("error", {"type": "error", "error": {"type": "api_error",
                                                           "message": error.message}})  # fmt: skip


def _sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _with_pings(outputs: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """``outputs``, with ``(-1, None)`` whenever `PING_S` pass without one."""
    pending = asyncio.ensure_future(anext(outputs))
    try:
        while True:
            done, _ = await asyncio.wait([pending], timeout=PING_S)
            if not done:
                yield -1, None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(outputs))
    finally:  # (the read must end before the outputs may be closed: an abort)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


class Streamer:
    """One answer's events, each an ``anthropic`` ``Raw*Event``: ``message_start`` (with
    the usage), a ``ping``, a text block opened at the first text (``text_delta``
    events), the calls as ``tool_use`` blocks (each one ``input_json_delta``),
    ``message_delta`` (the stop reason, the usage) and ``message_stop``."""

    def __init__(self, owner: Messages, p: Prepared, mid: str) -> None:
        self.owner, self.p, self.mid = owner, p, mid
        self.stream = Stream(p.plan.parser, p.plan.opening) if p.plan.parser else None
        self.started, self.index, self.text_open = False, 0, False
        self.first: StepOutput | None = None

    def feed(self, out: StepOutput | None) -> list[str]:
        from anthropic.types import RawMessageStartEvent

        if out is None:
            return [_sse("ping", {"type": "ping"})]
        events = []
        if not self.started:
            self.started, self.first = True, out
            start = self.owner.message(self.mid, self.p, out, None, None, [])
            events += [_event(RawMessageStartEvent(type="message_start", message=start)),
                       _sse("ping", {"type": "ping"})]  # fmt: skip
        api = self.owner.api
        text = out.text if self.stream is None else self.stream.feed(
            api.marked(out.token_ids, out.text))  # fmt: skip
        events += self.text(text)
        if out.finished:
            events += self.finish(out)
        return events

    def block(self, content: Any, delta: Any) -> list[str]:
        """A whole block: its start, one delta, its stop."""
        from anthropic.types import RawContentBlockStartEvent

        events = [_event(RawContentBlockStartEvent(type="content_block_start", index=self.index,
                                                   content_block=content))]  # fmt: skip
        events += self.delta(delta)
        return events + self.stop()

    def delta(self, delta: Any) -> list[str]:
        from anthropic.types import RawContentBlockDeltaEvent

        return [_event(RawContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                                 delta=delta))]  # fmt: skip

    def stop(self) -> list[str]:
        from anthropic.types import RawContentBlockStopEvent

        self.index += 1
        return [_event(RawContentBlockStopEvent(type="content_block_stop", index=self.index - 1))]

    def text(self, text: str) -> list[str]:
        from anthropic.types import RawContentBlockStartEvent, TextBlock, TextDelta

        if not text:
            return []
        events = []
        if not self.text_open:
            self.text_open = True
            events.append(_event(RawContentBlockStartEvent(
                type="content_block_start", index=self.index,
                content_block=TextBlock(type="text", text="", citations=None))))  # fmt: skip
        return events + self.delta(TextDelta(type="text_delta", text=text))

    def finish(self, last: StepOutput) -> list[str]:
        from anthropic.types import (
            InputJSONDelta,
            MessageDeltaUsage,
            RawMessageDeltaEvent,
            RawMessageStopEvent,
        )
        from anthropic.types.raw_message_delta_event import Delta

        calls: list[Call] = []
        events = []
        if self.stream is not None:
            rest, calls = self.owner.api.stream_end(self.p.plan, self.stream)
            events += self.text(rest or "")
        if self.text_open:
            events += self.stop()
        for c in calls:
            start = _tool_use(c).model_copy(update={"input": {}})
            events += self.block(start, InputJSONDelta(type="input_json_delta",
                                                       partial_json=c.arguments))  # fmt: skip
        reason, seq = stop_reason(last, calls)
        assert self.first is not None
        u = usage(self.first, self.p.marks, last.output_tokens)
        final = MessageDeltaUsage(
            input_tokens=u.input_tokens, output_tokens=u.output_tokens,
            cache_creation_input_tokens=u.cache_creation_input_tokens,
            cache_read_input_tokens=u.cache_read_input_tokens,
        )  # fmt: skip
        stopped = Delta(stop_reason=reason, stop_sequence=seq)
        delta = RawMessageDeltaEvent(type="message_delta", usage=final, delta=stopped)
        return events + [_event(delta), _event(RawMessageStopEvent(type="message_stop"))]


def _event(event: Any) -> str:
    return _sse(event.type, _dump(event))


__all__ = ["Messages", "usage"]
