"""`ServableBlocks`: KV events from a cache with sliding-window KV (`WindowKV`) tell
only the blocks a match could end at now.

A page of the tree is a hit for a new request only if a match may end at its end: its
full KV is in the tree and the window KV of the ``span`` units before that end (or of
all of them, from the root) is held (`WindowKV.match_limit`). Advertising every page of
the tree would send a router to a worker whose windows were evicted; advertising none
would lose the fleet the cache. So a page is told (``stored``) when it becomes servable
and withdrawn (``removed``) when it stops being so, whether because the tree evicted
it or because its window went while its full KV stays.

Within one node the servable pages are a suffix: a node holds window KV for a tail of
its units (``covered``), so a page inside the node is servable only past that tail's
start, by ``span`` units, or, when the whole node is covered, by what the covered run
entering it from its ancestors lacks of ``span``. Each node's entry is how many of its
last pages were told; the told set is always that suffix of every node's pages.

When it changes: a node's window slots change (`RadixCache.changed`), a node is new, or an
ancestor's coverage within ``span`` units before it changes. Nodes touched are
collected and the suffixes of them and of their descendants up to ``span`` units below
are recomputed at `flush` (once per engine step, when the event sink drains; each node
costs O(span / page) ancestors). Evictions, trims and detaches withdraw the told pages
they take at once, so the sink always hears stored before removed for a page.

The hashes are the chain component's (`radixkv.tree.hashes`: the fast event chain, or
BLAKE2b for a hash-only sink), which then reports nothing itself. Each stored event is
one node's newly servable run, with the hash of the page before it as its parent (that
page may not be told: a router treats such a worker's blocks each alone, as a recurrent
worker's checkpoints, `radixkv.router.index`).

Owns: which pages were told, and what the sink hears. Must not touch: the hashes, the
window slots, the tree's structure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.hashing import HASH_BYTES, hash_ints
from radixkv.hashing.fast import published
from radixkv.tree.component import TreeComponent
from radixkv.tree.hashes import BlockHashes, EventHashes

if TYPE_CHECKING:
    import torch

    from radixkv.kvcache.window.component import WindowKV
    from radixkv.tree.node import TreeNode


class ServableBlocks(TreeComponent):
    """See the module docstring. ``sink``: the real event sink; ``chain``: the hash
    component (its own sink `Muted`); ``window``: the cache's `WindowKV`."""

    name = "servable"
    empty = 0  # pages of the node told (its last ones)
    tells_events = True

    def __init__(self, sink: Any, chain: EventHashes | BlockHashes, window: WindowKV) -> None:
        self.sink, self.chain, self.window = sink, chain, window
        self.gated = window
        # arrays as the fast chain hands them (`EventHashes`); lists with BLAKE2b
        self.arrays = bool(getattr(sink, "arrays", False)) and isinstance(chain, EventHashes)
        self.touched: dict[int, TreeNode] = {}
        self.told = 0  # pages told, over the tree
        self._gone: list[int] = []

    def attach(self, cache: Any, index: int) -> None:
        if cache.is_eagle:
            raise ValueError("servable KV events: not with an EAGLE view")
        super().attach(cache, index)
        if callable(getattr(self.sink, "attach", None)):
            self.sink.attach(self.flush)

    def heard(self, source: TreeComponent, node: TreeNode) -> None:
        """The window's slots of ``node`` changed (`RadixCache.changed`)."""
        if source is self.window:
            self._touch(node)

    def _touch(self, node: TreeNode) -> None:
        self.touched[node.id] = node

    # --- the pages of a node --------------------------------------------------------
    def _hashes(self, node: TreeNode, lo: int, hi: int) -> list[int]:
        """The event hashes of ``node``'s pages ``lo .. hi - 1`` (page ``-1``: the
        parent's last)."""
        i = self.chain.index
        if isinstance(self.chain, EventHashes):
            return published(node.ext[i][lo * 8 : hi * 8])  # type: ignore[index]
        return hash_ints(node.ext[i][lo * HASH_BYTES : hi * HASH_BYTES])  # type: ignore[index]

    def _parent_hash(self, node: TreeNode, first: int) -> int | None:
        if first > 0:
            return self._hashes(node, first - 1, first)[0]
        parent = node.parent
        if parent is None or parent is self.cache.root:
            return None
        pages = len(parent) // self.cache.page_size
        return self._hashes(parent, pages - 1, pages)[0]

    def _run_in(self, node: TreeNode) -> int:
        """Window units covered just before ``node``, up to ``span`` (``span`` when the
        covered run reaches the root)."""
        span, root, w = self.window.span, self.cache.root, self.window
        run, x = 0, node.parent
        while x is not None and x is not root:
            k = w.covered(x)
            run += k
            if run >= span or k < len(x):
                return min(run, span)
            x = x.parent
        return span

    def servable_pages(self, node: TreeNode) -> int:
        """How many of ``node``'s last pages a match may end at now."""
        p, span, n = self.cache.page_size, self.window.span, len(node)
        k = self.window.covered(node)
        first = n - k + span if k < n else span - self._run_in(node)  # units from its start
        lowest = max(1, -(-first // p))  # the first page (1-based) ending at or past it
        return max(0, n // p - lowest + 1)

    # --- telling ------------------------------------------------------------------------
    def flush(self) -> None:
        """Hash what was inserted, then tell what became servable or stopped being so
        among the nodes touched and those up to ``span`` units below them."""
        self.chain.flush()
        if not self.touched:
            return
        touched, self.touched = self.touched, {}
        todo: dict[int, TreeNode] = {}
        for node in touched.values():
            if self._alive(node):
                self._below(node, todo)
        for node in sorted(todo.values(), key=self._depth):
            self._tell(node, self.servable_pages(node))

    def _alive(self, node: TreeNode) -> bool:
        x: TreeNode | None = node
        while x is not None and x is not self.cache.root:
            x = x.parent
        return x is not None

    def _depth(self, node: TreeNode) -> int:
        d, x = 0, node.parent
        while x is not None:
            d, x = d + 1, x.parent
        return d

    def _below(self, node: TreeNode, todo: dict[int, TreeNode]) -> None:
        """``node`` and its descendants that start within ``span`` units of its end."""
        span = self.window.span
        stack = [(node, 0)]
        while stack:
            x, dist = stack.pop()
            todo[x.id] = x
            for c in x.children.values():
                if dist < span:
                    stack.append((c, dist + len(c)))

    def _tell(self, node: TreeNode, now: int) -> None:
        """Make ``node``'s told suffix ``now`` pages long."""
        was = node.ext[self.index]  # type: ignore[index]
        if now == was:
            return
        pages, p = len(node) // self.cache.page_size, self.cache.page_size
        node.ext[self.index] = now  # type: ignore[index]
        self.told += now - was
        if now < was:
            self.sink.removed(self._hashes(node, pages - was, pages - now))
            return
        lo, hi = pages - now, pages - was
        hashes = self._hashes(node, lo, hi)
        tokens = np.frombuffer(node.key_bytes, dtype=np.int64)[lo * p : hi * p]
        parent = self._parent_hash(node, lo)
        if self.arrays:
            self.sink.stored(np.array(hashes, dtype=np.uint64), parent, tokens, p, node.extra_key)
        else:
            self.sink.stored(hashes, parent, tokens.tolist(), p, node.extra_key)

    def _last(self, node: TreeNode, pages: int) -> list[int]:
        """Hashes of the told pages among ``node``'s last ``pages``."""
        total = len(node) // self.cache.page_size
        told = min(node.ext[self.index], pages)  # type: ignore[index]
        return self._hashes(node, total - told, total) if told else []

    # --- the tree changes ---------------------------------------------------------------
    def new_leaf(self, leaf: TreeNode, parent: TreeNode) -> None:
        self._touch(leaf)

    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        told = lower.ext[self.index]  # type: ignore[index]
        keep = min(told, (len(lower) - units) // self.cache.page_size)
        lower.ext[self.index] = keep  # type: ignore[index]
        upper.ext[self.index] = told - keep  # type: ignore[index]
        self._touch(upper)

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        """The leaf takes the parent's place and its units: the parent's told pages
        are no longer a suffix, so they are withdrawn and told again at `flush`."""
        gone = self._last(parent, len(parent))
        if gone:
            self.told -= len(gone)
            self.sink.removed(gone)
        parent.ext[self.index] = 0  # type: ignore[index]
        self._touch(leaf)

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: torch.Tensor
    ) -> None:
        gone = [h for v in victims for h in self._last(v, len(v))]
        if trim is not None:
            gone += self._last(trim[0], trim[1] // self.cache.page_size)
        self._gone = gone

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        for v in victims:
            self.told -= v.ext[self.index]  # type: ignore[index]
            v.ext[self.index] = 0  # type: ignore[index]
        if trim is not None:
            node, units = trim  # its last units are gone: so are its last told pages
            was = node.ext[self.index]  # type: ignore[index]
            left = max(0, was - units // self.cache.page_size)
            self.told -= was - left
            node.ext[self.index] = left  # type: ignore[index]
            self._touch(node)
        gone, self._gone = self._gone, []
        if gone:
            self.sink.removed(gone)

    def detach(self, node: TreeNode) -> None:
        gone = self._last(node, len(node))
        self.told -= node.ext[self.index]  # type: ignore[index]
        node.ext[self.index] = 0  # type: ignore[index]
        if gone:
            self.sink.removed(gone)

    def reset(self) -> None:
        if self.told:
            self.sink.cleared()
        self.told, self.touched, self._gone = 0, {}, []

    # --- checks -------------------------------------------------------------------------
    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        told = node.ext[self.index]  # type: ignore[index]
        if not 0 <= told <= len(node) // self.cache.page_size:
            raise AssertionError(f"node {node.id}: {told} pages told of {len(node)} units")
        if not self.touched and not self.chain_pending() and told != self.servable_pages(node):
            raise AssertionError(f"node {node.id}: {told} pages told, "
                                 f"{self.servable_pages(node)} servable")  # fmt: skip

    def chain_pending(self) -> bool:
        return bool(getattr(self.chain, "pending", None))

    def check(self, nodes: set[int]) -> None:
        total = sum(n.ext[self.index] for n in self.cache.iter_nodes())  # type: ignore[misc]
        if total != self.told:
            raise AssertionError(f"{total} pages told over the nodes, counted {self.told}")


__all__ = ["ServableBlocks"]
