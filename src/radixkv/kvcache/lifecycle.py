"""The request lifecycle on top of the prefix cache, as SGLang's scheduler runs it.

A request's row in the `ReqToTokenPool` holds its slot indices, one per token whose KV is
(being) computed. The first ``cache_protected_len`` of them belong to the radix tree
(shared, locked through ``last_node``); the rest, up to ``kv_len``, are the request's own.

    arrival        match the prompt (all but its last token: that one is always computed,
                   to get logits), lock the matched node, copy the matched slots to the row
    allocate(n)    slots for the next n tokens; evicts from the tree when short
    chunk done     cache_unfinished_req: insert what is computed, free slots the tree
                   already had (duplicates), move the lock to where the insert ends,
                   point the row at the tree's slots
    finished       finishing (the managers' last look at its row), then
                   cache_finished_req: insert prompt + output, free duplicates and the
                   unaligned tail, release the lock and the row
    abort          free exactly what the request owns, release the lock and the row

A scheduler step uses the batched forms: `CacheManager.allocate_batch` (one allocator call
and one row-table write for every chunk and decode of the step), then
`cache_unfinished_batch` and `cache_finished_batch` (one free call each).

Full attention is this module's own work (the tree's values are its slots). Every other
layer spec has a manager (`radixkv.kvcache.managers.LayerManager`), and each step above
is also a loop over them: with sliding-window layers in a slot space of their own
(`radixkv.kvcache.window.slots.WindowSlots`) the match copies the tree's last window,
allocation gives window slots too, an insert locks its new end before releasing the old
one (so the window on the request's path stays while it reads it) and then offers the
request's own window slots, and the request's ``boundaries`` become marked ends that
keep their window; a recurrent model's states (`radixkv.kvcache.recurrent`) copy a
checkpoint into the request's row at the match and turn its snapshots into checkpoints
once the tree holds their prefix.

The accounting identity, checked by `CacheManager.check_memory` after any step:

    available + evictable + protected + private + reserved_tail == pool size
    free rows + running requests == rows

where *private* counts slots held by running requests and not in the tree, and
*reserved_tail* the unfilled rest of requests' partial pages (0 with page size 1), and
every slot is owned exactly once (by the tree, by one request, or by the allocator).

Owns: a request's slots, rows and locks from arrival to finish. Must not touch:
scheduling (who runs), the model.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixkv.key import RadixKey, check_namespace
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.tree import RadixCache, TreeNode
from radixkv.units import align_down


@dataclass(eq=False)
class Req:
    """A request's tokens and its memory state (the latter managed by `CacheManager`).

    Attributes:
        rid: the caller's id.
        input_ids: prompt token ids.
        output_ids: generated token ids so far.
        extra_key: cache namespace (LoRA id, tenant, salt).
        row: its row in the `ReqToTokenPool`; -1 when not admitted.
        kv_len: leading tokens of ``input_ids + output_ids`` that have slots in the row.
        cache_protected_len: leading slots of the row owned by the tree (locked).
        cached_len: prompt tokens served from the cache at arrival.
        full_hit: at admission, its tokens' full-attention match (before the
            components' cut: where a hybrid request leaves a cached path).
        last_node: the locked tree node ending the protected prefix.
        cache_limit: the most leading tokens the request hands to the tree (``None``:
            all it computes); what lies past it stays its own and is freed at the end
            (OpenAI's explicit prompt caching: only up to the last breakpoint).
        cache_read: False: it matches nothing at arrival (a request that does not use
            the prompt cache).
        boundaries: positions worth caching a prefix at (the end of a chat's system
            message): with window KV the tree keeps a window there; a recurrent model
            checkpoints its state there (`radixkv.kvcache.recurrent`).
    """

    rid: Any
    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    row: int = -1
    kv_len: int = 0
    cache_protected_len: int = 0
    cached_len: int = 0
    full_hit: int = 0
    last_node: TreeNode | None = None
    final_node: TreeNode | None = None  # where its cached path ended when it left
    cache_limit: int | None = None
    cache_read: bool = True
    boundaries: tuple[int, ...] = ()
    _tokens: array | None = field(default=None, init=False, repr=False)

    @property
    def all_ids(self) -> list[int]:
        """``input_ids + output_ids`` as a new list (O(n); hot paths use `token_array`)."""
        return self.input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def token_array(self) -> array:
        """``input_ids + output_ids`` as ``array('q')``: converted once, then extended as
        output tokens are appended (converting a list of ints is the costly part of a key).

        Raises:
            TypeError: a token is not an integer.
        """
        arr = self._tokens
        if arr is None:
            arr = RadixKey(self.input_ids).token_ids
            if arr is self.input_ids:  # an array('q') given by the caller: do not grow it
                arr = array("q", arr)
            arr.extend(RadixKey(self.output_ids).token_ids)
            self._tokens = arr
        elif len(arr) < len(self.input_ids) + len(self.output_ids):
            arr.extend(RadixKey(self.output_ids[len(arr) - len(self.input_ids) :]).token_ids)
        return arr

    @property
    def admitted(self) -> bool:
        return self.row >= 0


class CacheManager:
    """Runs requests' KV memory through a `RadixCache`, an allocator and a row table.

    Args:
        cache: the prefix cache; its ``allocator`` must be ``allocator`` (evictions free
            slots there), and its page size the allocator's.
        allocator: the slot allocator.
        req_pool: the request-to-token table.
        managers: one per layer spec beyond full attention (`LayerManager`: the window
            slots of a model with sliding-window layers in a slot space of their own,
            a recurrent model's states), each joined to ``cache`` and ``req_pool``.
        room: with one arena for every kind (`radixkv.kvcache.arena.ArenaRoom`), what
            frees room across kinds in the budget's order and says what can be had;
            ``None``: the tree evicts for the full KV's own pool.
    """

    def __init__(
        self, cache: RadixCache, allocator: TokenToKVPoolAllocator, req_pool: ReqToTokenPool,
        *managers: LayerManager, room: Any = None,
    ) -> None:  # fmt: skip
        if cache.allocator is not allocator and not cache.disable:
            raise ValueError("cache.allocator must be the allocator, so evictions free slots")
        if cache.page_size != allocator.page_size:
            raise ValueError(
                f"page sizes differ: cache {cache.page_size} != allocator {allocator.page_size}"
            )
        for m in managers:
            if not isinstance(m, LayerManager):
                raise TypeError(f"managers must be LayerManagers, got {type(m).__name__}")
            m.join(cache, req_pool)
        self.cache, self.allocator, self.req_pool = cache, allocator, req_pool
        self.managers = managers
        # the old end stays locked across an insert while a manager reads the path
        self._late_unlock = any(m.reads_path for m in managers)
        self._marks = [m for m in managers if m.marks_ends]
        self.crosses_pages = all(m.crosses_pages for m in managers)  # (`LayerManager`)
        self.running: dict[int, Req] = {}  # row -> request
        self.evicted_tokens = 0  # evicted to make room, since the start
        self.room = room

    def manager(self, kind: str) -> LayerManager | None:
        """The manager of ``kind`` (``"window"``, ``"states"``), if the model has one."""
        return next((m for m in self.managers if m.kind == kind), None)

    # --- the managers' steps (`radixkv.kvcache.managers`) ----------------------------------
    def new_round(self) -> None:
        """An admission round starts: no manager holds a reservation."""
        for m in self.managers:
            m.new_round()

    def reserve(self, req: Req, hit: int, chunk: int) -> bool:
        """Every manager has room for the request's first ``chunk`` tokens after a hit
        of ``hit`` (each reserves it for this round)."""
        return all(m.reserve(req, hit, chunk) for m in self.managers)

    def prefill_run(self, req: Req, chunk: int) -> int | None:
        """How many of the prefilling request's next tokens one step may compute where
        its ``chunk``-token steps would decide the same for every manager (the least
        they say, `LayerManager.prefill_run`; None: any number)."""
        runs = [n for m in self.managers if (n := m.prefill_run(req, chunk)) is not None]
        return min(runs) if runs else None

    def step_inputs(self, plan: Sequence[tuple[Req, int]]) -> dict[str, list]:
        """What the model needs of each manager for the step ``plan``, by kind."""
        return {m.kind: m.forward(plan) for m in self.managers}

    def _allocate_managers(
        self, reqs: Sequence[Req], rows: np.ndarray, kv: np.ndarray, counts: np.ndarray
    ) -> bool:
        """Every manager's room for the tokens; one short undoes the ones before it."""
        for i, m in enumerate(self.managers):
            if not m.allocate(reqs, rows, kv, counts):
                self._unallocate_managers(rows, kv, counts, self.managers[:i])
                return False
        return True

    def _unallocate_managers(
        self, rows: np.ndarray, kv: np.ndarray, counts: np.ndarray,
        managers: Sequence[LayerManager] | None = None,
    ) -> None:  # fmt: skip
        for m in self.managers if managers is None else managers:
            m.unallocate(rows, kv, counts)

    # --- helpers ------------------------------------------------------------------------
    def _key(self, req: Req, n: int) -> RadixKey:
        """The first ``n`` tokens as a key in the cache's view: under EAGLE a bigram view,
        so slicing counts the units the tree stores (pairs), not raw tokens."""
        return RadixKey.view_of(req.token_array(), 0, n, req.extra_key, self.cache.is_eagle)

    def _cacheable_key(self, req: Req) -> RadixKey:
        """The computed tokens the request hands to the tree (up to its ``cache_limit``)."""
        n = req.kv_len if req.cache_limit is None else min(req.kv_len, req.cache_limit)
        return self._key(req, n)

    def _slots(self, req: Req, start: int, end: int) -> np.ndarray:
        """``row[start:end]`` as a numpy view of the host table (copy it to keep it)."""
        return self.req_pool.array[req.row, start:end]

    def _require_admitted(self, req: Req, op: str) -> None:
        if not isinstance(req, Req):
            raise TypeError(f"{op}: req must be a Req, got {type(req).__name__}")
        if self.running.get(req.row) is not req:
            raise ValueError(f"{op}: request {req.rid!r} is not admitted")

    def available_tokens(self) -> int:
        """Slots that can be had now: free ones plus what eviction can free."""
        if self.room is not None:
            return self.room.available(self.allocator)
        return self.allocator.available_size() + self.cache.evictable_size()

    def run_room(self) -> int:
        """Slots a prefill run may take in one step deciding what its chunks would
        (`radixkv.engine.scheduler.Scheduler.prefill_run`): what can be had now where
        asking eviction for a run's slots at once frees what asking chunk by chunk
        would (the tree's order); the free ones alone under one budget with
        checkpoints (`_rounds`)."""
        return self.allocator.available_size() if self._rounds() else self.available_tokens()

    def _rounds(self) -> bool:
        """One budget over checkpoints evicts in rounds that read node ends and the
        leaves as each round starts (`HybridBudget`: a dead tail per leaf node, a dead
        parent a round uncovers waiting for the next round), so one ask for a run's
        slots may free other victims than its chunks' asks, and a chain of chunk nodes
        other victims than one node: chunk steps and a run evict alike where nothing is
        evicted during the run and the tree is split where the chunks would split it."""
        return self.room is not None and self.room.budget.state is not None

    def drop_held_checkpoint(self) -> bool:
        """With one arena, drop the least recently used checkpoint held, a locked one
        included (`HybridBudget.drop_held_checkpoint`): the last resort of a request
        running alone that finds no room. False: no arena, or none to drop."""
        return self.room is not None and self.room.budget.drop_held_checkpoint()

    def make_prompt_room(self, reqs: Sequence[Req]) -> None:
        """With one arena: free room for the admitted requests' prompts still to compute
        now, in one pass of the budget's order (`radixkv.kvcache.budget`), as the budget
        simulator does, rather than chunk by chunk as they run, each chunk's victims
        chosen after the chunks before it changed the tree (docs/hybrid.md: on Marconi's
        trace -0.0005 to +0.007 of the hit rate; the chat workload unchanged).
        Without an arena the tree's own order decides, at allocation (SGLang's). Best
        effort: what cannot be freed now is freed at allocation, as before. O(evicted)."""
        if self.room is None or not reqs:
            return
        short = sum(len(r.input_ids) - r.kv_len for r in reqs) - self.allocator.available_size()
        if short > 0:
            self._evict_for(short)

    def _evict_for(self, need: int) -> None:
        """Make room for ``need`` more slots: the tree's eviction, or with one arena
        the budget's across kinds."""
        if self.room is not None:
            self.evicted_tokens += self.room.evict_for(self.allocator, need)
        else:
            self.evicted_tokens += self.cache.evict(need)

    # --- arrival --------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Match the prompt, lock the hit, give the request a row holding the hit's slots.

        Returns:
            False (nothing changed) when no row is free.

        Raises:
            ValueError: the prompt is empty, longer than ``max_context_len``, or the
                request is already admitted.
        """
        if not isinstance(req, Req):
            raise TypeError(f"admit: req must be a Req, got {type(req).__name__}")
        if req.admitted:
            raise ValueError(f"admit: request {req.rid!r} is already admitted")
        n = req.num_tokens
        if n == 0:
            raise ValueError("admit: the request has no tokens")
        if n > self.req_pool.max_context_len:
            raise ValueError(
                f"admit: request {req.rid!r} has {n} tokens, more than "
                f"max_context_len={self.req_pool.max_context_len}"
            )
        if req.extra_key is not None:  # validated before any change, as the tokens are
            check_namespace(req.extra_key)
        key = self._key(req, n)
        row = self.req_pool.alloc()
        if row is None:
            return False
        try:  # the last token is always computed
            if req.cache_read:
                parts, last, hit, req.full_hit = self.cache.match_parts(key[: n - 1])
            else:  # it reads nothing; its full-attention match still says where it
                # leaves a cached path (a recurrent model checkpoints that branch point)
                parts, last, hit = [], self.cache.root, 0
                req.full_hit = self.cache.match_len(key[: n - 1], full=True)
            self.req_pool.write_parts(row, parts)
        except BaseException:
            self.req_pool.free(row)  # nothing else changed yet (a split is harmless)
            raise
        self.cache.inc_lock_ref(last)
        req.row, req.last_node = row, last
        req.kv_len = req.cache_protected_len = req.cached_len = hit
        self.running[row] = req
        try:
            for m in self.managers:
                m.admitted(req)
        except BaseException:
            self._release(req)  # every manager frees what it took (none owns more)
            raise
        return True

    # --- allocation -------------------------------------------------------------------------
    def allocate(self, req: Req, n: int) -> torch.Tensor | None:
        """Slots for the request's next ``n`` tokens, written to its row; evicts from the
        tree when the allocator is short.

        Returns:
            The new slots, or ``None`` (nothing changed but evictions) when memory is
            short even after evicting everything evictable.

        Raises:
            ValueError: ``n`` would exceed the request's tokens or ``max_context_len``.
        """
        self._require_admitted(req, "allocate")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate: n must be a non-negative int, got {n!r}")
        end = req.kv_len + n
        if end > self.req_pool.max_context_len:
            raise ValueError(
                f"allocate: request {req.rid!r} would need {end} tokens, more than "
                f"max_context_len={self.req_pool.max_context_len}"
            )
        if end > req.num_tokens:
            raise ValueError(
                f"allocate: request {req.rid!r} has only {req.kv_len} + fewer "
                f"than {n} tokens to compute"
            )
        p = self.allocator.page_size
        last = -1
        if req.kv_len % p and req.kv_len > req.cache_protected_len:
            last = self.req_pool.slot_at(req.row, req.kv_len - 1)
        at = np.array([req.row]), np.array([req.kv_len]), np.array([n], dtype=np.int64)
        if not self._allocate_managers([req], *at):
            return None
        try:
            slots = self.allocator.alloc_extend(last, n)
            if slots is None:
                self._evict_for(max(self.allocator.shortfall(np.array([last]), np.array([n])), 0))
                slots = self.allocator.alloc_extend(last, n)
        except BaseException:
            self._unallocate_managers(*at)
            raise
        if slots is None:
            self._unallocate_managers(*at)
            return None
        self.req_pool.write(req.row, req.kv_len, slots)
        req.kv_len = end
        return slots

    def allocate_batch(self, reqs: Sequence[Req], counts: Sequence[int]) -> torch.Tensor | None:
        """`allocate` for a whole step: request ``i`` gets slots for its next
        ``counts[i]`` tokens, with one allocator call and one row-table write for the
        batch (SGLang's ``alloc_extend`` / ``alloc_decode``). Evicts when short.

        Returns:
            Every request's new slots concatenated in order (``out_cache_loc``), or
            ``None`` (nothing changed but evictions) when memory is short for the batch
            as a whole even after evicting everything evictable.

        Raises:
            TypeError / ValueError: as `allocate`, for any request (or a request listed
                twice, or lengths that differ); nothing changes.
        """
        if len(reqs) != len(counts):
            raise ValueError(f"allocate_batch: {len(reqs)} requests but {len(counts)} counts")
        if len({id(r) for r in reqs}) != len(reqs):
            raise ValueError("allocate_batch: a request is listed twice")
        if not reqs:
            return torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        limit, running = self.req_pool.max_context_len, self.running
        rows, kvs, protected = [], [], []
        for req, n in zip(reqs, counts, strict=True):  # one pass: check and gather
            if running.get(getattr(req, "row", None)) is not req:
                self._require_admitted(req, "allocate_batch")
            if type(n) is not int or n < 0:
                raise ValueError(f"allocate_batch: counts must be non-negative ints, got {n!r}")
            if req.kv_len + n > min(limit, len(req.input_ids) + len(req.output_ids)):
                raise ValueError(
                    f"allocate_batch: request {req.rid!r} would need {req.kv_len + n} tokens, "
                    f"more than its {req.num_tokens} or max_context_len={limit}"
                )
            rows.append(req.row)
            kvs.append(req.kv_len)
            protected.append(req.cache_protected_len)
        p = self.allocator.page_size
        rows, kv = np.array(rows), np.array(kvs, dtype=np.int64)
        n = np.array(counts, dtype=np.int64)
        last = np.full(len(reqs), -1, dtype=np.int64)
        if p > 1:  # a partial page of the request's own continues; the tree's never does
            own = (kv % p != 0) & (kv > np.array(protected))
            last[own] = self.req_pool.array[rows[own], kv[own] - 1]
        if not self._allocate_managers(reqs, rows, kv, n):
            return None
        try:
            slots = self.allocator.alloc_extend_batch(last, n)
            if slots is None:
                self._evict_for(max(self.allocator.shortfall(last, n), 0))
                slots = self.allocator.alloc_extend_batch(last, n)
        except BaseException:
            self._unallocate_managers(rows, kv, n)
            raise
        if slots is None:
            self._unallocate_managers(rows, kv, n)
            return None
        self.req_pool.write_batch(rows, kv, n, slots)
        for req, k in zip(reqs, counts, strict=True):
            req.kv_len += k
        return slots

    # --- caching ----------------------------------------------------------------------------
    def _insert_computed(self, req: Req, key: RadixKey | None = None) -> int:
        """Insert the computed tokens, free the request's duplicates of what the tree
        already had, point the row at the tree's slots and move the lock to where the
        insert ends. Returns the units the tree now holds for this request.

        The lock on the old last node is released *before* the insert, so a tree that
        merges chains extends that node instead of hanging a new child under it (nothing
        else runs in between: the lock is taken again on the new last node, or on the
        old one if the insert fails). With window KV it is released *after* the new end
        is locked instead, so the window slots the request reads on its path stay
        locked throughout, and the request's window slots are offered only then, by a
        second insert of the (now cached and locked) key: whatever the tree takes of
        them is on the request's locked path, and a failure before it leaves them all
        the request's own (`radixkv.kvcache.window.slots`).

        The one call that can fail after the insert is freeing the duplicates; it runs
        before the row changes, and a failure undoes the insert (the units it added go
        back to the request), so the request still owns exactly
        ``row[cache_protected_len:kv_len]`` when the error propagates."""
        key = self._cacheable_key(req) if key is None else key
        stored = self.cache.cacheable_len(key)
        if stored <= req.cache_protected_len:
            return req.cache_protected_len
        old = req.last_node
        assert old is not None
        early = not self._late_unlock  # with window KV the old end stays locked (see above)
        if early:
            self.cache.dec_lock_ref(old)
        try:
            had, last = self.cache.insert_node(
                key,
                self._slots(req, 0, len(key)),
                slots_checked=True,  # the allocator's
                near=old,  # (its path spells the key's start: the walk starts there)
            )
        except BaseException:
            if early:
                self.cache.inc_lock_ref(old)  # the insert validates before it changes anything
            raise
        if had > req.cache_protected_len:  # another request cached some of it first
            # the tree went past `old` before this insert, so `old` was not merged away
            try:
                self.allocator.free(self._slots(req, req.cache_protected_len, had).copy())
            except BaseException:
                if had < stored:
                    self.cache.detach_leaf(last, stored - had)
                if early:
                    self.cache.inc_lock_ref(old)
                raise
            self.req_pool.write(req.row, 0, self.cache.path_values(last))
        self.cache.inc_lock_ref(last)
        if not early:
            self.cache.dec_lock_ref(old)
        req.last_node, req.cache_protected_len = last, stored
        for m in self.managers:  # the whole key is cached and locked (the window's offer)
            m.inserted(req, key)
        return stored

    def _insert_marked(self, req: Req, key: RadixKey | None = None) -> None:
        """`_insert_computed`, first up to each of the request's boundaries it computed
        since the last insert, marking the end there so the tree keeps a window at it
        (a chat's system message: the next request sharing it hits)."""
        key = self._cacheable_key(req) if key is None else key
        if self._marks and req.boundaries:
            p = self.cache.page_size
            for b in sorted({align_down(b, p) for b in req.boundaries}):
                if req.cache_protected_len < b <= len(key):
                    self._insert_computed(req, key[:b])
                    for m in self._marks:
                        m.boundary(req)
        self._insert_computed(req, key)

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: hand the computed whole pages to the tree, re-point the
        row at the tree's slots and move the lock to the new last node."""
        self._require_admitted(req, "cache_unfinished_req")
        self._insert_marked(req)
        self._cached(req, req.cache_protected_len)

    def cache_finished_req(self, req: Req) -> None:
        """The request is done: cache prompt + output, free duplicates and the unaligned
        tail, release its lock and its row."""
        self._require_admitted(req, "cache_finished_req")
        self._insert_final(req)
        self._leave([req])

    def finishing(self, req: Req) -> None:
        """The request has its last token: the managers' last look at its row (a
        recurrent model's state after prompt + output). Call it per request before
        `cache_finished_req` or `cache_finished_batch`, so that a failure here fails
        that request alone (it can still be aborted)."""
        self._require_admitted(req, "finishing")
        for m in self.managers:
            m.finishing(req)

    def _insert_final(self, req: Req) -> None:
        """A finished request's insert: its unaligned tail freed, prompt + output
        handed to the tree."""
        key = self._cacheable_key(req)
        stored = max(self.cache.cacheable_len(key), req.cache_protected_len)
        if req.kv_len > stored:  # the unaligned tail first: if this raises, nothing changed
            self.allocator.free(self._slots(req, stored, req.kv_len).copy())
            for m in self.managers:
                m.free_tail(req, stored)
            req.kv_len = stored  # it no longer owns the freed tail
        self._insert_marked(req, key)

    def _cached(self, req: Req, upto: int) -> None:
        """The managers' part once the tree holds the request's tokens up to ``upto``
        (outside any group of frees: a checkpoint kept there may evict)."""
        for m in self.managers:
            m.cached(req, upto)

    def _leave(self, reqs: Sequence[Req]) -> None:
        """Finished requests whose inserts are done: the managers' part of what they
        cached, then each releases its lock and its row (even if that part raises)."""
        error: BaseException | None = None
        for req in reqs:
            try:
                self._cached(req, req.num_tokens)
            except BaseException as e:  # the others leave all the same
                error = error or e
            self._release(req)
        if error is not None:
            raise error

    def cache_unfinished_batch(
        self, reqs: Sequence[Req], run: tuple[Req, int, int] | None = None
    ) -> None:
        """`cache_unfinished_req` for every request of a step; the duplicates they free go
        to the allocator in one call. ``run``: ``(req, start, chunk)``, ``req`` computed
        a run of ``chunk``-token chunks from ``start`` this step (a replay's,
        `radixkv.engine.scheduler.Scheduler.prefill_run`): under one budget over
        checkpoints (`_rounds`) it is inserted chunk by chunk, as its chunk steps would
        insert it (the same nodes, merges and boundaries); elsewhere the tree's own order
        evicts the same whatever its node ends (tests/sim/test_serve_replay.py)."""
        for req in reqs:
            self._require_admitted(req, "cache_unfinished_batch")
        with self.allocator.free_group():
            for req in reqs:
                if run is not None and run[0] is req and self._rounds():
                    limit = req.cache_limit
                    for end in range(run[1] + run[2], req.kv_len, run[2]):
                        self._insert_marked(req, self._key(req, end if limit is None
                                                           else min(end, limit)))  # fmt: skip
                self._insert_marked(req)
        for req in reqs:
            self._cached(req, req.cache_protected_len)

    def cache_finished_batch(self, reqs: Sequence[Req]) -> None:
        """`cache_finished_req` for every request of a step; tails and duplicates go to
        the allocator in one call. That call validates the whole group at once: if it is
        refused (a slot freed twice, a bug upstream), it frees nothing and the error
        propagates after the tree has taken what it caches."""
        for req in reqs:
            self._require_admitted(req, "cache_finished_batch")
        done: list[Req] = []
        try:
            with self.allocator.free_group():
                for req in reqs:
                    self._insert_final(req)
                    done.append(req)
        finally:  # those whose inserts are done leave, as `cache_finished_req` does
            self._leave(done)

    def abort(self, req: Req) -> None:
        """Drop the request at any point: free exactly its own slots, nothing cached."""
        self._require_admitted(req, "abort")
        if req.kv_len > req.cache_protected_len:
            self.allocator.free(self._slots(req, req.cache_protected_len, req.kv_len).copy())
        self._release(req)

    def _release(self, req: Req) -> None:
        assert req.last_node is not None
        for m in self.managers:
            m.release(req)
        self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(req.row)
        del self.running[req.row]
        req.final_node = req.last_node
        req.row, req.last_node = -1, None
        req.kv_len = req.cache_protected_len = 0

    # --- the accounting identity -----------------------------------------------------------
    def check_memory(self) -> None:
        """Check that every slot is owned exactly once and the sizes add up.

        Raises:
            AssertionError: naming what is leaked or owned twice.
        """
        alloc, cache, rows = self.allocator, self.cache, self.req_pool
        alloc.check()
        rows.check()
        in_use = rows.rows_in_use()
        assert in_use == sorted(self.running), (
            f"check_memory: rows in use {in_use} != rows of running requests "
            f"{sorted(self.running)} (a row leaked or was freed twice)"
        )
        for row, r in self.running.items():
            assert r.row == row, f"request {r.rid!r} is filed under row {row} but holds {r.row}"
        tree = cache.all_values().numpy()
        assert len(tree) == cache.total_size(), "tree values disagree with its size"
        private = [self._slots(r, r.cache_protected_len, r.kv_len) for r in self.running.values()]
        private_n = sum(len(x) for x in private)
        free = alloc.free_slots()
        parts = [tree, free, *private]
        owners = np.bincount(np.concatenate(parts), minlength=alloc.size)
        if len(owners) > alloc.size:
            raise AssertionError("check_memory: a slot index beyond the pool is in use")
        twice = np.flatnonzero(owners > 1)
        if len(twice):
            raise AssertionError(f"check_memory: slot {twice[0]} is owned twice")
        lost = np.flatnonzero(owners == 0)
        if len(lost):
            raise AssertionError(f"check_memory: slot {lost[0]} is leaked (owned by nobody)")
        total = (
            alloc.unbound_size()
            + cache.evictable_size()
            + cache.protected_size()
            + private_n
            + alloc.reserved_tail_size()
        )
        assert total == alloc.size, f"check_memory: sizes add to {total} != {alloc.size}"
        assert alloc.handed_out_size() == len(tree) + private_n, "handed-out count is off"
        for m in self.managers:
            m.check(self.running)
        for r in self.running.values():
            protected = self._slots(r, 0, r.cache_protected_len)
            assert r.last_node is not None and r.last_node.lock_ref > 0, "a request lost its lock"
            expected = cache.path_values(r.last_node).numpy()  # raises if it left the tree
            assert np.array_equal(protected, expected), f"request {r.rid!r}: row != tree path"
