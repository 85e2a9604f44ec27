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

Owns: the tier simulation. Must not touch: the real tiers (`radixkv.storage.tier`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from radixkv.key import RadixKey
from radixkv.sim.replay import serve_request
from radixkv.sim.traces import Trace
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


def simulate_tiers(
    trace: Trace,
    device_units: int | None,
    host_units: int,
    shared: bool = True,
    cache_outputs: bool = False,
) -> TierResult:
    """Replay ``trace`` through device + host (+ shared) tiers; hits by tier."""
    if host_units < 0:
        raise ValueError(f"host capacity must be >= 0, got {host_units}")
    host: OrderedDict[int, None] = OrderedDict()
    device = RadixCache(page_size=1, allocator=_Demote(host, host_units), merge_chains=True)
    seen: set[int] = set()
    dev_tok = host_tok = shared_tok = prompt_tok = host_reqs = spilled = 0
    demote = device.allocator
    for req in trace.requests:
        prompt = req.units[: req.num_prompt_units]
        d = device.match_len(RadixKey(array("q", prompt)))
        h = d
        while h < len(prompt) and prompt[h] in host:
            del host[prompt[h]]  # loaded back: it lives on the device now (exclusive)
            h += 1
        s = h
        if shared:
            while s < len(prompt) and prompt[s] in seen:
                s += 1
        dev_tok += trace.hit_tokens(req, d)
        from_host = trace.hit_tokens(req, h) - trace.hit_tokens(req, d)
        host_tok, host_reqs = host_tok + from_host, host_reqs + (from_host > 0)
        shared_tok += trace.hit_tokens(req, s) - trace.hit_tokens(req, h)
        prompt_tok += req.prompt_tokens
        served = req.units if cache_outputs else prompt
        serve_request(device, req, device_units, cache_outputs)
        kept = device.match_len(RadixKey(array("q", served))) if host_units else len(served)
        if kept < len(served):  # computed, not held: written to the host tier
            demote.spill(served[kept:])
            spilled += trace.hit_tokens(req, len(served)) - trace.hit_tokens(req, kept)
        seen.update(served)
    return TierResult(
        trace.name, device_units, host_units, shared, len(trace.requests), prompt_tok,
        dev_tok, host_tok, shared_tok, host_reqs, spilled,
    )  # fmt: skip


def sweep_tiers(
    trace: Trace, caps: list[int | None], hosts: list[int], shared: bool, cache_outputs: bool
) -> TierSweep:
    """Every (device, host) point, and for each bounded device the hit rate of one cache
    as large as device + host: ``(device, host, rate)``."""
    from radixkv.sim.replay import simulate

    hosts = list(dict.fromkeys(hosts))
    results = [simulate_tiers(trace, c, h, shared, cache_outputs) for c in caps for h in hosts]
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
    for col in ("device", "host", "shared", "device hits", "host hits", "shared hits",
                "total hit rate"):  # fmt: skip
        table.add_column(col, justify="right", overflow="fold")
    for r in results:
        table.add_row(
            labels.get(r.device_units, str(r.device_units)),
            labels.get(("host", r.host_units), str(r.host_units)),
            "unbounded" if r.shared else "none",
            f"{r.rate(r.device_hit_tokens):.4f}",
            f"{r.rate(r.host_hit_tokens):.4f}",
            f"{r.rate(r.shared_hit_tokens):.4f}",
            f"{r.rate(r.hit_tokens):.4f}",
        )
    console.print(table)
