"""A session-aware eviction order for the simulator (``--policy session``, issue 61):
evict the cached prefix whose session is predicted to come back last. The prediction is
the engine's own (`radixkv.kvcache.sessions.SessionClock`: ``radixkv serve
--eviction-policy session`` predicts with the same code); this module keeps what only a
replay needs: which session last used each token, and an exact walk of the leaves.

A leaf no session owns (no trace session) goes first, least recently used; the rest by
their session's predicted return, latest first, the last victim trimmed to exactly what is
needed (as the engine's precise eviction). Nothing reads the future: a request's stop
reason and end are used only once ``now`` is past its end (the clock treats a session
whose answer has not ended yet as running).

`StampedSessions` drives the engine's own order instead (`radixkv.kvcache.sessions.
SessionOrder`: the tree's ``priority`` stamped per session) on a replay's clock, for the
hybrid budget's ``priority`` order (`radixkv.sim.hybrid`'s ``session`` policy): a
request's session is running from its arrival (stamped as running) until its end, and
its stop reason is read only once a later arrival is past that end.

Owns: the per-token owners and the walk; the stamps' timing. Must not touch: the tree
(it evicts through `RadixCache.evict_leaf`), the replay (`radixkv.sim.replay` calls it),
the prediction.

Complexity: an eviction walks the tree for its unlocked leaves, O(nodes) per victim (the
nodes are about the sessions cached: one path each, plus old branches); the simulator's
order, not the engine's (which keeps a heap: `radixkv.tree.eviction`).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from radixkv.kvcache.sessions import DEFAULT_GAP_S, SessionClock
from radixkv.kvcache.sessions import SessionOrder as Stamps
from radixkv.sim.traces import SimRequest


class SessionOrder:
    """Call `arrive` with each request before it is served (its arrival is ``now``),
    and pass `evict` as the replay's eviction. Times: the trace's milliseconds."""

    def __init__(self) -> None:
        self.now = 0.0  # ms
        self.owner: dict[int, Any] = {}  # unit -> the session that used it last
        self.clock = SessionClock()  # in seconds

    def arrive(self, req: SimRequest) -> None:
        self.now = req.timestamp
        s = req.session
        if s is None:
            return
        self.clock.started(s, req.timestamp / 1000.0)
        # closed loop: its answer's end and stop are in the trace; the clock reads them
        # only once its time has come (before, the session counts as running)
        self.clock.stopped(s, (req.timestamp + req.duration_ms) / 1000.0, req.stop)
        for u in req.units:
            self.owner[u] = s

    def predicted(self, session: Any) -> float:
        """When ``session`` is predicted to send its next request (ms)."""
        return self.clock.predicted(session, self.now / 1000.0) * 1000.0

    def evict(self, cache: Any, need: int, after: float | None = None) -> int:
        """Free at least ``need`` units (fewer if nothing more is unlocked), the leaf
        predicted to be used last first; with ``after`` (ms), only leaves whose session
        is predicted back later than that (or that no session owns)."""
        freed = 0
        while freed < need:
            leaves = [n for n in cache.iter_nodes()
                      if n is not cache.root and not n.children and not n.lock_ref]  # fmt: skip
            if not leaves:
                break
            victim = max(leaves, key=self._key)
            if after is not None and self._key(victim)[:2] < (0.0, after):
                break  # the latest return left comes sooner than ``after``
            take = min(len(victim), need - freed)
            freed += cache.evict_leaf(victim, take if take < len(victim) else None)
        return freed

    def _key(self, node: Any) -> tuple[float, float, int]:
        last = int.from_bytes(node.key_bytes[-8:], "little", signed=True)
        s = self.owner.get(last)
        if s is None or s not in self.clock.sessions:  # no session: first, least recently used
            return (1.0, -float(node.last_access), node.id)
        return (0.0, self.predicted(s), node.id)


class StampedSessions:
    """The engine's stamps on a replay's clock: `arrive` before a request is served,
    `served` after, with the node its cached path ends at. Times: the trace's ms."""

    def __init__(self, cache: Any) -> None:
        self.stamps = Stamps(cache)
        self._ends: list[tuple[float, int, Any, str, Any]] = []  # (end s, n, session, stop, node)
        self._n = itertools.count()

    def arrive(self, req: SimRequest) -> None:
        now = req.timestamp / 1000.0
        while self._ends and self._ends[0][0] <= now:  # answers that ended before it
            end, _, session, stop, node = heapq.heappop(self._ends)
            self.stamps.stopped(session, end, stop, node)
        self.stamps.tick(now)
        if req.session is not None:
            self.stamps.started(req.session, now)

    def served(self, req: SimRequest, node: Any) -> None:
        if req.session is None:
            return
        now = req.timestamp / 1000.0
        self.stamps.stamp(node, self.stamps.clock.predicted(req.session, now))  # running
        end = (req.timestamp + req.duration_ms) / 1000.0
        heapq.heappush(self._ends, (end, next(self._n), req.session, req.stop, node))


__all__ = ["DEFAULT_GAP_S", "SessionOrder", "StampedSessions"]
