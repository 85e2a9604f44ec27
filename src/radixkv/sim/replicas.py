"""Routing over many replicas, simulated: a trace replayed over N replicas, each a radix
cache of the given capacity, with a router choosing a replica for every request.

Load model (simple on purpose, the same for every router): a request occupies its
replica from its arrival for ``computed prompt tokens / prefill_rate + output tokens x
decode_s`` seconds (replicas run requests concurrently); "in flight" counts the requests
still occupying a replica. Busy time is the sum of those durations; load imbalance is the
busiest replica's busy time over the mean. Prefills queue: a replica computes one
prompt's uncached tokens at a time, so a request's time to first token is its wait for
the replica's earlier prefills plus its own (decode runs beside them, as in continuous
batching); TTFT p50/p90 show what piling onto one replica costs.

Reuse, decomposed per request: *fleet-available* is the longest prefix any replica
holds when the request arrives; *routing-captured* what the chosen replica holds (here
also what it serves: the simulated caches are exact, so nothing is lost after routing).
Their gap is reuse the router left on the table.

Routers:
    round_robin   replicas in turn
    least_load    fewest requests in flight
    approx        SGLang router's cache-aware policy with its defaults: if the loads are
                  imbalanced (max - min > 64 and max > 1.5 x min) the least loaded;
                  else, if some replica's tree of routed prompts matches more than 0.3
                  of the request, the best match; else the replica with the smallest
                  tree. Each replica's tree holds what was routed to it, bounded by the
                  replica's capacity (LRU).
    kv            Dynamo's KV router (`radixkv.router.policies.kv`): cost = weight x
                  (1/4 x blocks queued for prefill there + this request's blocks after
                  the replica's cached overlap, known exactly, as events would report
                  it) + blocks of the requests in flight there; the lowest cost wins.
                  (The router's shared-prefix term needs its index's fan-out; the
                  simulator has no global index and leaves it out.)
    oracle        the replica with the longest cached prefix, load ignored (ties: the
                  emptiest cache). Not a bound when capacity is short: a prefix every
                  request shares (a system prompt) pulls all traffic to one replica,
                  whose cache then thrashes. `pooled_bound` is the reference instead.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.sim.replay import serve_request
from radixkv.sim.traces import SimRequest, Trace
from radixkv.tree import RadixCache

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
    def __init__(self, capacity: int | None) -> None:
        self.cache = RadixCache(page_size=1, merge_chains=True)  # as the engine's
        self.capacity = capacity
        self.busy = 0.0
        self.finishing: list[tuple[float, int]] = []  # (finish time, blocks) heap
        self.active_blocks = 0
        self.prefill_free = 0.0  # when the replica's queued prefills are done
        self.routed = RadixCache(page_size=1)  # approx: prompts routed here

    def retire(self, now: float) -> None:
        while self.finishing and self.finishing[0][0] <= now:
            self.active_blocks -= heapq.heappop(self.finishing)[1]

    @property
    def in_flight(self) -> int:
        return len(self.finishing)


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
    reps = [_Replica(capacity_units) for _ in range(replicas)]
    choose = _ROUTERS[router]
    if router == "kv":
        choose = functools.partial(_kv, w=kv_weight, rate=prefill_rate, unit=trace.block_size)
    turn = itertools.count()
    hit_tokens = prompt_tokens = prefill = fleet_tokens = 0
    peak = 0
    ttfts: list[float] = []
    owns: list[float] = []
    for req in trace.requests:
        now = req.timestamp / 1000.0  # trace timestamps are milliseconds
        for r in reps:
            r.retire(now)
        prompt = RadixKey(array("q", req.units[: req.num_prompt_units]))
        fleet_tokens += trace.hit_tokens(req, max(r.cache.match_len(prompt) for r in reps))
        i = choose(reps, req, prompt, next(turn))
        rep = reps[i]
        hit, _ = serve_request(rep.cache, req, capacity_units, cache_outputs)
        if router == "approx":
            serve_request(rep.routed, req, capacity_units, False)
        hit_tok = trace.hit_tokens(req, hit)
        computed = req.prompt_tokens - hit_tok
        rep.prefill_free = max(rep.prefill_free, now) + computed / prefill_rate
        ttfts.append(rep.prefill_free - now)
        owns.append(computed / prefill_rate)
        duration = computed / prefill_rate + req.output_tokens * decode_s
        rep.busy += duration
        blocks = len(req.units)
        heapq.heappush(rep.finishing, (now + duration, blocks))
        rep.active_blocks += blocks
        peak = max(peak, rep.in_flight)
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
        ttft_p50_s=_quantile(ttfts, 0.5),
        ttft_p90_s=_quantile(ttfts, 0.9),
        own_prefill_p90_s=_quantile(owns, 0.9),
    )


def _quantile(xs: list[float], q: float) -> float:
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


Router = Callable[[list[_Replica], SimRequest, RadixKey, int], int]


def _round_robin(reps: list[_Replica], req: SimRequest, prompt: RadixKey, turn: int) -> int:
    return policies.round_robin(range(len(reps)), turn)


def _least_load(reps: list[_Replica], req: SimRequest, prompt: RadixKey, turn: int) -> int:
    return policies.least_load(range(len(reps)), {i: r.in_flight for i, r in enumerate(reps)})


def _approx(reps: list[_Replica], req: SimRequest, prompt: RadixKey, turn: int) -> int:
    ids = range(len(reps))
    return policies.approx(
        ids,
        {i: r.in_flight for i, r in enumerate(reps)},
        {i: r.routed.match_len(prompt) for i, r in enumerate(reps)},
        len(prompt),
        {i: r.routed.total_size() for i, r in enumerate(reps)},
    )


def _kv(
    reps: list[_Replica],
    req: SimRequest,
    prompt: RadixKey,
    turn: int,
    w: float = KV_OVERLAP_WEIGHT,
    rate: float = PREFILL_RATE,
    unit: int = 1,
) -> int:
    now = req.timestamp / 1000.0
    # a router counts the prefills it sent that have not answered yet: here, the queue
    queued = {i: max(0.0, r.prefill_free - now) * rate / unit for i, r in enumerate(reps)}
    return policies.kv(
        range(len(reps)),
        {i: r.cache.match_len(prompt) for i, r in enumerate(reps)},
        len(prompt),
        {i: r.active_blocks for i, r in enumerate(reps)},
        w,
        {i: r.cache.total_size() for i, r in enumerate(reps)},
        queued,
    )


def _oracle(reps: list[_Replica], req: SimRequest, prompt: RadixKey, turn: int) -> int:
    # ties (a cold prompt above all) go to the emptiest cache, spreading new prefixes
    return max(
        range(len(reps)),
        key=lambda i: (reps[i].cache.match_len(prompt), -reps[i].cache.total_size(), -i),
    )


_ROUTERS: dict[str, Router] = {
    "round_robin": _round_robin,
    "least_load": _least_load,
    "approx": _approx,
    "kv": _kv,
    "oracle": _oracle,
}


def print_replicas_table(results: list[ReplicaResult], console: Any, labels: dict) -> None:
    from rich.table import Table

    first = results[0]
    table = Table(title=f"{first.trace}: {first.requests:,} requests over replicas")
    for col in ("replicas", "capacity each", "router", "fleet-available", "token hit rate",
                "prefill tokens", "TTFT p50 / p90", "own prefill p90", "load imbalance",
                "max in flight"):  # fmt: skip
        table.add_column(col, justify="left" if col == "router" else "right")
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install 'radixkv[plot]'") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for router in dict.fromkeys(r.router for r in results):
        pts = sorted((r.replicas, r.token_hit_rate) for r in results if r.router == router)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=router)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"Cache-aware routing: {results[0].trace}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
