"""`Retention`: cached prefixes kept for a while on request (OpenAI's prompt caching:
``prompt_cache_options.ttl``, ``prompt_cache_retention: "24h"``, a content block's
``prompt_cache_breakpoint``).

A retained prefix is a lock on the tree node where it ends, held until a deadline; a
request that asks for the same prefix again, or whose cache hit uses it whole (`hit`),
moves the deadline (never earlier): a prefix lives its lifetime from its last use. While
locked the prefix is never evicted, whatever else floods the cache.

**Everything a hit needs.** The lock keeps the prefix's full-attention KV and, on a model
with sliding layers, the window at its end (a locked node keeps its window). On a
recurrent model the pin also protects two state checkpoints (`StateCheckpoints.protect`):
the one at the prefix's end (a request that goes on past it starts there) and the deepest
one strictly before it (the same prompt sent again must compute its last token, so it
starts there); without them the KV would serve nothing.

**Tenants.** Each namespace (a tenant's ``cache_salt``) has its own quota: ``max_tokens``
retained tokens, ``max_states`` protected checkpoints. A namespace over its quota
releases its own least recently asked-for pins, never another's. All namespaces together
keep at most ``max_total`` tokens and ``max_states_total`` checkpoints, shared fairly:
when a new pin does not fit, the asking namespace, if the pin would put it over its fair
share (the cap over the namespaces holding pins, itself included), releases its own
oldest pins (holding none, the pin is refused); within its share, the namespace holding
the most releases its oldest if it holds more than its share; otherwise the new pin is
refused. So another tenant's traffic can take a
namespace's pins only while that namespace holds more than its share of the cap (salts
are the client's to choose: a client rotating them shrinks the shares, never takes a
pin from a namespace within its share). Engine pressure (`relieve`: a request that
cannot run otherwise) takes from the namespace holding the most first: retention never
blocks a request.

Released (at the deadline: `expire`, once per engine step; by a quota; by pressure; by a
flush), a prefix is ordinary cache again: evicted by the cache's policy, and demoted to a
host or store tier on the way out when the engine has one, as any page.

Accounting: a pin counts its whole prefix against the quotas; two pins on one path (a
prompt's breakpoints) count once each, so the quotas are conservative.

Complexity: every operation is O(log pins) amortised, plus the tree's own O(depth) lock
walks (`pin`, a release) and `hit`'s O(depth) walk. Deadlines, each namespace's pins by
last use, and the namespaces by holdings are heaps with lazily dropped stale entries
(compacted when they grow past twice the live ones). Releasing 8,192 small pins for one
large one used to cost O(pins) each: 13 s of one engine step.

Not thread-safe: the engine's thread owns it, as it owns the cache.

Owns: the pins (one lock each on the tree, and their checkpoint protections) and their
quotas. Must not touch: the tree's other locks, eviction order, requests.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixkv.key import RadixKey
from radixkv.kvcache.recurrent.component import Checkpoint, StateCheckpoints
from radixkv.tree import RadixCache, TreeNode

REASONS = ("expired", "quota", "pressure", "flush")  # why a pin was released


@dataclass(eq=False)
class Pin:
    node: TreeNode
    tokens: int
    namespace: str | None
    deadline: float
    asked: float  # when a request last asked for it, or used it whole
    ttl: float = 0.0  # the longest lifetime asked for it: a use renews that much
    checkpoints: tuple[Checkpoint, ...] = ()  # the recurrent-state checkpoints it protects
    live: bool = True  # False once released (its heap entries are stale then)


@dataclass
class _Lazy:
    """A heap whose entries go stale: ``valid(entry)`` says which still count."""

    valid: Callable[[tuple], bool]
    heap: list = field(default_factory=list)

    def push(self, entry: tuple) -> None:
        heapq.heappush(self.heap, entry)

    def top(self) -> tuple | None:
        """The least valid entry (stale ones on the way are dropped), or None."""
        heap = self.heap
        while heap and not self.valid(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def compact(self, live: int) -> None:
        if len(self.heap) > 2 * live + 64:
            self.heap = [e for e in self.heap if self.valid(e)]
            heapq.heapify(self.heap)


class Retention:
    """Prefixes pinned in ``cache`` until a deadline (see the module docstring).

    Args:
        cache: the prefix cache (its locks hold the pins).
        max_tokens: the most tokens one namespace keeps retained (0: retention off,
            every pin refused).
        max_total: the most tokens all namespaces together keep retained.
        clock: seconds, monotonic (tests pass their own).
        states: the cache's recurrent-state checkpoints (`StateCheckpoints`), if any: a
            pin also protects the checkpoints a hit on it starts from.
        max_states: the most checkpoints one namespace protects [an eighth of the
            component's ``max_states``, at least 2: one pin's].
        max_states_total: the most all namespaces together protect [half of them: the
            rest must turn over].
    """

    def __init__(
        self,
        cache: RadixCache,
        max_tokens: int,
        max_total: int,
        clock: Callable[[], float] = time.monotonic,
        states: StateCheckpoints | None = None,
        max_states: int | None = None,
        max_states_total: int | None = None,
    ) -> None:
        held = states.max_states if states is not None else 0
        max_states = max(2, held // 8) if max_states is None else max_states
        max_states_total = held // 2 if max_states_total is None else max_states_total
        limits = {"max_tokens": max_tokens, "max_total": max_total,
                  "max_states": max_states, "max_states_total": max_states_total}  # fmt: skip
        for name, v in limits.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        self.cache, self.clock, self.states = cache, clock, states
        self.max_tokens, self.max_total = max_tokens, max_total
        self.max_states, self.max_states_total = max_states, max_states_total
        self.pins: dict[int, Pin] = {}  # id(node) -> its pin
        self.used: Counter[str | None] = Counter()  # retained tokens per namespace
        self.protected: Counter[str | None] = Counter()  # protected checkpoints per namespace
        self.held_pins: Counter[str | None] = Counter()  # pins per namespace
        self.total = 0
        self.total_states = 0
        self.released: Counter[str] = Counter()  # pins released, by reason
        self.refused = 0  # asked for but not retained (over a quota or share, or not cached)
        self._seq = itertools.count()
        self._deadlines = _Lazy(lambda e: e[2].live and e[2].deadline == e[0])
        self._asked: dict[Any, _Lazy] = {}  # namespace -> its pins by last use
        # namespaces by holdings, the largest first (ties: the first seen): tokens, then
        # checkpoints
        self._rank: dict[Any, int] = {}  # namespace -> when it came (while it holds pins)
        self._ranks = itertools.count()
        self._by_tokens = _Lazy(lambda e: self._holds(self.used, e))
        self._by_states = _Lazy(lambda e: self._holds(self.protected, e))

    # --- the operations ---------------------------------------------------------------------

    @classmethod
    def over(cls, cache: RadixCache, max_tokens: int, max_total: int) -> Retention:
        """Retention over ``cache``, protecting with each pin the checkpoints its tree
        holds (its ``state`` component, `StateCheckpoints`, if any)."""
        return cls(cache, max_tokens, max_total, states=cache.component("state"))

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
            self._renew(pin, now, max(pin.deadline, now + ttl))
            pin.ttl = max(pin.ttl, ttl)
            return n
        cps = self.states.serving(node) if n and self.states is not None else ()
        if not self._make_room(ns, n, len(cps)):
            self.refused += 1
            return 0
        self.cache.inc_lock_ref(node)
        for c in cps:
            self.states.protect(c)  # type: ignore[union-attr]
        pin = Pin(node, n, ns, now + ttl, now, ttl, cps)
        self.pins[id(node)] = pin
        self._count(pin, +1)
        self._deadlines.push((pin.deadline, next(self._seq), pin))
        self._asked_heap(ns).push((now, next(self._seq), pin))
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
                self._renew(pin, now, max(pin.deadline, now + pin.ttl))
                renewed += 1
            x = x.parent
        return renewed

    def expire(self) -> int:
        """Release the pins whose deadline passed; returns how many."""
        now, gone = self.clock(), 0
        while (e := self._deadlines.top()) is not None and e[0] <= now:
            self._release(e[2], "expired")
            gone += 1
        return gone

    def relieve(self, tokens: int) -> int:
        """Release pins, the oldest of the namespace holding the most first, until the
        cache can evict ``tokens`` more than now (or no pin is left); returns the
        evictable tokens gained."""
        before = self.cache.evictable_size()
        while self.pins and self.cache.evictable_size() - before < tokens:
            top = self._by_tokens.top()
            assert top is not None
            self._release(self._oldest(top[2]), "pressure")
        return self.cache.evictable_size() - before

    def release_all(self) -> None:
        """Release every pin (an operator's flush)."""
        for p in list(self.pins.values()):
            self._release(p, "flush")

    # --- quotas and shares ------------------------------------------------------------------
    def _make_room(self, ns: Any, n: int, states: int) -> bool:
        """Release pins until ``n`` more tokens and ``states`` more checkpoints of ``ns``
        fit its quota and the shared caps (see the module docstring); False, releasing
        nothing of others', when they cannot."""
        if n == 0 or n > min(self.max_tokens, self.max_total):
            return False
        if states > min(self.max_states, self.max_states_total):
            return False
        while self.used[ns] + n > self.max_tokens or self.protected[ns] + states > self.max_states:
            self._release(self._oldest(ns), "quota")
        caps = (
            (self.used, "total", self.max_total, n, self._by_tokens),
            (self.protected, "total_states", self.max_states_total, states, self._by_states),
        )
        for held, total, cap, more, order in caps:
            while getattr(self, total) + more > cap:
                holders = len(self.held_pins) + (ns not in self.held_pins)
                share = cap / holders
                if held.get(ns, 0) + more > share:  # over its own share: only its own go
                    if ns not in self.held_pins:
                        return False
                    self._release(self._oldest(ns), "quota")
                    continue
                top = order.top()
                if top is None or top[2] == ns or -top[0] <= share:
                    return False  # everyone within its share: no room for this one
                self._release(self._oldest(top[2]), "quota")
        return True

    # --- bookkeeping ------------------------------------------------------------------------
    def _renew(self, pin: Pin, now: float, deadline: float) -> None:
        if now != pin.asked:  # (asked at the same time again: its place stays)
            pin.asked = now
            self._asked_heap(pin.namespace).push((now, next(self._seq), pin))
        if deadline != pin.deadline:
            pin.deadline = deadline
            self._deadlines.push((deadline, next(self._seq), pin))
        self._asked[pin.namespace].compact(self.held_pins[pin.namespace])
        self._deadlines.compact(len(self.pins))

    def _holds(self, held: Counter, entry: tuple) -> bool:
        """Whether a namespaces-by-holdings entry is current."""
        ns = entry[2]
        return held.get(ns, 0) == -entry[0] != 0 and self._rank.get(ns) == entry[1]

    def _asked_heap(self, ns: Any) -> _Lazy:
        heap = self._asked.get(ns)
        if heap is None:
            heap = self._asked[ns] = _Lazy(lambda e: e[2].live and e[2].asked == e[0])
        return heap

    def _oldest(self, ns: Any) -> Pin:
        top = self._asked[ns].top()
        assert top is not None, f"namespace {ns!r} holds no pin"
        return top[2]

    def _count(self, p: Pin, sign: int) -> None:
        ns = p.namespace
        if ns not in self._rank:
            self._rank[ns] = next(self._ranks)
        self.used[ns] += sign * p.tokens
        self.protected[ns] += sign * len(p.checkpoints)
        self.held_pins[ns] += sign
        if not self.held_pins[ns]:
            del self.held_pins[ns]
        self.total += sign * p.tokens
        self.total_states += sign * len(p.checkpoints)
        for held, order in ((self.used, self._by_tokens), (self.protected, self._by_states)):
            if held[ns] <= 0:
                del held[ns]
            else:  # ties: the namespace seen first
                order.push((-held[ns], self._rank[ns], ns))
            order.compact(len(held))

    def _release(self, p: Pin, reason: str) -> None:
        del self.pins[id(p.node)]
        p.live = False
        self.cache.dec_lock_ref(p.node)
        for c in p.checkpoints:
            self.states.unprotect(c)  # type: ignore[union-attr]
        self._count(p, -1)
        if p.namespace not in self.held_pins:  # forgotten: salts are the client's to mint
            self._asked.pop(p.namespace, None)
            self._rank.pop(p.namespace, None)
        self.released[reason] += 1

    def locks(self) -> list[TreeNode]:
        """The nodes its pins hold a lock on, one each (the engine's lock ledger:
        `radixkv.tree.core.RadixCache.check_locks`)."""
        return [p.node for p in self.pins.values()]

    def check(self) -> None:
        """The counts add up, every pin holds a lock on a node of the cache, and every
        namespace is within its quotas. O(pins).

        Raises:
            AssertionError: naming what does not hold (raised, so ``-O`` keeps it).
        """
        pinned = sum(p.tokens for p in self.pins.values())
        if not self.total == pinned == sum(self.used.values()):
            raise AssertionError(f"retained {self.total}, pins hold {pinned}, "
                                 f"namespaces {sum(self.used.values())}")  # fmt: skip
        states = sum(len(p.checkpoints) for p in self.pins.values())
        if not self.total_states == states == sum(self.protected.values()):
            raise AssertionError(f"{self.total_states} checkpoints protected, pins hold {states}")
        if self.total > self.max_total or self.total_states > self.max_states_total:
            raise AssertionError("the shared caps are exceeded")
        for p in self.pins.values():
            if p.node.evicted or p.node.lock_ref <= 0:
                raise AssertionError(f"pin on node {p.node.id}: evicted or unlocked")
            if self.used[p.namespace] > self.max_tokens:
                raise AssertionError(f"namespace {p.namespace!r} over its quota")
            if self.protected.get(p.namespace, 0) > self.max_states:
                raise AssertionError(f"namespace {p.namespace!r} over its checkpoint quota")
            for c in p.checkpoints:
                held = self.states is not None and self.states.held.get(c.slot) is c
                if not held or self.states.protected.get(c.slot, 0) <= 0:  # type: ignore[union-attr]
                    raise AssertionError(f"pin on node {p.node.id}: {c!r} gone or unprotected")


__all__ = ["REASONS", "Pin", "Retention"]
