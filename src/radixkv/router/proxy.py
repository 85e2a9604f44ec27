"""``radixkv route``: an OpenAI-compatible proxy that sends each request to the replica
most likely to hold its prefix.

Workers are ``radixkv serve`` (or vLLM) replicas, each optionally with its KV events
address. The router tokenizes the prompt with the model's tokenizer (chat template
included), asks the routing core for a worker (`radixkv.router.core`: the policies, the
load, the event-fed index), and forwards the request body unchanged, streaming the answer
back byte for byte; the response carries ``x-radixkv-worker``.

Forwarding uses aiohttp (its HTTP parser is C: a streamed answer costs the router about a
third of httpx's CPU; docs/performance.md, "The proxy's cost"); health checks and the
admin calls, a few a second, use httpx.

Owns: HTTP (the OpenAI endpoints, forwarding, retries, streams) and the health loop. Must
not touch: how a worker is chosen (`radixkv.router.core`), the fleet's bookkeeping
(`radixkv.router.fleet`) or its admin endpoints (`radixkv.router.admin`).

A health check (``GET /health``) runs every ``health_interval`` seconds for each worker on
its own (a slow one delays no other's), each within `HEALTH_TIMEOUT_S` in all (see
`radixkv.router.fleet`). A request is retried on the next worker only when it never ran
(the connection never opened, or a 503 ``queue_full``); an error the request may have
caused goes back to its client, so one request cannot take down the fleet.

What a worker can cost the router (`Limits`): at most ``worker_connections`` connections
each (a hung worker cannot take the connections the others need), an answer's headers
within ``header_timeout`` (else a 504, and the connection is closed: the worker drops the
request), and every body the router reads whole (a card, ``/v1/models``, ``/health``, an
error) capped in size and time (`radixkv.web.bounded`); answers are relayed, never held.
A client that leaves before the headers arrive closes the worker's connection too, so
the worker aborts the request (a stream's client leaving does the same through the relay).
5xx answers, timeouts and broken connections count against a worker's circuit breaker
(`radixkv.router.breaker`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from radixkv.router.admin import ADMIN_PATHS, fleet_routes
from radixkv.router.core import Ticket
from radixkv.router.fleet import CARD_BYTES, Router, Worker, WorkerSpec, check_workers
from radixkv.web.access import Access, AccessMiddleware
from radixkv.web.bounded import PeerError, bounded_get
from radixkv.web.errors import ApiError, is_anthropic, shaped
from radixkv.web.serving import until_disconnected

MAX_CACHE_KEY = 1024  # as radixkv.server.protocol (the router imports no server module)
MAX_CHOICES = 128  # n, as radixkv.server.protocol's MAX_N (OpenAI's limit)

FORWARDED_HEADERS = ("content-type", "retry-after")
USAGE_TAIL = 4096  # bytes kept from the end of an answer: its usage is there
# prompt tokens the worker found cached: OpenAI's usage, or Anthropic's
_CACHED = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)"\s*:\s*(\d+)')
# errors raised before a request's bytes reached a worker: safe to retry (aiohttp
# raises ConnectionTimeoutError for a connect that timed out)
NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# an idle connection to a worker is closed after this; uvicorn (radixkv serve, vLLM)
# closes idle ones after 5 s, and reusing one it closed would fail a request that ran
KEEPALIVE_S = 4.0
CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0  # a worker's /health answers in full within this, or the check failed
HEALTH_BYTES = 64 << 10  # a /health answer, at most
MODELS_TIMEOUT_S = 5.0  # GET /v1/models through the router: the worker's answer, in full
ERROR_BODY_BYTES = 64 << 10  # an error body read to learn its code, at most
# a body this small is parsed and tokenized on the event loop (well under a millisecond
# with a Rust tokenizer); a larger one in a thread
INLINE_BODY_BYTES = 8 << 10


@dataclass(frozen=True)
class Limits:
    """What one worker may cost the router (the module docstring).

    ``worker_connections``: connections to each worker at once; past it a request waits
    for one of that worker's (100 was the router's total for every worker, which a hung
    worker took whole). ``header_timeout``: seconds for an answer's headers (a
    non-streamed answer's headers come with the whole answer; SGLang's gateway allows a
    request 30 minutes)."""

    worker_connections: int = 64
    header_timeout: float = 1800.0

    def __post_init__(self) -> None:
        n = self.worker_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"worker_connections must be an int >= 1, got {n!r}")
        t = self.header_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"header_timeout must be a positive number of seconds, got {t!r}")


class ClientGone(Exception):
    """The client left before the worker's answer began."""


def _cached_tokens(tail: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` from the end of an answer (a JSON
    body, or an SSE stream whose last event before ``[DONE]`` carries the usage; a stream
    without ``include_usage`` has none: 0)."""
    found = _CACHED.findall(tail)
    return int(found[-1]) if found else 0


async def _read_error(upstream: aiohttp.ClientResponse) -> tuple[bytes, str | None]:
    """A worker's (small) error body, read whole (at most ``ERROR_BODY_BYTES``), and its
    ``error.code`` (None when it has none)."""
    data = b""
    try:  # to its end: a read returns what has arrived, which may be a part
        while len(data) <= ERROR_BODY_BYTES:
            chunk = await upstream.content.read(ERROR_BODY_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except aiohttp.ClientError:
        pass  # what arrived, if anything
    finally:
        upstream.release()
    try:
        err = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return data, None
    code = err.get("code") if isinstance(err, dict) else None
    return data, code if isinstance(code, str) else None


class Proxy:
    """What the endpoints share: the fleet (`Router`) and one HTTP client to its workers.

    Owns: forwarding a request (choose, send, retry what never ran, relay the answer)
    and the health checks. ``client`` (httpx) checks and describes workers; ``session``
    (aiohttp, opened with the app's event loop) forwards requests."""

    def __init__(
        self, router: Router, health_interval: float, limits: Limits | None = None
    ) -> None:
        self.router, self.health_interval = router, health_interval
        self.limits = limits or Limits()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), headers=router.worker_headers,
            trust_env=False,
        )  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self.checks: dict[Worker, asyncio.Task] = {}  # each worker's health check running

    # --- health --------------------------------------------------------------------------
    async def check(self, w: Worker) -> None:
        """One health check, all of it within `HEALTH_TIMEOUT_S`: an answer other than
        200, or a refused connection, is certain (the worker is out at once); a timeout
        may be a busy worker (it counts towards `HEALTH_FAILURES`)."""
        try:
            answer = await bounded_get(self.client, f"{w.url}/health", HEALTH_BYTES,
                                       HEALTH_TIMEOUT_S)  # fmt: skip
            ok, certain = answer.status == 200, True
        except PeerError as e:
            ok, certain = False, e.refused
        if w in self.router.workers:  # (not removed meanwhile)
            self.router.health_checked(w, ok, certain)

    async def health_loop(self) -> None:
        """Every interval, a check of each worker whose last one is over: checks never
        wait for each other, so one slow ``/health`` delays no other worker's."""
        while True:
            workers = list(self.router.workers)
            for w in workers:
                task = self.checks.get(w)
                if task is None or task.done():
                    self.checks[w] = asyncio.ensure_future(self.check(w))
            for w in [w for w in self.checks if w not in workers]:
                self.checks.pop(w).cancel()
            self.router.refresh()
            await asyncio.sleep(self.health_interval)

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        # the body goes as it came, the answer comes back as the worker wrote it (no
        # compression asked for, none undone: its bytes are relayed); no proxy settings
        # read from the environment, no cookie kept from one request for the next
        self.session = aiohttp.ClientSession(
            headers=self.router.worker_headers, auto_decompress=False, trust_env=False,
            skip_auto_headers=("Accept-Encoding",), cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S,
                                           limit_per_host=self.limits.worker_connections),
        )  # fmt: skip
        self.router.start_events()
        task = asyncio.ensure_future(self.health_loop())
        try:
            yield
        finally:
            task.cancel()
            for check in self.checks.values():
                check.cancel()
            self.router.stop_events()
            await self.client.aclose()
            await self.session.close()

    # --- forwarding ----------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        """Choose a worker, send the body unchanged, relay the answer. Only what never
        ran passes to the next alive worker: a connection that never opened, or a 503
        ``queue_full`` (refused before it ran). Any other error, a 500 the request
        caused included, goes back to the client as the worker answered it: a request
        that breaks a worker is never sent to the next one. Every ticket is released
        once, on whichever path ends it."""
        try:
            raw = await request.body()
        except ClientDisconnect:
            raise ApiError(400, "the client went away before its body arrived",
                           code="client_disconnected", kind="router_error") from None  # fmt: skip
        # parsing and tokenizing a large prompt take long: off the event loop, so
        # /health and every other request keep their answers; a small one takes less
        # than handing it to a thread does
        if len(raw) <= INLINE_BODY_BYTES:
            body, tokens = self.router.parse(path, raw)
        else:
            body, tokens = await asyncio.to_thread(self.router.parse, path, raw)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) else 16
        n = body.get("n")  # choices run as n sequences on the worker (it checks the value)
        n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES else 1
        self.router.refresh()  # a breaker whose cooldown is over may take its probe
        ticket = self.choose(body, tokens, max_tokens, n)
        streamed = body.get("stream") is True
        first = self.router.worker_of(ticket)
        order = [first] + [w for w in self.router.workers if w is not first and w.alive]
        for attempt, w in enumerate(order):
            if w is not first:  # a retry: the load moves with it
                ticket = self.router.core.assign(w.url, tokens, max_tokens, n)
            answer = await self.attempt(
                request, w, ticket, (raw, path, streamed), attempt + 1 < len(order)
            )  # fmt: skip
            if answer is None:
                continue
            if answer.status_code != 503:
                self.count(w, ticket, tokens, w is first)
            return answer
        raise ApiError(
            503, "no worker could take the request", code="no_worker", kind="router_error"
        )  # fmt: skip  (every ticket released)

    def choose(self, body: dict, tokens: list[int], max_tokens: int, n: int) -> Ticket:
        """The routing core's ticket for the request (its salt and cache key as the
        worker will read them)."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        key = body.get("prompt_cache_key")
        # the worker refuses others (empty, or longer than its MAX_CACHE_KEY); hashing a
        # body-sized key for every worker would cost every request behind it
        key = key if isinstance(key, str) and 0 < len(key) <= MAX_CACHE_KEY else None
        ticket = self.router.core.choose(tokens, salt, max_tokens, key, n)
        if key is not None:
            self.router.m_key.inc()
            if ticket.key_spilled:
                self.router.m_key_spills.inc()
        return ticket

    async def attempt(
        self, request: Request, w: Worker, ticket: Ticket, sent: tuple[bytes, str, bool],
        retry: bool,
    ) -> Response | None:  # fmt: skip
        """Send ``sent`` (the body, path, and whether it streams) to ``w``: the answer,
        or None when it never ran there and the next worker may take it (``retry``: there
        is a next one). Every path tells the breaker what came of it."""
        router = self.router
        raw, path, streamed = sent
        router.in_flight_changed(w)
        router.request_started(w)
        try:
            upstream = await self.send_watched(request, w, raw, path)
        except NEVER_SENT as e:  # it never reached the worker: the next one may take it
            self.give_back(w, ticket, False, f"{type(e).__name__}: {e}")
            router.mark_dead(w, f"{type(e).__name__}: {e}")
            router.m_retries.labels(w.url).inc()
            return None
        except aiohttp.ClientError as e:  # it reached the worker, which then broke
            # the connection: the request may have run, or broken it; never retried
            self.give_back(w, ticket, False, f"{type(e).__name__}: {e}")
            router.mark_dead(w, f"{type(e).__name__}: {e}")
            raise ApiError(502, f"the worker {w.url} broke the connection before answering "
                           f"({type(e).__name__}); not retried: the request may have run",
                           code="worker_failed", kind="router_error") from None  # fmt: skip
        except asyncio.TimeoutError:  # its connection is closed: the worker drops it
            t = self.limits.header_timeout
            self.give_back(w, ticket, False, f"no answer within {t:g} s")
            raise ApiError(504, f"the worker {w.url} did not answer within {t:g} s "
                           "(--header-timeout); the request was cancelled there",
                           code="worker_timeout", kind="router_error") from None  # fmt: skip
        except ClientGone:  # nobody to answer; the worker's connection is closed
            self.give_back(w, ticket, None)
            raise ApiError(400, "the client went away before the answer began",
                           code="client_disconnected", kind="router_error") from None  # fmt: skip
        except BaseException:
            self.give_back(w, ticket, None)
            raise
        ticket.started()  # the answer started: its prefill is done
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["x-radixkv-worker"] = w.url
        if upstream.status in (503, 529):  # (529: Anthropic's API's full queue)
            data, code = await _read_error(upstream)
            code = "queue_full" if upstream.status == 529 else code
            # queue_full: refused before it ran, no failure (the worker is busy)
            self.give_back(w, ticket, None if code == "queue_full" else False, "answered 503")
            if code == "engine_dead":  # /health says so too; stop sending there now
                router.mark_dead(w, "its engine is not running")
            if code == "queue_full" and retry:
                router.m_retries.labels(w.url).inc()  # refused before it ran: the next
                return None
            return Response(data, upstream.status, headers=headers)
        router.request_ended(w, upstream.status < 500, f"answered {upstream.status}")
        sse = streamed and upstream.status == 200
        return StreamingResponse(
            self.relay(w, ticket, upstream, sse, path), status_code=upstream.status,
            headers=headers,
        )

    async def send_watched(
        self, request: Request, w: Worker, raw: bytes, path: str
    ) -> aiohttp.ClientResponse:
        """`send`, until the answer's headers arrive: within ``header_timeout``
        (`asyncio.TimeoutError`), and while the client is there (`ClientGone`). Either
        way the send is cancelled, which closes its connection: the worker sees its client
        leave and aborts the request, as it would for a client of its own."""
        send = asyncio.ensure_future(self.send(w, raw, path))
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            done, _ = await asyncio.wait([send, gone], timeout=self.limits.header_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            gone.cancel()
        if send in done:
            return send.result()
        send.cancel()
        late = (await asyncio.gather(send, return_exceptions=True))[0]
        if isinstance(late, aiohttp.ClientResponse):  # it answered as it was cancelled
            late.close()
        if gone in done and not gone.cancelled():
            raise ClientGone
        raise asyncio.TimeoutError

    def give_back(self, w: Worker, ticket: Ticket, ok: bool | None, why: str = "") -> None:
        """Release a ticket for a request that did not run on ``w`` (or may have, and
        failed), telling the breaker ``ok`` (`Router.request_ended`)."""
        ticket.release(served=False)
        self.router.in_flight_changed(w)
        self.router.request_ended(w, ok, why)

    async def send(self, w: Worker, raw: bytes, path: str) -> aiohttp.ClientResponse:
        assert self.session is not None, "the app's lifespan opens the session"
        return await self.session.post(
            f"{w.url}{path}", data=raw, headers={"content-type": "application/json"}
        )

    def count(self, w: Worker, ticket: Ticket, tokens: list[int], first: bool) -> None:
        """The reuse decomposition for a request a worker took."""
        router = self.router
        size = router.core.block_size
        overlap = ticket.held if first else 0
        router.m_requests.labels(w.url, router.policy).inc()
        router.m_overlap.labels(w.url).inc(overlap)
        router.m_blocks.inc(len(tokens) // size)
        router.m_prompt.inc(len(tokens))
        router.m_fleet.inc(min(len(tokens), ticket.fleet * size))
        router.m_captured.inc(min(len(tokens), overlap * size))

    async def relay(
        self, w: Worker, ticket: Ticket, upstream: aiohttp.ClientResponse, sse: bool,
        path: str = "",
    ) -> AsyncIterator[bytes]:  # fmt: skip
        router = self.router
        anthropic = is_anthropic(path)  # its streams end with message_stop, not [DONE]
        end = b"event: message_stop" if anthropic else b"data: [DONE]"
        tail = b""  # the answer's last bytes: its end, and the usage before it
        try:
            async for chunk in upstream.content.iter_any():
                tail = (tail + chunk)[-USAGE_TAIL:]
                yield chunk
            router.m_delivered.inc(_cached_tokens(tail))
            if sse and end not in tail:
                raise aiohttp.ClientPayloadError(f"the stream ended without {end.decode()}")
        except aiohttp.ClientError as e:  # the worker died mid-answer: nothing to retry
            router.mark_dead(w, f"mid-stream: {e}")
            router.m_cut.labels(w.url).inc()
            if sse:  # an error event in the API's shape, so the client sees a failure
                err = ApiError(502, f"the worker {w.url} broke off the answer: {e}",
                               code="worker_failed", kind="server_error")  # fmt: skip
                name = "event: error\n" if anthropic else ""
                yield f"{name}data: {json.dumps(shaped(err, path)[1])}\n\n".encode()
        finally:
            upstream.release()
            ticket.release(served=True)
            router.in_flight_changed(w)


def openai_routes(proxy: Proxy) -> APIRouter:
    """The OpenAI endpoints a client calls, and the router's own health, metrics and
    state."""
    api, router = APIRouter(), proxy.router

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/completions")

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.forward(request, "/v1/chat/completions")

    @api.post("/v1/messages")  # Anthropic's: routed by its prompt's tokens as chats are
    async def messages(request: Request) -> Response:
        return await proxy.forward(request, "/v1/messages")

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await proxy.forward(request, "/v1/messages/count_tokens")

    @api.get("/v1/models")
    async def models() -> Response:
        for w in router.workers:
            if w.alive:
                try:  # the worker's answer, bounded: any client can ask for it
                    r = await bounded_get(proxy.client, f"{w.url}/v1/models", CARD_BYTES,
                                          MODELS_TIMEOUT_S)  # fmt: skip
                    return Response(r.body, r.status, media_type="application/json")
                except PeerError as e:
                    if e.refused:
                        router.mark_dead(w, str(e))
                    raise ApiError(502, f"the worker's /v1/models: {e}",
                                   code="worker_failed", kind="router_error") from None  # fmt: skip
        raise ApiError(503, "no worker is alive", code="no_worker", kind="router_error")

    @api.get("/health")
    async def health() -> Response:
        """200 while a worker takes requests (``degraded`` when some do not, each with
        why), 503 when none does."""
        alive = [w.url for w in router.workers if w.alive]
        out = {w.url: router.out_reason(w) for w in router.workers if not w.alive}
        status = "ok" if not out else "degraded" if alive else "no worker"
        return JSONResponse({"status": status, "alive": alive, "out": out},
                            200 if alive else 503)  # fmt: skip

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/route/state")
    async def state() -> dict:
        return {
            "policy": router.policy,
            "block_size": router.index.block_size,
            "workers": [
                {
                    "url": w.url,
                    "alive": w.alive,
                    "healthy": w.healthy,
                    "breaker": w.breaker.state,
                    "in_flight": w.in_flight,
                    "queued_blocks": w.load.queued_blocks,
                    "recent_work_blocks": round(w.load.recent_work(router.core.clock()), 1),
                    "events_stale": w.load.stale,
                    "indexed_blocks": router.index.num_blocks(w.url),
                }
                for w in router.workers
            ],
            "time": time.time(),
        }

    return api


def build_router_app(
    router: Router, health_interval: float = 1.0, access: Access | None = None,
    limits: Limits | None = None,
) -> FastAPI:  # fmt: skip
    """The proxy app. Its lifespan starts the event subscribers and the health loop.
    ``access``: who may reach it (`radixkv.web.access`; admin paths are ``/workers``:
    without an admin key, the fleet cannot be changed at run time); ``limits``: what one
    worker may cost the router (`Limits`)."""
    proxy = Proxy(router, health_interval, limits)
    app = FastAPI(title="radixkv route", lifespan=proxy.lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, access=access or Access(admin_paths=ADMIN_PATHS))
    app.state.router = router

    @app.exception_handler(ApiError)
    async def _api_error(r: Request, e: ApiError) -> JSONResponse:
        # every refusal: the access rules' (413 for a chunked body), a body that is not
        # a request, no worker to take it (in Anthropic's shape on its paths)
        status, body = shaped(e, r.url.path)
        return JSONResponse(body, status_code=status, headers=e.headers)

    app.include_router(openai_routes(proxy))
    app.include_router(fleet_routes(router, proxy.client))
    return app


__all__ = ["ADMIN_PATHS", "Limits", "Router", "WorkerSpec", "build_router_app", "check_workers"]
