"""When an agent's session comes back (`SessionClock`), and the eviction order it gives the
tree (`SessionOrder`: ``--eviction-policy session``), for the engine and the simulator
alike (issue 61).

An agent's session that last stopped on ``tool_use`` comes back in seconds (the tool ran);
one that stopped on ``end_turn`` waits on a person (minutes to days). A server knows both
online: which session a request belongs to, how its last answer stopped, and the gaps the
session has shown so far. The prediction of a session's next request:

* while one of its requests runs: not before it ends (nothing of it can be evicted then:
  its path is locked);
* after an answer: its end + the session's median gap after that stop reason so far (at
  most `MAX_GAPS` remembered; before any: `DEFAULT_GAP_S`);
* a session already past that prediction has been away longer than expected: it is
  predicted to stay away as long again (``now + (now - end)``), re-predicted each time it
  passes the new one (so O(log) times for any absence).

Nothing reads the future: a request's stop reason is known only once it ended.

`SessionOrder` turns predictions into the tree's ``priority`` order (the policy
``session`` is the tree's ``priority`` key: the lowest priority is evicted first). A
session's last path is stamped ``PRIORITY_TOP - predicted ms``: what returns last goes
first; prefixes no session stamped keep priority 0 and go before all of them, least
recently used first. The leaf's own branch takes the stamp; shared ancestors keep the
highest (the soonest return among the sessions below them).
No stamp outlives its session's interest in the path (it would be a return long past,
the highest priority there is, never evicted): a path its session left (its next request
went on from elsewhere, or forked below it, even after the old path's last node went) or
a forgotten session's goes back to 0; once an order evicted a session's last node whole,
its next stamp lands on what is left of its branch, and, the branch gone, on the prefix
it shared (a return already past there is replaced). A branch is found again after its
nodes were split or its last one evicted from where it hangs (the node above it and its
first page's key), not from node objects a split may have left below.
What the order decides does not depend on how a path is split into nodes (cached in one
insert, or chunk by chunk as the engine computes a prompt: a chain of single-child
nodes). A session's end and the node its branch hangs from follow their unbranched run
up when evicted, as a trim of one node would keep them (`_Places`), and a stale stamp on
a leaf an eviction leaves counts as none within that eviction and goes, with the rest
of its run's (tests/kvcache/test_sessions.py: two trees, the same steps, the same tokens
at the same priorities; so a replay may compute a prompt at once).

Complexity: `SessionClock.stopped` O(log sessions) (a heap of predictions, stale entries
dropped lazily), `SessionOrder.stamp` O(depth of the session's branch), `SessionOrder.tick`
O(log sessions) per session that came due. Memory: O(sessions x `MAX_GAPS`), at most
`MAX_SESSIONS` sessions (the least recently started idle one goes first); sessions not
seen for `FORGET_S` are forgotten.

Not thread-safe: the engine's thread owns it, as it owns the cache.

Owns: predicting a session's return, and stamping the tree's priorities from it. Must not
touch: how the tree evicts (its order reads the priorities), requests.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import statistics
from collections import deque
from typing import Any, NamedTuple

from radixkv.tree.component import TreeComponent

DEFAULT_GAP_S = {"tool_use": 10.0, "end_turn": 600.0, "": 30.0}
MAX_GAPS = 64  # gaps remembered per session and stop reason
FORGET_S = 7 * 86400.0  # a session silent this long is forgotten
# sessions remembered at most: the keys are the client's (a header), so a client naming a
# new one per request would grow the map without end; the least recently started that
# runs nothing is forgotten first
MAX_SESSIONS = 100_000
PRIORITY_TOP = 1 << 62  # a stamp is this less the predicted return in ms
# why the cache gave up tokens (`EvictionReasons`): what its stamp said when it went
REASONS = ("no_session", "back_within_1m", "back_later")
SOON_S = 60.0  # a return predicted within this long is an agent about to come back


class _Session:
    __slots__ = ("anchor", "end", "gaps", "node", "running", "stop", "version")

    def __init__(self) -> None:
        self.end = 0.0  # its last answer's end (s)
        self.stop = ""  # how that answer stopped
        self.running = 0  # its requests running now
        self.node: Any = None  # where its last request's cached path ends
        # that path's own branch when last stamped: (the node above it, the key of its
        # first page there, the priority given), which a split of the branch keeps
        self.anchor: tuple[Any, Any, int] | None = None
        self.gaps: dict[str, deque[float]] = {}
        self.version = 0  # its heap entries older than this are stale


class Due(NamedTuple):
    """A session whose prediction came due: its key, its node, the new prediction."""

    session: Any
    node: Any
    predicted: float


class SessionClock:
    """Sessions' predicted returns. Times are seconds on the caller's clock."""

    def __init__(self) -> None:
        self.sessions: dict[Any, _Session] = {}
        self._due: list[tuple[float, int, Any]] = []  # (predicted, version, session)
        self.running = 0  # sessions with a request running (the rest wait: a metric)
        # (key, session) of the sessions forgotten since last read
        self.forgotten: list[tuple[Any, _Session]] = []

    def started(self, session: Any, now: float) -> None:
        """A request of ``session`` arrived: the gap since its last answer is recorded
        under that answer's stop reason."""
        s = self.sessions.pop(session, None)  # (re-inserted: the map is in start order)
        if s is None:
            s = _Session()
            self._make_room()
        elif s.running == 0 and s.end and now >= s.end:
            gaps = s.gaps.setdefault(s.stop, deque(maxlen=MAX_GAPS))
            gaps.append(now - s.end)
        self.sessions[session] = s
        self.running += s.running == 0
        s.running += 1
        s.version += 1  # running: not due

    def stopped(self, session: Any, now: float, stop: str, node: Any = None) -> float:
        """A request of ``session`` ended at ``now``, its answer stopped by ``stop``
        (``tool_use``, ``end_turn``, or ``""``: unknown), its cached path ending at
        ``node``. Returns the session's predicted return."""
        s = self.sessions.get(session)
        if s is None:
            self._make_room()
            s = self.sessions[session] = _Session()
        self.running -= s.running == 1
        s.running = max(0, s.running - 1)
        s.end, s.stop = now, stop
        if node is not None:
            s.node = node
        s.version += 1
        predicted = now + self.typical(session, stop)
        if s.running == 0:
            heapq.heappush(self._due, (predicted, s.version, session))
        return predicted

    def _make_room(self) -> None:
        """At `MAX_SESSIONS`, forget the least recently started sessions that run nothing
        (the running ones, at most the engine's slots, are skipped)."""
        while len(self.sessions) >= MAX_SESSIONS:
            # the oldest idle one: only running sessions (a few) come before it
            idle = next((k for k, s in self.sessions.items() if s.running == 0), None)
            if idle is None:
                return
            self._forget(idle)

    def _forget(self, session: Any) -> None:
        """Forget a session; it waits in ``forgotten`` for the caller (`SessionOrder`
        releases its stamp)."""
        s = self.sessions.pop(session)
        if s.node is not None or s.anchor is not None:
            self.forgotten.append((session, s))

    def typical(self, session: Any, stop: str) -> float:
        """The session's median gap after ``stop`` so far (seconds)."""
        s = self.sessions.get(session)
        seen = s.gaps.get(stop) if s is not None else None
        if seen:
            return statistics.median(seen)
        return DEFAULT_GAP_S.get(stop, DEFAULT_GAP_S[""])

    def predicted(self, session: Any, now: float) -> float:
        """When ``session`` is predicted to send its next request."""
        s = self.sessions[session]
        if s.running or now < s.end:  # (an end still to come: running, as far as now knows)
            return now + self.typical(session, "tool_use")
        guess = s.end + self.typical(session, s.stop)
        return guess if guess >= now else now + (now - s.end)

    def due(self, now: float) -> list[Due]:
        """The sessions whose prediction passed without their return, each predicted
        again (away as long again); sessions silent for `FORGET_S` are forgotten."""
        out, heap = [], self._due
        while heap and heap[0][0] < now:
            _, version, session = heapq.heappop(heap)
            s = self.sessions.get(session)
            if s is None or version != s.version or s.running:
                continue
            if now - s.end > FORGET_S:
                self._forget(session)
                continue
            again = now + (now - s.end)
            s.version += 1
            heapq.heappush(heap, (again, s.version, session))
            out.append(Due(session, s.node, again))
        if len(heap) > 2 * len(self.sessions) + 64:  # stale entries: drop them
            live = {k: s.version for k, s in self.sessions.items()}
            self._due = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._due)
        return out


def priority_of(predicted: float) -> int:
    """The tree priority a prediction (seconds) stamps: later returns lower."""
    return max(1, PRIORITY_TOP - int(predicted * 1000.0))


def predicted_of(priority: int) -> float:
    """The return (seconds) a stamp says: `priority_of`'s inverse, to the millisecond."""
    return (PRIORITY_TOP - priority) / 1000.0


class EvictionReasons(TreeComponent):
    """Tokens the cache evicted, by what their stamp said then (`REASONS`): no session's
    (priority 0), a session predicted back within `SOON_S` (an agent about to return:
    the cache is short of its working set), or later. Read by the metrics; counted once
    the tree changed (``evicted``: a retried eviction is not counted twice)."""

    name = "session_reasons"

    def __init__(self) -> None:
        self.now = 0.0  # the session clock's time, as of the last tick
        self.tokens = dict.fromkeys(REASONS, 0)
        self._parents: list[Any] = []  # the whole victims' parents (leaves next, maybe)

    def evicting(self, victims: list[Any], trim: tuple[Any, int] | None, slots: Any) -> None:
        self._parents = [v.parent for v in victims]  # (a retry sets the same again)

    def evicted(self, victims: list[Any], trim: tuple[Any, int] | None) -> None:
        self._unstamp_stale(self._parents)
        for node, units in [(v, len(v)) for v in victims] + ([trim] if trim else []):
            if not node.priority:
                reason = "no_session"
            else:
                back = predicted_of(node.priority)
                reason = "back_within_1m" if back - self.now <= SOON_S else "back_later"
            self.tokens[reason] += units  # (a unit is a token: pages are whole units)
        if trim:  # (a leaf too: what one node's eviction would leave of a chain's)
            self._unstamp_stale([trim[0]])

    def _unstamp_stale(self, parents: list[Any]) -> None:
        """A parent left a leaf by the eviction (or a leaf it trimmed), its stamp a return
        already past: no live session's (each overdue one was stamped again at the last
        tick, its own branch with it), so it is a prefix its sessions shared and left (a
        shared ancestor keeps the soonest return ever stamped below it). Back to 0, as a
        path no session owns, and so is the rest of its unbranched run that holds such a
        stamp (the same path, were it one node). An eviction choosing a node's children
        keys it so already (`SessionOrder._uncovered_key`)."""
        for x in parents:
            if (x is not None and x.parent is not None and x.priority and not x.children
                    and predicted_of(x.priority) < self.now):  # fmt: skip
                x.priority = 0
                if not x.lock_ref:
                    self.cache.order.push(x)
                y = x.parent  # (not leaves: nothing to index again)
                while (y.parent is not None and len(y.children) == 1 and y.priority
                       and predicted_of(y.priority) < self.now):  # fmt: skip
                    y.priority, y = 0, y.parent


class _Places(TreeComponent):
    """Where each session's path ends (`_Session.node`) and where its own branch hangs
    (the node of `_Session.anchor`), kept through the tree's changes as a trim of one
    node keeps them, however a path is split into nodes (a prompt computed chunk by
    chunk is a chain of single-child nodes; computed at once, one node). A node evicted
    whole (or detached) hands its sessions to its parent while that parent has no other
    child (the same unbranched run: one node's trim would have kept the place); past a
    fork or at the root the place is gone (the node stays the dead one). A node merged
    into a leaf hands them to that leaf. A moved anchor names no child below (its branch
    is gone). O(victims) an eviction; two entries per session at most."""

    name = "session_places"

    def __init__(self, sessions: dict[Any, _Session]) -> None:
        self.sessions = sessions  # the clock's: key -> session
        self.ends: dict[Any, set[Any]] = {}  # node -> keys of the sessions ending there
        self.bases: dict[Any, set[Any]] = {}  # node -> keys of the sessions hanging there
        self._moves: list[tuple[Any, Any]] = []  # (victim, the place it hands on, or None)

    def end(self, key: Any, s: _Session, node: Any) -> None:
        """``s.node`` = ``node``, and the map with it."""
        _regroup(self.ends, key, s.node, node)
        s.node = node

    def hang(self, key: Any, s: _Session, anchor: tuple[Any, Any, int] | None) -> None:
        """``s.anchor`` = ``anchor``, and the map with it."""
        _regroup(self.bases, key, s.anchor[0] if s.anchor else None,
                 anchor[0] if anchor else None)  # fmt: skip
        s.anchor = anchor

    def forget(self, key: Any, s: _Session) -> None:
        self.end(key, s, None)
        self.hang(key, s, None)

    def evicting(self, victims: list[Any], trim: tuple[Any, int] | None, slots: Any) -> None:
        self._moves = []  # (a retry computes them again)
        placed = [v for v in victims if v in self.ends or v in self.bases]
        gone = {id(v) for v in victims} if placed else set()  # (most evictions: none)
        for v in placed:
            x, up = v, None
            while (p := x.parent) is not None and p.parent is not None and len(p.children) == 1:
                if id(p) not in gone:
                    up = p
                    break
                x = p
            self._moves.append((v, up))

    def evicted(self, victims: list[Any], trim: tuple[Any, int] | None) -> None:
        for v, up in self._moves:
            self._move(v, up)
        self._moves = []

    def merge(self, leaf: Any, parent: Any) -> None:
        self._move(parent, leaf)

    def detached(self, node: Any, parent: Any) -> None:
        alone = parent.parent is not None and not parent.children
        self._move(node, parent if alone else None)

    def reset(self) -> None:
        self.ends.clear()
        self.bases.clear()

    def _move(self, node: Any, to: Any) -> None:
        for key in self.ends.pop(node, ()):
            s = self.sessions.get(key)
            if to is not None and s is not None and s.node is node:
                self.ends.setdefault(to, set()).add(key)
                s.node = to
        for key in self.bases.pop(node, ()):
            s = self.sessions.get(key)
            if to is not None and s is not None and s.anchor and s.anchor[0] is node:
                self.bases.setdefault(to, set()).add(key)
                s.anchor = (to, None, s.anchor[2])


def _regroup(groups: dict[Any, set[Any]], key: Any, old: Any, new: Any) -> None:
    """Move ``key`` from ``groups[old]`` to ``groups[new]`` (None: none)."""
    if old is not None and old in groups:
        groups[old].discard(key)
        if not groups[old]:
            del groups[old]
    if new is not None:
        groups.setdefault(new, set()).add(key)


class SessionOrder:
    """The tree's ``session`` order: `started` and `stopped` as requests come and go,
    `tick` before evicting (the sessions that came due are stamped again)."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.clock = cache, SessionClock()
        self.reasons = EvictionReasons()
        cache.add_component(self.reasons)
        cache.order.uncovered_key = self._uncovered_key
        self.places = _Places(self.clock.sessions)
        cache.add_component(self.places)
        self._anonymous = itertools.count()

    def started(self, session: Any, now: float) -> None:
        self.clock.started(session, now)
        self._release_forgotten()

    def admitted(self, req: Any, now: float) -> None:
        """A request whose tag names no session (``session.key`` None) was admitted: its
        session is the one whose last answer ended where its cached prefix ends (its
        hit's node, ``req.last_node``, or that node's only child: a hit ending inside
        that answer's node split it), else a new one of its own. The tag is replaced by
        one naming it. O(1): a prefix many sessions share is never walked."""
        node, key = req.last_node, None
        if node is not None and node.parent is not None:
            near = (node, *node.children.values()) if len(node.children) == 1 else (node,)
            ends = self.places.ends
            live = [k for x in near for k in ends.get(x, ()) if k in self.clock.sessions]
            if live:  # (the latest answer among them)
                key = max(live, key=lambda k: self.clock.sessions[k].end)
        if key is None:
            key = ("tree", next(self._anonymous))
        req.session = dataclasses.replace(req.session, key=key)
        self.started(key, now)

    def _release_forgotten(self) -> None:
        while self.clock.forgotten:
            key, s = self.clock.forgotten.pop()
            self.release(s.node, s.anchor)
            self.places.forget(key, s)

    def requests_stopped(self, reqs: Any, now: float) -> None:
        """Requests that left (``session``: a `SessionTag` or None; ``final_node``, their
        text, output ids and finish reason): how each stopped (a tool call its
        ``called_tool`` recognises; ``end_turn`` for any other ``stop``; unknown for a
        cut, an abort or a failure)."""
        for r in reqs:
            tag = getattr(r, "session", None)
            if tag is None or tag.key is None:  # (left before admission named it)
                continue
            stop = "end_turn" if r.finish_reason == "stop" else ""
            if stop and tag.called_tool is not None:
                try:
                    stop = "tool_use" if tag.called_tool(r.text, r.output_ids) else stop
                except Exception:  # the caller's recogniser: it must not stop the engine
                    stop = ""
            self.stopped(tag.key, now, stop, r.final_node)

    def stopped(self, session: Any, now: float, stop: str, node: Any) -> None:
        s = self.clock.sessions.get(session)
        before = (s.node, s.anchor) if s is not None else (None, None)
        predicted = self.clock.stopped(session, now, stop, None)
        self._release_forgotten()
        s = self.clock.sessions[session]
        if node is not None:  # (where a tagless follow-up lands, too)
            self.places.end(session, s, node)
        if before[0] is not None and node is not None and not _on_path(before[0], node):
            self.release(*before, node)  # the session left that path (went on elsewhere)
        if node is not None and self.clock.sessions[session].running == 0:
            self._stamp_session(session, predicted, now)

    def loaded_back(self, session: Any, node: Any, now: float) -> None:
        """``session``'s last path came back from a tier ahead of its return, ending at
        ``node``: its path ends there again, stamped with its prediction (unstamped, the
        pages just loaded would be the first to go)."""
        s = self.clock.sessions.get(session)
        if s is None or s.running or node is None or node.parent is None:
            return
        self.places.end(session, s, node)
        self._stamp_session(session, self.clock.predicted(session, now), now)

    def release(
        self, node: Any, anchor: tuple[Any, Any, int] | None = None, left: Any = None
    ) -> None:
        """A path no session will come back to (its session went on from elsewhere, to
        ``left``, or was forgotten): what is left of its own branch (`_surviving`) goes
        back to priority 0, evicted before every stamped one (a stamp it kept would be
        a return long past: the highest priority there is). Found from ``anchor`` once
        ``node`` was evicted: before, a branch forked below its top was missed (the walk
        stopped at the fork and zeroed the new path's prefix), and its stamp held a
        quarter of an agentic replay's cache for the rest of the replay."""
        node = self._surviving(node, anchor, left)
        if node is None:
            return
        x = node
        while x is not None and x.parent is not None:
            x.priority = 0
            if len(x.parent.children) != 1:
                break
            x = x.parent
        if not node.children and not node.lock_ref:
            self.cache.order.push(node)

    def _uncovered_key(self, node: Any) -> tuple[Any, ...]:
        """The eviction key of a parent whose children an eviction takes: a stale stamp
        there counts as none (priority 0), as `EvictionReasons` leaves it once they went,
        within the same eviction (so taking a prompt's room at once or chunk by chunk
        takes the same victims)."""
        key = self.cache.order.policy_key(node)  # (priority, then the tie-breaks)
        if node.priority and predicted_of(node.priority) < self.reasons.now:
            return (0, *key[1:])
        return key

    def tick(self, now: float) -> None:
        self.reasons.now = now
        for due in self.clock.due(now):
            self._stamp_session(due.session, due.predicted, now)
        self._release_forgotten()

    def _stamp_session(self, session: Any, predicted: float, now: float) -> None:
        """Stamp what is left of the session's last path: its end node, or, once that
        was evicted whole (an order eats a path from its leaf up), the deepest node
        still cached down its own branch (`_surviving`); once the whole branch is gone,
        the prefix it shared (the node above the branch: `_stamp_shared`). Without this
        a session's older turns, or a prefix only gone sessions shared, kept the stamp
        of a return long past, the highest priority there is, and were never evicted."""
        s = self.clock.sessions.get(session)
        if s is None:
            return
        node = self._surviving(s.node, s.anchor)
        self.places.end(session, s, node)  # (a tagless follow-up lands where it survives)
        if node is None:  # its own branch is gone: a prefix it shared may be left
            base = s.anchor[0] if s.anchor is not None else None
            if base is not None and base.parent is not None:
                self._stamp_shared(base, predicted, now)
            return
        top = self.stamp(node, predicted)
        anchor = None
        if top is not None:
            anchor = (top.parent, self.cache.child_key(top.parent, top), top.priority)
        self.places.hang(session, s, anchor)

    def _surviving(
        self, node: Any, anchor: tuple[Any, Any, int] | None, left: Any = None
    ) -> Any:
        """``node`` while cached; once evicted whole, the deepest node still cached of
        its own branch as last stamped (``anchor``: the node above the branch, the key
        of the branch's first page there, the priority it gave): down the branch's only
        child at each node, or where the path a session went on with (``left``: the node
        it ends at now) branched off it, the one child off that path (of several, the
        one still holding the stamp it gave: the others are other sessions'). An order
        evicts a path from its leaf up; a split leaves a node's head under the same key.
        None when that is gone too, or (``left``) when nothing of it is off the new
        path. O(depth + children of the forks it passes)."""
        if node is not None and node.parent is not None:
            return node
        if anchor is None:
            return None
        base, key, value = anchor
        if base.parent is None and base is not self.cache.root:  # (evicted)
            return None
        x, new = base.children.get(key), None
        while x is not None and x.children:
            kids = list(x.children.values())
            if len(kids) > 1 and left is not None:  # (a fork: the child off the new path)
                new = new if new is not None else _path_ids(left)
                kids = [c for c in kids if id(c) not in new]
                if len(kids) > 1:  # (another session's branch forked here too)
                    kids = [c for c in kids if c.priority == value]
            if len(kids) != 1:
                break
            x = kids[0]
        return None if x is None or (left is not None and _on_path(x, left)) else x

    def _stamp_shared(self, node: Any, predicted: float, now: float) -> None:
        """Give ``node`` and its ancestors, prefixes other sessions may share, the
        priority of ``predicted`` where theirs is lower or a return already past (no
        prediction any more: it would be the highest priority there is); the leaf is
        indexed again under its new key."""
        value, x = priority_of(predicted), node
        while x is not None and x.parent is not None:
            if x.priority < value or predicted_of(x.priority) < now:
                x.priority = value
            x = x.parent
        if not node.children and not node.lock_ref:
            self.cache.order.push(node)

    def stamp(self, node: Any, predicted: float) -> Any:
        """Give ``node``'s own branch the priority of ``predicted``; shared ancestors
        keep the highest; the leaf is indexed again under its new key. Returns the top
        of the own branch (None: ``node`` was evicted, or is the root)."""
        if node.parent is None:  # evicted since (or the root)
            return None
        value = priority_of(predicted)
        x, own, top = node, True, node
        while x is not None and x.parent is not None:
            if own:
                x.priority = value
                top = x
            else:
                x.priority = max(x.priority, value)
            own = own and len(x.parent.children) == 1
            x = x.parent
        if not node.children and not node.lock_ref:
            self.cache.order.push(node)
        return top


def _path_ids(leaf: Any) -> set[int]:
    """The ids of ``leaf`` and its ancestors (O(depth)): a fork's many children are each
    checked in O(1) against the path, not walked up from one by one."""
    out = set()
    while leaf is not None:
        out.add(id(leaf))
        leaf = leaf.parent
    return out


def _on_path(node: Any, leaf: Any) -> bool:
    """Whether ``node`` is ``leaf`` or one of its ancestors (O(depth))."""
    x = leaf
    while x is not None:
        if x is node:
            return True
        x = x.parent
    return False


def session_order(
    policy: str, cache: Any, managers: Any, budget: Any = None
) -> SessionOrder | None:
    """The engine's `SessionOrder` for eviction ``policy`` ``session`` (None for any
    other). A hybrid model's cache is ordered by its one byte budget (``budget``: a
    `radixkv.kvcache.budget.HybridBudget` in the ``priority`` order reads the stamps);
    with separate pools (no ``cache_bytes``) its layer managers evict each in their own
    order, which reads no priority: refused there, not ignored.

    Raises:
        ValueError: ``session`` with layer managers and no budget in the stamped order
            (naming ``eviction_policy``).
    """
    if policy != "session":
        return None
    if managers and getattr(budget, "order", None) != "priority":
        raise ValueError("eviction_policy session orders a hybrid model's cache through "
                         "its one byte budget: give it cache_bytes (its separate pools "
                         "each evict in their own order)")  # fmt: skip
    return SessionOrder(cache)


__all__ = ["DEFAULT_GAP_S", "PRIORITY_TOP", "REASONS", "Due", "EvictionReasons",
           "SessionClock", "SessionOrder", "predicted_of", "priority_of",
           "session_order"]  # fmt: skip
