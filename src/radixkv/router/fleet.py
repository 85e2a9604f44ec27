"""The router's fleet: the workers it forwards to, their health, their event streams and
the router's metrics, around one `RoutingCore` (`radixkv.router.core`).

Owns: worker addresses (`WorkerSpec`), health (three failed checks in a row, or a failed
connection, take a worker out until it answers again; its index entries stay: a restarted
worker's event stream starts over and clears them), the event subscribers, the check
that a worker matches the router (tokenizer, page size, model), and the Prometheus
counters. Must not touch: how a worker is chosen (the core's), HTTP (the proxy's).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from radixkv.engine.tokenizer import Tokenizer, tokenizer_fingerprint
from radixkv.events import KVEventBatch, replay_endpoint
from radixkv.router import policies
from radixkv.router.core import RoutingCore, Ticket, WorkerLoad

log = logging.getLogger("radixkv.router")
HEALTH_FAILURES = 3  # health checks failed in a row that take a worker out (SGLang's: 3)


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
    """A worker as the proxy sees it: its address, health, and its load in the core."""

    spec: WorkerSpec
    load: WorkerLoad
    failed_checks: int = 0  # health checks failed in a row

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def id(self) -> str:
        """``HOST:PORT``: how ``/workers/{id}`` names it."""
        return self.spec.url.split("://", 1)[1]

    @property
    def alive(self) -> bool:
        return self.load.alive

    @property
    def in_flight(self) -> int:
        return self.load.in_flight


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


class Router:
    """The fleet around a routing core (see the module docstring).

    Args:
        specs: the workers at start.
        policy, kv_weight: the core's policy (`radixkv.router.core`).
        tokenizer: the workers' tokenizer (routing compares token ids).
        events_key: the workers' key for namespace tags.
        worker_key: the workers' API key, which the router sends them (never a
            client's key).
    """

    def __init__(
        self,
        specs: list[WorkerSpec],
        policy: str,
        tokenizer: Tokenizer,
        kv_weight: float = policies.KV_OVERLAP_WEIGHT,
        events_key: bytes | None = None,
        worker_key: str | None = None,
    ) -> None:
        if not specs:
            raise ValueError("give at least one worker")
        self.core = RoutingCore(policy, kv_weight, events_key)
        self.policy, self.tokenizer = policy, tokenizer
        self.worker_headers = {"authorization": f"Bearer {worker_key}"} if worker_key else {}
        self.workers: list[Worker] = []
        self.subscribers: dict[str, Any] = {}  # worker URL -> its EventSubscriber
        self._events_on = False
        self._metrics()
        for s in specs:
            self.add_worker(s, quiet=True)

    def _metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("radixkv_router:requests", "Requests routed",
                                  ["worker", "policy"], registry=r)  # fmt: skip
        self.m_retries = Counter("radixkv_router:retries", "Requests retried after a "
                                 "worker failed", ["worker"], registry=r)  # fmt: skip
        self.m_overlap = Counter("radixkv_router:overlap_blocks", "Cached blocks the index "
                                 "reported on the chosen worker", ["worker"],
                                 registry=r)  # fmt: skip
        self.m_blocks = Counter("radixkv_router:request_blocks", "Whole blocks of routed "
                                "prompts", registry=r)  # fmt: skip
        self.m_in_flight = Gauge("radixkv_router:in_flight", "Requests in flight",
                                 ["worker"], registry=r)  # fmt: skip
        self.m_alive = Gauge("radixkv_router:worker_alive", "1 while the worker is healthy",
                             ["worker"], registry=r)  # fmt: skip
        # reuse, decomposed: what the fleet held, what routing captured, what was served
        self.m_prompt = Counter("radixkv_router:prompt_tokens", "Prompt tokens routed "
                                "(the router's tokenizer)", registry=r)  # fmt: skip
        self.m_fleet = Counter("radixkv_router:fleet_available_tokens", "Prompt tokens the "
                               "worker holding the longest prefix had, by the index",
                               registry=r)  # fmt: skip
        self.m_captured = Counter("radixkv_router:routing_captured_tokens", "Prompt tokens "
                                  "the chosen worker had, by the index",
                                  registry=r)  # fmt: skip
        self.m_delivered = Counter("radixkv_router:engine_delivered_tokens", "Prompt tokens "
                                   "the chosen worker served from its cache (its usage's "
                                   "cached_tokens)", registry=r)  # fmt: skip
        self.m_cut = Counter("radixkv_router:streams_cut", "Answers a worker broke off "
                             "after the first byte (the client got an error event)",
                             ["worker"], registry=r)  # fmt: skip

    @property
    def index(self) -> Any:
        return self.core.index

    # --- events -------------------------------------------------------------------------
    def start_events(self) -> None:
        self._events_on = True
        for w in self.workers:
            self._subscribe(w)

    def _subscribe(self, w: Worker) -> None:
        from radixkv.router.subscriber import EventSubscriber

        if self._events_on and w.spec.events:
            self.subscribers[w.url] = EventSubscriber(
                w.url, w.spec.events, w.spec.replay, self.apply
            )

    def apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        self.core.apply(worker, batch)

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

    def add_worker(self, spec: WorkerSpec, quiet: bool = False) -> Worker:
        """Route to ``spec`` from now on (following its events, if it has any).

        Raises:
            ValueError: the router already has a worker at that address.
        """
        ident = spec.url.split("://", 1)[1]
        if self.find(spec.url) is not None or self.find(ident) is not None:
            raise ValueError(f"the router already has the worker {spec.url}")
        w = Worker(spec, self.core.add(spec.url))
        self.workers.append(w)
        self.m_alive.labels(w.url).set(1)
        self._subscribe(w)
        if not quiet:
            log.warning("worker %s added", w.url)
        return w

    def remove_worker(self, w: Worker) -> None:
        """Stop routing to ``w`` and forget what the index knew of it. Requests already
        there finish; their answers still reach the clients."""
        self.workers.remove(w)
        sub = self.subscribers.pop(w.url, None)
        if sub is not None:
            sub.close()  # no batch of w's lands in the index after this
        self.core.remove(w.url)
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

    def worker_of(self, ticket: Ticket) -> Worker:
        """The proxy's view of the worker a ticket charges."""
        name = ticket.worker.name
        return next(w for w in self.workers if w.url == name)

    def in_flight_changed(self, w: Worker) -> None:
        self.m_in_flight.labels(w.url).set(w.in_flight)

    # --- health -------------------------------------------------------------------------
    def mark_dead(self, w: Worker, why: str) -> None:
        """Stop routing to ``w``. Its index entries stay: a worker that was only slow
        comes back with its cache, and one that restarted starts its event stream over,
        which clears them (`EventSubscriber`)."""
        if w.alive:
            log.warning("worker %s is out: %s", w.url, why)
        w.load.alive = False
        self.m_alive.labels(w.url).set(0)

    def mark_alive(self, w: Worker) -> None:
        w.failed_checks = 0
        if not w.alive:
            log.warning("worker %s is back", w.url)
        w.load.alive = True
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
