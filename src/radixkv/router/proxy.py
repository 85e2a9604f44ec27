"""``radixkv route``: an OpenAI-compatible proxy that sends each request to the replica
most likely to hold its prefix.

Workers are ``radixkv serve`` (or vLLM) replicas, each optionally with its KV events
address. The router tokenizes the prompt with the model's tokenizer (chat template
included), asks its policy for a worker (`radixkv.router.policies`), and forwards the
request body unchanged, streaming the answer back byte for byte; the response carries
``x-radixkv-worker``. Policies:

    round_robin, least_load (requests in flight through this router),
    approx  SGLang router's cache-aware policy over a tree of the prompts it routed,
    kv      (default) Dynamo's cost over the event-fed index (`policies.kv`): weight x
            (1/4 x blocks still to prefill for requests sent to the worker that have
            not answered yet + this prompt's blocks after the worker's cached overlap,
            a prefix many cached prompts share counting as held everywhere) + blocks
            of the requests in flight there. A prompt routed to a worker counts as
            cached there while the request runs and for EVENTS_GRACE_S after (at most
            PENDING_S), until the worker's events arrive (they follow the request by a
            step or more, and a chat's next turn often comes first).

A health check (``GET /health``) runs every ``health_interval`` seconds; a worker that
fails three in a row, or whose connection fails, is taken out until it answers again
(its index entries stay: a restarted worker's event stream starts over and clears
them). A request whose worker fails before the answer starts is retried on the
next worker; once streaming has started it cannot be.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from radixkv.engine.tokenizer import Tokenizer
from radixkv.events import KVEventBatch, replay_endpoint, salt_tag
from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.router.index import KvIndex
from radixkv.server.access import Access, AccessMiddleware
from radixkv.tree import RadixCache

log = logging.getLogger("radixkv.router")
APPROX_TREE_TOKENS = 1 << 22  # per worker; the oldest routed prompts are evicted beyond
# kv: a routed prompt counts as cached on its worker for this long, until the worker's
# events (which follow the request by a step or more) make the index say so
PENDING_S = 10.0
EVENTS_GRACE_S = 1.0  # after a request ends, how long its claim still stands
FORWARDED_HEADERS = ("content-type", "retry-after")
HEALTH_FAILURES = 3  # health checks failed in a row that take a worker out (SGLang's: 3)
ADMIN_PATHS = ("/workers",)  # changing the fleet: the router's --admin-key only


@dataclass
class WorkerSpec:
    """A worker's HTTP base URL and, optionally, its KV events endpoints."""

    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """``URL`` or ``URL,EVENTS`` (replay on the events port + 1)."""
        url, _, events = text.partition(",")
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker {text!r}: expected http://HOST:PORT[,tcp://HOST:PORT]")
        if not events:
            return cls(url)
        try:
            return cls(url, events, replay_endpoint(events))
        except ValueError as e:
            raise ValueError(f"worker {text!r}: {e}") from None


@dataclass(eq=False)
class Worker:
    spec: WorkerSpec
    alive: bool = True
    in_flight: int = 0
    active_blocks: int = 0
    queued_blocks: int = 0  # prefill blocks of requests sent here, not answered yet
    failed_checks: int = 0  # health checks failed in a row
    routed: RadixCache = field(default_factory=lambda: RadixCache(page_size=1))
    pending: deque = field(default_factory=deque)  # [expiry, RadixKey] of recent routes

    def pending_overlap(self, key: RadixKey, now: float) -> int:
        """Tokens of ``key`` shared with a prompt routed here whose pages the worker's
        events may not have reported yet (see `Router.settled`)."""
        while self.pending and self.pending[0][0] < now:
            self.pending.popleft()
        best = 0
        for expiry, k in self.pending:
            if expiry >= now and k.extra_key == key.extra_key:
                best = max(best, k.match(key))
        return best

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def id(self) -> str:
        """``HOST:PORT``: how ``/workers/{id}`` names it."""
        return self.spec.url.split("://", 1)[1]


@dataclass
class Choice:
    """A routing decision: the worker, the blocks the index says it holds, the most any
    alive worker holds (fleet-available), and the blocks it must prefill (its overlap
    counts what was routed there lately)."""

    worker: Worker
    held: int
    fleet: int
    prefill: int
    pending: list | None = None  # kv: [expiry, key], the claim routing made for it


def check_workers(
    specs: list[WorkerSpec],
    tokenizer: Tokenizer,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> list[str]:
    """What makes a worker unfit to route to, read from its ``/v1/models``: a tokenizer
    other than the router's (every overlap would be computed on other token ids, and be
    0), a page size other than the other workers', or another model (weights, config,
    dtype: the same prompt would not mean the same KV, so routing by cached prefix would
    mix models). Workers that do not answer, or do not say (a vLLM), are passed over
    with a warning; the index still checks their events' block size."""
    from radixkv.engine.tokenizer import tokenizer_fingerprint

    mine = tokenizer_fingerprint(tokenizer)
    problems, pages, models = [], {}, {}
    for spec in specs:
        try:
            r = httpx.get(f"{spec.url}/v1/models", timeout=timeout, headers=headers)
            card = r.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("worker %s: cannot read /v1/models (%s); not checked", spec.url, e)
            continue
        info = card.get("radixkv") if isinstance(card, dict) else None
        if not isinstance(info, dict):
            log.warning("worker %s does not describe its tokenizer; not checked", spec.url)
            continue
        if info.get("tokenizer") != mine:
            problems.append(
                f"worker {spec.url} ({card.get('id')}) tokenizes with {info.get('tokenizer')}, "
                f"the router with {mine}: give route --model the workers' model"
            )
        pages[spec.url] = info.get("page_size")
        if info.get("model") is not None:
            models[spec.url] = f"{card.get('id')} {str(info['model'])[:16]}"
    if len(set(pages.values())) > 1:
        problems.append(f"the workers' page sizes differ: {pages}")
    if len(set(models.values())) > 1:
        problems.append(f"the workers serve different models (id and identity): {models}")
    return problems


USAGE_TAIL = 4096  # bytes kept from the end of an answer: its usage is there


def _cached_tokens(tail: bytes) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` from the end of an answer (a JSON
    body, or an SSE stream whose last event before ``[DONE]`` carries the usage; a stream
    without ``include_usage`` has none: 0)."""
    found = _CACHED.findall(tail)
    return int(found[-1]) if found else 0


_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


class Router:
    """The routing state: workers, the event-fed index, the policy."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        policy: str,
        tokenizer: Tokenizer,
        kv_weight: float = policies.KV_OVERLAP_WEIGHT,
        events_key: bytes | None = None,
        worker_key: str | None = None,
    ) -> None:
        if policy not in policies.POLICIES:
            raise ValueError(f"policy must be one of {policies.POLICIES}, got {policy!r}")
        if not specs:
            raise ValueError("give at least one worker")
        self.workers = [Worker(s) for s in specs]
        self.policy, self.tokenizer, self.kv_weight = policy, tokenizer, kv_weight
        self.events_key = events_key  # the workers' key for namespace tags (salt_tag)
        # what the router sends the workers (their --api-key), never the client's key
        self.worker_headers = {"authorization": f"Bearer {worker_key}"} if worker_key else {}
        self.index = KvIndex()
        self._index_lock = threading.Lock()  # subscriber threads write, handlers read
        self._turn = itertools.count()
        self.subscribers: dict[str, Any] = {}  # worker URL -> its EventSubscriber
        self._events_on = False
        self.registry = CollectorRegistry()
        self.m_requests = Counter("radixkv_router:requests", "Requests routed",
                                  ["worker", "policy"], registry=self.registry)  # fmt: skip
        self.m_retries = Counter("radixkv_router:retries", "Requests retried after a "
                                 "worker failed", ["worker"], registry=self.registry)  # fmt: skip
        self.m_overlap = Counter("radixkv_router:overlap_blocks", "Cached blocks the index "
                                 "reported on the chosen worker", ["worker"],
                                 registry=self.registry)  # fmt: skip
        self.m_blocks = Counter("radixkv_router:request_blocks", "Whole blocks of routed "
                                "prompts", registry=self.registry)  # fmt: skip
        self.m_in_flight = Gauge("radixkv_router:in_flight", "Requests in flight",
                                 ["worker"], registry=self.registry)  # fmt: skip
        self.m_alive = Gauge("radixkv_router:worker_alive", "1 while the worker is healthy",
                             ["worker"], registry=self.registry)  # fmt: skip
        # reuse, decomposed: what the fleet held, what routing captured, what was served
        self.m_prompt = Counter("radixkv_router:prompt_tokens", "Prompt tokens routed "
                                "(the router's tokenizer)", registry=self.registry)  # fmt: skip
        self.m_fleet = Counter("radixkv_router:fleet_available_tokens", "Prompt tokens the "
                               "worker holding the longest prefix had, by the index",
                               registry=self.registry)  # fmt: skip
        self.m_captured = Counter("radixkv_router:routing_captured_tokens", "Prompt tokens "
                                  "the chosen worker had, by the index",
                                  registry=self.registry)  # fmt: skip
        self.m_delivered = Counter("radixkv_router:engine_delivered_tokens", "Prompt tokens "
                                   "the chosen worker served from its cache (its usage's "
                                   "cached_tokens)", registry=self.registry)  # fmt: skip
        self.m_cut = Counter("radixkv_router:streams_cut", "Answers a worker broke off "
                             "after the first byte (the client got an error event)",
                             ["worker"], registry=self.registry)  # fmt: skip
        for w in self.workers:
            self.m_alive.labels(w.url).set(1)

    # --- events -------------------------------------------------------------------------
    def start_events(self) -> None:
        self._events_on = True
        for w in self.workers:
            self._subscribe(w)

    def _subscribe(self, w: Worker) -> None:
        from radixkv.router.subscriber import EventSubscriber

        if self._events_on and w.spec.events:
            self.subscribers[w.url] = EventSubscriber(
                w.url, w.spec.events, w.spec.replay, self._apply
            )

    def _apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        with self._index_lock:
            self.index.apply(worker, batch)

    def stop_events(self) -> None:
        self._events_on = False
        for s in self.subscribers.values():
            s.close()

    # --- membership ---------------------------------------------------------------------
    def find(self, worker_id: str) -> Worker | None:
        """The worker whose id (``HOST:PORT``) or URL is ``worker_id``."""
        for w in self.workers:
            if worker_id in (w.id, w.url):
                return w
        return None

    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Route to ``spec`` from now on (following its events, if it has any).

        Raises:
            ValueError: the router already has a worker at that address.
        """
        if self.find(spec.url) is not None or self.find(Worker(spec).id) is not None:
            raise ValueError(f"the router already has the worker {spec.url}")
        w = Worker(spec)
        self.workers.append(w)
        self.m_alive.labels(w.url).set(1)
        self._subscribe(w)
        log.warning("worker %s added", w.url)
        return w

    def remove_worker(self, w: Worker) -> None:
        """Stop routing to ``w`` and forget what the index knew of it. Requests already
        there finish; their answers still reach the clients."""
        self.workers.remove(w)
        sub = self.subscribers.pop(w.url, None)
        if sub is not None:
            sub.close()  # no batch of w's lands in the index after this
        with self._index_lock:
            self.index.remove_worker(w.url)
        self.m_alive.labels(w.url).set(0)
        log.warning("worker %s removed", w.url)

    # --- choosing -----------------------------------------------------------------------
    def tokens(self, path: str, body: dict) -> list[int]:
        """The prompt's token ids as the workers will see them (best effort: [] when
        the body is not a prompt the tokenizer understands; the worker will say why)."""
        try:
            if path.endswith("chat/completions"):
                messages = [
                    {"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else "".join(p.get("text", "") for p in m["content"])}
                    for m in body["messages"]
                ]  # fmt: skip
                return list(self.tokenizer.apply_chat_template(messages))
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt))
            return [int(t) for t in prompt]
        except (KeyError, TypeError, ValueError, AttributeError):
            return []

    def choose(self, tokens: list[int], salt: Any) -> Choice:
        """The worker for a prompt, with what the index says about it."""
        alive = [w for w in self.workers if w.alive] or self.workers
        pending = None  # kv: the claim this route makes until the worker's events speak
        in_flight = {w: w.in_flight for w in alive}
        with self._index_lock:
            tag = None if salt is None else salt_tag(salt, self.events_key)
            by_url, shared = self.index.lookup(tokens, tag, salt)
        held = {w: by_url.get(w.url, 0) for w in alive}
        overlap: dict[Hashable, int] = dict(held)
        if self.policy == "kv":
            size = self.index.block_size or 16
            key, now = RadixKey(tokens, salt), time.monotonic()
            overlap = {w: max(held[w], w.pending_overlap(key, now) // size) for w in alive}
        if self.policy == "round_robin":
            w = policies.round_robin(alive, next(self._turn))
        elif self.policy == "least_load":
            w = policies.least_load(alive, in_flight)
        elif self.policy == "approx":
            key = RadixKey(tokens, salt) if tokens else None
            matched = {x: x.routed.match_len(key) if key else 0 for x in alive}
            sizes = {x: x.routed.total_size() for x in alive}
            w = policies.approx(alive, in_flight, matched, len(tokens), sizes)
            if key is not None:
                self._remember(w, key)
        else:
            size = self.index.block_size or 16
            with self._index_lock:
                cached = {x: self.index.num_blocks(x.url) for x in alive}
            w = policies.kv(
                alive, overlap, len(tokens) // size, {x: x.active_blocks for x in alive},
                self.kv_weight, cached, {x: x.queued_blocks for x in alive}, shared,
            )  # fmt: skip
            pending = [now + PENDING_S, key]
            w.pending.append(pending)
        fleet, size = max(held.values(), default=0), self.index.block_size or 16
        prefill = len(tokens) // size - overlap.get(w, 0)
        return Choice(w, held.get(w, 0), fleet, prefill, pending)

    @staticmethod
    def settled(choice: Choice, served: bool) -> None:
        """The chosen worker is done with the request: its events about the prompt follow
        within a step, so after ``EVENTS_GRACE_S`` the index alone speaks for it (a worker
        under memory pressure may already have evicted it; claiming it for the whole
        ``PENDING_S`` piled a run's requests on one thrashing worker). ``served``
        False: it never took the request; forget the claim now."""
        if choice.pending is not None:
            end = time.monotonic() + (EVENTS_GRACE_S if served else 0.0)
            choice.pending[0] = min(choice.pending[0], end)

    def _remember(self, w: Worker, key: RadixKey) -> None:
        over = w.routed.total_size() + len(key) - APPROX_TREE_TOKENS
        if over > 0:
            w.routed.evict(over)
        w.routed.insert(key)

    def charge(self, w: Worker, blocks: int, sign: int = 1) -> None:
        """Count (``sign`` 1) or release (-1) a request's load on ``w``: from the moment
        it is chosen until it ends or fails, so a request still in prefill is seen."""
        w.in_flight += sign
        w.active_blocks += sign * blocks
        self.m_in_flight.labels(w.url).set(w.in_flight)

    def queue(self, w: Worker, blocks: int, sign: int = 1) -> None:
        """Count (1) or release (-1) the prefill blocks of a request sent to ``w`` until
        its answer starts (``radixkv serve`` answers after the first token)."""
        w.queued_blocks += sign * blocks

    def mark_dead(self, w: Worker, why: str) -> None:
        """Stop routing to ``w``. Its index entries stay: a worker that was only slow
        comes back with its cache, and one that restarted starts its event stream over,
        which clears them (`EventSubscriber`)."""
        if w.alive:
            log.warning("worker %s is out: %s", w.url, why)
        w.alive = False
        self.m_alive.labels(w.url).set(0)

    def mark_alive(self, w: Worker) -> None:
        w.failed_checks = 0
        if not w.alive:
            log.warning("worker %s is back", w.url)
        w.alive = True
        self.m_alive.labels(w.url).set(1)

    def health_checked(self, w: Worker, ok: bool) -> None:
        """A health check's answer: ``HEALTH_FAILURES`` failures in a row take ``w`` out
        (a busy worker may miss one); one success brings it back. A request whose
        connection to ``w`` fails takes it out at once (`mark_dead`)."""
        if ok:
            self.mark_alive(w)
            return
        w.failed_checks += 1
        if w.failed_checks >= HEALTH_FAILURES:
            self.mark_dead(w, f"{w.failed_checks} health checks failed in a row")


def build_router_app(
    router: Router, health_interval: float = 1.0, access: Access | None = None
) -> FastAPI:
    """The proxy app. Its lifespan starts the event subscribers and the health loop.
    ``access``: who may reach it (`radixkv.server.access`; admin paths are ``/workers``:
    without an admin key, the fleet cannot be changed at run time)."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), headers=router.worker_headers
    )

    async def health_loop() -> None:
        while True:
            for w in list(router.workers):
                try:
                    ok = (await client.get(f"{w.url}/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if w in router.workers:  # (not removed meanwhile)
                    router.health_checked(w, ok)
            await asyncio.sleep(health_interval)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        router.start_events()
        task = asyncio.ensure_future(health_loop())
        try:
            yield
        finally:
            task.cancel()
            router.stop_events()
            await client.aclose()

    app = FastAPI(title="radixkv route", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(AccessMiddleware, access=access or Access(admin_paths=ADMIN_PATHS))
    app.state.router = router

    def error(status: int, message: str, code: str | None = None) -> JSONResponse:
        body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
        return JSONResponse(body, status_code=status)

    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error(400, f"the body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        tokens = router.tokens(path, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) else 16
        size = router.index.block_size or 16
        blocks = (len(tokens) + max_tokens) // size
        choice = router.choose(tokens, salt)
        first = choice.worker
        order = [first] + [w for w in router.workers if w is not first and w.alive]
        streamed = body.get("stream") is True
        for attempt, w in enumerate(order):
            # counted now, so the next choice sees this request; the load moves with a retry
            prefill = choice.prefill if w is first else len(tokens) // size
            router.charge(w, blocks)
            router.queue(w, prefill)
            try:
                upstream = await client.send(
                    client.build_request(
                        "POST",
                        f"{w.url}{path}",
                        content=raw,
                        headers={"content-type": "application/json"},
                    ),
                    stream=True,
                )
            except httpx.TransportError as e:
                router.queue(w, prefill, -1)
                router.charge(w, blocks, -1)
                if w is first:
                    router.settled(choice, served=False)
                router.mark_dead(w, f"{type(e).__name__}: {e}")
                router.m_retries.labels(w.url).inc()
                continue
            except BaseException:
                router.queue(w, prefill, -1)
                router.charge(w, blocks, -1)
                router.settled(choice, served=False)
                raise
            router.queue(w, prefill, -1)  # the answer started: its prefill is done
            if upstream.status_code >= 500 and attempt + 1 < len(order):
                await upstream.aclose()  # busy or broken before answering: next worker
                router.charge(w, blocks, -1)
                if w is first:
                    router.settled(choice, served=False)
                router.m_retries.labels(w.url).inc()
                continue
            router.m_requests.labels(w.url, router.policy).inc()
            overlap = choice.held if w is first else 0
            router.m_overlap.labels(w.url).inc(overlap)
            router.m_blocks.inc(len(tokens) // size)
            router.m_prompt.inc(len(tokens))
            router.m_fleet.inc(min(len(tokens), choice.fleet * size))
            router.m_captured.inc(min(len(tokens), overlap * size))
            sse = streamed and upstream.status_code == 200

            async def relay(
                w: Worker = w, upstream: httpx.Response = upstream, sse: bool = sse
            ) -> AsyncIterator[bytes]:
                tail = b""  # the answer's last bytes: [DONE], and the usage before it
                try:
                    async for chunk in upstream.aiter_raw():
                        tail = (tail + chunk)[-USAGE_TAIL:]
                        yield chunk
                    router.m_delivered.inc(_cached_tokens(tail))
                    if sse and b"data: [DONE]" not in tail:
                        raise httpx.RemoteProtocolError("the stream ended without [DONE]")
                except httpx.HTTPError as e:  # the worker died mid-answer: nothing to retry
                    router.mark_dead(w, f"mid-stream: {e}")
                    router.m_cut.labels(w.url).inc()
                    if sse:  # an OpenAI-style error event, so the client sees a failure
                        err = {"error": {"message": f"the worker {w.url} broke off the "
                                         f"answer: {e}", "type": "server_error",
                                         "param": None, "code": "worker_failed"}}  # fmt: skip
                        yield f"data: {json.dumps(err)}\n\n".encode()
                finally:
                    await upstream.aclose()
                    router.charge(w, blocks, -1)
                    router.settled(choice, served=True)

            headers = {k: v for k, v in upstream.headers.items() if k.lower() in FORWARDED_HEADERS}
            headers["x-radixkv-worker"] = w.url
            return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)
        return error(503, "no worker could take the request", "no_worker")  # all released

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for w in router.workers:
            if w.alive:
                try:
                    r = await client.get(f"{w.url}/v1/models", timeout=5.0)
                    return Response(r.content, r.status_code, media_type="application/json")
                except httpx.HTTPError as e:
                    router.mark_dead(w, str(e))
        return error(503, "no worker is alive", "no_worker")

    @app.get("/health")
    async def health() -> Response:
        alive = [w.url for w in router.workers if w.alive]
        status = 200 if alive else 503
        return JSONResponse({"status": "ok" if alive else "no worker", "alive": alive}, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    # --- the fleet at run time (admin: needs the router's --admin-key) -------------------
    def describe(w: Worker) -> dict:
        return {"id": w.id, "url": w.url, "events": w.spec.events, "alive": w.alive}

    @app.get("/workers")
    async def list_workers() -> dict:
        return {"workers": [describe(w) for w in router.workers]}

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(400, f"the body is not valid JSON: {e}")
        url = body.get("url") if isinstance(body, dict) else None
        events = body.get("events") if isinstance(body, dict) else None
        if not isinstance(url, str) or not (events is None or isinstance(events, str)):
            return error(400, 'send {"url": "http://HOST:PORT", "events": "tcp://HOST:PORT"} '
                         "(events optional)", "invalid_worker")  # fmt: skip
        try:
            spec = WorkerSpec.parse(url if events is None else f"{url},{events}")
        except ValueError as e:
            return error(400, str(e), "invalid_worker")
        if router.find(spec.url) is not None:
            return error(409, f"the router already has the worker {spec.url}", "worker_exists")
        others = [w.spec for w in router.workers]
        problems = await asyncio.to_thread(
            check_workers, [*others, spec], router.tokenizer, 5.0, router.worker_headers
        )
        if problems:
            return error(400, "; ".join(problems), "worker_mismatch")
        try:
            w = router.add_worker(spec)
        except ValueError as e:  # added meanwhile by another request
            return error(409, str(e), "worker_exists")
        return JSONResponse(describe(w), status_code=201)

    @app.delete("/workers/{worker_id:path}")
    async def remove_worker(worker_id: str) -> Response:
        w = router.find(worker_id)
        if w is None:
            return error(404, f"no worker {worker_id!r}: GET /workers lists them", "no_worker")
        if len(router.workers) == 1:
            return error(409, "that is the last worker: add another first", "last_worker")
        await asyncio.to_thread(router.remove_worker, w)
        return JSONResponse(describe(w))

    @app.get("/route/state")
    async def state() -> dict:
        return {
            "policy": router.policy,
            "block_size": router.index.block_size,
            "workers": [
                {
                    "url": w.url,
                    "alive": w.alive,
                    "in_flight": w.in_flight,
                    "queued_blocks": w.queued_blocks,
                    "indexed_blocks": router.index.num_blocks(w.url),
                }
                for w in router.workers
            ],
            "time": time.time(),
        }

    return app
