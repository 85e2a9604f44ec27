"""`LayerManager`: one layer spec's part of a request's memory, behind one small interface
that the request lifecycle (`radixkv.kvcache.lifecycle.CacheManager`) loops over, as
vLLM's ``KVCacheCoordinator`` loops over its single-type managers.

A model declares one spec per layer type (`radixkv.kvcache.spec`); the engine's memory
(`radixkv.engine.cache_memory`) builds one manager per spec beyond full attention:

    FullAttentionSpec   the lifecycle itself: the tree's values are full-attention
                        slots, so matching, locking and inserting them is its own work
    SlidingWindowSpec   `radixkv.kvcache.window.slots.WindowSlots`: a running
                        request's window slots, beside its full ones
    RecurrentSpec       `radixkv.kvcache.recurrent.RecurrentStates`: a running
                        request's state row, its snapshots and the tree's checkpoints

The steps of a request's life, in the order the lifecycle calls them; each is a loop over
the managers, and a manager leaves alone what it has no part in (every hook here does
nothing):

    reserve(req, hit, chunk)  before admission: can it take the request's first chunk
                            besides what this round's earlier admissions reserved?
                            (`new_round` starts a round)
    admitted(req)           after the match: the request's row holds the hit's
                            full-attention slots and its lock is on ``req.last_node``
    allocate(...)           before its next tokens get full slots (False: short; then
                            `unallocate` undoes it when the full slots cannot be had)
    forward(plan)           what the model needs of this manager in the step (a
                            recurrent model's snapshot positions)
    inserted(req, key)      after an insert of ``key``, the lock on its new end
    cached(req, upto)       after the step's inserts of the request, outside any group
                            of frees (it may evict): what it computed up to ``upto`` is
                            in the tree
    finishing(req)          the request has its last token; its row is still there
                            (called by the lifecycle's caller, per request)
    free_tail(req, start)   the request's own slots from ``start`` on are freed
    release(req)            it leaves (finished, preempted, aborted): free what it owns
    check(running)          its invariants, with ``running`` the lifecycle's rows

Three flags and a hook say how a manager bends the lifecycle's own steps: ``reads_path``
(it reads the tree's slots on a request's locked path across an insert, so the old end
stays locked until the new one is), ``marks_ends`` (an insert stops at each of a
request's boundaries and tells it, `boundary`, so it can keep what a match ending there
needs), ``crosses_pages`` (a replay's decode run may cross a page boundary: nothing of
its own is decided at each) and `prefill_run` (how far a replay's prompt may run in one
step before a chunk's end decides something of its own).
`join` checks, once, that the manager fits the lifecycle's tree and row table.

What the engine reports of a manager, each a hook too (the engine names no layer type):
``held_bytes`` / ``evicted_bytes`` of its own pool, ``summary`` (its pool as sized) or
``arena_summary`` (its pages under one budget, ``title`` in the budget's line),
``arena_units`` (the arena units it holds, for the arena's check), ``metrics`` (its
Prometheus values), ``use_room`` / ``use_tiers`` (one arena's room, its type's tiers:
before any request).

Eviction is not a manager's: each spec's cached part is a tree component
(`radixkv.kvcache.window.WindowKV`, `radixkv.kvcache.recurrent.StateCheckpoints`) that
the tree evicts with its nodes, and with one arena the budget (`radixkv.kvcache.budget`) orders
victims across kinds.

Owns: the interface. Must not touch: any manager's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from radixkv.kvcache.lifecycle import Req


class LayerManager:
    """One spec's part of a request's memory; see the module docstring for when each hook
    runs. ``kind`` names it in reports (``"window"``, ``"states"``)."""

    kind = ""
    component: Any = None  # its cached part: a component of the tree, evicted with it
    reads_path = False
    marks_ends = False
    # what the engine's KV events tell of a model with this layer type ("" : pages, each
    # with the run before it; "checkpoints", "windows": servable blocks, each alone)
    event_blocks = ""
    # whether the tree may merge an insert into another request's finished leaf (LRU's
    # chain merging): not where a windowed insert (full KV first) would drop its window
    allows_merge = True
    # a replay's decode run may cross page boundaries, ending on one: nothing of its own
    # is decided at each (`radixkv.engine.scheduler.Scheduler.steady_run`); a window
    # trims its slots at each
    crosses_pages = False

    def publish(self, sink: Any) -> bool:
        """KV events are on: True when this manager tells ``sink`` what is servable
        itself (the tree then tells it nothing)."""
        return False

    def held_bytes(self) -> int:
        """Bytes of its own pool the cache and the running requests hold."""
        return 0

    def evicted_bytes(self) -> int:
        """Bytes its pool evicted to make room since the start."""
        return 0

    def summary(self) -> str:
        """One line on its own pool as sized ("": nothing to say)."""
        return ""

    title = ""  # what one budget's summary calls its pages ("": none of its own)

    def arena_summary(self, shape: Any) -> str:
        """One line on its pages under one budget (``shape``: the plan's `ArenaPlan`)."""
        return ""

    def arena_units(self) -> list[np.ndarray]:
        """The arena units it holds (its kind's, for `Arena.check`)."""
        return []

    def metrics(self, cache: Any) -> list[tuple[str, str, str, float]]:
        """Its values for ``/metrics``: (``counter`` or ``gauge``, name, help, value)."""
        return []

    def use_room(self, room: Any) -> None:
        """One arena: its allocations make room through ``room`` (`ArenaRoom`)."""

    def use_tiers(self, tiers: Any) -> None:
        """Its type's tiers below the device (`radixkv.storage.layers`), before any
        request."""

    def retained_marks(self, positions: Sequence[int], page: int) -> list[int]:
        """Boundaries to add where a request asked ``positions`` retained (a window
        keeps a page short of each: the same prefix sent again hits there)."""
        return []

    def join(self, cache: Any, req_pool: Any) -> None:
        """Raise ``ValueError`` when this manager cannot serve a lifecycle over
        ``cache`` and ``req_pool``."""

    def new_round(self) -> None:
        """An admission round starts: nothing is reserved."""

    def reserve(self, req: Req, hit: int, chunk: int) -> bool:
        """Whether the request, hitting ``hit`` tokens, can compute its first ``chunk``
        besides this round's earlier reservations; reserves it when so."""
        return True

    def admitted(self, req: Req) -> None:
        """The request was just admitted (row, lock and hit set)."""

    def allocate(
        self, reqs: Sequence[Req], rows: np.ndarray, kv: np.ndarray, counts: np.ndarray
    ) -> bool:
        """Room for ``counts[i]`` more tokens of ``reqs[i]`` (at row ``rows[i]``, from
        ``kv[i]``). False: short (nothing changed but evictions)."""
        return True

    def unallocate(self, rows: np.ndarray, kv: np.ndarray, counts: np.ndarray) -> None:
        """Undo the last `allocate` of these (the full slots could not be had)."""

    def prefill_run(self, req: Req, chunk: int) -> int | None:
        """How many of the prefilling request's next tokens one step may compute where
        its ``chunk``-token steps would decide the same of this manager's part (a
        replay's, `radixkv.engine.scheduler.Scheduler.prefill_run`): a multiple of
        ``chunk``, or None (any number: nothing of its own happens where a chunk ends).
        By default one chunk (a window slides where a chunk ends)."""
        return chunk

    def forward(self, plan: Sequence[tuple[Req, int]]) -> list:
        """What the model needs of this manager for the step ``plan``."""
        return []

    def inserted(self, req: Req, key: Any) -> None:
        """``key`` (the request's first tokens) was inserted; its end is locked."""

    def boundary(self, req: Req) -> None:
        """An insert ended at one of the request's boundaries (``req.last_node``)."""

    def cached(self, req: Req, upto: int) -> None:
        """The tree holds what the request computed up to ``upto``."""

    def finishing(self, req: Req) -> None:
        """The request has its last token; its row still holds its state."""

    def free_tail(self, req: Req, start: int) -> None:
        """The request's own slots from ``start`` on were freed."""

    def release(self, req: Req) -> None:
        """The request leaves: free what it still owns."""

    def check(self, running: dict) -> None:
        """Raise ``AssertionError`` when an invariant does not hold."""


__all__ = ["LayerManager"]
