"""`RecurrentStates`: prefix caching for models with recurrent layers (Qwen3.5's Gated
DeltaNet), joining the state pool (`radixkv.kvcache.recurrent.pool`: the tensors and the
spare rows) and the tree's `StateCheckpoints` component.

A recurrent layer's state after a prefix is one fixed-size tensor, updated in place, so a
cached prefix helps only where a snapshot of it exists. The pool keeps one state row per
request-table row (``0 .. max_running - 1``) and the checkpoints in the rows after them;
the model reads and writes the rows in place.

    admission   the match already ends at a checkpoint (the component's match limit);
                its state is copied into the request's row (copy, never lend), and the
                request is told where to snapshot during its prefill (`plan`: the
                prompt's end, the branch point where it leaves a cached path, its
                boundaries such as the end of a chat's system message, and the last
                page boundary before its end, where the same prompt sent again starts)
    a chunk     each snapshot position inside the step's new tokens is handed to the
                model (``ForwardBatch.snapshots``), which copies the state there to a
                free checkpoint row during the same pass (its snapshots, kept here)
    caching     once the tree holds the prefix (after the step's inserts), each snapshot
                becomes a checkpoint on the node ending there; at finish the state after
                prompt + output is one more when that length is page-aligned. Once the
                request has computed a page past one of its own (a prompt's end, its
                resend point, an interval), it will cache a longer sequence through it,
                so that checkpoint is superseded now (`StateCheckpoints.pass_through`),
                not once the tree holds the request's pages: room the request needs
                meanwhile comes from it, not from another conversation's (docs/hybrid.md:
                on Marconi's trace the engine then caches 1.06-1.92x the best published
                row at every size, page 1 and 16)
    freeing     a checkpoint the tree evicts (with its node, or beyond ``max_states``)
                gives its row back; a preempted or aborted request's pending snapshots
                too
    tiers       with a host pool or a shared store (`radixkv.storage.states`), each
                checkpoint goes down the tiers as its KV does, and one found there
                before admission comes back as a checkpoint (`adopt`); in one arena
                (its units) as in the pool's rows, its KV's path locked while the
                arena makes room for it
    events      with a KV event sink (`publish`), each checkpoint is one stored block:
                the page that ends at it, with its chained hash and its true parent
                hash, removed when the checkpoint goes. Only servable prefixes are
                advertised: a page past the last checkpoint is no hit here, so the
                pages between checkpoints are never told (a router credits the deepest
                block it holds, not the run before it; the worker's card says so)

Invariants (`check`): every checkpoint row is free, held by one checkpoint, or pending in
one running request's snapshots; a checkpoint's ``passing`` count is the number of
running requests passing through it.

Owns: which checkpoint a row is, and when rows are copied. Must not touch: the KV, the
state tensors (the pool's), the tree's structure (it inserts through `RadixCache`),
scheduling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.hashing.fast import event_hashes
from radixkv.key import RadixKey
from radixkv.kvcache.arena import ArenaCheckpoints
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.recurrent.component import SUPERSEDABLE, Checkpoint, StateCheckpoints
from radixkv.kvcache.recurrent.pool import StatePool
from radixkv.tree import RadixCache
from radixkv.units import align_down, div_ceil

if TYPE_CHECKING:
    from radixkv.kvcache.lifecycle import Req


@dataclass(slots=True)
class _Snapshots:
    """One running request's: positions to snapshot its state at during the prefill,
    with why each (its ``boundaries`` among them), and the snapshots taken, not yet in
    the tree: (position, row, why)."""

    plan: list[tuple[int, str]] = field(default_factory=list)
    rows: list[tuple[int, int, str]] = field(default_factory=list)
    # its own checkpoints a longer sequence of its may pass: (position, checkpoint)
    ends: list[tuple[int, Checkpoint]] = field(default_factory=list)
    # the checkpoints it will cache a longer sequence through (`StateCheckpoints.pass_through`)
    passing: list[Checkpoint] = field(default_factory=list)


class RecurrentStates(LayerManager):
    """See the module docstring: the recurrent spec's manager
    (`radixkv.kvcache.managers`). ``pool``: ``max_running`` running rows and at least
    ``max_states`` spare ones (`spare_rows`); ``max_states`` checkpoints at most are
    held."""

    kind = "states"
    event_blocks = "checkpoints"
    # a decode run ending on a page boundary rewrites the decode snapshot one-token
    # steps would have rewritten at each boundary it crossed (`_roll`)
    crosses_pages = True

    def __init__(
        self, pool: StatePool, max_states: int, every_pages: int = 0,
        store: ArenaCheckpoints | None = None,
    ) -> None:  # fmt: skip
        self.pool = pool
        # with one arena (`radixkv.kvcache.arena`): checkpoints live in its units, the
        # pool's spare rows hold pending snapshots only; ``room`` frees units for one
        self.store = store
        self.room: Callable[[int], bool] | None = None
        state_bytes = store.per * store.arena.unit_bytes if store is not None else pool.row_size
        self.component = StateCheckpoints(max_states, self, every_pages=every_pages,
                                          state_bytes=state_bytes)  # fmt: skip
        self.sink: Any = None  # a KV event sink (`publish`)
        self.published: dict[int, int] = {}  # checkpoint row -> its block hash, told
        self.tiers: Any = None  # host pool and store of states (radixkv.storage.states)
        self.running: dict[int, _Snapshots] = {}  # id(request) -> its snapshots

    @property
    def row_size(self) -> int:
        """Bytes of one checkpoint (the pool's row)."""
        return self.pool.row_size

    @staticmethod
    def spare_rows(max_running: int, max_states: int) -> int:
        """Spare rows a pool needs: every checkpoint, and pending snapshots beside them."""
        return max_states + max_running

    def held_bytes(self) -> int:
        return len(self.component.held) * self.row_size

    def evicted_bytes(self) -> int:
        return self.component.evictions * self.row_size

    def summary(self) -> str:
        rows = self.pool.first + self.pool.spare
        return (f"recurrent states: {rows} rows x {self.row_size / 2**20:.2f} MiB = "
                f"{rows * self.row_size / 2**20:,.1f} MiB")

    title = "recurrent-state checkpoints"

    def arena_summary(self, shape: Any) -> str:
        rows = self.pool.first + self.pool.spare
        return (f"checkpoint: {shape.state_units} units; running and pending states outside "
                f"the budget: {rows} rows x {self.row_size / 2**20:.2f} MiB")

    def arena_units(self) -> list[np.ndarray]:
        return self.store.units() if self.store is not None else []

    def metrics(self, cache: Any) -> list[tuple[str, str, str, float]]:
        comp = self.component
        return [
            ("gauge", "state_checkpoints", "Recurrent-state checkpoints held by the prefix "
             "cache", len(comp.held)),
            ("gauge", "state_checkpoint_bytes", "Bytes of the recurrent-state checkpoints "
             "held", len(comp.held) * self.row_size),
            ("counter", "state_checkpoint_hits", "Requests started from a checkpoint's state",
             comp.hits),
            ("counter", "state_checkpoints_evicted", "Checkpoints evicted to stay within "
             "max_checkpoints", comp.evictions),
        ]  # fmt: skip

    def use_room(self, room: Any) -> None:
        self.room = room.make

    def use_tiers(self, tiers: Any) -> None:
        self.tiers = tiers  # each checkpoint is written down as it is taken

    def publish(self, sink: Any) -> bool:
        """Tell ``sink`` (`radixkv.tree.CacheEventSink`) of every checkpoint from now
        on, as one stored block each (see the module docstring); the tree tells it
        nothing (a prefix is servable only at a checkpoint). Before any checkpoint is
        held."""
        if self.component.held:
            raise ValueError("KV events must be on before the first checkpoint")
        self.sink = sink
        return True

    # --- where a checkpoint lives: a spare row of the pool, or units of the arena --------
    def _keep(self, row: int) -> int | None:
        """The pending snapshot in ``row`` as a checkpoint's slot: the row itself, or
        (with an arena) units it is copied to, the row given back. ``None``: no room."""
        if self.store is None:
            return row
        if self.room is not None:
            self.room(self.store.per)
        slot = self.store.store(self.pool.row_flat(row))
        self.pool.give([row])
        return slot

    def _take(self, fill: Callable[[int], None]) -> int | None:
        """A free spare row, filled by ``fill(row)`` (given back if that raises)."""
        row = self.pool.take()
        if row is not None:
            try:
                fill(row)
            except BaseException:
                self.pool.give([row])
                raise
        return row

    def _unkeep(self, slots: list[int]) -> None:
        """Checkpoint slots (from `_keep`) back."""
        if self.store is None:
            self.pool.give(slots)
        else:
            self.store.give(slots)

    def restore(self, slot: int, row: int) -> None:
        """Running row ``row`` becomes a copy of checkpoint ``slot``."""
        if self.store is None:
            self.pool.copy(slot, row)
        else:
            self.pool.load_flat(row, self.store.load(slot))

    # the component's allocator: evicted checkpoints give their rows back
    def free(self, slots: torch.Tensor) -> None:
        rows = [int(s) for s in slots]
        if self.tiers is not None:  # before the rows are reused: they go down a tier
            self.tiers.evicted(rows)
        self._unkeep(rows)
        if self.sink is not None:
            gone = [self.published.pop(r) for r in rows if r in self.published]
            if gone:
                self.sink.removed(gone)

    def row_bytes(self, row: int) -> bytes:
        """A checkpoint's states, as bytes (`StatePool.row_bytes`)."""
        if self.store is not None:
            return self.store.load(row).cpu().numpy().tobytes()
        return self.pool.row_bytes(row)

    def adopt(self, key: RadixKey, data: bytes, cache: RadixCache) -> bool:
        """Make ``data`` (`row_bytes` of a state after ``key``, from a lower tier) the
        checkpoint at the end of ``key``, which the tree holds. False: the tree does not
        hold all of ``key``'s KV, no free row or room, or a checkpoint is there already.

        The path is locked while the state is kept: with one arena keeping it makes room,
        which must not evict the KV the state is a checkpoint of."""
        hit = cache.match_prefix(key, full=True)  # (splits: the node ends at the key's end)
        if hit.prefix_len < len(key):
            return False
        node = hit.last_node
        cache.inc_lock_ref(node)
        try:
            row = self._take(lambda row: self.pool.load_row(row, data))
            row = None if row is None else self._keep(row)
        finally:
            cache.dec_lock_ref(node)
        if row is None:
            return False
        if not self.component.add(node, row, kind="end"):
            self._unkeep([row])
            return False
        self._added(row, key, cache.page_size)
        return True

    def _added(self, row: int, key: RadixKey, page: int) -> None:
        if self.sink is not None:
            self._tell_stored(row, key, page)
        if self.tiers is not None:
            self.tiers.added(row, key)

    def _tell_stored(self, row: int, key: RadixKey, page: int) -> None:
        """The checkpoint in ``row`` ends ``key`` (page-aligned): one stored block."""
        tokens, pages = key.token_ids, len(key) // page
        if getattr(self.sink, "strong_hashes", False):  # hash-only events: BLAKE2b
            from radixkv.hashing import chain_hashes

            chain = chain_hashes(tokens, key.extra_key, page, pages)[-2:]
            hashes = [int.from_bytes(h[:8], "big") for h in chain]
        else:
            hashes = event_hashes(tokens, key.extra_key, page, pages)[-2:]
        parent = hashes[0] if len(hashes) == 2 else None
        self.published[row] = hashes[-1]
        self.sink.stored([hashes[-1]], parent, list(tokens[-page:]), page, key.extra_key)

    # --- the lifecycle's hooks (`LayerManager`) -------------------------------------
    def join(self, cache: RadixCache, req_pool: Any) -> None:
        if self.component.cache is not cache:
            raise ValueError("states: its StateCheckpoints is not a component of the cache")
        if self.pool.first < req_pool.max_reqs:
            raise ValueError(f"states: {self.pool.first} running rows for "
                             f"{req_pool.max_reqs} requests")  # fmt: skip

    def admitted(self, r: Req) -> None:
        """After the match: copy the checkpoint the hit ends at into the request's row,
        and plan where its prefill snapshots."""
        self.release(r)
        cache = self.component.cache
        if r.cached_len:
            slot = self.component.used(r.last_node)
            assert slot is not None, "a hit on a recurrent model ends at a checkpoint"
            self.restore(slot, r.row)
        # the prompt's full-attention match, from the admission's one walk (which covered
        # a preempted request's outputs too: the prompt's is its whole pages up to n - 1)
        n = len(r.input_ids)
        full = align_down(min(r.full_hit, n - 1), cache.page_size)
        self._of(r).plan = self.component.plan(n, full, r.cached_len, r.boundaries,
                                               resend=True)  # fmt: skip

    def _of(self, r: Req) -> _Snapshots:
        """The running request's snapshots, planned and taken (kept until `release`)."""
        snaps = self.running.get(id(r))
        if snaps is None:
            snaps = self.running[id(r)] = _Snapshots()
        return snaps

    def prefill_run(self, r: Req, chunk: int) -> int | None:
        """Up to the end of the first chunk where a snapshot is taken (`forward`: a
        planned position) or a checkpoint of its own is passed (a page past it): each
        happens after that chunk's slots are had, before the next chunk's, so a run may
        end there but not go on past it. One chunk while a snapshot waits to be kept (a
        step's end keeps it once the tree holds its prefix). None: no snapshot ahead."""
        snaps = self.running.get(id(r))
        if snaps is None:
            return None
        if snaps.rows:
            return chunk
        page, start = self.component.cache.page_size, r.kv_len
        ahead = [p - start for p, _ in snaps.plan if p > start]
        ahead += [max(p + page - start, 1) for p, _ in snaps.ends]
        return div_ceil(min(ahead), chunk) * chunk if ahead else None

    def forward(self, plan: Sequence[tuple[Req, int]]) -> list[tuple[int, int, int]]:
        """The step's snapshots: ``(index in plan, new tokens before it, row)`` for each
        planned position its new tokens reach (a free row each; none left: skipped),
        and a decode step that ends on a page boundary (`_roll`). A checkpoint of its own
        it has now computed a page past, it will cache a longer sequence through
        (`StateCheckpoints.pass_through`)."""
        out = []
        page = self.component.cache.page_size
        for i, (r, n) in enumerate(plan):
            start, snaps = r.kv_len - n, self._of(r)
            while snaps.ends and snaps.ends[0][0] + page <= r.kv_len:  # a page past it
                self._pass(snaps, snaps.ends.pop(0)[1])
            while snaps.plan and snaps.plan[0][0] <= r.kv_len:
                pos, kind = snaps.plan.pop(0)
                row = self.pool.take() if pos > start else None
                if row is not None:
                    out.append((i, pos - start, row))
                    snaps.rows.append((pos, row, kind))
            if start >= len(r.input_ids) and r.kv_len % page == 0:
                self._roll(r, i, n, out)
        return out

    def _roll(self, r: Req, i: int, n: int, out: list[tuple[int, int, int]]) -> None:
        """A decode step reaching a page boundary: the state there replaces the
        request's previous decode snapshot (its row is written again), so at finish the
        sequence's last page boundary has one; the next turn of a chat starts there
        rather than at this turn's prompt end. (The last sampled token is never
        computed, so that boundary is the furthest a later request can hit.)"""
        prompt, rows = len(r.input_ids), self._of(r).rows
        old = next((k for k, (pos, _, _) in enumerate(rows) if pos > prompt), None)
        row = self.pool.take() if old is None else rows.pop(old)[1]
        if row is not None:
            out.append((i, n, row))
            rows.append((r.kv_len, row, "end"))

    def finishing(self, r: Req) -> None:
        """Before the request's row goes: its state after prompt + output, when that
        length is page-aligned (the tree caches whole pages only)."""
        page, rows = self.component.cache.page_size, self._of(r).rows
        if r.kv_len and r.kv_len % page == 0 and all(p != r.kv_len for p, _, _ in rows):
            row = self._take(lambda row: self.pool.copy(r.row, row))
            if row is not None:
                rows.append((r.kv_len, row, "end"))

    def cached(self, r: Req, upto: int) -> None:
        """Make the request's snapshots at positions ``<= upto`` checkpoints of the
        tree (which holds that prefix now). A call that raises midway leaves every
        snapshot not yet handled pending, and the one it was handling freed."""
        snaps = self._of(r)
        pending, snaps.rows = snaps.rows, []
        for i, (pos, row, kind) in enumerate(pending):
            if pos > upto:
                snaps.rows.append((pos, row, kind))
                continue
            try:
                slot = self._keep(row)  # (may evict: before the tree is asked)
            except BaseException:
                snaps.rows += pending[i:]
                raise
            if slot is None:
                continue
            try:
                self._attach(r, pos, slot, kind)
            except BaseException:
                snaps.rows += pending[i + 1 :]
                raise

    def _attach(self, r: Req, pos: int, slot: int, kind: str) -> None:
        """Checkpoint ``slot`` (kept) on the node ending at ``pos``, if the tree holds
        that prefix and has no checkpoint there; else freed."""
        cache = self.component.cache
        key = RadixKey(r.token_array(), r.extra_key)[:pos]
        try:
            held = cache.match_len(key, full=True) >= pos  # not (or no longer) in the tree
            added = held and self.component.add(cache.insert_node(key).last_node, slot, kind=kind)
        except BaseException:
            self._unkeep([slot])
            raise
        if not added:
            self._unkeep([slot])
            return
        c = self.component.held[slot]
        if c.kind in SUPERSEDABLE:
            self._of(r).ends.append((pos, c))
        self._added(slot, key, cache.page_size)

    def _pass(self, snaps: _Snapshots, c: Checkpoint) -> None:
        snaps.passing.append(c)
        self.component.pass_through(c, 1)

    def release(self, r: Req) -> None:
        """A request leaves without caching (preempted, aborted): free its pending
        snapshots."""
        snaps = self.running.pop(id(r), None)
        if snaps is not None:
            self.pool.give(row for _, row, _ in snaps.rows)
            for c in snaps.passing:
                self.component.pass_through(c, -1)

    def check(self, running: dict) -> None:
        own = [self.running.get(id(r)) for r in running.values()]
        pending = [row for snaps in own if snaps is not None for _, row, _ in snaps.rows]
        if self.running.keys() - {id(r) for r in running.values()}:
            raise AssertionError("a request that left still has snapshots planned or taken")
        passing = Counter(id(c) for snaps in own if snaps is not None for c in snaps.passing
                          if self.component.held.get(c.slot) is c)  # fmt: skip
        if any(c.passing != passing[id(c)] for c in self.component.held.values()):
            raise AssertionError("a checkpoint's running requests passing it are miscounted")
        if self.store is None:
            self.pool.check([*pending, *self.component.held])
        else:
            self.pool.check(pending)
            if sorted(self.store.held_ids) != sorted(self.component.held):
                raise AssertionError("the arena's checkpoints are not those the tree holds")
        if self.sink is not None and self.published.keys() != self.component.held.keys():
            raise AssertionError("the checkpoints told as KV events are not those held")
