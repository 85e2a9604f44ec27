"""`Scheduler`: who runs this step, and how many tokens each computes.

It owns the waiting and running queues. Each step it

    1. admits waiting requests while rows and KV slots allow, in ``fcfs`` order or
       ``lpm`` (longest cached prefix first). Under ``lpm`` a request whose prefix is
       being computed right now by an admitted request waits a step, so a group sharing
       a prompt computes it once (SGLang's in-batch prefix deprioritisation);
    2. plans the batch: one token for each decode, then prompt chunks within
       ``chunk_size`` prefill tokens, the decodes in one allocation and the chunks in
       another (`CacheManager.allocate_batch`); allocating evicts from the cache. When a
       batch does not fit, it goes request by request: a chunk that finds no slot waits,
       a decode preempts the newest other running request (`preempt`: its KV is freed,
       it re-queues at the front and later recomputes, mostly from cache).

Fairness: the ``n`` choices of one request (a group) run at most `GROUP_SHARE` of the
running slots at once; the others wait, so one request cannot hold every slot while other
clients wait (a request of 128 choices once held 31 of 32 slots for 65 s).

Progress: a request is admitted only if it fits the pool alone (``add`` refuses one
that never can), and preemption always picks the newest request, so the oldest running
request always advances and no request is preempted forever. When no request can run
at all (every prefill chunk waits for memory the others hold, as in a window pool
smaller than every running request's windows: `radixkv.kvcache.window.slots`), the newest
yields too. Retained prefixes (`radixkv.kvcache.retention`) never block that: they are released
(``relieve``) before a decode preempts, and when a request alone cannot be admitted or
get its chunk's slots. Nor do checkpoints on a lone request's own locked path, in one
arena: they are dropped last of all (`CacheManager.drop_held_checkpoint`), when it alone
still finds no room (a burst at the tightest budget once stalled there).

Owns: the waiting and running queues, admission, the batch plan, preemption, and the one
fit check. Must not touch: the model, outputs.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import NamedTuple

from radixkv.engine.config import EngineConfig
from radixkv.engine.request import EngineReq
from radixkv.key import RadixKey
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.tree import RadixCache

# Under LPM a request waits a step when an admitted request is computing more than this
# many tokens of its prefix right now (then it finds them cached instead of recomputing).
IN_BATCH_PREFIX_THRESHOLD = 16
GROUP_SHARE = 0.5  # of the running slots the choices of one request may hold at once

Plan = list[tuple[EngineReq, int]]  # (request, tokens it computes this step)


class DoesNotFit(ValueError):
    """A request that can never run: longer than the context, or than the KV pool holds.

    Attributes:
        limit: the most tokens (prompt + output) a request may have here.
        prompt_tokens, max_new_tokens: what the request asked for.
    """

    def __init__(self, message: str, limit: int, prompt_tokens: int, max_new_tokens: int):
        super().__init__(message)
        self.limit, self.prompt_tokens, self.max_new_tokens = limit, prompt_tokens, max_new_tokens


class SchedulerHooks(NamedTuple):
    """What the scheduler calls out to, each optional, given at construction."""

    # once per request, when it is next in line for a slot before its first admission
    # (loads its pages from the host pool and the shared store)
    prefetch: Callable[[EngineReq], None] | None = None
    # right after a request is admitted (a retained prefix it hit lives on)
    on_admit: Callable[[EngineReq], None] | None = None
    # frees retained prefixes to make at least n more tokens evictable (returns how many
    # it made): when a request cannot run otherwise (radixkv.kvcache.retention)
    relieve: Callable[[int], int] | None = None


NO_HOOKS = SchedulerHooks()


class Scheduler:
    """Admission, chunked-prefill planning and preemption over a `CacheManager`."""

    def __init__(
        self, config: EngineConfig, mgr: CacheManager, hooks: SchedulerHooks = NO_HOOKS
    ) -> None:
        self.config, self.mgr = config, mgr
        self.waiting: deque[EngineReq] = deque()
        self.running: list[EngineReq] = []
        self.preemptions = 0
        self.queried_tokens = 0  # prompt tokens looked up at first admission
        self.hit_tokens = 0  # of which served from the cache
        # this step's prefill run, inserted chunk by chunk: (request, start, chunk)
        self.last_run: tuple[EngineReq, int, int] | None = None
        self.prefetch, self.on_admit, self.relieve = hooks

    def max_tokens(self) -> int:
        """The most tokens (prompt + output) one request may need: it must fit the
        context and, with one page of slack for its partial page, the pool alone."""
        return min(
            self.mgr.req_pool.max_context_len,
            self.mgr.allocator.capacity - self.mgr.allocator.page_size,
        )

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """The one check that a request can ever run here: its prompt and output fit the
        context and, alone, the KV pool (`max_tokens`).

        Raises:
            DoesNotFit: naming which, and the limit.
        """
        need = prompt_tokens + max_new_tokens
        context = self.mgr.req_pool.max_context_len
        what = f"prompt of {prompt_tokens} tokens + max_tokens {max_new_tokens} = {need}"
        if need > context:
            raise DoesNotFit(f"{what} exceeds the context (max_context_len={context})",
                             self.max_tokens(), prompt_tokens, max_new_tokens)  # fmt: skip
        if need > self.max_tokens():
            raise DoesNotFit(
                f"{what} can never fit the KV pool of {self.mgr.allocator.capacity} tokens "
                f"(at most {self.max_tokens()}): raise "
                f"{'cache_bytes' if self._budget_limits() else 'kv_tokens'}", self.max_tokens(),
                prompt_tokens, max_new_tokens,
            )  # fmt: skip

    def _budget_limits(self) -> bool:
        """Whether a byte budget, not a ``kv_tokens`` cap inside it, sets the capacity."""
        cfg, alloc = self.config, self.mgr.allocator
        if not cfg.cache_bytes:
            return False
        return (
            cfg.kv_tokens is None
            or alloc.capacity < cfg.kv_tokens // alloc.page_size * alloc.page_size
        )

    def add(self, req: EngineReq) -> None:
        """Queue a request (`check_fits` first)."""
        self.check_fits(len(req.input_ids), req.sampling.max_new_tokens)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------
    def schedule(self, runs: bool = False) -> Plan:
        """Admit, then plan this step's batch (allocating its slots). ``runs``: the
        runner knows the tokens ahead (a replay's), so a prompt may take a run of its
        chunks in one step (`prefill_run`)."""
        self.last_run = None
        self._admit()
        return self._plan(self.prefill_run() if runs else self.config.chunk_size)

    def prefill_run(self) -> int:
        """This step's prefill token budget: ``chunk_size``, or a run of a prompt's chunks
        where computing them in one step decides what its chunk steps would. That holds
        while it runs alone and no waiting request could be admitted (so no chunk
        boundary admits or preempts anyone), none of the run's tokens is in the tree
        already (a chunk that is gives its own slots back when inserted, so the next
        chunk's come from them), no layer manager decides something where a chunk inside
        the run ends (`CacheManager.prefill_run`: full attention never; a window slides
        at every chunk's end; a recurrent state only where it is snapshotted or passes
        its own checkpoint; the prompt's last chunk, which samples, is a step of its own),
        and the run fits what it may take now (`CacheManager.run_room`:
        free + evictable where its chunks would evict in the same order, the same
        victims in all; free alone where they may not). The run is inserted chunk by
        chunk (``last_run``, `CacheManager.cache_unfinished_batch`). Fewer steps
        to the same cache, request for request (tests/sim/test_serve_replay.py).
        O(1) but a walk of the tree along the prompt."""
        budget = self.config.chunk_size
        if len(self.running) != 1 or (self.waiting and self.config.max_running > 1):
            return budget
        r = self.running[0]
        rest = r.num_tokens - r.kv_len
        if not r.prefilling or rest <= budget:
            return budget
        run = min(rest - 1, self.mgr.prefill_run(r, budget) or rest)
        run -= run % budget  # (whole chunks, the last one alone: it samples)
        if run <= budget or run > self.mgr.run_room():
            return budget
        if self.mgr.cache.match_len(RadixKey(r.token_array(), r.extra_key), full=True) > r.kv_len:
            return budget
        self.last_run = (r, r.kv_len, budget)
        return run

    def steady_run(self) -> int:
        """How many tokens every running request can decode in one step while deciding
        nothing that one-token steps would not (1: no run now). It holds while no
        waiting request could be admitted and none is prefilling, and only its token
        budget may stop a request (no end-of-sequence, stop strings or logprobs), so
        the run ends where the first of them reaches its budget, and either (1) each
        request decodes into the page it has begun: nothing to allocate or evict, the
        windows and checkpoints moving only on page boundaries (so the last token of a
        run may end a page, as the last of those steps would); or (2) with no layer
        manager bound to every page boundary (`CacheManager.crosses_pages`: a window
        trims at each, a recurrent state's decode snapshot is rewritten in place), the
        requests' pages end together and the run ends on a page boundary, its pages
        fitting what a run may take (`CacheManager.run_room`). A runner that knows the
        tokens ahead (a replay's) decodes it at once: fewer steps to the same cache,
        request for request (tests/sim/test_serve_replay.py). O(running)."""
        if not self.running or (self.waiting and len(self.running) < self.config.max_running):
            return 1
        p = self.mgr.allocator.page_size
        inpage, left, fills = p, [], set()
        for r in self.running:
            s, at = r.sampling, r.kv_len % p
            if (r.num_tokens - r.kv_len != 1 or r.prefilling or s.stop or not s.ignore_eos
                    or s.logprobs is not None):  # fmt: skip
                return 1
            own = at and r.kv_len > r.cache_protected_len  # (a page of its own begun)
            inpage = min(inpage, p - at) if own else 0
            left.append(s.max_new_tokens - len(r.output_ids))
            fills.add(p - at if own else -1 if at else 0)  # (-1: the tree's page begun)
        run = max(min(inpage, *left), 1)
        if len(fills) != 1 or not self.mgr.crosses_pages:
            return run
        fill = fills.pop()
        if fill < 0:
            return run
        pages = min((min(left) - fill) // p, self.mgr.run_room() // (p * len(self.running)))
        return max(run, fill + pages * p) if pages > 0 else run

    def _admit(self) -> None:
        cfg, mgr, cache = self.config, self.mgr, self.mgr.cache
        if not self.waiting or len(self.running) >= cfg.max_running:
            return
        lpm = cfg.schedule_policy == "lpm"
        key = {id(r): RadixKey(r.token_array(), r.extra_key) for r in self.waiting}
        hits = {id(r): cache.match_len(key[id(r)]) if r.cache_read else 0 for r in self.waiting}
        order = list(self.waiting)
        if lpm:
            order.sort(key=lambda r: (-hits[id(r)], r.order))
            in_flight = RadixCache()  # prompts being computed now, not yet in the cache
            for r in self.running:
                if r.prefilling:
                    in_flight.insert(RadixKey(r.token_array(), r.extra_key)[: len(r.input_ids)])
        admitted = []
        mgr.new_round()  # the managers' reservations for this round's admissions
        cap = max(1, int(cfg.max_running * GROUP_SHARE))
        groups = Counter(r.group for r in self.running if r.group is not None)
        for r in order:
            if len(self.running) >= cfg.max_running:
                break
            if r.group is not None and groups[r.group] >= cap:
                continue  # its group holds its share of the slots: others go first
            if self._load(r):
                hits[id(r)] = cache.match_len(key[id(r)])  # (it loaded: it reads the cache)
            if lpm:
                if in_flight.match_len(key[id(r)]) - hits[id(r)] > IN_BATCH_PREFIX_THRESHOLD:
                    continue  # its prefix is being computed by another request: wait a step
                in_flight.insert(key[id(r)])
            need = r.num_tokens - hits[id(r)] + mgr.allocator.page_size
            if need > mgr.available_tokens() and not self.running and self.relieve is not None:
                self.relieve(need - mgr.available_tokens())  # retention never blocks it
            chunk = min(r.num_tokens - hits[id(r)], cfg.chunk_size)
            room = need <= mgr.available_tokens() and mgr.reserve(r, hits[id(r)], chunk)
            if not room and self.running:
                break  # (with nothing running it fits alone (`check_fits`) and nothing is
                # locked, so its allocations can evict all they need: an estimate of room
                # that says otherwise must not leave the engine waiting forever)
            if not mgr.admit(r):
                break
            if self.on_admit is not None:
                self.on_admit(r)
            if r.prompt_cached < 0:
                r.prompt_cached = r.cached_len
                self.queried_tokens += len(r.input_ids)
                self.hit_tokens += r.cached_len
            admitted.append(r)
            self.running.append(r)
            if r.group is not None:
                groups[r.group] += 1
        if admitted:
            mgr.make_prompt_room(admitted)
            gone = {id(r) for r in admitted}
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)

    def _load(self, r: EngineReq) -> bool:
        """Before a request's first admission, its pages from the tiers below the device
        (the ``prefetch`` hook), once: only where it is next in line for a slot, as
        SGLang's HiCache loads back for a request it adds to the batch. (Loading every
        waiting request's pages at once filled a tight budget with pages evicted again
        before their requests ran: Qwen3.5-like, one budget of 512 KiB, 16 chats, a host
        tier: 0.242 of the prompt tokens hit and 203 preemptions, 0.411 and 24 without
        the tier.) True: it ran."""
        if self.prefetch is None or r.prompt_cached >= 0 or r.prefetched or not r.cache_read:
            return False
        r.prefetched = True
        self.prefetch(r)
        return True

    def _plan(self, budget: int) -> Plan:
        plan: Plan = []
        # decodes first (one token each): one allocation for all of them when memory
        # allows; otherwise request by request below, preempting as needed
        order = sorted(self.running, key=lambda r: (r.prefilling, r.order))
        decodes = [r for r in order if not r.prefilling and r.num_tokens > r.kv_len]
        counts = [r.num_tokens - r.kv_len for r in decodes]
        if decodes and self.mgr.allocate_batch(decodes, counts) is not None:
            plan = list(zip(decodes, counts, strict=True))
        if plan or not decodes:  # then the prefill chunks within the budget, at once too
            order = [r for r in order if r.prefilling]
            chunks = []
            for r in order:
                n = min(r.num_tokens - r.kv_len, budget)
                if n > 0:
                    chunks.append((r, n))
                    budget -= n
            reqs = [r for r, _ in chunks]
            if not chunks or self.mgr.allocate_batch(reqs, [n for _, n in chunks]) is not None:
                return plan + chunks
            budget = self.config.chunk_size
        # otherwise request by request: a chunk waits for memory, a decode preempts
        for r in order:
            if r not in self.running:
                continue  # preempted while planning
            pending = r.num_tokens - r.kv_len
            prefill = r.prefilling
            n = min(pending, budget) if prefill else pending
            if n <= 0:
                continue
            slots = self.mgr.allocate(r, n)
            # retained prefixes yield before a decode preempts, or a chunk alone waits
            alone = len(self.running) == 1
            if slots is None and (not prefill or alone) and self.relieve and self.relieve(n):
                slots = self.mgr.allocate(r, n)
            while slots is None and not prefill:
                victims = [q for q in self.running if q is not r]
                if not victims:
                    break
                self.preempt(max(victims, key=lambda q: q.order))
                plan = [(q, m) for q, m in plan if q in self.running]
                slots = self.mgr.allocate(r, n)
            # alone and still short: the checkpoints its own locked path holds go (it
            # copied what it needed), or it would wait for ever (or raise, decoding)
            while slots is None and len(self.running) == 1 and self.mgr.drop_held_checkpoint():
                slots = self.mgr.allocate(r, n)
            if slots is None:
                if not prefill:  # alone and still no room: cannot happen after `add`
                    raise RuntimeError(f"request {r.rid!r} does not fit the KV pool alone")
                continue  # a prefill chunk waits for memory
            if prefill:
                budget -= n
            plan.append((r, n))
        if not plan and len(self.running) > 1:
            # every chunk waits for memory the others hold: the newest yields, so the
            # oldest runs (alone at worst, where it always fits)
            self.preempt(max(self.running, key=lambda q: q.order))
            return self._plan(self.config.chunk_size)
        return plan

    # --- moving requests ------------------------------------------------------------------
    def preempt(self, req: EngineReq) -> None:
        """Free the request's KV and put it first in line (it recomputes later)."""
        self.mgr.abort(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.preemptions += 1
        self.preemptions += 1

    def finish(self, reqs: list[EngineReq]) -> None:
        """Finished requests: cache their prompts and outputs, release their memory (one
        free for the step)."""
        self.mgr.cache_finished_batch(reqs)
        gone = {id(r) for r in reqs}
        self.running = [r for r in self.running if id(r) not in gone]

    def abort(self, req: EngineReq) -> None:
        """Drop the request wherever it is; frees its KV (nothing is cached)."""
        if req in self.running:
            self.mgr.abort(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
