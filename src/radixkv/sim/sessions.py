"""A session-aware eviction order for the simulator (``--policy session``, issue 61):
evict the cached prefix whose session is predicted to come back last.

An agent's session that last stopped on ``tool_use`` comes back in seconds (the tool ran);
one that stopped on ``end_turn`` waits on a person (minutes to days). A server knows both
online: which session a prefix was last used by, whether that session's request is still
running, how its last answer stopped, and the gaps the session has shown so far. For each
unlocked leaf the order predicts when its session next sends a request:

* running now (its answer is being written): ``now`` + the session's typical gap after a
  tool call (it is about to come back);
* otherwise its last answer's end + the session's median gap after that stop reason so
  far (defaults: `DEFAULT_GAP_S`);
* a session already past that prediction has been away longer than expected: it is
  predicted to stay away as long again (``now + (now - end)``);

and evicts the leaf predicted last, trimming the last victim to exactly what is needed
(as the engine's precise eviction). A leaf no session owns (no trace session) goes first,
least recently used. Nothing reads the future: a request's stop reason and end are used
only once ``now`` is past its end.

Owns: the prediction and the order. Must not touch: the tree (it evicts through
`RadixCache.evict_leaf`), the replay (`radixkv.sim.replay` calls it).

Complexity: an eviction walks the tree for its unlocked leaves, O(nodes) per victim (the
nodes are about the sessions cached: one path each, plus old branches); the simulator's
order, not the engine's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from radixkv.sim.traces import SimRequest

DEFAULT_GAP_S = {"tool_use": 10.0, "end_turn": 600.0, "": 30.0}
MAX_GAPS = 64  # gaps remembered per session and stop reason


class SessionOrder:
    """Call `arrive` with each request before it is served (its arrival is ``now``),
    and pass `evict` as the replay's eviction."""

    def __init__(self) -> None:
        self.now = 0.0  # ms
        self.owner: dict[int, Any] = {}  # unit -> the session that used it last
        self.last: dict[Any, tuple[float, float, str]] = {}  # session -> (start, end, stop)
        self.gaps: dict[Any, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def arrive(self, req: SimRequest) -> None:
        self.now = req.timestamp
        s = req.session
        if s is None:
            return
        prev = self.last.get(s)
        if prev is not None and prev[1] <= self.now:  # the gap its last stop was followed by
            gaps = self.gaps[s][prev[2]]
            gaps.append(self.now - prev[1])
            del gaps[:-MAX_GAPS]
        self.last[s] = (req.timestamp, req.timestamp + req.duration_ms, req.stop)
        for u in req.units:
            self.owner[u] = s

    def _typical(self, session: Any, stop: str) -> float:
        seen = self.gaps[session].get(stop)
        if seen:
            return statistics.median(seen)
        return DEFAULT_GAP_S.get(stop, DEFAULT_GAP_S[""]) * 1000.0

    def predicted(self, session: Any) -> float:
        """When ``session`` is predicted to send its next request (ms)."""
        _start, end, stop = self.last[session]
        if self.now < end:  # still running: a tool call follows, most often
            return self.now + self._typical(session, "tool_use")
        guess = end + self._typical(session, stop)
        return guess if guess >= self.now else self.now + (self.now - end)

    def evict(self, cache: Any, need: int) -> int:
        """Free at least ``need`` units (fewer if nothing more is unlocked), the leaf
        predicted to be used last first."""
        freed = 0
        while freed < need:
            leaves = [n for n in cache.iter_nodes()
                      if n is not cache.root and not n.children and not n.lock_ref]  # fmt: skip
            if not leaves:
                break
            victim = max(leaves, key=self._key)
            take = min(len(victim), need - freed)
            freed += cache.evict_leaf(victim, take if take < len(victim) else None)
        return freed

    def _key(self, node: Any) -> tuple[float, float, int]:
        last = int.from_bytes(node.key_bytes[-8:], "little", signed=True)
        s = self.owner.get(last)
        if s is None or s not in self.last:  # no session: first, least recently used
            return (1.0, -float(node.last_access), node.id)
        return (0.0, self.predicted(s), node.id)


__all__ = ["DEFAULT_GAP_S", "SessionOrder"]
