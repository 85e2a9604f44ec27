"""The routing core: which worker a request goes to, and what it costs there until it
ends. No HTTP: ``radixkv route``'s proxy (`radixkv.router.proxy`) and the replica
simulator (`radixkv.sim.replicas`) drive this same core, the proxy on the wall clock and
the simulator on its own, so a simulated policy is the shipped one.

Owns: each worker's load (requests and blocks in flight, prefill blocks queued), claims
(a prompt routed to a worker counts as cached there until the worker's events can have
reported it), the approximate trees of routed prompts (``approx``), the event-fed
`KvIndex` and the lock that guards it, shared-prefix pricing, and `RoutingCore.choose`.
Must not touch: HTTP, retries, streams, health checks, metrics (the proxy's), or the
workers themselves.

A `Ticket` is one request's charge on one worker: counted from the moment it is issued
(so the next choice sees it, and a burst spreads before anyone answers), its prefill
blocks until `Ticket.started` (the answer began), the rest until `Ticket.release`, which
takes effect exactly once whatever path ends the request (an answer, a failure, a
retry elsewhere, a client gone).

Policies (`radixkv.router.policies` has the pure functions):

    round_robin, least_load (requests in flight),
    approx  SGLang router's cache-aware policy over a tree of the prompts routed to
            each worker (bounded: the oldest routed prompts go first),
    kv      Dynamo's cost over the event-fed index: weight x (1/4 x blocks still to
            prefill for requests sent to the worker that have not answered yet + this
            prompt's blocks after the worker's cached overlap, a prefix many cached
            prompts share counting as held everywhere) + blocks of the requests in
            flight there. A prompt routed to a worker counts as cached there while the
            request runs and for `EVENTS_GRACE_S` after (at most `PENDING_S`), until
            the worker's events arrive (they follow the request by a step or more, and
            a chat's next turn often comes first). Where the cost goes is bounded
            (`RoutingCore._place`): a conversation's next turn stays with its history
            unless that worker is loaded far past the mean, and a cold prompt is placed
            by the demand routed to each worker against its pool (its card's
            ``kv_blocks``) and by the prefill work it has been sent lately, not by the
            load of the moment.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.events import KVEventBatch, salt_tag
from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.router.index import KvIndex
from radixkv.tree import RadixCache
from radixkv.units import align_down

APPROX_TREE_TOKENS = 1 << 22  # per worker; the oldest routed prompts are evicted beyond
# kv: a routed prompt counts as cached on its worker for this long, until the worker's
# events (which follow the request by a step or more) make the index say so
PENDING_S = 10.0
EVENTS_GRACE_S = 1.0  # after a request ends, how long its claim still stands
DEFAULT_BLOCK = 16  # block size assumed before any worker's events said it
DEMAND_POOLS = 4  # kv: a worker's routed prompts remembered, in pools of its KV
# kv: the half-life of a worker's recent prefill work, by which cold prompts are placed
# beside its demand (`RoutingCore._place`); 60 s, 300 s and 30 min place agentic
# sessions alike (3 replicas x 256k, kv-cache-tester traces, 3 seeds: hit within 0.02,
# imbalance <= 1.24)
WORK_HALF_LIFE_S = 300.0


@dataclass(eq=False)
class WorkerLoad:
    """What the core knows of one worker: its load and what was routed to it."""

    name: Hashable
    alive: bool = True
    stale: bool = False  # its event stream keeps failing: its index entries are not trusted
    in_flight: int = 0  # sequences: a request of ``n`` choices counts ``n`` (its worker runs n)
    active_blocks: int = 0
    queued_blocks: int = 0  # prefill blocks of requests sent here, not answered yet
    # prefill blocks sent here, decayed by half every `WORK_HALF_LIFE_S` (`recent_work`)
    work: float = 0.0
    work_at: float | None = None  # when ``work`` was last decayed
    routed: RadixCache = field(default_factory=lambda: RadixCache(page_size=1))
    claims: deque = field(default_factory=deque)  # [expiry, RadixKey] of recent routes

    def recent_work(self, now: float) -> float:
        """The prefill blocks sent here lately: each counts 1 when sent, halving every
        `WORK_HALF_LIFE_S` (the compute its conversations have been costing it)."""
        if self.work_at is not None and now > self.work_at:
            self.work *= 0.5 ** ((now - self.work_at) / WORK_HALF_LIFE_S)
        self.work_at = now if self.work_at is None else max(now, self.work_at)
        return self.work

    def claimed(self, key: RadixKey, now: float, checkpoint_page: int = 0) -> int:
        """Tokens of ``key`` shared with a prompt routed here whose pages the worker's
        events may not have reported yet. With ``checkpoint_page`` (its page size: a
        recurrent worker, `KvIndex.sparse`) the worker serves only from the checkpoint
        at such a prompt's end (its last whole page): ``key`` must go through it."""
        while self.claims and self.claims[0][0] < now:
            self.claims.popleft()
        best = 0
        for expiry, k in self.claims:
            if expiry >= now and k.extra_key == key.extra_key:
                shared = k.match(key)
                if checkpoint_page:
                    end = align_down(len(k), checkpoint_page)
                    shared = end if shared >= end else 0
                best = max(best, shared)
        return best


@dataclass(eq=False)
class Ticket:
    """One request's charge on one worker (see the module docstring).

    Attributes:
        worker: the worker's load record (``worker.name`` names it).
        held: blocks of the prompt the index says the worker holds.
        fleet: the most blocks any alive worker holds (fleet-available).
        prefill: blocks the worker must compute (claims count as held).
        blocks: blocks charged while the request is in flight (the prompt once, every
            choice's output).
        choices: its ``n``: the sequences it counts in flight.
    """

    core: RoutingCore
    worker: WorkerLoad
    held: int
    fleet: int
    prefill: int
    blocks: int
    choices: int = 1
    claim: list | None = None  # kv: [expiry, key], the claim routing made for it
    queued: bool = True
    released: bool = False
    key_spilled: bool = False  # a prompt_cache_key request sent past the key's worker

    def started(self) -> None:
        """The answer started: the worker has done this request's prefill."""
        if self.queued and not self.released:
            self.queued = False
            self.worker.queued_blocks -= self.prefill

    def release(self, served: bool = True) -> None:
        """The request is over on this worker: its load goes, once (later calls do
        nothing). Its claim stands `EVENTS_GRACE_S` more when ``served`` (the worker's
        events about the prompt follow within a step; a worker under memory pressure
        may already have evicted it), and ends now when not (it never took it)."""
        if self.released:
            return
        self.started()
        self.released = True
        w = self.worker
        w.in_flight -= self.choices
        w.active_blocks -= self.blocks
        if self.claim is not None:
            end = self.core.clock() + (EVENTS_GRACE_S if served else 0.0)
            self.claim[0] = min(self.claim[0], end)


class RoutingCore:
    """Workers' load, the event-fed index and the policy (see the module docstring).

    Args:
        policy: one of `radixkv.router.policies.POLICIES`.
        kv_weight: the ``kv`` cost's weight on prefill blocks.
        events_key: the workers' key for namespace tags (`radixkv.events.salt_tag`).
        approx_tokens: tokens each worker's tree of routed prompts holds (``approx``).
        clock: seconds (the proxy's monotonic clock, or a simulator's).
    """

    def __init__(
        self,
        policy: str,
        kv_weight: float = policies.KV_OVERLAP_WEIGHT,
        events_key: bytes | None = None,
        approx_tokens: int = APPROX_TREE_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in policies.POLICIES:
            raise ValueError(f"policy must be one of {policies.POLICIES}, got {policy!r}")
        self.policy, self.kv_weight, self.events_key = policy, kv_weight, events_key
        self.approx_tokens, self.clock = approx_tokens, clock
        self.workers: dict[Hashable, WorkerLoad] = {}
        self.index = KvIndex()
        self.lock = threading.Lock()  # event threads write the index, choices read it
        self._turn = itertools.count()
        self.key_requests = 0  # requests with a prompt_cache_key
        self.key_spills = 0  # of which sent past the key's first worker (it was loaded)

    # --- workers and events -------------------------------------------------------------
    def add(self, name: Hashable) -> WorkerLoad:
        if name in self.workers:
            raise ValueError(f"the router already has the worker {name}")
        w = self.workers[name] = WorkerLoad(name)
        return w

    def remove(self, name: Hashable) -> None:
        """Forget the worker and what the index knew of it (its tickets still release
        into its old record)."""
        self.workers.pop(name, None)
        with self.lock:
            self.index.remove_worker(name)

    def apply(self, name: Hashable, batch: KVEventBatch) -> None:
        """One batch of the worker's KV events, into the index: checked whole first
        (`KvIndex.validate` raises `BadBatch` and nothing changes), then applied a
        slice at a time, so a large batch never holds the lock a choice waits for long.

        Raises:
            BadBatch: the batch is refused (the caller counts it).
        """
        with self.lock:
            self.index.validate(name, batch)
        for event in self.index.slices(batch):
            with self.lock:
                self.index.apply_event(name, event)

    @property
    def block_size(self) -> int:
        return self.index.block_size or DEFAULT_BLOCK

    # --- choosing -----------------------------------------------------------------------
    def choose(
        self,
        tokens: Sequence[int],
        salt: Any = None,
        max_tokens: int = 16,
        cache_key: str | None = None,
        n: int = 1,
    ) -> Ticket:
        """Pick a worker for a prompt (its token ids as the workers see them) and charge
        it; the ticket says what the index knew. Alive workers only, unless none is.
        ``n``: the request's choices, each a sequence of up to ``max_tokens`` on the
        worker after the prompt they share.

        ``cache_key`` (OpenAI's ``prompt_cache_key``): requests with the same key (in
        the same salt: a key never crosses a salt) go to the key's worker
        (`policies.key_home`, spilling past it when it is loaded beyond the bound). The
        key adds to the prefix match: under ``kv`` the key's worker takes the request
        unless another worker holds a longer prefix of it; then the cost decides, with
        the key's worker counted as holding the longest prefix any worker holds (a
        request that continues a conversation cached elsewhere still weighs where its
        prefix is). Leaving it to the cost alone scattered a cold tenant by load: its
        worker's one-block edge never outweighed a request in flight there."""
        alive = [w for w in self.workers.values() if w.alive] or list(self.workers.values())
        if not alive:
            raise LookupError("the router has no worker")
        with self.lock:
            tag = None if salt is None else salt_tag(salt, self.events_key)
            by_name, shared = self.index.lookup(tokens, tag, salt)
            cached = {w: self.index.num_blocks(w.name) for w in alive}
        size = self.block_size
        held = {w: 0 if w.stale else by_name.get(w.name, 0) for w in alive}
        cached = {w: 0 if w.stale else n for w, n in cached.items()}
        overlap, claim, now = held, None, self.clock()
        key = RadixKey(tokens, salt)
        if self.policy == "kv":
            sparse = self.index.sparse
            overlap = {w: max(held[w], w.claimed(key, now, size if w.name in sparse else 0)
                              // size) for w in alive}  # fmt: skip
        home, spilled, known = None, False, overlap
        if cache_key is not None:
            names = {x.name: x for x in alive}
            name, spilled = policies.key_home(list(names), cache_key, salt,
                                              {x.name: x.in_flight for x in alive})  # fmt: skip
            home = names[name]
            self.key_requests += 1
            self.key_spills += spilled
            if self.policy == "kv":  # the longest prefix anywhere, and ties go home
                overlap = {**overlap, home: max(overlap.values(), default=0) + 1}
        if home is not None and (self.policy != "kv" or held[home] >= max(held.values())):
            w = home  # under kv: unless another worker holds a longer prefix of it
        elif self.policy == "round_robin":
            w = policies.round_robin(alive, next(self._turn))
        elif self.policy == "least_load":
            w = policies.least_load(alive, {x: x.in_flight for x in alive})
        elif self.policy == "approx":
            matched = {x: x.routed.match_len(key) if tokens else 0 for x in alive}
            sizes = {x: x.routed.total_size() for x in alive}
            w = policies.approx(alive, {x: x.in_flight for x in alive}, matched, len(tokens),
                                sizes)  # fmt: skip
            if tokens:
                self._remember(w, key)
        else:

            def cost(pool: list[WorkerLoad]) -> WorkerLoad:
                return policies.kv(
                    pool, overlap, len(tokens) // size, {x: x.active_blocks for x in pool},
                    self.kv_weight, cached, {x: x.queued_blocks for x in pool}, shared,
                )  # fmt: skip

            w = self._place(alive, overlap, shared, cost, key)
            claim = [now + PENDING_S, key]
            w.claims.append(claim)
            if tokens:  # what was routed where: the demand a cold prompt is placed by
                self._remember(w, key)
        prefill = len(tokens) // size - known.get(w, 0)
        fleet = max(held.values(), default=0)
        ticket = self._charge(w, held.get(w, 0), fleet, prefill, tokens, max_tokens, n, claim)
        ticket.key_spilled = spilled
        return ticket

    def assign(
        self, name: Hashable, tokens: Sequence[int], max_tokens: int = 16, n: int = 1
    ) -> Ticket:
        """Charge a worker picked elsewhere (a retry after the chosen one failed): its
        whole prompt counts as to prefill, and it claims nothing."""
        w = self.workers[name]
        size = self.block_size
        return self._charge(w, 0, 0, len(tokens) // size, tokens, max_tokens, n, None)

    def _charge(
        self, w: WorkerLoad, held: int, fleet: int, prefill: int, tokens: Sequence[int],
        max_tokens: int, n: int, claim: list | None,
    ) -> Ticket:  # fmt: skip
        blocks = (len(tokens) + n * max_tokens) // self.block_size
        w.recent_work(self.clock())
        w.work += prefill
        w.in_flight += n
        w.active_blocks += blocks
        w.queued_blocks += prefill
        return Ticket(self, w, held, fleet, prefill, blocks, n, claim)

    def _place(
        self, alive: list[WorkerLoad], overlap: dict[WorkerLoad, int], shared: int,
        cost: Callable[[list[WorkerLoad]], WorkerLoad], key: RadixKey,
    ) -> WorkerLoad:  # fmt: skip
        """``kv``'s choice (the cost, `policies.kv`, breaks every tie):

        - a conversation's next turn (`_history`) stays with the worker holding the most
          of it while that worker's load is within `policies.KV_STICK_SLACK` x the mean;
          past that the cost decides;
        - a new conversation goes among the workers within `policies.KV_PLACE_SLACK` x
          the mean load whose recent prefill work (`WorkerLoad.recent_work`) is within
          `policies.KV_WORK_SLACK` x the fleet's mean: to the one holding the most of
          it when that is more than the shared prefix (another conversation's prefix:
          a sub-agent's, one behind a long common prefix before it is known shared),
          of those whose recent work is within `policies.KV_NEAR_SLACK` x the mean or
          under one pool (its card's ``kv_blocks``: a worker that computed less than its
          cache holds is not busy; without it a second request behind a fresh system
          prompt left the worker that had just computed it);
        - a cold prompt (nothing beyond a shared prefix anywhere among those) to the one
          with the least
          demand and work: its share of the tokens routed to them (its tree of routed
          prompts: the demand its conversations put on its pool) plus its share of their
          recent work. When every such worker's demand already exceeds its pool (its
          card's ``kv_blocks``), to the calm one exceeding it most: its pool thrashes
          anyway, and the others keep theirs. Among all within `policies.KV_WORK_SLACK`
          instead, the one routed the least was never chosen again: with three workers
          that bound lets one do no work at all (1.5 x the mean is half of the fleet's),
          and live (kv-cache-tester's client, short sessions behind a warm prefix, every
          routed tree at `DEMAND_POOLS`) one worker of three served 4 of 67 requests.
          Demand alone let one agent's 800k-token context
          (three pools of routed prompts on a worker that computes little: a hit) keep
          every new session off that worker while the two others did all the work
          (busy time 20,694 / 11,190 / 841 s: imbalance 1.90)."""
        loads = {x: x.in_flight for x in alive}
        history = self._history(alive, overlap, shared, key)
        if history:
            stick = policies.KV_STICK_SLACK
            homes = [x for x in history if policies.within_bound(alive, x, loads, stick)]
            return cost(homes or alive)
        fit = [x for x in alive
               if policies.within_bound(alive, x, loads, policies.KV_PLACE_SLACK)]  # fmt: skip
        if not fit:
            return cost(alive)
        now = self.clock()
        work = {x: x.recent_work(now) for x in alive}
        mean = sum(work.values()) / len(alive)
        calm = [x for x in fit  # (below one pool of recent work a worker is never busy)
                if work[x] <= max(policies.KV_NEAR_SLACK * mean * (1 + 1e-9),
                                  self.index.max_blocks.get(x.name, 0))]  # fmt: skip
        near = max((overlap.get(x, 0) for x in calm), default=0)
        if near > shared:  # another conversation's prefix: where it is, within bounds
            return cost([x for x in calm if overlap.get(x, 0) == near])
        bound = policies.KV_WORK_SLACK * mean
        fit = [x for x in fit if work[x] <= bound * (1 + 1e-9)] or fit
        demand = {x: x.routed.total_size() for x in fit}
        pool = {x: self.index.max_blocks.get(x.name, 1 << 62) * self.block_size for x in fit}
        if all(demand[x] > pool[x] for x in fit):  # oversubscribed: the most over first,
            fit = [x for x in fit if x in calm] or fit  # among the calm ones
            score = {x: pool[x] - demand[x] for x in fit}
        else:
            routed, done = sum(demand.values()) or 1, sum(work[x] for x in fit) or 1.0
            score = {x: demand[x] / routed + work[x] / done for x in fit}
        least = min(score.values())
        return cost([x for x in fit if score[x] == least])

    def _history(
        self, alive: list[WorkerLoad], overlap: dict[WorkerLoad, int], shared: int,
        key: RadixKey,
    ) -> list[WorkerLoad]:  # fmt: skip
        """The workers holding ``key``'s conversation: the most of it beyond the shared
        prefix, where ``key`` extends a prompt routed there (its tree of routed prompts:
        `RadixCache.extends_leaf`), a conversation's next turn. A prompt that only shares
        a prefix with another conversation's is no one's history: a burst of new agent
        sessions behind one long common prefix (kv-cache-tester's warm prefix), routed
        before any worker reported the prefix shared by enough continuations
        (`KvIndex.lookup`), all went to the first session's worker and stayed (live: 77
        of 77 requests on one of 3 workers; simulated: imbalance 2.77, hit 0.88x the
        cache-aware rule's). When no worker's routed prompts match
        beyond the shared prefix (another router routed them, or they were forgotten),
        the workers' reports decide alone."""
        best = max(overlap.values(), default=0)
        if best <= shared:
            return []
        homes = [x for x in alive if overlap.get(x, 0) == best]
        size = self.block_size
        if not any(x.routed.match_len(key) // size > shared for x in alive):
            return homes
        return [x for x in homes if x.routed.extends_leaf(key)]

    def _remember(self, w: WorkerLoad, key: RadixKey) -> None:
        """Add a routed prompt to the worker's tree, its oldest prompts evicted past
        ``approx_tokens`` (``kv``: past `DEMAND_POOLS` of the worker's pool too, when its
        card says it: demand beyond that places nothing differently, and the router's
        memory follows the fleet's, not what it was sent)."""
        limit = self.approx_tokens
        pool = self.index.max_blocks.get(w.name)
        if self.policy == "kv" and pool:
            limit = min(limit, DEMAND_POOLS * pool * self.block_size)
        over = w.routed.total_size() + len(key) - limit
        if over > 0:
            w.routed.evict(over)
        w.routed.insert(key)


__all__ = ["EVENTS_GRACE_S", "PENDING_S", "RoutingCore", "Ticket", "WorkerLoad"]
