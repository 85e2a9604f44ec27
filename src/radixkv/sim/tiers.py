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
with ``cache_outputs``) is on the device.

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
        if not self.capacity:
            return
        for u in units.tolist():
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
    dev_tok = host_tok = shared_tok = prompt_tok = 0
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
        host_tok += trace.hit_tokens(req, h) - trace.hit_tokens(req, d)
        shared_tok += trace.hit_tokens(req, s) - trace.hit_tokens(req, h)
        prompt_tok += req.prompt_tokens
        serve_request(device, req, device_units, cache_outputs)
        seen.update(req.units if cache_outputs else prompt)
    return TierResult(
        trace.name, device_units, host_units, shared, len(trace.requests), prompt_tok,
        dev_tok, host_tok, shared_tok,
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
