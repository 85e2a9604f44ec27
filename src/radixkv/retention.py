"""`Retention`: cached prefixes kept for a while on request (OpenAI's prompt caching:
``prompt_cache_options.ttl``, ``prompt_cache_retention: "24h"``, a content block's
``prompt_cache_breakpoint``).

A retained prefix is a lock on the tree node where it ends, held until a deadline; a
request that asks for the same prefix again, or whose cache hit uses it whole (`hit`),
moves the deadline (never earlier): a prefix lives its lifetime from its last use. While
locked the prefix is never evicted, whatever else floods the cache. The lock goes:

* at the deadline (`expire`, called once per engine step);
* when its namespace (a tenant's ``cache_salt``) would hold more than ``max_tokens``
  retained, or all namespaces together more than ``max_total``: the least recently
  asked-for pins of that namespace (then of all) go first (`pin`);
* when the engine needs the room for a request that cannot run otherwise (`relieve`,
  least recently asked-for first): retention never blocks a request.

On a recurrent model the pin also protects the state checkpoint at the prefix's end
(`StateCheckpoints.protect`), without which the KV would serve nothing.

Released, a prefix is ordinary cache again: evicted by the cache's policy, and demoted to
a host or store tier on the way out when the engine has one, as any page.

Accounting: a pin counts its whole prefix against the quotas; two pins on one path (a
prompt's breakpoints) count once each, so the quotas are conservative. Each operation is
O(pins) at worst (pins are few: each holds a whole prefix).

Not thread-safe: the engine's thread owns it, as it owns the cache.

Owns: the pins (one lock each on the tree) and their quotas. Must not touch: the
tree's other locks, eviction order, requests.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from radixkv.key import RadixKey
from radixkv.tree import RadixCache, TreeNode
from radixkv.tree.state import StateCheckpoints

REASONS = ("expired", "quota", "pressure", "flush")  # why a pin was released


@dataclass(eq=False)
class Pin:
    node: TreeNode
    tokens: int
    namespace: str | None
    deadline: float
    asked: float  # when a request last asked for it, or used it whole
    ttl: float = 0.0  # the longest lifetime asked for it: a use renews that much
    slot: int | None = None  # the recurrent-state checkpoint it protects, if any


class Retention:
    """Prefixes pinned in ``cache`` until a deadline (see the module docstring).

    Args:
        cache: the prefix cache (its locks hold the pins).
        max_tokens: the most tokens one namespace keeps retained (0: retention off,
            every pin refused).
        max_total: the most tokens all namespaces together keep retained.
        clock: seconds, monotonic (tests pass their own).
        states: the cache's recurrent-state checkpoints (`StateCheckpoints`), if any: a
            pin also protects the checkpoint at its end, which serves the prefix.
    """

    def __init__(
        self,
        cache: RadixCache,
        max_tokens: int,
        max_total: int,
        clock: Callable[[], float] = time.monotonic,
        states: StateCheckpoints | None = None,
    ) -> None:
        for name, v in (("max_tokens", max_tokens), ("max_total", max_total)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.cache, self.clock, self.states = cache, clock, states
        self.max_tokens, self.max_total = max_tokens, max_total
        self.pins: dict[int, Pin] = {}  # id(node) -> its pin
        self.used: Counter[str | None] = Counter()  # retained tokens per namespace
        self.total = 0
        self.released: Counter[str] = Counter()  # pins released, by reason
        self.refused = 0  # asked for but not retained (over a quota alone, or not cached)
        self._next = float("inf")  # the earliest deadline

    def pin(self, key: RadixKey, ttl: float) -> int:
        """Keep ``key``'s cached prefix for ``ttl`` seconds from now. Returns the tokens
        retained (0: refused, counted in ``refused``): the part of ``key`` the cache can
        serve now, which may be shorter than ``key``.

        Raises:
            ValueError: ``ttl`` is not a positive number.
        """
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        m = self.cache.match_prefix(key)  # splits: the node ends exactly there
        n, node, ns = m.prefix_len, m.last_node, key.extra_key
        now = self.clock()
        pin = self.pins.get(id(node)) if n else None
        if pin is not None:
            pin.deadline, pin.asked = max(pin.deadline, now + ttl), now
            pin.ttl = max(pin.ttl, ttl)
            if pin.slot is None and self.states is not None:
                pin.slot = self.states.protect(node)
            return n
        if n == 0 or n > min(self.max_tokens, self.max_total):
            self.refused += 1
            return 0
        while self.used[ns] + n > self.max_tokens:
            self._release(self._oldest(ns), "quota")
        while self.total + n > self.max_total:
            self._release(self._oldest(None, any_ns=True), "quota")
        self.cache.inc_lock_ref(node)
        slot = self.states.protect(node) if self.states is not None else None
        self.pins[id(node)] = Pin(node, n, ns, now + ttl, now, ttl, slot)
        self.used[ns] += n
        self.total += n
        self._next = min(self._next, now + ttl)
        return n

    def hit(self, node: TreeNode) -> int:
        """A request's cache hit ended at ``node``: every retained prefix it used whole
        (pinned at ``node`` or above it) lives its lifetime again from now. Returns how
        many. O(depth), and nothing while no prefix is retained."""
        if not self.pins:
            return 0
        now, renewed = self.clock(), 0
        x: TreeNode | None = node
        while x is not None and x is not self.cache.root:
            pin = self.pins.get(id(x))
            if pin is not None:
                pin.deadline, pin.asked = max(pin.deadline, now + pin.ttl), now
                renewed += 1
            x = x.parent
        return renewed

    def expire(self) -> int:
        """Release the pins whose deadline passed; returns how many."""
        now = self.clock()
        if now < self._next:
            return 0
        gone = [p for p in self.pins.values() if p.deadline <= now]
        for p in gone:
            self._release(p, "expired")
        return len(gone)

    def relieve(self, tokens: int) -> int:
        """Release pins, least recently asked-for first, until the cache can evict
        ``tokens`` more than now (or no pin is left); returns the evictable tokens
        gained."""
        before = self.cache.evictable_size()
        while self.pins and self.cache.evictable_size() - before < tokens:
            self._release(self._oldest(None, any_ns=True), "pressure")
        return self.cache.evictable_size() - before

    def release_all(self) -> None:
        """Release every pin (an operator's flush)."""
        for p in list(self.pins.values()):
            self._release(p, "flush")

    def _oldest(self, ns: str | None, any_ns: bool = False) -> Pin:
        return min(
            (p for p in self.pins.values() if any_ns or p.namespace == ns), key=lambda p: p.asked
        )

    def _release(self, p: Pin, reason: str) -> None:
        del self.pins[id(p.node)]
        self.cache.dec_lock_ref(p.node)
        if p.slot is not None and self.states is not None:
            self.states.unprotect(p.slot)
        self.used[p.namespace] -= p.tokens
        if not self.used[p.namespace]:
            del self.used[p.namespace]
        self.total -= p.tokens
        self.released[reason] += 1
        self._next = min((q.deadline for q in self.pins.values()), default=float("inf"))

    def check(self) -> None:
        """The counts add up and every pin holds a lock on a node of the cache.

        Raises:
            AssertionError: naming what does not hold (raised, so ``-O`` keeps it).
        """
        pinned = sum(p.tokens for p in self.pins.values())
        if not self.total == pinned == sum(self.used.values()):
            raise AssertionError(f"retained {self.total}, pins hold {pinned}, "
                                 f"namespaces {sum(self.used.values())}")  # fmt: skip
        for p in self.pins.values():
            if p.node.evicted or p.node.lock_ref <= 0:
                raise AssertionError(f"pin on node {p.node.id}: evicted or unlocked")
            if self.used[p.namespace] > self.max_tokens:
                raise AssertionError(f"namespace {p.namespace!r} over its quota")


__all__ = ["REASONS", "Pin", "Retention"]
