"""The router's fleet: the workers it forwards to, their health, their event streams and
the router's metrics, around one `RoutingCore` (`radixkv.router.core`).

Owns: worker addresses (`WorkerSpec`), health (three failed checks in a row, or a failed
connection, take a worker out until it answers again; its index entries stay: a restarted
worker's event stream starts over and clears them), each worker's circuit breaker
(`radixkv.router.breaker`: requests that keep failing take it out though its health says
200), the event subscribers, the check that a worker matches the router (tokenizer, page
size, model) and that its card is sane, and the Prometheus counters. Must not touch: how a
worker is chosen (the core's), HTTP (the proxy's).

A worker is routable (its `WorkerLoad.alive`, which the core reads) while it is healthy
and its breaker admits requests; `Router.refresh` turns a breaker whose cooldown ended
half-open, and the proxy calls it before each choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from radixkv.events import KVEventBatch, replay_endpoint
from radixkv.router import policies
from radixkv.router.breaker import Breaker, BreakerConfig
from radixkv.router.core import RoutingCore, Ticket, WorkerLoad
from radixkv.tokenizer import Tokenizer, load_tokenizer, supports_tools, tokenizer_fingerprint
from radixkv.web.anthropic import CountTokensRequest, MessagesRequest, to_chat
from radixkv.web.bounded import PeerError, bounded_get
from radixkv.web.errors import ApiError, is_anthropic


class Parsed(NamedTuple):
    """A request the router read (`Router.parse`)."""

    body: dict
    tokens: list[int]  # its prompt's token ids, as the workers will see them


log = logging.getLogger("radixkv.router")
HEALTH_FAILURES = 3  # health checks failed in a row that take a worker out (SGLang's: 3)
CARD_BYTES = 1 << 20  # a worker's /v1/models answer, at most (a card is a few hundred bytes)
CARD_TIMEOUT_S = 5.0  # ... and all of it within this
# a card's sizes: positive ints, at most these (a page of 2^16 tokens, a context of 2^31)
CARD_INTS = {"page_size": 1 << 16, "kv_blocks": 1 << 40, "max_model_len": 1 << 31}


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
    breaker: Breaker = field(default_factory=Breaker)
    failed_checks: int = 0  # health checks failed in a row
    healthy: bool = True  # its health checks and connections say it is up
    why: str | None = None  # why it is out, while it is

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def id(self) -> str:
        """``HOST:PORT``: how ``/workers/{id}`` names it."""
        return self.spec.url.split("://", 1)[1]

    @property
    def alive(self) -> bool:
        """Routable: healthy, and its breaker admits requests."""
        return self.load.alive

    @property
    def in_flight(self) -> int:
        return self.load.in_flight


async def read_card(
    client: httpx.AsyncClient, spec: WorkerSpec, timeout: float = CARD_TIMEOUT_S
) -> dict | None:
    """The worker's model card (its ``/v1/models``' first entry), or ``None`` when it
    does not answer in full within ``timeout`` s and `CARD_BYTES`, or has none (a warning
    says so)."""
    try:
        answer = await bounded_get(client, f"{spec.url}/v1/models", CARD_BYTES, timeout)
        card = json.loads(answer.body)["data"][0]
    except (PeerError, ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
        log.warning("worker %s: cannot read /v1/models (%s); not checked", spec.url,
                    str(e)[:200])  # fmt: skip
        return None
    return card if isinstance(card, dict) else None


def read_cards(
    specs: list[WorkerSpec], headers: dict | None = None, timeout: float = CARD_TIMEOUT_S
) -> dict[str, dict | None]:
    """Every worker's card (`read_card`), read at once: the whole read takes at most
    ``timeout`` s however many workers are slow."""

    async def read_all() -> list[dict | None]:
        async with httpx.AsyncClient(headers=headers, trust_env=False) as client:
            return await asyncio.gather(*(read_card(client, s, timeout) for s in specs))

    return dict(zip([s.url for s in specs], asyncio.run(read_all()), strict=True))


def card_problems(url: str, card: dict | None) -> list[str]:
    """What is wrong with a worker's card: its sizes (``page_size``, ``kv_blocks`` and
    ``max_model_len``, where given) must be positive ints within `CARD_INTS`, and its
    descriptive fields strings. The router computes with them on every request, so a
    card it cannot use is refused when the worker joins, not met as a 500 later."""
    if not isinstance(card, dict):
        return []
    problems = []
    raw = card.get("radixkv")
    if raw is not None and not isinstance(raw, dict):
        problems.append(f"worker {url}: its card's radixkv must be an object, got "
                        f"{type(raw).__name__}")  # fmt: skip
    info = radixkv_info(card)
    fields = [(k, info[k]) for k in ("page_size", "kv_blocks") if k in info]
    fields += [("max_model_len", card["max_model_len"])] if "max_model_len" in card else []
    for name, value in fields:
        if value is None and name == "max_model_len":
            continue  # (OpenAI-style cards may say null: no limit known)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                1 <= value <= CARD_INTS[name]):  # fmt: skip
            problems.append(f"worker {url}: its card's {name} must be an int in 1.."
                            f"{CARD_INTS[name]}, got {str(value)[:40]!r}")  # fmt: skip
    for name in ("tokenizer", "tokenizer_source", "model", "events"):
        if info.get(name) is not None and not isinstance(info[name], str):
            problems.append(f"worker {url}: its card's {name} must be a string")
    return problems


def radixkv_info(card: dict | None) -> dict:
    """What a radixkv worker's card says of it (``{}`` for other servers)."""
    info = card.get("radixkv") if isinstance(card, dict) else None
    return info if isinstance(info, dict) else {}


def workers_tokenizer(cards: dict[str, dict | None]) -> Tokenizer | None:
    """The tokenizer the workers' cards name (``tokenizer_source``), loaded here and
    checked against their fingerprint, for a router started without ``--model``;
    ``None`` when no worker says what it tokenizes with (none answered, or vLLMs).

    Raises:
        ValueError: the workers tokenize differently (naming each), or none of the
            sources they name loads here into their tokenizer (a path on another
            machine): give ``--model``.
    """
    prints = {url: radixkv_info(c).get("tokenizer") for url, c in cards.items()}
    prints = {url: p for url, p in prints.items() if isinstance(p, str)}
    if not prints:
        return None
    if len(set(prints.values())) > 1:
        raise ValueError(f"the workers tokenize differently ({prints}): route one fleet "
                         "per tokenizer")  # fmt: skip
    wanted = next(iter(prints.values()))
    sources = dict.fromkeys(
        s for s in (radixkv_info(cards[url]).get("tokenizer_source") for url in prints)
        if isinstance(s, str)
    )  # fmt: skip
    why = []
    for source in sources:
        try:
            tokenizer = load_tokenizer(source)
        except (ValueError, OSError, ModuleNotFoundError) as e:
            why.append(f"{source}: {str(e)[:200]}")
            continue
        if tokenizer_fingerprint(tokenizer) == wanted:
            return tokenizer
        why.append(f"{source}: tokenizes with {tokenizer_fingerprint(tokenizer)} here")
    raise ValueError(f"the workers tokenize with {wanted}, and no source they name loads "
                     f"into it here ({'; '.join(why) or 'none named'}): give --model")  # fmt: skip


def check_workers(
    specs: list[WorkerSpec],
    tokenizer: Tokenizer,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
    cards: dict[str, dict | None] | None = None,
) -> list[str]:
    """What makes a worker unfit to route to, read from its ``/v1/models``: a tokenizer
    other than the router's (every overlap would be computed on other token ids, and be
    0), a page size other than the other workers', or another model (weights, config,
    dtype: the same prompt would not mean the same KV, so routing by cached prefix would
    mix models). Workers that do not answer, or do not say (a vLLM), are passed over
    with a warning. ``cards``: the cards read already (by URL)."""
    mine = tokenizer_fingerprint(tokenizer)
    problems, pages, models = [], {}, {}
    missing = [s for s in specs if cards is None or s.url not in cards]
    cards = {**(cards or {}), **(read_cards(missing, headers, timeout) if missing else {})}
    for spec in specs:
        card = cards[spec.url]
        info = radixkv_info(card)
        if card is None:
            continue
        bad = card_problems(spec.url, card)
        if bad:
            problems += bad
            continue
        if not info:
            log.warning("worker %s does not describe its tokenizer; not checked", spec.url)
            continue
        if info.get("tokenizer") != mine:
            problems.append(
                f"worker {spec.url} ({str(card.get('id'))[:100]}) tokenizes with "
                f"{str(info.get('tokenizer'))[:100]}, "
                f"the router with {mine}: give route --model the workers' model"
            )
        pages[spec.url] = info.get("page_size")
        if info.get("model") is not None:
            models[spec.url] = f"{str(card.get('id'))[:100]} {str(info['model'])[:16]}"
    if len(set(pages.values())) > 1:
        problems.append(f"the workers' page sizes differ: {pages}")
    if len(set(models.values())) > 1:
        problems.append(f"the workers serve different models (id and identity): {models}")
    return problems


def _template_message(m: dict) -> dict:
    """An OpenAI chat message as the template takes it (best effort, as a worker renders
    it: text parts joined, a call's arguments as an object)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content)
    out = {"role": m["role"], "content": content}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]  # fmt: skip
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _strings(value: Any) -> int:
    """Characters of all the strings in a JSON value (iteratively: no recursion)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def _prompt_chars(path: str, body: dict) -> int:
    """Characters of text the prompt holds (best effort: 0 for what is not text)."""
    try:
        if is_anthropic(path):
            return _strings([body.get("system"), body.get("messages"), body.get("tools")])
        if path.endswith("chat/completions"):
            total = 0
            for m in body["messages"]:
                c = m["content"]
                total += len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)
            return total
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return len(prompt)
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return sum(map(len, prompt))
    except (KeyError, TypeError, AttributeError):
        pass
    return 0


class _EventFailures:
    """``radixkv_router:event_messages_failed_total`` by worker and kind, read from the
    subscribers at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        m = CounterMetricFamily("radixkv_router:event_messages_failed", "Event messages a "
                                "worker's stream sent that were skipped (malformed, refused "
                                "by the index)", labels=["worker", "kind"])  # fmt: skip
        for url, sub in list(self.router.subscribers.items()):
            for kind, n in list(sub.failures.items()):
                m.add_metric([url, kind], n)
        yield m


class Router:
    """The fleet around a routing core (see the module docstring).

    Args:
        specs: the workers at start.
        policy, kv_weight: the core's policy (`radixkv.router.core`).
        tokenizer: the workers' tokenizer (routing compares token ids).
        events_key: the workers' key for namespace tags.
        worker_key: the workers' API key, which the router sends them (never a
            client's key).
        cards: the workers' model cards by URL (`read_card`): their page size is the
            index's block size, their pool its bound on what each may claim to hold,
            their context the longest prompt the router tokenizes.
        block_size: the fleet's block size when no card says it (vLLM workers).
        breaker: each worker's circuit breaker (`radixkv.router.breaker`).
    """

    def __init__(
        self,
        specs: list[WorkerSpec],
        policy: str,
        tokenizer: Tokenizer,
        kv_weight: float = policies.KV_OVERLAP_WEIGHT,
        events_key: bytes | None = None,
        worker_key: str | None = None,
        cards: dict[str, dict | None] | None = None,
        block_size: int | None = None,
        breaker: BreakerConfig | None = None,
    ) -> None:
        if not specs:
            raise ValueError("give at least one worker")
        self.breaker = breaker or BreakerConfig()
        self.core = RoutingCore(policy, kv_weight, events_key)
        self.cards: dict[str, dict | None] = dict(cards or {})
        sizes = {radixkv_info(c).get("page_size") for c in self.cards.values()} - {None}
        if block_size is None and len(sizes) == 1:
            block_size = sizes.pop()
        self.core.index.block_size = block_size
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
        self.m_key = Counter("radixkv_router:prompt_cache_key_requests", "Requests with a "
                             "prompt_cache_key", registry=r)  # fmt: skip
        self.m_key_spills = Counter("radixkv_router:prompt_cache_key_spills", "prompt_cache_key "
                                    "requests sent past the key's worker, which was loaded "
                                    "beyond the bound", registry=r)  # fmt: skip
        self.m_retries = Counter("radixkv_router:retries", "Requests retried after a "
                                 "worker failed", ["worker"], registry=r)  # fmt: skip
        self.m_overlap = Counter("radixkv_router:overlap_blocks", "Cached blocks the index "
                                 "reported on the chosen worker", ["worker"],
                                 registry=r)  # fmt: skip
        self.m_blocks = Counter("radixkv_router:request_blocks", "Whole blocks of routed "
                                "prompts", registry=r)  # fmt: skip
        self.m_in_flight = Gauge("radixkv_router:in_flight", "Sequences in flight (a request "
                                 "of n choices counts n)", ["worker"], registry=r)  # fmt: skip
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
        self.m_failures = Counter("radixkv_router:worker_failures", "Requests a worker "
                                  "failed (a 5xx other than queue_full, no headers in time, "
                                  "a broken connection)", ["worker"], registry=r)  # fmt: skip
        self.m_trips = Counter("radixkv_router:breaker_trips", "Times a worker's circuit "
                               "breaker opened", ["worker"], registry=r)  # fmt: skip
        self.m_cut = Counter("radixkv_router:streams_cut", "Answers a worker broke off "
                             "after the first byte (the client got an error event)",
                             ["worker"], registry=r)  # fmt: skip
        self.m_stale = Gauge("radixkv_router:worker_events_stale", "1 while the worker's "
                             "index entries are not trusted: its event stream keeps "
                             "failing, or its replay is being applied", ["worker"],
                             registry=r)  # fmt: skip
        r.register(_EventFailures(self))

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
                w.url, w.spec.events, w.spec.replay, self.apply, self.set_stale
            )

    def apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        """A worker's batch into the index (refused whole, raising, if it fails a check)."""
        self.core.apply(worker, batch)

    def set_stale(self, worker: Hashable, stale: bool) -> None:
        load = self.core.workers.get(worker)
        if load is not None:
            load.stale = stale
            self.m_stale.labels(worker).set(int(stale))

    def max_context(self) -> int | None:
        """The longest prompt + output any worker takes, by their cards (``None``: no
        card says)."""
        lens = [c.get("max_model_len") for c in self.cards.values() if isinstance(c, dict)]
        lens = [n for n in lens if isinstance(n, int) and n > 0]
        return max(lens) if lens else None

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

    def add_worker(self, spec: WorkerSpec, quiet: bool = False, card: dict | None = None) -> Worker:
        """Route to ``spec`` from now on (following its events, if it has any).

        Raises:
            ValueError: the router already has a worker at that address.
        """
        ident = spec.url.split("://", 1)[1]
        if self.find(spec.url) is not None or self.find(ident) is not None:
            raise ValueError(f"the router already has the worker {spec.url}")
        if card is not None:
            self.cards[spec.url] = card
        w = Worker(spec, self.core.add(spec.url), Breaker(self.breaker, self.core.clock))
        info = radixkv_info(self.cards.get(spec.url))
        blocks = info.get("kv_blocks")
        if isinstance(blocks, int) and blocks > 0:  # a worker never holds more than its pool
            self.core.index.max_blocks[spec.url] = blocks
        # a recurrent model's events name its checkpoints, a windowed model's the pages
        # whose window is held: each block alone
        if info.get("events") in ("checkpoints", "windows"):
            self.core.index.sparse.add(spec.url)
        else:
            self.core.index.sparse.discard(spec.url)
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
    def parse(self, path: str, raw: bytes) -> Parsed:
        """The body and its prompt's token ids. Runs off the event loop.

        Raises:
            ApiError: (400) not JSON, not an object, or a prompt longer than any worker's
                context could hold (refused before tokenizing, as a server refuses it: a
                token covers at most the tokenizer's longest vocabulary entry).
        """

        def refuse(message: str, code: str | None = None, param: str | None = None) -> Any:
            return ApiError(400, message, param, code)

        try:
            body = json.loads(raw)
        except RecursionError:
            raise refuse("the body is nested too deeply") from None
        except ValueError as e:
            raise refuse(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise refuse("the body must be a JSON object")
        limit, per_token = self.max_context(), getattr(self.tokenizer, "max_token_chars", 0)
        chars = _prompt_chars(path, body)
        if limit and per_token and chars > limit * per_token:
            param = "prompt" if path.endswith("/v1/completions") else "messages"
            message = f"This model's maximum context length is {limit} tokens; the prompt has "
            raise refuse(f"{message}over {limit} tokens.", "context_length_exceeded", param)
        return Parsed(body, self.tokens(path, body))

    def tokens(self, path: str, body: dict) -> list[int]:
        """The prompt's token ids as the workers will see them (best effort: [] when
        the body is not a prompt the tokenizer understands; the worker will say why)."""
        try:
            if is_anthropic(path):
                return self._anthropic_tokens(path, body)
            if path.endswith("chat/completions"):
                messages = [_template_message(m) for m in body["messages"]]
                tools = body.get("tools")
                if tools and supports_tools(self.tokenizer):
                    return list(self.tokenizer.apply_chat_template(messages, tools))
                return list(self.tokenizer.apply_chat_template(messages))
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt))
            return [int(t) for t in prompt]
        except (KeyError, TypeError, ValueError, AttributeError, ApiError):
            return []

    def _anthropic_tokens(self, path: str, body: dict) -> list[int]:
        """An Anthropic request's prompt as a worker renders it (`radixkv.web.anthropic`:
        its messages and tools through the chat template, then a prefill)."""
        model = CountTokensRequest if path.endswith("count_tokens") else MessagesRequest
        chat = to_chat(model.model_validate(body))
        tk = self.tokenizer
        if chat.tools and supports_tools(tk):
            ids = list(tk.apply_chat_template(chat.messages, chat.tools))
        else:
            ids = list(tk.apply_chat_template(chat.messages))
        if chat.prefill:
            ids += getattr(tk, "encode_plain", tk.encode)(chat.prefill)
        return ids

    def worker_of(self, ticket: Ticket) -> Worker:
        """The proxy's view of the worker a ticket charges."""
        name = ticket.worker.name
        return next(w for w in self.workers if w.url == name)

    def in_flight_changed(self, w: Worker) -> None:
        self.m_in_flight.labels(w.url).set(w.in_flight)

    # --- health -------------------------------------------------------------------------
    def _update(self, w: Worker) -> None:
        """``w``'s routability (what the core reads) from its health and its breaker."""
        routable = w.healthy and w.breaker.admits()
        if routable != w.load.alive:
            w.load.alive = routable
            self.m_alive.labels(w.url).set(int(routable))

    def refresh(self) -> None:
        """Turn breakers whose cooldown is over half-open (O(workers))."""
        for w in self.workers:
            self._update(w)

    def mark_dead(self, w: Worker, why: str) -> None:
        """Stop routing to ``w``. Its index entries stay: a worker that was only slow
        comes back with its cache, and one that restarted starts its event stream over,
        which clears them (`EventSubscriber`)."""
        if w.healthy:
            log.warning("worker %s is out: %s", w.url, why)
        w.healthy, w.why = False, why
        self._update(w)

    def mark_alive(self, w: Worker) -> None:
        w.failed_checks = 0
        if not w.healthy:
            log.warning("worker %s is back", w.url)
            w.healthy, w.why = True, None
        self._update(w)

    def health_checked(self, w: Worker, ok: bool, certain: bool = False) -> None:
        """A health check's answer: a ``certain`` failure (``/health`` answered other
        than 200, or the connection was refused) takes ``w`` out at once;
        ``HEALTH_FAILURES`` uncertain ones (timeouts: a busy worker may miss one) in a
        row do; one success brings it back. A request whose connection to ``w`` fails
        takes it out at once too (`mark_dead`)."""
        if ok:
            self.mark_alive(w)
            return
        w.failed_checks += 1
        if certain or w.failed_checks >= HEALTH_FAILURES:
            self.mark_dead(w, f"{w.failed_checks} health checks failed in a row")

    # --- outcomes (the breaker) ---------------------------------------------------------
    def request_started(self, w: Worker) -> None:
        """A request goes to ``w`` now (a half-open breaker's probe: no other until it
        ends)."""
        w.breaker.started()
        self._update(w)

    def request_ended(self, w: Worker, ok: bool | None, why: str = "") -> None:
        """What came of a request sent to ``w``: ``ok`` True (it answered, a 4xx
        included: the client's fault), False (a 5xx other than ``queue_full``, no
        headers in time, a broken connection), None (no outcome: its client left
        first, or it was refused before running)."""
        b = w.breaker
        if ok is None:
            b.abandoned()
        elif ok:
            b.succeeded()
        else:
            self.m_failures.labels(w.url).inc()
            if b.failed_once():
                self.m_trips.labels(w.url).inc()
                log.warning("worker %s: breaker open for %g s after %d failed requests (%s)",
                            w.url, b.cooldown, b.failed, why)  # fmt: skip
        self._update(w)

    def out_reason(self, w: Worker) -> str | None:
        """Why ``w`` gets no traffic now (None: it does)."""
        if not w.healthy:
            return w.why or "unhealthy"
        if not w.alive:
            return f"circuit breaker {w.breaker.state} after {w.breaker.failed} failed requests"
        return None
