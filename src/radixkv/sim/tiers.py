"""Tiered KV, simulated: a device cache, a host tier and a shared store, so an operator
can size the host tier before buying RAM.

    device   a radix cache of ``device_units`` (LRU, evicts leaves); what it evicts is
             demoted to the host tier
    host     ``host_units`` of pages (LRU over pages; a unit id names its whole prefix);
             a page loaded back to the device leaves it (exclusive tiers)
    shared   every page ever computed (write-through to an unbounded store such as
             Redis), or nothing with ``shared=False``

A request's prompt hits, in order: the leading pages on the device, then the pages that
continue it in the host tier, then those in the shared store. Whatever it hit in a lower
tier is loaded back to the device, so after the request its whole prompt (and output,
with ``cache_outputs``) is on the device; what the device cannot hold of it (a context
longer than the device) is written to the host tier as it is computed (HiCache's
write-through of what would otherwise be dropped): an agent's 900k-token context on a
256k device used to be lost beyond its head, 0.85-0.91 of the reuse ceiling at 256k +
4M on 40 Claude Code sessions, now 0.99.

The time a host hit adds to a request's first token: its bytes over the host link
(`TierResult.load_seconds`, for a model's bytes per token and a bandwidth).

The device evicts least recently used first, or by the session order (``policy=
"session"``: `radixkv.sim.sessions`). With ``ahead`` (`Ahead`), a waiting session's
pages come back from the host before it is predicted to return, in the link's idle time
(`radixkv.sim.prefetch`); a request's host hits are then what it loaded on arrival.

Owns: the tier simulation. Must not touch: the real tiers (`radixkv.storage.tier`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from radixkv.key import RadixKey
from radixkv.sim.prefetch import Prefetch
from radixkv.sim.replay import SESSION, serve_request
from radixkv.sim.sessions import SessionOrder
from radixkv.sim.traces import SimRequest, Trace
from radixkv.tree import RadixCache


class TierSweep(NamedTuple):
    """`sweep_tiers`: every (device, host) point, and the pooled comparison."""

    results: list[TierResult]
    pooled: list[tuple[int, int, float]]  # (device, host, hit rate of one device + host cache)


@dataclass
class TierResult:
    trace: str
    device_units: int | None
    host_units: int
    shared: bool
    requests: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    shared_hit_tokens: int
    host_hit_requests: int = 0  # requests that loaded pages from the host tier
    spilled_tokens: int = 0  # computed tokens the device could not hold: written to host
    # with a `Prefetch`: tokens loaded from the host before their session came back (host
    # hits count only what a request loaded when it arrived), and the 90th percentile over
    # all requests of the tokens a request loaded when it arrived
    prefetched_tokens: int = 0
    host_load_p90_tokens: int = 0
    policy: str = "lru"  # the device's eviction order

    def load_p90_seconds(self, bytes_per_token: float, bandwidth: float) -> float:
        """The 90th percentile over all requests of the time spent loading host hits."""
        return self.host_load_p90_tokens * bytes_per_token / bandwidth

    def load_seconds(self, bytes_per_token: float, bandwidth: float) -> float:
        """Mean time a request with host hits spent loading them (``bandwidth``: bytes
        per second over the host link)."""
        if not self.host_hit_requests:
            return 0.0
        return self.host_hit_tokens * bytes_per_token / bandwidth / self.host_hit_requests

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.shared_hit_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            device_hit_rate=self.rate(self.device_hit_tokens),
            host_hit_rate=self.rate(self.host_hit_tokens),
            shared_hit_rate=self.rate(self.shared_hit_tokens),
            token_hit_rate=self.rate(self.hit_tokens),
        )
        return d


class _Demote:
    """The device cache's allocator: evicted pages (unit ids, the tree's default
    values) go to the host tier."""

    def __init__(self, host: OrderedDict, capacity: int) -> None:
        self.host, self.capacity = host, capacity

    def free(self, units: Any) -> None:
        self.spill(units.tolist())

    def spill(self, units: list[int]) -> None:
        """``units`` go to the host tier (the most recent), its oldest out past capacity."""
        if not self.capacity:
            return
        for u in units:
            self.host[u] = None
            self.host.move_to_end(u)
        while len(self.host) > self.capacity:
            self.host.popitem(last=False)


class Ahead(NamedTuple):
    """Load waiting sessions' host pages ahead of their predicted return
    (`radixkv.sim.prefetch`): the host link's ``tokens_per_ms``, and how far ahead."""

    tokens_per_ms: float
    horizon_ms: float


def simulate_tiers(
    trace: Trace,
    device_units: int | None,
    host_units: int,
    shared: bool = True,
    cache_outputs: bool = False,
    ahead: Ahead | None = None,
    policy: str = "lru",
) -> TierResult:
    """Replay ``trace`` through device + host (+ shared) tiers; hits by tier. The
    device evicts by ``policy``: ``lru``, or ``session`` (`radixkv.sim.sessions`: what
    its session is predicted to use last first); with ``ahead``, waiting sessions' pages
    are loaded from the host before they are predicted back (`radixkv.sim.prefetch`):
    under ``session`` such a load evicts only what is predicted back later."""
    if host_units < 0:
        raise ValueError(f"host capacity must be >= 0, got {host_units}")
    if policy not in ("lru", SESSION):
        raise ValueError(f"policy: the device's order is lru or session, got {policy!r}")
    replay = _TierReplay(trace, device_units, host_units, cache_outputs, policy)
    prefetch = None
    if ahead is not None:
        prefetch = Prefetch(*ahead, trace.block_size, device_units, cache_outputs)
    seen: set[int] = set()
    dev_tok = host_tok = shared_tok = prompt_tok = host_reqs = spilled = 0
    loads: list[int] = []  # tokens each request loaded from the host when it arrived
    for req in trace.requests:
        if prefetch is not None:  # (before the order hears of ``req``: it knows no future)
            prefetch.arrive(req, replay.load)
        if replay.order is not None:
            replay.order.arrive(req)
        prompt = req.units[: req.num_prompt_units]
        d, h = replay.lookup(prompt)
        s = h
        if shared:
            while s < len(prompt) and prompt[s] in seen:
                s += 1
        dev_tok += trace.hit_tokens(req, d)
        from_host = trace.hit_tokens(req, h) - trace.hit_tokens(req, d)
        host_tok, host_reqs = host_tok + from_host, host_reqs + (from_host > 0)
        loads.append(from_host)
        if prefetch is not None:
            prefetch.loaded(req.timestamp, from_host)
        shared_tok += trace.hit_tokens(req, s) - trace.hit_tokens(req, h)
        prompt_tok += req.prompt_tokens
        spilled += replay.serve(req)
        seen.update(req.units if cache_outputs else prompt)
    loads.sort()
    return TierResult(
        trace.name, device_units, host_units, shared, len(trace.requests), prompt_tok,
        dev_tok, host_tok, shared_tok, host_reqs, spilled,
        prefetch.tokens_ahead if prefetch is not None else 0,
        loads[int(0.9 * (len(loads) - 1))] if loads else 0, policy,
    )  # fmt: skip


class _TierReplay:
    """The device cache over its host tier: a request's lookup (loading what it hits in
    the host), its serving (spilling what the device cannot hold), and loads ahead."""

    def __init__(
        self, trace: Trace, device_units: int | None, host_units: int, outputs: bool,
        policy: str,
    ) -> None:  # fmt: skip
        self.trace, self.capacity, self.outputs = trace, device_units, outputs
        self.host: OrderedDict[int, None] = OrderedDict()
        self.demote = _Demote(self.host, host_units)
        self.device = RadixCache(page_size=1, allocator=self.demote, merge_chains=True)
        self.order = SessionOrder() if policy == SESSION else None

    def _match(self, units: list[int]) -> int:
        return self.device.match_len(RadixKey(array("q", units)))

    def lookup(self, prompt: list[int], most: int | None = None) -> tuple[int, int]:
        """``(d, h)``: the device holds ``prompt[:d]``, the host ``prompt[d:h]`` (at most
        ``most`` pages), which leaves it for the device (exclusive tiers)."""
        d = h = self._match(prompt)
        end = len(prompt) if most is None else min(len(prompt), d + most)
        while h < end and prompt[h] in self.host:
            del self.host[prompt[h]]
            h += 1
        return d, h

    def _evict(self, after: float | None = None) -> Callable[[int], int] | None:
        """The device's eviction (``after``: only what returns later, in ms)."""
        order = self.order
        if order is None:
            return None
        return lambda n: order.evict(self.device, n, after=after)

    def serve(self, req: SimRequest) -> int:
        """Cache ``req`` on the device; what it computed and the device cannot hold goes
        to the host tier. Returns those spilled tokens."""
        served = req.units if self.outputs else req.units[: req.num_prompt_units]
        serve_request(self.device, req, self.capacity, self.outputs, self._evict())
        kept = self._match(served) if self.demote.capacity else len(served)
        if kept == len(served):
            return 0
        self.demote.spill(served[kept:])
        return self.trace.hit_tokens(req, len(served)) - self.trace.hit_tokens(req, kept)

    def load(self, session: Any, units: list[int], most: int) -> int:
        """Up to ``most`` of ``units``' pages that continue the device's match, from the
        host to the device, for ``session``'s return (under the session order, evicting
        only what is predicted back later); returns how many stayed there."""
        d, h = self.lookup(units, most)
        if h == d:
            return 0
        path = units[:h]
        after = self.order.predicted(session) if self.order is not None else None
        serve_request(self.device, SimRequest(path, h, 0), self.capacity, False,
                      self._evict(after))  # fmt: skip
        kept = self._match(path)
        self.demote.spill(path[kept:])  # (what the device could not hold goes back)
        return max(0, kept - d)


def sweep_tiers(
    trace: Trace, caps: list[int | None], hosts: list[int], shared: bool, cache_outputs: bool,
    policies: tuple[str, ...] = ("lru",), ahead: Ahead | None = None,
) -> TierSweep:  # fmt: skip
    """Every (device, host, device order) point, and for each bounded device the hit rate
    of one cache as large as device + host: ``(device, host, rate)``."""
    from radixkv.sim.replay import simulate

    hosts = list(dict.fromkeys(hosts))
    results = [simulate_tiers(trace, c, h, shared, cache_outputs, ahead, p)
               for c in caps for h in hosts for p in policies]  # fmt: skip
    pooled = [
        (c, h, simulate(trace, c + h, "lru", cache_outputs).token_hit_rate)
        for c in caps
        if c is not None
        for h in hosts
    ]
    return TierSweep(results, pooled)


def print_tiers_table(results: list[TierResult], console: Any, labels: dict) -> None:
    from rich.table import Table

    table = Table(title=f"{results[0].trace}: hit rate by tier")
    for col in ("device", "order", "host", "shared", "device hits", "host hits",
                "shared hits", "total hit rate"):  # fmt: skip
        table.add_column(col, justify="right", overflow="fold")
    for r in results:
        table.add_row(
            labels.get(r.device_units, str(r.device_units)),
            r.policy,
            labels.get(("host", r.host_units), str(r.host_units)),
            "unbounded" if r.shared else "none",
            f"{r.rate(r.device_hit_tokens):.4f}",
            f"{r.rate(r.host_hit_tokens):.4f}",
            f"{r.rate(r.shared_hit_tokens):.4f}",
            f"{r.rate(r.hit_tokens):.4f}",
        )
    console.print(table)
