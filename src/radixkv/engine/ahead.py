"""Loading a waiting agent's pages back before it returns (``EngineConfig.prefetch_within``,
``radixkv serve --prefetch-within SECONDS``; issue 61: "loaded back when its next request
arrives, or before, when predicted").

An agent whose answer called a tool is back in seconds (the session order's prediction:
`radixkv.kvcache.sessions`). Meanwhile other sessions' requests may have pushed its pages
down to the host pool or the store, and its next request would wait for them to load
before its first token. `LoadAhead.run` loads them back: of the sessions with nothing
running that are predicted back within the horizon, the soonest first, the pages of its
last path (prompt and output, as cached when it finished) that the device lacks. Room is
made only by evicting what the order ranks below that session (predicted back later, or
no session's), never a sooner return; what does not fit stays below. It runs while the
engine has no request to run (`Engine.idle`: all that fits), and before a busy step when
no request waits to be admitted (a waiting request's own loads come first). An idle
call loads at most `IDLE_CHUNKS` chunks (the engine's loop calls it again at once while
it loads: a request arriving meanwhile waits for that much at most); a busy step at
most ``chunk_size`` tokens (copying a chunk's KV costs far less than computing it),
leaving the running requests the slots they still need for their prompts and answers in
what is free or ranks below the session (`EvictionOrder.size_below`; taken, the pages
loaded would be evicted again before those requests end). The loaded path is stamped as
the session's end again (`SessionOrder.loaded_back`). With layer managers (a hybrid
model, in one byte budget: the session order needs it) the loads are the ones a
request's arrival makes (each layer type's tier: window pages, a checkpoint with the KV
up to it), run with the tree's order under the session's floor
(`radixkv.tree.eviction.EvictionOrder.below`), which the budget's rounds read too: a
load whose room cannot be had so brings nothing. A call whose cap ends short of a
recurrent model's next checkpoint loads the KV toward it and holds it (`_toward`:
locked, as the KV past a model's last checkpoint serves no match and the budget frees
it first) until the checkpoint lands, the session is no longer the one due, a request
waits, or a decode short of room would preempt (`release`, `relieving`); only when the
room for all of it can be had at once.

Bounds: the paths of at most `MAX_PATHS` sessions, each at most ``max_tokens`` (what
device and host pool hold together), all of them `PATHS_OVER` times that, the least
recently finished dropped first. A path is looked at again only once the room changed
since it was last seen as whole as it can be (the tokens the cache evicted, or those it
could evict: a running request's path unlocked); one a step's cap cut, at the next call.
One session's load per call, at most `IDLE_CHUNKS` chunks when idle, so a request that
arrives waits for at most that copy.

Invariant: at most one path is held, by one lock (`locks`: the engine's lock ledger
counts it), and none once a call ends without holding it.

Owns: which session to load ahead, and the room for it. Must not touch: how pages load
(the tier's `load`), the prediction (`SessionClock`), the tree's order.

Complexity: `run` O(paths) to choose, a prefix match per path looked at, plus the load
and its evictions; a busy step's call adds `size_below`'s O(leaves + their chains) when a
session is due.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

from radixkv.key import RadixKey
from radixkv.kvcache.sessions import priority_of
from radixkv.units import align_down

MAX_PATHS = 1024  # sessions whose last path is kept for a load ahead
IDLE_CHUNKS = 8  # an idle call loads at most this many chunks (a request arriving waits
# for that copy at most: at the default 512-token chunks, 4,096 tokens, 0.5 GiB of an 8B
# model's KV, ~20 ms over PCIe 4.0, where a whole 100k-token path was ~0.5 s, and
# seconds from a shared store)
# the paths kept hold at most this many times the tokens device and host hold together
# (paths share prefixes; 8 bytes a token id, a small part of a token's KV)
PATHS_OVER = 4


class LoadAhead:
    """``remember`` each finished request's path; ``run`` when the engine is idle, and
    with a ``cap`` before a busy step."""

    def __init__(self, cache: Any, mgr: Any, sessions: Any, tier: Any, horizon_s: float,
                 max_tokens: int, load_layers: Any = None, layer_tiers: Any = ()
                 ) -> None:  # fmt: skip
        self.cache, self.mgr, self.sessions, self.tier = cache, mgr, sessions, tier
        # with layer managers: ``load_layers(tokens, ns, usable, ahead=True[, kv_only])``,
        # the loads a request's arrival makes (each layer type's tier), run under the floor
        self.load_layers = load_layers
        # the layer tiers whose load brings the KV only up to a checkpoint (``reach``)
        self.reaching = [t for t in layer_tiers if t.loads_pages]
        self._hold: Any = None  # (session, node): a busy load's KV toward a checkpoint
        self.horizon = horizon_s
        self.max_tokens = max_tokens  # a path's (what device and host hold together)
        self.max_held = PATHS_OVER * max_tokens  # all paths' (8 bytes a token id)
        # session -> (its last path, namespace, `_epoch` when last seen whole)
        self.paths: OrderedDict[Any, tuple[array, Any, tuple[int, int]]] = OrderedDict()
        self.held = 0  # tokens of the paths kept
        self._short: Any = None  # (room epoch, session) a busy call found no room at

    def remember(self, session: Any, tokens: array, ns: Any) -> None:
        """``session``'s request finished with ``tokens`` cached (whole pages)."""
        old = self.paths.pop(session, None)
        self.held -= len(old[0]) if old is not None else 0
        if not tokens or len(tokens) > self.max_tokens:
            return
        self.paths[session] = (tokens, ns, self._epoch())
        self.held += len(tokens)
        while self.held > self.max_held or len(self.paths) > MAX_PATHS:
            self.held -= len(self.paths.popitem(last=False)[1][0])

    def clear(self) -> None:
        """Forget every path (a flushed cache is loaded back by no one)."""
        self.release()
        self.paths.clear()
        self.held = 0

    def release(self) -> int:
        """Unlock the KV a busy load holds toward a checkpoint (a request waits: the room
        is its; the pages stay, for a match or the budget's first round). Returns the
        tokens that became evictable."""
        if self._hold is None:
            return 0
        gained = self.cache.dec_lock_ref(self._hold[1])
        self._hold = None
        return gained

    def relieving(self, then: Any) -> Any:
        """The scheduler's ``relieve`` hook (make ``n`` more tokens evictable before a
        decode preempts or a lone chunk waits): what this holds goes first, then
        ``then`` (retained prefixes) for the rest."""

        def relieve(n: int) -> int:
            gained = self.release()
            return gained + (then(n - gained) if gained < n else 0)

        return relieve

    def locks(self) -> list[Any]:
        """The node it holds a lock on, if any (the engine's lock ledger)."""
        return [self._hold[1]] if self._hold is not None else []

    def run(self, now: float, cap: int | None = None, keep: int = 0) -> int:
        """Load the missing pages of the session predicted back soonest (within the
        horizon) that may lack some: only a path seen whole before the room last changed
        is looked at again. ``cap``: the most tokens to load now (whole pages; a busy
        engine's step), the rest at the next call; None: all that fits. ``keep``: slots
        the running requests still need, left to them in what is free or ranks below
        the session (taken, the pages loaded would be evicted again before they end).
        Returns the tokens loaded."""
        old, self._hold = self._hold, None  # (locked until this call holds its successor)
        try:
            return self._run(now, cap, keep, old)
        finally:
            if old is not None and self._hold is not old:
                self.cache.dec_lock_ref(old[1])

    def _run(self, now: float, cap: int | None, keep: int, old: Any) -> int:
        self.sessions.tick(now)  # (as a step does: overdue sessions' stamps are stale)
        clock, epoch, due = self.sessions.clock, self._epoch(), []
        page = self.cache.page_size
        for key, (_, _, seen) in self.paths.items():
            s = clock.sessions.get(key)
            if s is None or s.running or (seen == epoch and (old is None or old[0] != key)):
                continue  # (a path held toward its checkpoint is looked at every call)
            back = clock.predicted(key, now)
            if back <= now + self.horizon:
                due.append((back, key))
        for back, key in sorted(due, key=lambda d: d[0]):
            tokens, ns, seen = self.paths[key]
            floor, held = priority_of(back), self.cache.match_len(RadixKey(tokens, ns))
            if held >= align_down(len(tokens), page):
                self.paths[key] = (tokens, ns, epoch)  # whole on the device
                continue
            if cap is not None:  # (what the running requests will evict first stays theirs)
                if old is not None and old[0] == key:  # (what it holds stays held while
                    self._hold = old  # its session is the next due, short of room or not)
                if self._short == (epoch, key):  # (counted short, and nothing was evicted
                    return 0  # or unlocked since: a decode's slots come out of its keep)
                room = self.cache.order.size_below(floor, keep + cap)
                cap = min(cap, self.mgr.allocator.available_size() + room - keep)
                if cap < page:
                    self._short = (epoch, key)
                    return 0  # (a later return has less room below it still)
                self._hold = None  # (held again below only while it still leads nowhere)
            if self.load_layers is None:
                n, loaded, cut = self._load_pages(tokens, ns, floor, cap)
            else:
                n, loaded, cut = self._load_layers(tokens, ns, floor, cap, held)
                if cut and not loaded and (n := self._toward(key, tokens, ns, floor, cap, keep)):
                    return n  # (KV toward a checkpoint, held: nothing servable yet)
            if not (cut and loaded):  # (seen as whole as it can be now; a path the cap cut
                seen = self._epoch()  # after some progress: again at the next call)
            self.paths[key] = (tokens, ns, seen)
            if loaded:
                node = self.cache.match_prefix(RadixKey(tokens[:n], ns)).last_node
                self.sessions.loaded_back(key, node, now)
                return loaded
        return 0

    def _epoch(self) -> tuple[int, int]:
        """What changes when the room a load could have changes: the tokens the cache
        evicted, and those it could evict (a running request's path, unlocked at its
        end, is room a busy step's load could not take)."""
        return self.mgr.evicted_tokens, self.cache.evictable_size()

    def _load_pages(self, tokens: array, ns: Any, floor: int, cap: int | None
                    ) -> tuple[int, int, bool]:  # fmt: skip
        """Full attention alone: room for as much of the path as can be had below
        ``floor`` (`_make_room`), then its pages; (tokens held, tokens loaded, whether
        ``cap`` left some of the path untried)."""
        n, hashes, cut = self._make_room(tokens, ns, floor, cap)
        if not n:
            return 0, 0, cut
        alloc = self.mgr.allocator.alloc
        return n, self.tier.load(tokens, ns, n, alloc, hashes, ahead=True), cut

    def _load_layers(self, tokens: array, ns: Any, floor: int, cap: int | None, before: int
                     ) -> tuple[int, int, bool]:  # fmt: skip
        """With layer managers (window pages, checkpoints: each brought by its type's
        tier, room made across kinds by the one budget): the loads a request's arrival
        makes, every eviction they cause kept below ``floor``
        (`radixkv.tree.eviction.EvictionOrder.below`); a load that finds no room brings
        nothing; under ``cap``, up to the deepest end (a checkpoint, a window) within
        ``cap`` tokens of what the device has of the path. ``before``: the tokens of the
        path the device serves now (less than its whole pages). (tokens the device serves
        of the path then, tokens that became servable, whether ``cap`` left some of it
        untried)."""
        key, page = RadixKey(tokens, ns), self.cache.page_size
        usable = len(tokens)
        if cap is not None:
            usable = min(usable, align_down(self.cache.match_len(key, full=True) + cap, page))
        with self.cache.order.below(floor):
            self.load_layers(tokens, ns, usable, ahead=True)
        after = self.cache.match_len(key)
        return after, max(0, after - before), usable < align_down(len(tokens), page)

    def _toward(self, session: Any, tokens: array, ns: Any, floor: int, cap: int, keep: int
                ) -> int:  # fmt: skip
        """A busy step whose chunk ends short of the path's next checkpoint (a recurrent
        layer's tier: `StateTiers.reach`) loads the KV toward it, ``cap`` tokens, and
        holds it (locked: the KV beyond a model's last checkpoint serves no match, and
        the budget's first round frees it for anyone) until the checkpoint lands in a
        later step, the session stops being the one due, or a request waits
        (`release`). Only when the room for all of it up to the checkpoint can be had
        now, ``keep`` left to the running requests. Returns the KV tokens loaded."""
        key, page = RadixKey(tokens, ns), self.cache.page_size
        full = self.cache.match_len(key, full=True)
        end = max((t.reach(tokens, ns, len(tokens)) for t in self.reaching), default=0)
        need = end - full
        if need <= cap or need > self.mgr.allocator.available_size() + (
            self.cache.order.size_below(floor, keep + need) - keep
        ):
            return 0  # (within the chunk, it was the load's to bring; or no room for it)
        with self.cache.order.below(floor):
            self.load_layers(tokens, ns, align_down(full + cap, page), ahead=True, kv_only=True)
        now = self.cache.match_prefix(key[:end], full=True)
        if now.prefix_len <= full:
            return 0
        self.cache.inc_lock_ref(now.last_node)
        self._hold = (session, now.last_node)
        return now.prefix_len - full

    def _make_room(self, tokens: array, ns: Any, floor: int, cap: int | None = None
                   ) -> tuple[int, list | None, bool]:  # fmt: skip
        """Free slots for the pages the device lacks of ``tokens`` that a tier can bring
        back (without a store: the run the host pool holds), at most ``cap`` tokens'
        worth, evicting only leaves of priority below ``floor``; returns how many
        leading tokens can then be held (0: nothing to load), the path's page hashes if
        they were computed, and whether the cap left some of the path untried."""
        page, allocator = self.cache.page_size, self.mgr.allocator
        want = align_down(len(tokens), page)
        hit = self.cache.match_prefix(RadixKey(tokens[:want], ns), full=True)
        missing, hashes = want - hit.prefix_len, None
        if missing > 0 and self.tier.store is None:  # (what the host pool cannot bring
            hashes = self.tier.page_hashes(tokens, ns, want // page)  # back is worth no room)
            missing = page * self.tier.host_run(hashes, hit.prefix_len // page)
        cut = cap is not None and missing > align_down(cap, page)
        if cut:
            missing = align_down(cap, page)
        if missing <= 0:
            return 0, hashes, cut
        self.cache.inc_lock_ref(hit.last_node)  # (its own prefix is not a victim)
        try:
            short = missing - allocator.available_size()
            while short > 0 and (first := self.cache.order.peek()) is not None:
                (priority, *_), node = first
                if priority >= floor:  # the next victim returns no later than this one
                    break
                take = min(len(node), -(-short // page) * page)
                freed = self.cache.evict_leaf(node, take if take < len(node) else None)
                self.mgr.evicted_tokens += freed
                short -= freed
        finally:
            self.cache.dec_lock_ref(hit.last_node)
        room = align_down(min(missing, allocator.available_size()), page)
        return (hit.prefix_len + room if room else 0), hashes, cut


def load_ahead(cfg: Any, cache: Any, mgr: Any, sessions: Any, tier: Any, load_layers: Any,
               layer_tiers: Any = ()) -> LoadAhead | None:  # fmt: skip
    """The engine's `LoadAhead` for ``cfg.prefetch_within`` (None: off); with layer
    managers it loads through ``load_layers`` (the engine's loads on a request's
    arrival: `LoadAhead._load_layers`) and asks ``layer_tiers`` how far a checkpoint
    is (`LoadAhead._toward`)."""
    if cfg.prefetch_within is None:
        return None
    return LoadAhead(cache, mgr, sessions, tier, float(cfg.prefetch_within),
                     cfg.host_tokens + mgr.allocator.capacity,
                     load_layers if mgr.managers else None, layer_tiers)  # fmt: skip


__all__ = ["IDLE_CHUNKS", "MAX_PATHS", "PATHS_OVER", "LoadAhead", "load_ahead"]
