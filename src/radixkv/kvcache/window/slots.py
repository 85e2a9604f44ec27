"""`WindowSlots`: running requests' sliding-window KV slots, beside their full-attention
ones: the second slot space of a model with sliding-window layers (SGLang's SWA pool).

A sliding layer attends to its last ``window`` tokens only, so a request needs window KV
for those alone, and the tree (`radixkv.kvcache.window.WindowKV`) keeps it only where a
match can end. It is the sliding-window spec's manager (`radixkv.kvcache.managers`): the
request lifecycle calls the hooks named below at each step. Row ``r`` of ``table``
holds request ``r``'s window slots by position, ``-1`` where it has none; ``own`` says
which of them the request owns (the others are the tree's, on the request's locked
path).

    admission   (`admitted`) the match ends where the tree holds the window before
                it: those slots (its last ``span`` positions) go to the row, as the
                tree's; `reserve` first checks the pool can take its window and chunk
    allocation  (`allocate`) first the request gives up its own slots behind
                ``align_down(kv_len, page) - span`` (`trim`): no read and no later
                insert needs them; then a window slot for every new token, its own;
                when short, window KV is evicted from the tree (tombstones)
    insert      (`inserted`) once the full-attention insert is done and the
                request's lock is on its new end, the request offers its own slots for
                the key (`offer`, ``-1`` elsewhere); those the tree takes are the
                tree's from then on, on the request's locked path
    leaving     (`release`) it frees everything it still owns

Frees go through the component (``WindowKV.release``), which never raises: a free that
fails stays pending and is retried, so no lifecycle step is left half done by one.

Invariants (`check`): every window slot is free, held by the tree, owned by one row, or
pending in a failed free;
for every position a running request's next step reads (its last ``window - 1``) it has
a slot of its own or the tree's slot at that position on its path.

Why the reads stay valid. A position a request reads lies at or after
``kv_len - window + 1``, so after ``cache_protected_len - span``: within the last
``span`` units before its lock end. A lock end is a useful end, so the tree keeps the
window it holds there, and evicts no window KV of a locked node. The request holds a
lock from admission until it leaves, and an insert locks the new end before it releases
the old one (`radixkv.kvcache.lifecycle`), so the tree's slots it reads are always within a
locked end's window. The request frees its own slots only behind
``align_down(kv_len) - span``: behind everything it reads and everything an insert asks
of it (the last ``span`` units before the key's end, and the chunk just computed,
offered before the next trim).

Owns: the window row table and which of its slots each request owns. Must not touch:
the full KV, the tree's structure, scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.key import RadixKey
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import TokenToKVPoolAllocator, runs
from radixkv.kvcache.window.component import WindowKV
from radixkv.units import align_down, align_up

if TYPE_CHECKING:
    from radixkv.kvcache.lifecycle import Req


def window_peak(window: int, page: int, chunk: int) -> int:
    """The most window slots one request holds while it computes ``chunk`` tokens: the
    window before its lock end (the tree's), its own last window and partial page, and
    the chunk's pages."""
    span = align_up(window, page)
    return 2 * span + 2 * page + align_up(chunk, page)


class WindowSlots(LayerManager):
    """The window slots of the request table's rows (see the module docstring): the
    sliding-window spec's manager (`radixkv.kvcache.managers`).

    Args:
        component: the tree's `WindowKV`; its allocator must be ``allocator``.
        allocator: the window slot space.
        max_reqs, max_context_len: the request table's shape.
        window: the longest window of the model's sliding layers (what a step reads).
    """

    def __init__(
        self, component: WindowKV, allocator: TokenToKVPoolAllocator, max_reqs: int,
        max_context_len: int, window: int, token_bytes: int = 0, layers: int = 0,
    ) -> None:  # fmt: skip
        if component.allocator is not allocator:
            raise ValueError("the WindowKV component must free into the window allocator")
        if window > component.window:
            raise ValueError(f"window {window} is longer than the tree keeps "
                             f"({component.window})")  # fmt: skip
        self.component, self.allocator, self.window = component, allocator, window
        # (for reports) one window slot's KV over the sliding layers, and how many
        self.token_bytes, self.layers = token_bytes, layers
        self.page = allocator.page_size
        self.span = align_up(component.window, self.page)  # what the tree keeps at an end
        self.table = np.full((max_reqs, max_context_len), -1, dtype=np.int64)
        self.own = np.zeros((max_reqs, max_context_len), dtype=bool)
        self.kept = np.zeros(max_reqs, dtype=np.int64)  # no slot of the row lies before it
        self.evicted = 0  # window units evicted from the tree to make room
        self.room: object = None  # one arena's room across kinds (`CacheManager.room`)
        self._reserved = 0  # window slots this admission round's requests reserved

    kind = "window"
    event_blocks = "windows"  # pages whose window is held: the runs have holes
    allows_merge = False

    def held_bytes(self) -> int:
        a = self.allocator
        return (a.size - a.available_size()) * self.token_bytes

    def evicted_bytes(self) -> int:
        return self.evicted * self.token_bytes

    def summary(self) -> str:
        """The window pool as sized (separate pools: with an arena, its pages' line is
        the arena's)."""
        n = self.allocator.size
        return (f"sliding-window KV: {n:,} tokens x {self.layers} layers = "
                f"{n * self.token_bytes / 2**20:,.1f} MiB "
                f"(window {self.window}: a running request keeps its last window; cached "
                f"windows stay while there is room, those no match end needs go first)")

    title = "sliding-window KV"

    def arena_summary(self, shape: Any) -> str:
        cap = shape.window_cap
        capped = f"; capped at {cap * self.page:,} tokens" if cap else ""
        return (f"sliding-window KV page: {shape.window_columns} units (window "
                f"{shape.window}: a running request keeps its last window{capped})")

    def arena_units(self) -> list[np.ndarray]:
        return [self.allocator.source.units()]  # type: ignore[attr-defined]

    def metrics(self, cache: Any) -> list[tuple[str, str, str, float]]:
        """Window KV held and evicted; with KV events, the pages a match can end at now
        (`radixkv.kvcache.window.servable`); with a pool of its own, its usage."""
        held = self.component.held_units()
        values: list[tuple[str, str, str, float]] = [
            ("gauge", "prefix_cache_window_tokens", "Tokens of sliding-window KV held by "
             "the prefix cache", held),
            ("gauge", "prefix_cache_window_bytes", "Bytes of sliding-window KV held by the "
             "prefix cache", held * self.token_bytes),
            ("counter", "window_kv_evicted_tokens", "Sliding-window KV tokens the cache "
             "freed to make room (its matches end earlier there)", self.evicted),
        ]  # fmt: skip
        gate = cache.component("servable")
        if gate is not None:
            values.append(("gauge", "prefix_cache_servable_blocks", "Pages a match can end "
                           "at now (their window held), as the KV events told them",
                           gate.told))  # fmt: skip
        if self.room is None:  # (with one budget there is no window pool of its own)
            a = self.allocator
            values.append(("gauge", "window_kv_usage_perc", "Fraction of the sliding-window "
                           "KV pool in use (running requests and cached windows)",
                           1.0 - a.available_size() / a.size))  # fmt: skip
        return values

    def use_room(self, room: Any) -> None:
        self.room = room

    def retained_marks(self, positions: Sequence[int], page: int) -> list[int]:
        """The same prefix sent again hits a page short of its end (its last token is
        computed): a retained prefix keeps a window there too."""
        return [(p - 1) // page * page for p in positions]
    reads_path = True  # the reads stay valid only with the old end locked (see above)
    marks_ends = True

    def forward(self, plan: Sequence[tuple[Req, int]]) -> list[tuple[torch.Tensor, int]]:
        """The step's window batch: for each planned request computing its last ``n``
        tokens, its window slots from the first key its first new token sees
        (``window - 1`` back) to its end, and where its new tokens start among them."""
        out = []
        for r, n in plan:
            start = r.kv_len - n
            lo = max(0, start - self.window + 1)
            out.append((torch.from_numpy(self.table[r.row, lo : r.kv_len]), start - lo))
        return out

    def join(self, cache: Any, req_pool: Any) -> None:
        if getattr(self.component, "cache", None) is not cache:
            raise ValueError("window: its WindowKV is not a component of the cache")
        if self.page != cache.page_size or cache.is_eagle:
            raise ValueError("window: needs the cache's page size and no EAGLE view")
        if self.table.shape != (req_pool.max_reqs, req_pool.max_context_len):
            raise ValueError("window: its table must have the request table's shape")

    def peak(self, chunk: int) -> int:
        """`window_peak` of the tree's window."""
        return window_peak(self.component.window, self.page, chunk)

    def available(self, at_least: int) -> int:
        """Window slots that can be had now: free, plus (counted only when fewer than
        ``at_least`` are free, and only until there are ``at_least``) what evicting the
        tree's window KV frees."""
        if self.room is not None:
            return self.room.available(self.allocator)  # type: ignore[attr-defined]
        free = self.allocator.available_size()
        if free >= at_least:
            return free
        return free + self.component.evictable_units(enough=at_least - free)

    # --- the lifecycle's hooks (`LayerManager`) -------------------------------------
    def new_round(self) -> None:
        self._reserved = 0

    def reserve(self, req: Req, hit: int, chunk: int) -> bool:
        """Room for the request's window and first chunk besides what this round's
        earlier admissions reserved (so requests admitted together cannot starve each
        other's windows)."""
        need, reserved = self.peak(chunk), self._reserved
        if need + reserved > self.available(need + reserved):
            return False
        self._reserved = reserved + need
        return True

    def admitted(self, req: Req) -> None:
        """The match ends at the request's lock after its hit: the last window's slots
        there (the tree's) go to its row."""
        row, node, hit = req.row, req.last_node, req.cached_len
        lo = max(0, hit - self.span)
        self.table[row, lo:hit] = self.component.tail_slots(node, hit - lo).numpy()  # type: ignore[arg-type]
        self.kept[row] = lo

    def allocate(
        self, reqs: Sequence[Req], rows: np.ndarray, kv: np.ndarray, counts: np.ndarray
    ) -> bool:
        """Trim the requests' windows (what no read or insert needs goes), then give
        window slots for their next tokens (`alloc`)."""
        for req in reqs:
            self.trim(req.row, req.kv_len)
        return self.alloc(rows, kv, counts) is not None

    def unallocate(self, rows: np.ndarray, kv: np.ndarray, counts: np.ndarray) -> None:
        """Undo `alloc` (the full slots of the same tokens could not be had)."""
        at = np.repeat(rows, counts), runs(kv, counts)
        self._free(self.table[at])
        self.table[at] = -1
        self.own[at] = False

    def inserted(self, req: Req, key: RadixKey) -> None:
        """The whole key is cached and locked: offer the request's own window slots
        for it in a second insert; what the tree takes is its own from then on."""
        row = req.row
        offer = {"window": self.offer(row, len(key))}
        self.component.cache.insert_node(key, extras=offer, near=req.last_node)  # type: ignore[arg-type]
        taken = self.component.taken  # one entry per unit the insert stored
        self.own[row, : len(taken)] &= ~taken

    def boundary(self, req: Req) -> None:
        """Keep the window at the request's boundary (a marked end)."""
        self.component.mark(req.last_node)

    def free_tail(self, req: Req, start: int) -> None:
        """Free the row's own slots from ``start`` on (a finished request's unaligned
        tail, which the tree never takes)."""
        self._clear(req.row, start)

    def release(self, req: Req) -> None:
        """The request leaves: free what it owns, clear its row."""
        row = req.row
        self._clear(row, int(self.kept[row]))
        self.kept[row] = 0

    # --- a request's row --------------------------------------------------------------
    def _free(self, slots: np.ndarray) -> None:
        """Hand slots back through the component, which never raises: a free that
        fails stays pending and is retried (`radixkv.tree.component`)."""
        if len(slots):
            self.component.release(torch.from_numpy(slots.copy()))

    def trim(self, row: int, kv_len: int) -> None:
        """Free the row's own slots behind ``align_down(kv_len) - span``."""
        lo, upto = int(self.kept[row]), align_down(kv_len, self.page) - self.span
        if upto <= lo:
            return
        self._free(self.table[row, lo:upto][self.own[row, lo:upto]])
        self.table[row, lo:upto] = -1
        self.own[row, lo:upto] = False
        self.kept[row] = upto

    def _clear(self, row: int, start: int) -> None:
        """Free the row's own slots from ``start`` on and clear them."""
        self._free(self.table[row, start:][self.own[row, start:]])
        self.table[row, start:] = -1
        self.own[row, start:] = False

    def alloc(self, rows: np.ndarray, kv: np.ndarray, counts: np.ndarray) -> torch.Tensor | None:
        """Window slots for the next ``counts[i]`` tokens of row ``rows[i]`` (at
        ``kv[i]``), one allocator call; evicts the tree's window KV when short.
        ``None`` (nothing changed but evictions): short even then."""
        p = self.page
        counts = np.asarray(counts, dtype=np.int64)
        last = np.full(len(rows), -1, dtype=np.int64)
        if p > 1:  # a row's partial page is always its own (the tree takes whole pages)
            part = kv % p != 0
            last[part] = self.table[rows[part], kv[part] - 1]
        slots = self.allocator.alloc_extend_batch(last, counts)
        if slots is None:
            self._evict(self.allocator.shortfall(last, counts))
            slots = self.allocator.alloc_extend_batch(last, counts)
            if slots is None:
                return None
        at = np.repeat(rows, counts), runs(kv, counts)
        self.table[at] = slots.numpy(force=True)
        self.own[at] = True
        return slots

    def _evict(self, short: int) -> None:
        """Free window KV of the tree for ``short`` more slots: with one arena the
        budget's order across kinds, else the spare windows first."""
        if self.room is not None:
            held = self.component.held_units()
            self.room.evict_for(self.allocator, short)  # type: ignore[attr-defined]
            self.evicted += max(0, held - self.component.held_units())
        else:
            spare = self.component.evict_spare(short)  # no match loses an end for these
            self.evicted += spare + self.component.evict(max(short - spare, 0))

    def take(self, n: int) -> torch.Tensor | None:
        """``n`` window slots (whole pages) outside any row, for window pages a tier
        brings back (`radixkv.storage.windows`); evicts as `alloc` does. ``None``:
        short even then."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self._evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        return slots

    def offer(self, row: int, n: int) -> np.ndarray:
        """The row's own slots of its first ``n`` positions, ``-1`` elsewhere (an
        insert's ``extras["window"]``)."""
        given = self.table[row, :n].copy()
        given[~self.own[row, :n]] = -1
        return given

    # --- the invariants ---------------------------------------------------------------
    def check(self, running: dict) -> None:
        """Check the invariants of the module docstring for ``running`` (row ->
        request). Raises ``AssertionError`` naming what is wrong."""
        comp, alloc = self.component, self.allocator
        alloc.check()
        tree = [comp.slots(n).numpy() for n in comp.cache.iter_nodes()]
        mine = []
        for row, r in running.items():
            lo = int(self.kept[row])
            if self.own[row, :lo].any() or self.own[row, r.kv_len :].any():
                raise AssertionError(f"request {r.rid!r} owns window slots outside "
                                     f"[{lo}, {r.kv_len})")  # fmt: skip
            mine.append(self.table[row][self.own[row]])
            self._check_reads(r)
        pending = [t.numpy() for t in comp.__dict__.get("pending", [])]
        every = np.concatenate([*tree, *mine, *pending, alloc.free_slots()])
        owners = np.bincount(every, minlength=alloc.size)
        if len(owners) > alloc.size or (every < 0).any():
            raise AssertionError("a window slot index outside the pool is in use")
        if (owners > 1).any():
            raise AssertionError(f"window slot {np.flatnonzero(owners > 1)[0]} is owned twice")
        if (owners == 0).any():
            raise AssertionError(f"window slot {np.flatnonzero(owners == 0)[0]} is leaked")
        if sum(len(t) for t in tree) != comp.held_units():
            raise AssertionError("the tree's window units disagree with its count")

    def _check_reads(self, r: object) -> None:
        """Every position ``r``'s next step reads has a slot: its own, or the tree's at
        that position of its locked path."""
        row, kv, cp = r.row, r.kv_len, r.cache_protected_len  # type: ignore[attr-defined]
        lo = max(0, kv - self.window + 1)
        if lo >= kv:
            return
        tree = np.full(kv - lo, -1, dtype=np.int64)  # the tree's slots there, by position
        node, end = r.last_node, cp  # type: ignore[attr-defined]
        while node is not None and node is not self.component.cache.root and end > lo:
            s = self.component.slots(node).numpy()
            a, b = max(end - len(s), lo), min(end, kv)
            if a < b:
                tree[a - lo : b - lo] = s[a - (end - len(s)) : b - (end - len(s))]
            end -= len(node)
            node = node.parent
        have, own = self.table[row, lo:kv], self.own[row, lo:kv]
        bad = ~own & ((have < 0) | (have != tree) | (np.arange(lo, kv) >= cp))
        if bad.any():
            q = lo + int(np.flatnonzero(bad)[0])
            rid = r.rid  # type: ignore[attr-defined]
            raise AssertionError(
                f"request {rid!r} reads position {q} from window slot "
                f"{have[q - lo]}, which is neither its own nor its path's"
            )


__all__ = ["WindowSlots", "window_peak"]
