"""`WindowKV`: the KV of sliding-window layers (Gemma 3, gpt-oss, Mistral) as a tree
component.

A sliding-window layer attends to the last ``window`` tokens only, so a cached prefix
serves it only where the window layers' KV of its last ``window`` tokens is present, and
the rest of that KV is dead weight. Each node keeps window KV slots (a pool of its own,
as SGLang's SWA pool) for a *tail* of its units: ``covered`` units ending at the node's
end; the units before them are a tombstone (full-attention KV only).

The contract (besides `radixkv.tree.component`'s):

* **Useful ends.** A match is expected to end at a leaf's end (a cached prompt or
  conversation), at a branch point (a node with two children or more: a shared prefix),
  where a running request holds the tree (a lock end), or at a node end the caller
  marked (`mark`: a template boundary, such as the end of a system message).
  ``reach(node)`` is how many units back from the node's end some useful end at or
  below it needs (``window`` from each, rounded up to pages), and a node needs
  ``min(len, reach)`` units of tail.
* **Retention.** With ``retain="ends"`` (the default here) a node keeps exactly the tail
  it needs: window KV beyond every useful end's window is freed (``allocator.free``) as
  soon as the tree changes so (an insert, a merge that makes a leaf end an inner
  position, an eviction, a lock released). With ``retain="all"`` (SGLang's unified
  cache) a node keeps all its window KV until `evict` tombstones it. A lock end is a
  useful end, so the window before it that the tree holds stays while the lock does
  (a running request reads it).
* **Matching** (``match_limit``): a match may end only where the window KV of its last
  ``window`` units (or of everything from the root, when shorter) is present.
* **Inserting** (``inserted``): the caller hands the window slots of its key (one per
  unit, ``extras={"window": slots}``; ``-1`` where it has none: a request keeps only
  its last window); the tree takes those of the new units and, in the part that was
  cached already, those it lacks where a window needs them (a tombstone recovered), as
  far as it keeps them and as far back as the caller's slots run without a hole.
  ``taken`` then says which of the caller's slots the tree owns; the caller frees the
  others (duplicates, or not needed).
* **Pressure** (`evict`): frees window KV of unlocked nodes, least recently used first,
  whatever their windows need (their matches then end earlier); `drop` frees one node's,
  for a caller with an order of its own. Validator and recovery equal SGLang's
  `SWAComponent` operation by operation (``tests/differential/test_sglang_hybrid_diff.py``).
  Complexity: `evict` and `evict_spare` cost O(log nodes) a node they look at (two
  heaps in ``(last_access, id)`` order, no scan); `evictable_units` scans the holders
  only until it has counted what the caller asks. A chain of one node per chunk is
  never walked whole: `servable` walks up one window, `match_limit` walks back from the
  match's end (each node at most once), an insert refits only the nodes whose reach it
  changed and those its slots reach.

Invariants (``check``): a node's window slots are a tail of it, at most its length, one
slot per unit; ``reach`` is what its own end and its children ask; with ``retain="ends"``
no node holds more than it needs.

Owns: the window slots of the nodes and which of them are kept. Must not touch: the
tree's structure, the full KV, locks (it reads them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.tree.component import TreeComponent
from radixkv.tree.node import bytes_to_tensor, is_tensor
from radixkv.units import align_up

if TYPE_CHECKING:
    import torch

    from radixkv.tree.node import TreeNode

RETAIN = ("ends", "all")
_NONE = b""


class _Win:
    """A node's entry: the window slots of its tail (8 bytes a unit), its reach, and
    whether the caller marked its end as a useful end."""

    __slots__ = ("mark", "reach", "slots")

    def __init__(self, slots: bytes = _NONE, reach: int = 0, mark: bool = False) -> None:
        self.slots, self.reach, self.mark = slots, reach, mark


class _Order:
    """Nodes least recently used first without a scan: one entry ``(last_access when
    added, id, node)`` a node in a heap; an entry whose node was used since goes back
    with its new time when it comes up, so the order is ``(last_access, id)``'s."""

    __slots__ = ("heap", "ids")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, TreeNode]] = []
        self.ids: dict[int, TreeNode] = {}  # the nodes with an entry

    def add(self, node: TreeNode) -> None:
        if node.id not in self.ids:
            self.ids[node.id] = node
            heapq.heappush(self.heap, (node.last_access, node.id, node))

    def oldest(self, keep: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """The nodes that ``keep`` accepts, oldest first (the others lose their entry);
        O(log n) a node looked at. Those yielded get an entry again when the caller
        closes it (`contextlib.closing`), if ``keep`` still accepts them."""
        heap, seen = self.heap, []
        try:
            while heap:
                at, nid, node = heap[0]
                if not keep(node):
                    heapq.heappop(heap)
                    del self.ids[nid]
                elif at != node.last_access:
                    heapq.heapreplace(heap, (node.last_access, nid, node))
                else:
                    heapq.heappop(heap)
                    del self.ids[nid]
                    seen.append(node)
                    yield node
        finally:
            for node in seen:
                if keep(node):
                    self.add(node)

    def prune(self, keep: Callable[[TreeNode], bool], limit: int) -> None:
        """Drop the entries of nodes ``keep`` rejects once there are over ``limit``."""
        if len(self.heap) > limit:
            self.heap = [e for e in self.heap if keep(e[2])]
            heapq.heapify(self.heap)
            self.ids = {e[1]: e[2] for e in self.heap}


class WindowKV(TreeComponent):
    """Sliding-window KV in a radix tree (see the module docstring).

    Args:
        window: the layers' window in tokens (rounded up to pages).
        allocator: ``free(slots)`` takes back window slots the tree lets go (``None``:
            dropped).
        retain: ``ends`` (free what no useful end's window needs) or ``all``.
    """

    name = "window"

    def __init__(self, window: int, allocator: Any = None, retain: str = "ends") -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if retain not in RETAIN:
            raise ValueError(f"retain must be one of {RETAIN}, got {retain!r}")
        if allocator is not None and not callable(getattr(allocator, "free", None)):
            raise TypeError("allocator must have a free(slots) method")
        self.window, self.allocator, self.retain = window, allocator, retain
        self.taken: np.ndarray = np.zeros(0, dtype=bool)  # of the last insert's slots
        self.held = 0  # window units the tree holds
        self._freed: list[bytes] = []  # slots let go in the current operation
        self._head: tuple[TreeNode, bytes] | None = None  # a merged leaf, its parent's slots
        self._parents: list[TreeNode] = []  # the parents of the nodes an eviction removes
        # pressure's orders: every node holding window KV is in ``_holders``; every one
        # with spare (`_spare`) in ``_spares``: a node is added when it gains slots or its
        # reach changes, the only ways to gain spare (a split or trim shortens a node's
        # covered tail as much as its need); one found without is dropped
        self._holders, self._spares = _Order(), _Order()
        # ``demote(node, start, slots)``: the window slots of ``node``'s units from
        # ``start`` on (its offset in the node) are about to be freed, by an eviction or
        # under pressure: a host tier copies their pages out (`radixkv.storage.windows`).
        # Best effort: one that raises is logged.
        self.demote: Callable[[TreeNode, int, torch.Tensor], None] | None = None

    def event_gate(self, sink: Any, chain: Any) -> TreeComponent | None:
        """KV events tell only the pages a match can end at (`ServableBlocks`, with the
        chain's hashes); ``None, None``: nobody hears of windows any more."""
        if sink is None:
            return None
        from radixkv.kvcache.window.servable import ServableBlocks

        return ServableBlocks(sink, chain, self)

    def attach(self, cache: Any, index: int) -> None:
        super().attach(cache, index)
        self.span = align_up(self.window, cache.page_size)  # the window, in whole pages

    # --- reading ------------------------------------------------------------------------
    def _w(self, node: TreeNode) -> _Win | None:
        return node.ext[self.index]  # type: ignore[index]

    def covered(self, node: TreeNode) -> int:
        """Units of ``node``'s tail that have window KV."""
        w = self._w(node)
        return len(w.slots) >> 3 if w is not None else 0

    def slots(self, node: TreeNode) -> torch.Tensor:
        """The window slots of ``node``'s covered tail, in order."""
        w = self._w(node)
        if w is None or not w.slots:
            return bytes_to_tensor([])
        return bytes_to_tensor([w.slots])

    def tail_slots(self, node: TreeNode, units: int) -> torch.Tensor:
        """The window slots of the last ``units`` units ending at ``node``'s end, walking
        up (what a match ending there serves).

        Raises:
            ValueError: some of those units have no window KV (a match may not end there).
        """
        if units <= 0:
            return bytes_to_tensor([])
        parts: list[bytes] = []
        left, x = units, node
        while left > 0 and x is not None and x is not self.cache.root:
            w = self._w(x)
            have = len(w.slots) >> 3 if w is not None else 0
            take = min(left, len(x))
            if have < take:
                raise ValueError(f"WindowKV.tail_slots: node {x.id} lacks window KV "
                                 f"({have} of {take} units)")  # fmt: skip
            parts.append(w.slots[(have - take) << 3 :])  # type: ignore[union-attr]
            left -= take
            x = x.parent
        if left > 0:
            raise ValueError(f"WindowKV.tail_slots: the path holds fewer than {units} units")
        return bytes_to_tensor(list(reversed(parts)))

    def held_units(self) -> int:
        """Window units the tree holds (counted as they come and go)."""
        return self.held

    def _useful(self, node: TreeNode) -> bool:
        """A match is expected to end at ``node``'s end (a leaf, a branch point, a lock
        end)."""
        kids = node.children
        if len(kids) != 1:
            return True
        w = self._w(node)
        if w is not None and w.mark:
            return True
        return node.lock_ref > sum(c.lock_ref for c in kids.values())

    def _reach(self, node: TreeNode) -> int:
        own = self.span if self._useful(node) else 0
        best = own
        for c in node.children.values():
            w = self._w(c)
            if w is not None and w.reach - len(c) > best:
                best = w.reach - len(c)
        return best

    def need(self, node: TreeNode) -> int:
        """Units of ``node``'s tail its useful ends need (``retain="all"``: all)."""
        if self.retain == "all":
            return len(node)
        w = self._w(node)
        return min(len(node), w.reach) if w is not None else 0

    def mark(self, node: TreeNode) -> None:
        """Keep a window at ``node``'s end from now on (until the node is evicted or a
        split moves its end): the caller knows requests will branch there (a template
        boundary). The window KV must come with a later insert through ``node``."""
        self.cache.path_to_root(node, "WindowKV.mark")
        w = self._w(node)
        if w is None:
            w = node.ext[self.index] = _Win()  # type: ignore[index]
        if not w.mark:
            w.mark = True
            self._refresh(node)

    # --- matching -----------------------------------------------------------------------
    def servable(self, node: TreeNode) -> bool:
        """A match may end at ``node``'s end: the window KV of its last ``window`` units
        (or all, from the root) is there. O(nodes those units span): the walk up stops
        at the first node not wholly covered, or once a window is counted."""
        if node.parent is None and node is not self.cache.root:
            raise ValueError(f"WindowKV.servable: node {node.id} is not in this cache "
                             "(evicted or foreign)")  # fmt: skip
        return self._short_at(node, self.span) < 0

    def _short_at(self, node: TreeNode, need: int) -> int:
        """Where the covered run ending at ``node``'s end falls short of ``need`` units:
        -1 when it reaches them (or the root), else how many wholly covered nodes lie
        between ``node`` and the node it starts in (a run ending at any node end from
        there down to ``node`` is shorter still). Walks up over wholly covered nodes
        only; O(nodes walked)."""
        got, k, x, root, ext = 0, 0, node, self.cache.root, self.index
        while got < need and x is not root:
            w = x.ext[ext]  # type: ignore[index]
            have, length = (len(w.slots) >> 3 if w is not None else 0), len(x.value_bytes) >> 3
            if have < length:
                return -1 if got + have >= need else k
            got += length
            k += 1
            x = x.parent  # type: ignore[assignment]
        return -1

    def match_limit(self, path: list[TreeNode], partial: TreeNode | None, units: int) -> int:
        """The deepest position within the match whose last ``window`` units (or all,
        from the root) have window KV. Walks back from the match's end and stops at the
        first position that qualifies: O(nodes back to it) besides summing the path's
        lengths (the same answer as a walk from the root that tracks where the covered
        run starts: tests/kvcache/test_window_walks.py)."""
        span, i = self.span, len(path)
        ends = list(itertools.accumulate(len(n.value_bytes) >> 3 for n in path))
        end = ends[-1] if ends else 0
        if partial is not None:
            k = self.covered(partial)
            first = end + len(partial) - k  # the covered tail's first unit
            pos = end + units
            if pos > first:
                if first > end:  # the covered run starts inside the partial node
                    if pos - first >= span:
                        return pos
                elif not path or self._short_at(path[-1], span - units) < 0:
                    return pos
        # the deepest node end whose covered run reaches back a window (or to the root);
        # a run that falls short inside node j rules out node j's end and every end after
        # it (their runs start there too, and node j's is shorter than a window): each
        # node is walked once, O(path) at most
        while i > 0:
            k = self._short_at(path[i - 1], span)
            if k < 0:
                return ends[i - 1]
            i -= k + 1
        return 0

    # --- inserting ----------------------------------------------------------------------
    def inserted(
        self, path: list[TreeNode], leaf: TreeNode | None, start: int, n: int, extra: Any
    ) -> None:
        """After an insert of ``n`` units, ``start`` of them cached before (``path``
        covers them; ``leaf`` holds the rest as its tail): recompute the windows, take
        the caller's slots that are new or fill a needed tombstone (``taken``)."""
        given = None
        if extra is not None:
            given = extra.numpy() if is_tensor(extra) else np.asarray(extra)
            given = given.astype(np.int64, copy=False)
            if len(given) != n:
                raise ValueError(f"window slots: {len(given)} for {n} units")
        self.taken = np.zeros(n, dtype=bool)
        head, self._head = self._head, None
        if leaf is not None:
            w = leaf.ext[self.index] = _Win()  # type: ignore[index]
            prior = head[1] if head is not None and head[0] is leaf else _NONE
            first = n if given is None else start + _run_start(given[start:n])
            if given is not None and first < n:  # the new units it has slots for, to the end
                joins = first == start  # what came before joins the covered tail
                w.slots = (prior if joins else _NONE) + given[first:n].tobytes()  # type: ignore[index]
                self._queue(leaf)
                self._changed(leaf)
                self.taken[first:n] = True
                self.held += n - first
                if not joins:
                    self._freed.append(prior)
            else:  # the merged leaf's old covered tail is no tail any more
                self._freed.append(prior)
        seen = self._reach_up(leaf if leaf is not None else (path[-1] if path else None))
        top = n - len(leaf) if leaf is not None else start  # where the path ends (a
        # merged parent's units are the leaf's)
        for node, end in self._to_fit(path, top, given, seen[leaf is not None :]):
            self._fit(node, end, given)
        if leaf is not None:
            self._fit(leaf, n, None)
        self._flush()

    def _to_fit(
        self, path: list[TreeNode], top: int, given: np.ndarray | None, seen: list[TreeNode]
    ) -> list[tuple[TreeNode, int]]:
        """The nodes of ``path`` (ending at unit ``top``) that `_fit` may change after
        an insert, with their ends, root first: those whose reach `_reach_up` just
        recomputed (``seen``: they may hold more than they now need) and those ending
        after the caller's first slot (they may take some). Every other node already
        holds at most what it needs (``check``'s invariant; ``retain="all"``: it needs
        all) and can take nothing, so its `_fit` would do nothing. O(nodes returned +
        the first slot's search)."""
        first = top
        if given is not None:
            real = np.flatnonzero(given[:top] >= 0)
            first = int(real[0]) if len(real) else top
        recomputed = {id(x) for x in seen}
        out, end, i = [], top, len(path)
        while i > 0 and (end > first or recomputed):
            i -= 1
            node = path[i]
            recomputed.discard(id(node))
            out.append((node, end))
            end -= len(node.value_bytes) >> 3
        return out[::-1]

    def _fit(self, node: TreeNode, end: int, given: np.ndarray | None) -> None:
        """Make ``node`` hold the tail it needs: free what is beyond (``retain="ends"``),
        take what it lacks from ``given`` (the caller's slots, by absolute unit)."""
        w = self._w(node)
        if w is None:
            w = node.ext[self.index] = _Win(_NONE, self._reach(node))  # type: ignore[index]
        need, have = self.need(node), len(w.slots) >> 3
        if have > need:
            cut = (have - need) << 3
            self._freed.append(w.slots[:cut])
            w.slots = w.slots[cut:]
            self._changed(node)
        elif have < need and given is not None:
            lo, hi = end - need, end - have  # the absolute units to take
            lo += _run_start(given[lo:hi])  # only the run up to the covered tail
            if lo < hi:
                w.slots = given[lo:hi].tobytes() + w.slots
                self._queue(node)
                self._changed(node)
                self.taken[lo:hi] = True
                self.held += hi - lo

    def _reach_up(self, node: TreeNode | None) -> list[TreeNode]:
        """Recompute reach from ``node`` up while it changes (always ``node`` itself and
        its parent); returns the nodes visited."""
        root, seen = self.cache.root, []
        while node is not None and node is not root:
            w = self._w(node)
            if w is None:
                w = node.ext[self.index] = _Win()  # type: ignore[index]
            reach = self._reach(node)
            changed = reach != w.reach
            w.reach = reach
            if changed:
                self._spares.add(node)
                self._bound()
            seen.append(node)
            if not changed and len(seen) > 1:
                break
            node = node.parent
        return seen

    def _refresh(self, node: TreeNode | None) -> None:
        """Recompute reach from ``node`` up, and free what the visited nodes no longer
        need."""
        if node is None or node.parent is None:
            return
        for x in self._reach_up(node):
            self._fit(x, 0, None)
        self._flush()

    def _flush(self) -> None:
        freed = [b for b in self._freed if b]
        self._freed = []
        self.held -= sum(len(b) for b in freed) >> 3
        if freed:
            self.release(bytes_to_tensor(freed))

    def _changed(self, node: TreeNode) -> None:
        """``node``'s window slots changed: the cache's other components hear it (the
        event gate, `radixkv.kvcache.window.servable`, tells only the blocks a match
        can end at)."""
        self.cache.changed(self, node)

    # --- the tree changes ---------------------------------------------------------------
    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        w = self._w(lower)
        if w is None:
            return
        tail = len(lower) - units  # the lower half's length
        have = len(w.slots) >> 3
        up = max(have - tail, 0)  # covered units falling in the upper half
        upper.ext[self.index] = _Win(w.slots[: up << 3], max(w.reach - tail, 0))  # type: ignore[index]
        if up:
            self._queue(upper)
        # the mark stays with the lower half, whose end it is
        w.slots = w.slots[up << 3 :]
        self._changed(upper)
        self._changed(lower)

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        # ``inserted`` (next, in the same insert) joins the parent's covered tail, which
        # ends where the leaf's new units start, to the new units' slots
        pw = self._w(parent)
        self._head = (leaf, pw.slots if pw is not None else _NONE)

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: Any
    ) -> None:
        self._parents = [v.parent for v in victims if v.parent is not None]
        if self.demote is not None:  # (nothing is cut yet: a trimmed node is whole)
            for v in victims:
                self._demoting(v, len(v) - self.covered(v), self._w(v))
            if trim is not None:
                node, units = trim
                w, have = self._w(node), self.covered(node)
                take = min(have, units)
                if take:
                    self._demoting(node, len(node) - take, w, have - take)

    def _demoting(self, node: TreeNode, start: int, w: _Win | None, skip: int = 0,
                  upto: int | None = None) -> None:  # fmt: skip
        """Tell ``demote`` of ``node``'s window slots ``w.slots[skip:upto]`` (units from
        ``start`` in the node) before they are freed."""
        if self.demote is None or w is None or not w.slots:
            return
        raw = w.slots[skip << 3 : None if upto is None else upto << 3]
        if not raw:
            return
        try:
            self.demote(node, start, bytes_to_tensor([raw]))
        except Exception:
            import logging

            logging.getLogger("radixkv.tree").exception(
                "the window demote hook failed; the window pages are dropped"
            )

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        for v in victims:
            w = self._w(v)
            if w is not None:
                self._freed.append(w.slots)
            v.ext[self.index] = None  # type: ignore[index]
        if trim is not None:
            node, take = trim  # already trimmed by the core: its last units are gone
            w = self._w(node)
            if w is not None:
                have = len(w.slots) >> 3
                keep = max(have - take, 0)
                self._freed.append(w.slots[keep << 3 :])
                w.slots = w.slots[: keep << 3]
                self._changed(node)
            self._refresh(node)
        parents, self._parents = self._parents, []
        for node in {id(p): p for p in parents}.values():
            self._refresh(node)  # fewer children: a branch point may be gone
        self._flush()

    def detach(self, node: TreeNode) -> None:
        w = self._w(node)
        if w is not None:
            self._freed.append(w.slots)
        node.ext[self.index] = None  # type: ignore[index]

    def detached(self, node: TreeNode, parent: TreeNode) -> None:
        self._refresh(parent)
        self._flush()

    def lock(self, path: list[TreeNode]) -> int:
        self._refresh(path[0] if path else None)
        return 0

    def unlock(self, path: list[TreeNode]) -> int:
        self._refresh(path[0] if path else None)
        return 0

    def reset(self) -> None:
        if self.allocator is not None and self.cache.num_nodes():
            for n in self.cache.iter_nodes():
                w = self._w(n)
                if w is not None:
                    self._freed.append(w.slots)
            self._flush()
        self._freed, self._head, self._parents = [], None, []
        self._holders, self._spares = _Order(), _Order()
        self.held = 0

    # --- pressure -----------------------------------------------------------------------
    def _queue(self, node: TreeNode) -> None:
        """``node`` gained window slots: it holds some, and may have spare."""
        self._holders.add(node)
        self._spares.add(node)
        self._bound()

    def _bound(self) -> None:
        """Keep each order's entries within twice the tree's nodes (dead ones pruned)."""
        limit = 2 * self.cache.num_nodes() + 64
        self._holders.prune(self._holds, limit)
        self._spares.prune(self._has_spare, limit)

    def _holds(self, node: TreeNode) -> bool:
        w = self._w(node)
        return node.parent is not None and w is not None and bool(w.slots)

    def _has_spare(self, node: TreeNode) -> bool:
        return node.parent is not None and self._spare(node) > 0

    def evict(self, units: int) -> int:
        """Free the window KV of at least ``units`` units (when there are that many in
        unlocked nodes), whole nodes' tails, least recently used first."""
        freed = 0
        if units > 0:
            with closing(self._holders.oldest(self._holds)) as order:
                for node in order:
                    if not node.lock_ref:
                        freed += self._drop(node)
                        if freed >= units:
                            break
        self._flush()
        return freed

    def _spare(self, node: TreeNode) -> int:
        """Covered units of ``node`` that no useful end needs."""
        w = self._w(node)
        return max(0, (len(w.slots) >> 3) - min(len(node), w.reach)) if w is not None else 0

    def evictable_units(self, enough: int | None = None) -> int:
        """Window units `evict_spare` and `evict` can free now: all of an unlocked node's,
        the spare of a locked one's; counted only up to ``enough`` when given (the scan
        stops there). O(nodes holding window KV) at most."""
        total = 0
        for n in self._holders.ids.values():
            if n.parent is not None:
                total += self._spare(n) if n.lock_ref else self.covered(n)
                if enough is not None and total >= enough:
                    break
        return total

    def evict_spare(self, units: int) -> int:
        """Free window KV that no useful end needs (what ``retain="ends"`` would not
        hold), least recently used first, locked nodes included (a lock end is a useful
        end, so what its request reads stays), until at least ``units`` are freed or
        none is left; returns how many. Every servable match end stays servable: an
        engine under pressure calls this before `evict` (``retain="all"``: windows are
        kept while the pool has room, and the spare ones go first)."""
        freed = 0
        if units > 0:
            with closing(self._spares.oldest(self._has_spare)) as order:
                for node in order:
                    w = self._w(node)
                    assert w is not None
                    cut = self._spare(node)
                    self._demoting(node, len(node) - self.covered(node), w, 0, cut)
                    self._freed.append(w.slots[: cut << 3])
                    w.slots = w.slots[cut << 3 :]
                    self._changed(node)
                    freed += cut
                    if freed >= units:
                        break
        self._flush()
        return freed

    def drop(self, node: TreeNode) -> int:
        """Free ``node``'s window KV (a tombstone: its full KV stays), for a caller with
        an eviction order of its own; returns the units freed. Matches through it then
        end before it, or ``window`` units past it.

        Raises:
            ValueError: ``node`` is locked (a running request may read its window), or
                not in this cache.
        """
        self.cache.path_to_root(node, "WindowKV.drop")
        if node.lock_ref:
            raise ValueError(f"WindowKV.drop: node {node.id} is locked")
        freed = self._drop(node)
        self._flush()
        return freed

    def _drop(self, node: TreeNode) -> int:
        w = self._w(node)
        if w is None or not w.slots:
            return 0
        self._demoting(node, len(node) - self.covered(node), w)
        self._freed.append(w.slots)
        w.slots = _NONE
        self._changed(node)
        return len(self._freed[-1]) >> 3

    # --- checks -------------------------------------------------------------------------
    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        w = self._w(node)
        have = self.covered(node)
        if have > len(node):
            raise AssertionError(f"node {node.id}: {have} window units, {len(node)} units")
        if w is None:
            raise AssertionError(f"node {node.id}: no window entry")
        if w.reach != self._reach(node):
            raise AssertionError(f"node {node.id}: reach {w.reach}, its ends ask "
                                 f"{self._reach(node)}")  # fmt: skip
        if self.retain == "ends" and have > self.need(node):
            raise AssertionError(f"node {node.id}: holds {have} window units, needs "
                                 f"{self.need(node)}")  # fmt: skip

    def check(self, nodes: set[int]) -> None:
        held = sum(self.covered(n) for n in self.cache.iter_nodes())
        if held != self.held:
            raise AssertionError(f"{held} window units held, counted {self.held}")
        for n in self.cache.iter_nodes():
            for order, has in ((self._holders, self.covered(n)), (self._spares, self._spare(n))):
                if has and order.ids.get(n.id) is not n:
                    raise AssertionError(f"node {n.id}: {has} window units outside an order")
        for order in (self._holders, self._spares):
            if sorted(order.ids) != sorted(e[1] for e in order.heap):
                raise AssertionError("a pressure order's entries and its index disagree")


def _run_start(given: np.ndarray) -> int:
    """Where the last run of real slots (``>= 0``) in ``given`` starts: a tail the
    caller can hand over whole (``len(given)`` when its last entry is a hole)."""
    holes = np.flatnonzero(given < 0)
    return int(holes[-1]) + 1 if len(holes) else 0


__all__ = ["RETAIN", "WindowKV"]
