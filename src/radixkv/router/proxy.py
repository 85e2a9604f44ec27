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

A health check (``GET /health``) runs every ``health_interval`` seconds (see
`radixkv.router.fleet`). A request is retried on the next worker only when it never ran
(the connection never opened, or a 503 ``queue_full``); an error the request may have
caused goes back to its client, so one request cannot take down the fleet.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from radixkv.router.admin import ADMIN_PATHS, fleet_routes
from radixkv.router.core import Ticket
from radixkv.router.fleet import Router, Worker, WorkerSpec, check_workers
from radixkv.web.access import Access, AccessMiddleware
from radixkv.web.errors import ApiError

MAX_CACHE_KEY = 1024  # as radixkv.server.protocol (the router imports no server module)
MAX_CHOICES = 128  # n, as radixkv.server.protocol's MAX_N (OpenAI's limit)

FORWARDED_HEADERS = ("content-type", "retry-after")
USAGE_TAIL = 4096  # bytes kept from the end of an answer: its usage is there
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
# errors raised before a request's bytes reached a worker: safe to retry (aiohttp
# raises ConnectionTimeoutError for a connect that timed out)
NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# an idle connection to a worker is closed after this; uvicorn (radixkv serve, vLLM)
# closes idle ones after 5 s, and reusing one it closed would fail a request that ran
KEEPALIVE_S = 4.0
CONNECT_TIMEOUT_S = 5.0
# connections to all workers at once (httpx's default, as before): past it a request
# waits for one, so a flood cannot take every file descriptor the router has
MAX_WORKER_CONNECTIONS = 100
HEALTH_TIMEOUT_S = 2.0  # a worker's /health answers within this, or the check failed
ERROR_BODY_BYTES = 64 << 10  # an error body read to learn its code, at most
# a body this small is parsed and tokenized on the event loop (well under a millisecond
# with a Rust tokenizer); a larger one in a thread
INLINE_BODY_BYTES = 8 << 10


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

    def __init__(self, router: Router, health_interval: float) -> None:
        self.router, self.health_interval = router, health_interval
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), headers=router.worker_headers
        )
        self.session: aiohttp.ClientSession | None = None

    # --- health --------------------------------------------------------------------------
    async def check(self, w: Worker) -> None:
        """One health check: an answer other than 200, or a refused connection, is
        certain (the worker is out at once); a timeout may be a busy worker (it counts
        towards `HEALTH_FAILURES`)."""
        try:
            answer = await self.client.get(f"{w.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok, certain = answer.status_code == 200, True
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            ok, certain = False, True
        except httpx.HTTPError:
            ok, certain = False, False
        if w in self.router.workers:  # (not removed meanwhile)
            self.router.health_checked(w, ok, certain)

    async def health_loop(self) -> None:
        while True:  # every worker at once: a hung one delays no other's check
            await asyncio.gather(*(self.check(w) for w in list(self.router.workers)))
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
            connector=aiohttp.TCPConnector(limit=MAX_WORKER_CONNECTIONS,
                                           keepalive_timeout=KEEPALIVE_S),
        )  # fmt: skip
        self.router.start_events()
        task = asyncio.ensure_future(self.health_loop())
        try:
            yield
        finally:
            task.cancel()
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
        ticket = self.choose(body, tokens, max_tokens, n)
        streamed = body.get("stream") is True
        first = self.router.worker_of(ticket)
        order = [first] + [w for w in self.router.workers if w is not first and w.alive]
        for attempt, w in enumerate(order):
            if w is not first:  # a retry: the load moves with it
                ticket = self.router.core.assign(w.url, tokens, max_tokens, n)
            answer = await self.attempt(w, ticket, (raw, path, streamed), attempt + 1 < len(order))
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
        self, w: Worker, ticket: Ticket, request: tuple[bytes, str, bool], retry: bool
    ) -> Response | None:
        """Send ``request`` (its body, path, and whether it streams) to ``w``: the answer,
        or None when it never ran there and the next worker may take it (``retry``: there
        is a next one)."""
        router = self.router
        raw, path, streamed = request
        router.in_flight_changed(w)
        try:
            upstream = await self.send(w, raw, path)
        except NEVER_SENT as e:  # it never reached the worker: the next one may take it
            self.give_back(w, ticket)
            router.mark_dead(w, f"{type(e).__name__}: {e}")
            router.m_retries.labels(w.url).inc()
            return None
        except aiohttp.ClientError as e:  # it reached the worker, which then broke
            # the connection: the request may have run, or broken it; never retried
            self.give_back(w, ticket)
            router.mark_dead(w, f"{type(e).__name__}: {e}")
            raise ApiError(502, f"the worker {w.url} broke the connection before answering "
                           f"({type(e).__name__}); not retried: the request may have run",
                           code="worker_failed", kind="router_error") from None  # fmt: skip
        except BaseException:
            self.give_back(w, ticket)
            raise
        ticket.started()  # the answer started: its prefill is done
        headers = {k: v for k, v in upstream.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["x-radixkv-worker"] = w.url
        if upstream.status == 503:
            data, code = await _read_error(upstream)
            self.give_back(w, ticket)
            if code == "engine_dead":  # /health says so too; stop sending there now
                router.mark_dead(w, "its engine is not running")
            if code == "queue_full" and retry:
                router.m_retries.labels(w.url).inc()  # refused before it ran: the next
                return None
            return Response(data, 503, headers=headers)
        sse = streamed and upstream.status == 200
        return StreamingResponse(
            self.relay(w, ticket, upstream, sse), status_code=upstream.status, headers=headers
        )

    def give_back(self, w: Worker, ticket: Ticket) -> None:
        """Release a ticket for a request that did not run on ``w``."""
        ticket.release(served=False)
        self.router.in_flight_changed(w)

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
        self, w: Worker, ticket: Ticket, upstream: aiohttp.ClientResponse, sse: bool
    ) -> AsyncIterator[bytes]:
        router = self.router
        tail = b""  # the answer's last bytes: [DONE], and the usage before it
        try:
            async for chunk in upstream.content.iter_any():
                tail = (tail + chunk)[-USAGE_TAIL:]
                yield chunk
            router.m_delivered.inc(_cached_tokens(tail))
            if sse and b"data: [DONE]" not in tail:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except aiohttp.ClientError as e:  # the worker died mid-answer: nothing to retry
            router.mark_dead(w, f"mid-stream: {e}")
            router.m_cut.labels(w.url).inc()
            if sse:  # an OpenAI-style error event, so the client sees a failure
                err = ApiError(502, f"the worker {w.url} broke off the answer: {e}",
                               code="worker_failed", kind="server_error")  # fmt: skip
                yield f"data: {json.dumps(err.body())}\n\n".encode()
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

    @api.get("/v1/models")
    async def models() -> Response:
        for w in router.workers:
            if w.alive:
                try:
                    r = await proxy.client.get(f"{w.url}/v1/models", timeout=5.0)
                    return Response(r.content, r.status_code, media_type="application/json")
                except httpx.HTTPError as e:
                    router.mark_dead(w, str(e))
        raise ApiError(503, "no worker is alive", code="no_worker", kind="router_error")

    @api.get("/health")
    async def health() -> Response:
        alive = [w.url for w in router.workers if w.alive]
        status = 200 if alive else 503
        return JSONResponse({"status": "ok" if alive else "no worker", "alive": alive}, status)

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
                    "in_flight": w.in_flight,
                    "queued_blocks": w.load.queued_blocks,
                    "events_stale": w.load.stale,
                    "indexed_blocks": router.index.num_blocks(w.url),
                }
                for w in router.workers
            ],
            "time": time.time(),
        }

    return api


def build_router_app(
    router: Router, health_interval: float = 1.0, access: Access | None = None
) -> FastAPI:
    """The proxy app. Its lifespan starts the event subscribers and the health loop.
    ``access``: who may reach it (`radixkv.web.access`; admin paths are ``/workers``:
    without an admin key, the fleet cannot be changed at run time)."""
    proxy = Proxy(router, health_interval)
    app = FastAPI(title="radixkv route", lifespan=proxy.lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, access=access or Access(admin_paths=ADMIN_PATHS))
    app.state.router = router

    @app.exception_handler(ApiError)
    async def _api_error(_r: Request, e: ApiError) -> JSONResponse:
        # every refusal: the access rules' (413 for a chunked body), a body that is not
        # a request, no worker to take it
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    app.include_router(openai_routes(proxy))
    app.include_router(fleet_routes(router, proxy.client))
    return app


__all__ = ["ADMIN_PATHS", "Router", "WorkerSpec", "build_router_app", "check_workers"]
