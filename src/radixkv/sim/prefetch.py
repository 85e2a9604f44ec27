"""Loading a waiting session's pages back before it returns (issue 61: "loaded back when
its next request arrives, or before, when predicted"), for the tier simulation
(`radixkv.sim.tiers`, ``simulate --tiers --prefetch-within SECONDS``).

An agent whose answer stopped on ``tool_use`` is back in seconds; one that stopped on
``end_turn`` waits on a person. The engine's prediction (`radixkv.kvcache.sessions.
SessionClock`) says when. While the device cache keeps other sessions, a waiting one's
pages sit in the host tier, and loading them when its request arrives adds their bytes
over the host link to its first token (half a second for 100k tokens of an 8B model's
KV). Between arrivals the link is idle: `Prefetch` spends that time loading, soonest
predicted return first, the pages of each waiting session's last path that are in the
host tier and continue what the device holds of it, so they are on the device when the
session comes back.

Timing (the trace's milliseconds): the link moves ``rate`` tokens a millisecond, one
load at a time. A request's own host hits load when it arrives (the link is busy with
them from then for their time). Loads ahead use only the link's idle time before the
next arrival, and a session's only after its answer ended (its stop reason is known
then). Candidates are the sessions with nothing running whose predicted return is at
most ``horizon_ms`` ahead (an overdue session is predicted away as long again, so it
drops out once it has been away ``horizon_ms``), soonest first, as many as the device
holds the paths of (``room`` units: past it, a later return's pages would push a sooner
one's out of an LRU device). Nothing reads the future: the arrival that ends an idle
stretch only bounds the link's time; which session it belongs to is not used (it is
served after the loads).

Owns: choosing what to load ahead and the link's time. Must not touch: the tiers (the
caller loads: ``load(session, units)``), the prediction (the engine's `SessionClock`).

Complexity: per arrival, O(c log c) for the c candidates within the horizon (the
sessions active in the last ``horizon_ms``), plus the pages loaded; memory O(sessions)
plus each waiting session's last path (a reference to its request's units).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from radixkv.kvcache.sessions import SessionClock
from radixkv.sim.traces import SimRequest

# (session, its last path's units, at most this many of them) -> the units it loaded
Load = Callable[[Any, list[int], int], int]


class _Waiting(NamedTuple):
    end: float  # ms: its last answer's end
    units: list[int]  # its last request's cached path
    tokens: int  # that path's tokens


class Prefetch:
    """Call `arrive` with each request, in arrival order, before it is served; it first
    loads ahead (through ``load``) in the link's idle time since the last request, then
    charges the link for the request's own host hits (``host_tokens``, via `loaded`)."""

    def __init__(
        self, rate: float, horizon_ms: float, block_size: int, room: int | None, outputs: bool,
    ) -> None:  # fmt: skip
        if not (0 < rate < math.inf and 0 < horizon_ms < math.inf):
            raise ValueError(f"rate and horizon must be finite and > 0, got {rate}, "
                             f"{horizon_ms}")  # fmt: skip
        self.rate, self.horizon, self.block = rate, horizon_ms, block_size
        self.room, self.outputs = room, outputs
        self.clock = SessionClock()  # seconds
        self.waiting: dict[Any, _Waiting] = {}  # session -> its last path, once it ended
        self._ahead: list[tuple[float, int, Any]] = []  # (predicted ms, n, session): not yet near
        self._near: set[Any] = set()  # sessions predicted within the horizon at some point
        self._n = itertools.count()
        self.link_free = 0.0  # ms: when the link has done what it was given
        self.tokens_ahead = 0  # tokens loaded ahead of their session's return

    def arrive(self, req: SimRequest, load: Load) -> None:
        """Load ahead until ``req``'s arrival, then note ``req`` (its session runs)."""
        now = req.timestamp
        self._fill(now, load)
        s = req.session
        if s is None:
            return
        self.waiting.pop(s, None)
        self._near.discard(s)
        self.clock.started(s, now / 1000.0)
        end = req.timestamp + req.duration_ms
        # its stop reason is the trace's: read (by `_fill`) only once ``end`` is past
        predicted = self.clock.stopped(s, end / 1000.0, req.stop) * 1000.0
        units = req.units if self.outputs else req.units[: req.num_prompt_units]
        tokens = req.prompt_tokens + (req.output_tokens if self.outputs else 0)
        self.waiting[s] = _Waiting(end, units, tokens)
        heapq.heappush(self._ahead, (predicted, next(self._n), s))

    def loaded(self, now: float, tokens: int) -> None:
        """A request arriving at ``now`` loads ``tokens`` from the host: the link is busy."""
        if tokens:
            self.link_free = max(self.link_free, now) + tokens / self.rate

    def _fill(self, now: float, load: Load) -> None:
        while self._ahead and self._ahead[0][0] <= now + self.horizon:
            self._near.add(heapq.heappop(self._ahead)[2])
        order = []
        for s in list(self._near):
            w = self.waiting.get(s)
            if w is None:  # running
                self._near.discard(s)
                continue
            back = self.clock.predicted(s, now / 1000.0) * 1000.0
            if back > now + self.horizon:  # away longer than it was expected to be
                self._near.discard(s)
                continue
            order.append((back, w.end, s))
        cursor, held = self.link_free, 0
        for _, end, s in sorted(order, key=lambda o: (o[0], o[1])):
            w = self.waiting[s]
            held += len(w.units)
            if self.room is not None and held > self.room:
                break  # a later return's pages would push out a sooner one's (LRU)
            start = max(cursor, end)  # (its stop reason is known from its end)
            if start >= now:
                continue
            budget = int((now - start) * self.rate)  # tokens the link moves before ``now``
            got = load(s, w.units, budget // self.block)
            if got:
                moved = min(got * self.block, w.tokens)
                self.tokens_ahead += moved
                cursor = start + moved / self.rate
        self.link_free = max(self.link_free, cursor)


__all__ = ["Prefetch"]
