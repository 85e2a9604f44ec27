"""Routing over many replicas, simulated: a trace replayed over N replicas, each a radix
cache of the given capacity, with the router that ships choosing a replica for every
request: the same `RoutingCore` (`radixkv.router.core`) ``radixkv route`` runs, driven on
the trace's clock, its index fed by the replicas' own KV events.

Owns: the replicas' caches, the load model and the measurements. Must not touch: how a
replica is chosen (the core's, but for ``oracle``, which no router ships).

Load model (simple on purpose, the same for every router): a request occupies its
replica from its arrival for ``computed prompt tokens / prefill_rate + output tokens x
decode_s`` seconds (replicas run requests concurrently). Prefills queue: a replica
computes one prompt's uncached tokens at a time, so a request's time to first token is
its wait for the replica's earlier prefills plus its own (decode runs beside them, as in
continuous batching); TTFT p50/p90 show what piling onto one replica costs. The core sees
what a live router sees: a request's ticket charges its replica from its arrival, its
prefill blocks until its first token, and is released when it ends. Busy time is the sum
of the requests' durations; load imbalance the busiest replica's over the mean.

Reuse, decomposed per request: *fleet-available* is the longest prefix any replica
holds when the request arrives; *routing-captured* what the chosen replica holds (here
also what it serves: the simulated caches are exact and report their pages at once, so
nothing is lost after routing). Their gap is reuse the router left on the table.

Routers: every policy of `radixkv.router.policies` (``round_robin``, ``least_load``,
``approx`` over trees of routed prompts bounded by the replica's capacity, ``kv`` with its
claims and shared-prefix pricing), and ``oracle``: the replica with the longest cached
prefix, load ignored (ties: the emptiest cache). Not a bound when capacity is short: a
prefix every request shares (a system prompt) pulls all traffic to one replica, whose
cache then thrashes. `pooled_bound` is the reference instead.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from radixkv.events import EventCollector
from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.router.core import APPROX_TREE_TOKENS, RoutingCore, Ticket
from radixkv.sim.replay import serve_request
from radixkv.sim.traces import SimRequest, Trace
from radixkv.tree import RadixCache


class ReplicaSweep(NamedTuple):
    """`sweep_replicas`: every point, and the pooled bound per (replicas, capacity)."""

    results: list[ReplicaResult]
    bounds: dict[tuple[int, int | None], float]


class Fleet(NamedTuple):
    """The simulated fleet: its routing core and its replicas."""

    core: RoutingCore
    replicas: list[_Replica]


ROUTERS = (*policies.POLICIES, "oracle")
PREFILL_RATE = 10_000.0  # prompt tokens a second a replica computes (default)
DECODE_S = 0.02  # seconds per output token (default)
KV_OVERLAP_WEIGHT = policies.KV_OVERLAP_WEIGHT


@dataclass
class ReplicaResult:
    trace: str
    router: str
    replicas: int
    capacity_units: int | None
    requests: int
    prompt_tokens: int
    hit_tokens: int
    token_hit_rate: float
    prefill_tokens: int  # prompt tokens computed (not served from a cache)
    load_imbalance: float  # max busy time / mean busy time
    max_in_flight: int
    fleet_hit_rate: float = 0.0  # longest prefix any replica held / prompt tokens
    ttft_p50_s: float = 0.0  # time to first token: queued prefills + its own
    ttft_p90_s: float = 0.0
    # the TTFT p90 no router could beat at this hit rate: a request's own prefill alone
    own_prefill_p90_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Replica:
    """One replica: an exact cache, as the engine configures it, whose KV events go
    to the routing core's index the moment it changes."""

    def __init__(self, name: int, capacity: int | None, core: RoutingCore) -> None:
        self.name, self.core = name, core
        self.events = EventCollector()
        self.cache = RadixCache(page_size=1, merge_chains=True, event_sink=self.events)
        self.capacity = capacity
        self.busy = 0.0
        self.prefill_free = 0.0  # when the replica's queued prefills are done

    def serve(self, req: SimRequest, capacity: int | None, outputs: bool) -> int:
        """Serve one request; the index hears of what the cache stored and evicted."""
        hit, _ = serve_request(self.cache, req, capacity, outputs)
        batch = self.events.drain()
        if batch is not None:
            self.core.apply(self.name, batch)
        return hit


def simulate_replicas(
    trace: Trace,
    replicas: int,
    capacity_units: int | None,
    router: str = "kv",
    cache_outputs: bool = False,
    prefill_rate: float = PREFILL_RATE,
    decode_s: float = DECODE_S,
    kv_weight: float = KV_OVERLAP_WEIGHT,
) -> ReplicaResult:
    """Replay ``trace`` over ``replicas`` replicas of ``capacity_units`` each.
    ``kv_weight`` weighs the prefill blocks in the ``kv`` router's cost."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; valid: {', '.join(ROUTERS)}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    clock = [0.0]
    core, reps = _fleet(router, replicas, capacity_units, kv_weight, lambda: clock[0])
    pending: list[tuple[float, int, bool, Ticket]] = []  # (when, order, ends?, ticket)
    order = 0
    hit_tokens = prompt_tokens = prefill = fleet_tokens = peak = 0
    ttfts: list[float] = []
    owns: list[float] = []
    for req in trace.requests:
        now = clock[0] = req.timestamp / 1000.0  # trace timestamps are milliseconds
        _settle(pending, now)
        prompt = req.units[: req.num_prompt_units]
        fleet_tokens += trace.hit_tokens(
            req, max(r.cache.match_len(RadixKey(array("q", prompt))) for r in reps)
        )
        outputs = len(req.units) - req.num_prompt_units
        if router == "oracle":
            ticket = core.assign(_oracle(reps, prompt), prompt, outputs)
        else:
            ticket = core.choose(prompt, None, outputs)
        rep = reps[ticket.worker.name]
        hit_tok = trace.hit_tokens(req, rep.serve(req, capacity_units, cache_outputs))
        computed = req.prompt_tokens - hit_tok
        rep.prefill_free = max(rep.prefill_free, now) + computed / prefill_rate
        ttfts.append(rep.prefill_free - now)
        owns.append(computed / prefill_rate)
        duration = computed / prefill_rate + req.output_tokens * decode_s
        rep.busy += duration
        for when, ends in ((rep.prefill_free, False), (now + duration, True)):
            heapq.heappush(pending, (when, order, ends, ticket))
            order += 1
        peak = max(peak, ticket.worker.in_flight)
        hit_tokens += hit_tok
        prompt_tokens += req.prompt_tokens
        prefill += computed
    busy = [r.busy for r in reps]
    mean = sum(busy) / len(busy)
    return ReplicaResult(
        trace=trace.name,
        router=router,
        replicas=replicas,
        capacity_units=capacity_units,
        requests=len(trace.requests),
        prompt_tokens=prompt_tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        prefill_tokens=prefill,
        load_imbalance=max(busy) / mean if mean else 1.0,
        max_in_flight=peak,
        fleet_hit_rate=fleet_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50_s=quantile(ttfts, 0.5),
        ttft_p90_s=quantile(ttfts, 0.9),
        own_prefill_p90_s=quantile(owns, 0.9),
    )


def _fleet(
    router: str, replicas: int, capacity_units: int | None, kv_weight: float,
    clock: Callable[[], float],
) -> Fleet:  # fmt: skip
    """The routing core (``oracle`` assigns by itself, through round robin's core) and
    the replicas, one cache of ``capacity_units`` each."""
    core = RoutingCore(
        router if router != "oracle" else "round_robin", kv_weight,
        approx_tokens=capacity_units or APPROX_TREE_TOKENS, clock=clock,
    )  # fmt: skip
    core.index.block_size = 1  # the replicas' caches hold one unit a page
    reps = [_Replica(i, capacity_units, core) for i in range(replicas)]
    for r in reps:
        core.add(r.name)
    return Fleet(core, reps)


def _settle(pending: list[tuple[float, int, bool, Ticket]], now: float) -> None:
    """Each first token and end due by ``now``, in time order, told to its ticket."""
    while pending and pending[0][0] <= now:
        _, _, ends, ticket = heapq.heappop(pending)
        if ends:
            ticket.release()
        else:
            ticket.started()


def quantile(xs: list[float], q: float) -> float:
    """The nearest-rank quantile (0.0 for no values)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def pooled_bound(trace: Trace, replicas: int, capacity_units: int | None) -> float:
    """Token hit rate of one LRU cache as large as all replicas together: what perfect
    placement with no duplication would approach (no router sees more than it)."""
    from radixkv.sim.replay import simulate

    cap = None if capacity_units is None else capacity_units * replicas
    return simulate(trace, cap, "lru").token_hit_rate


def router_list(text: str | None) -> tuple[str, ...]:
    """The routers ``--router`` names (``None`` or ``all``: every one).

    Raises:
        ValueError: ``router: ...`` naming an unknown one.
    """
    names = ROUTERS if text in (None, "all") else tuple(text.split(","))  # type: ignore[union-attr]
    for name in names:
        if name not in ROUTERS:
            raise ValueError(f"router: unknown {name!r}; valid: {', '.join(ROUTERS)}")
    return names


def sweep_replicas(
    trace: Trace,
    counts: list[int],
    caps: list[int | None],
    routers: tuple[str, ...],
    cache_outputs: bool = False,
    kv_weight: float = KV_OVERLAP_WEIGHT,
) -> ReplicaSweep:
    """Every (capacity, replica count, router) point, and per (count, capacity) the
    pooled bound (`pooled_bound`)."""
    results, bounds = [], {}
    for cap in caps:
        for n in counts:
            bounds[(n, cap)] = pooled_bound(trace, n, cap)
            for name in routers:
                results.append(
                    simulate_replicas(trace, n, cap, name, cache_outputs, kv_weight=kv_weight)
                )
    return ReplicaSweep(results, bounds)


def _oracle(reps: list[_Replica], prompt: list[int]) -> int:
    # ties (a cold prompt above all) go to the emptiest cache, spreading new prefixes
    key = RadixKey(array("q", prompt))
    return max(
        range(len(reps)),
        key=lambda i: (reps[i].cache.match_len(key), -reps[i].cache.total_size(), -i),
    )


def print_replicas_table(results: list[ReplicaResult], console: Any, labels: dict) -> None:
    from rich.table import Table

    first = results[0]
    table = Table(title=f"{first.trace}: {first.requests:,} requests over replicas")
    for col in ("replicas", "capacity each", "router", "fleet-available", "token hit rate",
                "prefill tokens", "TTFT p50 / p90", "own prefill p90", "load imbalance",
                "max in flight"):  # fmt: skip
        table.add_column(col, justify="left" if col == "router" else "right", overflow="fold")
    for r in results:
        table.add_row(
            str(r.replicas),
            labels.get(r.capacity_units, str(r.capacity_units)),
            r.router,
            f"{r.fleet_hit_rate:.4f}",
            f"{r.token_hit_rate:.4f}",
            f"{r.prefill_tokens:,}",
            f"{r.ttft_p50_s * 1e3:,.0f} / {r.ttft_p90_s * 1e3:,.0f} ms",
            f"{r.own_prefill_p90_s * 1e3:,.0f} ms",
            f"{r.load_imbalance:.2f}",
            str(r.max_in_flight),
        )
    console.print(table)


def plot_replicas(results: list[ReplicaResult], path: str) -> None:
    """Hit rate against replica count, one line per router."""
    from radixkv.sim.sweep import pyplot, save_plot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for router in dict.fromkeys(r.router for r in results):
        pts = sorted((r.replicas, r.token_hit_rate) for r in results if r.router == router)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=router)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"Cache-aware routing: {results[0].trace}")
    save_plot(plt, fig, ax, path)
