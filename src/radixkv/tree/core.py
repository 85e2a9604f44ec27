"""`RadixCache`: a radix tree over token ids whose nodes hold KV slot indices.

One idea: the tree and every change to its structure, in one class (about 900 lines), so
that the invariants below are kept by the code of one file. The eviction order
(`radixkv.tree.eviction.EvictionOrder`) and the invariant checker
(`radixkv.tree.inspection`) are objects and functions of their own, reading it through
public names.

Owns: the tree's structure (walk, split, insert, merge, evict, detach), the full-attention
KV slots of every node, the lock counts and evictable/protected sizes, the components it
hosts (joined while it is empty, with the hash chains an event sink and an evict hook ask
for) and the logical clock. Must not touch: what components keep per node (block
hashes, event streams, sliding-window KV, recurrent state: `radixkv.tree.component`),
except through their hooks; the allocator, except ``free`` on what it evicts.

Representation (why it is fast):
    * A node's key is its run of logical units packed as native int64 ``bytes`` (8 bytes a
      token, 16 a bigram pair); its value is the matching slot indices, 8 bytes each.
      A walk compares a whole node with one ``bytes.startswith(node_key, offset)``
      (a ``memcmp``, no copy), so matching a key is linear in its length however deep
      the tree is. With the default value (the token ids) key and value share one object.
    * Children are keyed by the bytes of their first page (``page_size`` units); under the
      root the key is ``(extra_key, first_page)`` when the key has a namespace, so
      namespaces never share nodes.
    * Evictable leaves sit in an index ordered by the policy's sort key (see
      `radixkv.tree.policy`): a queue of entries pushed in order (under LRU nearly all: a
      touched or new leaf has the newest key) and a binary heap for the rest; the smaller
      head of the two is the next victim. Entries are invalidated lazily: an entry is live
      when its version equals the node's ``heap_version`` and the node is still an evictable leaf.
      Each change that makes a node an evictable leaf, or changes the sort key of one,
      pushes a fresh entry; the index is compacted once it holds more than twice as many
      entries as there are nodes. ``evict`` therefore costs O((k + 1) log n) for k nodes
      removed, and O(k + 1) when the queue serves them. An entry is flat,
      ``(*sort key, version, node)``, so comparisons stop at the first int (a policy's
      keys all have one length).

Invariants (all checked from scratch by ``check_integrity``, `radixkv.tree.inspection`):
    * every non-root node has a non-empty key, a multiple of ``page_size`` units long, and
      as many value indices as key units; its parent's dict key is its first page;
    * ``lock_ref(node) >= sum(lock_ref(child))`` (locks walk to the root);
    * ``evictable_size`` is the token count of unlocked nodes, ``protected_size`` that of
      locked ones, and their sum is ``total_size``;
    * every evictable leaf has exactly one live heap entry, holding its current sort key;
    * every node carries one entry per component, and each component's own invariants
      hold (the block hash chains, the pending event nodes).

Errors: every public operation validates its arguments before it changes anything, and
``evict`` hands the slots to ``allocator.free`` before it unlinks a node, so an exception
(bad input, or an allocator that raises) leaves the tree as it was.

Threads: a `RadixCache` is not thread-safe. One thread owns a cache (and its allocator);
other threads hand it work through a queue, as `radixkv.engine`'s async engine does.
Concurrent calls corrupt it (slots owned twice or by nobody).

Nothing here recurses: deep chains (thousands of nodes) are fine.

The node contract (SGLang's, kept by the default cache): a node you got from the cache
(``match_prefix(...).last_node``, ``insert_node(...).last_node``) stays valid for
``inc_lock_ref`` / ``dec_lock_ref`` / ``path_values`` until an ``evict`` (or ``reset``)
removes it. Other matches and inserts never invalidate it: a split keeps the node object
as the lower part, so it still ends where it ended and covers the same tokens from the
root. A node that is locked is never removed. ``evict(n)`` removes whole leaves in the
policy's order until at least ``n`` tokens are freed, as SGLang's ``RadixCache`` does.
``tests/differential/test_sglang_diff.py`` replays operation sequences recorded from SGLang's own
``RadixCache`` (pages 1/2/4/16, EAGLE on and off, namespaces) on the default cache and
compares every prefix length, matched slot, size, lock delta and evicted slot.

Eviction modes (``eviction_mode``; the default keeps the contract above, the other two
change what a caller can observe, so they are opt-in):

* ``"leaf"`` (the default): whole leaves, and a walk ending inside a node refreshes the
  whole node, as SGLang's ``RadixCache`` does.
* ``"precise"``: ``evict(n)`` trims the last victim's tail (whole pages) instead of
  dropping the whole leaf, so it frees ``n`` tokens rounded up to a page; and a match or
  insert that ends inside a node refreshes the recency of the part it matched only.
* ``"merge"`` (LRU only; precise too): multi-turn chats and chunked prefills grow a
  chain one node per turn or chunk, and a walk pays a dict lookup and a ``memcmp`` per
  node. When an insert extends a leaf that nothing pins (no lock, no child), the new
  units join that leaf instead of hanging under it as a new child: the merged node is a
  fresh node that replaces the leaf (the old leaf object is detached, as an evicted one
  is, so an unlocked reference to it fails loudly instead of silently covering more
  tokens). This breaks the contract above for unlocked nodes: a node you hold without a
  lock can be merged away by any insert, so lock what you keep (radixkv's own lifecycle
  and engine do, and opt in).

``precise=True`` and ``merge_chains=True`` are the older spellings of the last two.
The eviction index, `evict` and why merging keeps LRU's order: `radixkv.tree.eviction`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from radixkv.key import TOKEN_BYTES, RadixKey, as_bool, as_count, common_prefix_units
from radixkv.tree import inspection
from radixkv.tree.component import TreeComponent
from radixkv.tree.eviction import EvictionOrder, Victims, resolve_eviction_mode
from radixkv.tree.hashes import (
    BlockHashes,
    CacheEventSink,
    EventHashes,
    Muted,
    hash_components,
)
from radixkv.tree.node import (
    NO_CHILDREN,
    InsertResult,
    MatchParts,
    MatchResult,
    TreeNode,
    as_int64_bytes,
    bytes_to_tensor,
    check_slots,
)
from radixkv.tree.policy import get_policy

if TYPE_CHECKING:  # (the tree imports no torch: values come in and go out as tensors)
    import torch

_EMPTY = b""
MAX_PAGE_SIZE = 1 << 16  # tokens; larger pages are a units mistake (bytes for tokens?)


class RadixCache:
    """A prefix cache: the longest cached prefix of a key and the KV slots it occupies.

    Args:
        page_size: units per page; keys are truncated to whole pages and nodes split only
            at page boundaries.
        eviction_policy: one of ``lru lfu fifo mru filo priority slru``, or a custom
            sort-key function of a node (see `radixkv.tree.policy.get_policy`).
        allocator: anything with ``free(indices: torch.Tensor)``; ``evict`` hands it the
            removed slot indices (one call per ``evict``). ``None`` drops them.
        is_eagle: key every sequence by its bigram view (EAGLE speculative decoding).
        disable: a cache that never matches and never stores.
        event_sink: reports pages stored and removed (see `CacheEventSink`).
        merge_chains, precise: the older spellings of ``eviction_mode`` ``"merge"`` and
            ``"precise"`` (``precise=None``: on exactly when ``merge_chains``).
        eviction_mode: ``"leaf"`` (SGLang's; the default), ``"precise"`` or ``"merge"``
            (see the module docstring).
        components: tree components (`radixkv.tree.component`) beside the full KV.

    Complexities (n nodes, L key units, d path length): ``match_prefix`` and ``insert``
    O(L + d); ``evict`` O((k + 1) log n) for k nodes removed; locks O(d).
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: str = "lru",
        allocator: Any = None,
        is_eagle: bool = False,
        disable: bool = False,
        event_sink: CacheEventSink | None = None,
        merge_chains: bool = False,
        precise: bool | None = None,
        eviction_mode: str | None = None,
        components: tuple[TreeComponent, ...] = (),
    ) -> None:
        page_size = as_count(page_size, "page_size")
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
        if allocator is not None and not callable(getattr(allocator, "free", None)):
            raise TypeError("allocator must have a free(indices) method")
        self.is_eagle = as_bool(is_eagle, "is_eagle")
        self.disable = as_bool(disable, "disable")
        self.order = EvictionOrder(get_policy(eviction_policy), self.num_nodes)
        self.eviction_mode = resolve_eviction_mode(
            eviction_policy, eviction_mode, precise, merge_chains
        )
        self.precise = self.eviction_mode != "leaf"
        self.merge_chains = self.eviction_mode == "merge"
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.allocator = allocator
        # bytes of one key unit (a token id, or a bigram pair under EAGLE)
        self.unit_bytes = 2 * TOKEN_BYTES if self.is_eagle else TOKEN_BYTES
        self._sink: CacheEventSink | None = None
        self._evict_hook: Any = None
        self._components: list[TreeComponent] = []  # in node.ext order
        self._empty_ext: list[Any] = []  # a new node's ext: each component's empty entry
        self._own: list[TreeComponent] = []  # the ones the caller gave
        self._lockers: list[TreeComponent] = []
        self._limiters: list[TreeComponent] = []
        self._inserters: list[TreeComponent] = []
        self._listeners: list[TreeComponent] = []
        self._num_nodes = 0
        self.reset()
        for c in components:
            self.add_component(c)
        self.set_event_sink(event_sink)

    # --- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every node (without calling the allocator) and restart the clock; an
        event sink hears ``cleared``."""
        for c in self._components:
            c.reset()
        self.root = TreeNode(0)
        self.root.lock_ref = 1  # the root is never evictable
        if self._components:
            self.root.ext = self._empty_ext.copy()
        self._next_id = 1
        self._clock = 0
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0
        self.order.clear()

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what ``evict`` can free)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Tokens cached: ``evictable_size() + protected_size()``."""
        return self._evictable + self._protected

    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._num_nodes

    @property
    def clock(self) -> int:
        """The logical clock: ticks so far (no node's statistics are ahead of it)."""
        return self._clock

    @property
    def next_id(self) -> int:
        """The id the next new node gets (every node's is below it)."""
        return self._next_id

    # --- key and value preparation -----------------------------------------------------
    def _prepare(self, key: Any) -> tuple[bytes, int, Any, RadixKey]:
        """Validate ``key``; return (unit bytes, page-aligned unit count, namespace, the
        key in the cache's view). Never mutates the caller's key."""
        if not isinstance(key, RadixKey):
            if isinstance(key, (str, bytes)) or not hasattr(key, "__len__"):
                raise TypeError(
                    f"key must be a RadixKey or a sequence of ints, got {type(key).__name__}"
                )
            key = RadixKey(key)
        if key.is_bigram and not self.is_eagle:
            raise ValueError("key is a bigram view but this cache has is_eagle=False")
        view = key if key.is_bigram or not self.is_eagle else key.maybe_to_bigram_view(True)[0]
        n = len(view)
        if self.page_size > 1:
            n -= n % self.page_size
        return view.unit_bytes(n), n, view.extra_key, view

    def child_key(self, parent: TreeNode, node: TreeNode) -> Any:
        """The key under which ``parent.children`` holds ``node``: its first page (with
        its namespace under the root)."""
        first = node.key_bytes[: self.page_size * self.unit_bytes]
        if parent is self.root and node.extra_key is not None:
            return (node.extra_key, first)
        return first

    def _new_node(self, key: bytes, value: bytes, parent: TreeNode, extra_key: Any) -> TreeNode:
        node = TreeNode(self._next_id, key, value)
        self._next_id += 1
        self._num_nodes += 1
        node.parent = parent
        node.extra_key = extra_key
        if self._components:
            node.ext = self._empty_ext.copy()
        return node

    # --- the walk ----------------------------------------------------------------------
    def _descend(
        self, units: bytes, n: int, ns: Any, near: TreeNode | None = None
    ) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        """Walk from the root along ``units`` without changing anything; from ``near``
        when its path from the root spells the start of ``units`` (`_on_path`).

        Returns:
            (path of fully matched nodes, units they cover, the child where the match
            ends inside it or None, page-aligned units matched inside that child).
        """
        path: list[TreeNode] = []
        if n == 0:
            return path, 0, None, 0
        width, page = self.unit_bytes, self.page_size
        first = units[: page * width]
        child = self.root.children.get(first if ns is None else (ns, first))
        off = 0
        if near is not None and child is not None:
            path, off = self._on_path(near, child, units, n)
            if path:
                nxt = units[off * width : (off + page) * width]
                child = near.children.get(nxt) if off < n else None
        while child is not None:
            ob = off * width
            if units.startswith(child.key_bytes, ob):
                path.append(child)
                off += len(child.value_bytes) >> 3
                if off == n:
                    break
                child = child.children.get(units[off * width : (off + page) * width])
            else:
                limit = min(n - off, len(child.value_bytes) >> 3)
                m = common_prefix_units(units, ob, child.key_bytes, width, limit)
                return path, off, child, m - m % page
        return path, off, None, 0

    def _on_path(
        self, near: TreeNode, first: TreeNode, units: bytes, n: int
    ) -> tuple[list[TreeNode], int]:
        """The nodes from the root to ``near`` and the units they hold, when their keys
        spell the start of ``units`` (the first one ``first``, the root's child the key
        starts with), else ``([], 0)``: one join and one compare of the path's keys, no
        child lookup."""
        try:
            path = self.path_to_root(near, "insert_node")
        except ValueError:  # (evicted, or another tree's)
            return [], 0
        if not path or path[-1] is not first:  # (the root, or off the key's first node)
            return [], 0
        path.reverse()
        joined = b"".join([x.key_bytes for x in path])
        if not units.startswith(joined):  # (``units`` is the key: no longer than it)
            return [], 0
        return path, len(joined) // self.unit_bytes

    def _limit(
        self, path: list[TreeNode], off: int, partial: TreeNode | None, m: int
    ) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        """Cut a walk's match to what every component can serve (``match_limit``), to
        a fixed point: one component's cut may land where another cannot serve."""
        while True:
            keep = off + m
            for c in self._limiters:
                keep = min(keep, c.match_limit(path, partial, m))  # type: ignore[misc]
            keep -= keep % self.page_size
            if keep >= off + m:
                return path, off, partial, m
            path, off, partial, m = self._cut(path, off, partial, keep)

    def _cut(
        self, path: list[TreeNode], off: int, partial: TreeNode | None, keep: int
    ) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        while path and off - len(path[-1]) >= keep:  # whole nodes past the cut go
            off -= len(path.pop())
        if off > keep:  # the cut falls inside the last kept node: it is now partial
            node = path.pop()
            off -= len(node)
            return path, off, node, keep - off
        return path, off, (partial if keep > off else None), keep - off

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` units; return the new upper node (child keeps its
        identity as the lower part, so existing references and locks stay valid)."""
        width = self.unit_bytes
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key_bytes[: m * width], _EMPTY, parent, child.extra_key)
        for c in self._components:  # before the cut: the node is still whole
            c.split(child, upper, m)
        shared = child.key_bytes is child.value_bytes
        upper.value_bytes = upper.key_bytes if shared else child.value_bytes[: m * TOKEN_BYTES]
        child.key_bytes = child.key_bytes[m * width :]
        child.value_bytes = child.key_bytes if shared else child.value_bytes[m * TOKEN_BYTES :]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.created = child.created
        upper.priority = child.priority
        parent.children[self.child_key(parent, upper)] = upper
        upper.children = {child.key_bytes[: self.page_size * width]: child}
        child.parent = upper
        return upper

    def _touch(
        self, path: list[TreeNode], priority: int | None = None, reindex: bool = True
    ) -> None:
        """Refresh recency and hit counts along ``path`` (one clock tick per node); if the
        last node is an evictable leaf its sort key changed, so re-index it."""
        clock = self._clock
        for node in path:
            clock += 1
            node.last_access = clock
            node.hit_count += 1
            if priority is not None and priority > node.priority:
                node.priority = priority
        self._clock = clock
        last = path[-1]
        if reindex and not last.children and last.lock_ref == 0:
            self.order.push(last)

    def _touch_lower(self, lower: TreeNode) -> None:
        """SGLang refreshes the recency of a node a walk ends inside, before splitting it:
        its unmatched lower part too (``precise`` refreshes only what was matched)."""
        lower.last_access = self._clock
        if not lower.children and lower.lock_ref == 0:
            self.order.push(lower)

    # --- public operations -------------------------------------------------------------
    def match_prefix(self, key: RadixKey, split: bool = True, full: bool = False) -> MatchResult:
        """Find the longest cached prefix of ``key``.

        Args:
            key: a `RadixKey` (or a sequence of ints); truncated to whole pages.
            split: when True (the default) a match ending inside a node splits it so
                ``last_node`` is exact, and recency/hit counts are refreshed along the
                path. When False the lookup is read-only: nothing is split or touched,
                and ``last_node`` is the deepest node lying wholly inside the match.
            full: the full-attention KV's match, before components cut it (a tier
                that loads KV below it: only the KV, not a component, is there).

        Returns:
            `MatchResult` (indices, last_node, prefix_len).
        """
        parts, last, n, _ = self.match_parts(key, split, full)
        return MatchResult(bytes_to_tensor(parts), last, n)

    def match_parts(self, key: RadixKey, split: bool = True, full: bool = False) -> MatchParts:
        """`match_prefix` without the tensor, for callers that copy the slots anyway
        (`MatchParts`: the slots as packed chunks, the last node, the hit, and the
        full-attention match before the components' cut, all from the same walk)."""
        split = as_bool(split, "split")
        units, n, ns, _ = self._prepare(key)
        if self.disable:
            return MatchParts([], self.root, 0, 0)
        path, off, partial, m = self._descend(units, n, ns)
        full_len = off + m
        if self._limiters and not as_bool(full, "full"):
            path, off, partial, m = self._limit(path, off, partial, m)
        parts = [node.value_bytes for node in path]
        if not split:
            if partial is not None:
                parts.append(partial.value_bytes[: m * TOKEN_BYTES])
            return MatchParts(parts, path[-1] if path else self.root, off + m, full_len)
        if partial is not None and m:
            upper = self._split(partial, m)
            path.append(upper)
            parts.append(upper.value_bytes)
            off += m
        if path:
            self._touch(path)
            if partial is not None and m and not self.precise:
                self._touch_lower(partial)
            return MatchParts(parts, path[-1], off, full_len)
        return MatchParts(parts, self.root, 0, full_len)

    def extends_leaf(self, key: RadixKey) -> bool:
        """Read-only: whether ``key`` covers the whole path of some leaf (it extends, or
        equals, a cached sequence nothing else continues). Over a tree of prompts, a
        conversation's next turn extends its last turn, a leaf; a new conversation
        behind a shared prefix diverges from one (or at a branch). O(matched nodes)."""
        units, n, ns, _ = self._prepare(key)
        if self.disable:
            return False
        path, _, partial, _ = self._descend(units, n, ns)
        return partial is None and bool(path) and not path[-1].children

    def match_len(self, key: RadixKey, full: bool = False) -> int:
        """Read-only hit length of ``key`` in units: no split, no recency change, no tensor.
        For schedulers and routers that only rank requests by cache hit. ``full``: the
        full-attention KV's match, before components cut it (where a hybrid request
        leaves a cached path: a branch point)."""
        units, n, ns, _ = self._prepare(key)
        if self.disable:
            return 0
        path, off, partial, m = self._descend(units, n, ns)
        if self._limiters and not full:
            _, off, _, m = self._limit(path, off, partial, m)
        return off + m

    def cacheable_len(self, key: RadixKey) -> int:
        """Units of ``key`` that ``insert`` would store: its length in this cache's view
        (bigram pairs under EAGLE) floored to whole pages; 0 for a disabled cache."""
        if not isinstance(key, RadixKey):
            key = RadixKey(key)
        if self.disable:
            return 0
        n = len(key) if key.is_bigram or not self.is_eagle else max(0, key.raw_len() - 1)
        return n - n % self.page_size

    def insert(self, key: RadixKey, value: Any = None, priority: int = 0) -> int:
        """Cache ``key`` with slot indices ``value``; see `insert_node` (this returns its
        ``prefix_len``)."""
        return self.insert_node(key, value, priority).prefix_len

    def insert_node(
        self,
        key: RadixKey,
        value: Any = None,
        priority: int = 0,
        *,
        slots_checked: bool = False,
        extras: dict[str, Any] | None = None,
        near: TreeNode | None = None,
    ) -> InsertResult:
        """Cache ``key`` with slot indices ``value``, and say where it ends.

        Args:
            key: a `RadixKey` (or a sequence of ints); truncated to whole pages.
            value: slot indices, one per unit of ``key`` as given (1-D ints: tensor,
                ndarray, array or list); defaults to the token ids.
            priority: for the ``priority`` policy; nodes on the path keep the maximum.
            slots_checked: the caller vouches that ``value`` holds distinct non-negative
                slots (an allocator's, as `radixkv.kvcache.lifecycle` passes): skips the
                O(k log k) check of the new slots.
            extras: per component (by name), what it takes with the key: one entry per
                unit of ``key`` (a sliding window's slots; see the component).
            near: a node of this tree whose path from the root may spell the start of
                ``key`` (the node a request locked at its last insert): the walk starts
                there when it does, O(its depth) in one compare instead of a child
                lookup a node; ignored otherwise (the same result either way).

        Returns:
            `InsertResult`: ``prefix_len``, how many leading units were cached already
            (those keep their existing indices: the caller frees its own duplicates
            ``value[:prefix_len]``), and ``last_node``, the node where the (page-aligned)
            key ends, so a caller can lock what it inserted without matching it again.

        Raises:
            TypeError / ValueError: bad key, value or priority; the cache is unchanged.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if near is not None and not isinstance(near, TreeNode):
            raise TypeError(f"near must be a TreeNode or None, got {type(near).__name__}")
        if extras:
            unknown = set(extras) - {c.name for c in self._inserters}
            if unknown:
                raise ValueError(f"extras: no component takes {sorted(unknown)}")
        units, n, ns, view = self._prepare(key)
        given = len(key) if isinstance(key, RadixKey) else view.raw_len()
        tail = self._slots_given(value, units, view, n, given)
        if self.disable or n == 0:
            return InsertResult(0, self.root)
        if extras:
            for name, x in extras.items():
                if x is not None and len(x) < n:
                    raise ValueError(f"extras[{name!r}]: {len(x)} entries for {n} units")
        path, off, partial, m = self._descend(units, n, ns, near)
        start = off + m  # units cached already
        width = self.unit_bytes
        if start < n:
            leaf_key = units[start * width :] if start else units
            if tail is units:
                leaf_value = leaf_key
            elif isinstance(tail, np.ndarray):
                leaf_value = tail[start:n].tobytes()
            else:
                leaf_value = tail[start * TOKEN_BYTES : n * TOKEN_BYTES]
            if value is not None and not slots_checked:
                check_slots(leaf_value)
        if partial is not None:
            path.append(self._split(partial, m))
        off = start
        if off == n:
            self._touch(path, priority)
            if partial is not None and not self.precise:
                self._touch_lower(partial)
            if self._inserters:
                self._tell_inserted(path, None, start, n, extras)
            return InsertResult(off, path[-1])
        leaf = self._add_leaf(path, partial, leaf_key, leaf_value, ns, priority)
        if self._inserters:
            self._tell_inserted(path, leaf, start, n, extras)
        return InsertResult(off, leaf)

    def _slots_given(self, value: Any, units: bytes, view: RadixKey, n: int, given: int) -> Any:
        """An insert's slots, checked against the key's length: the key's own units when
        ``value`` is None, an int64 array as it is (packed later, only the part the tree
        lacks), anything else packed to int64 ``bytes``."""
        torch = sys.modules.get("torch")  # (a tensor exists only once torch is loaded)
        if (
            torch is not None
            and isinstance(value, torch.Tensor)
            and value.dtype == torch.int64
            and value.is_cpu
            and value.dim() == 1
        ):
            value = value.numpy()  # a view: the fast path below
        if value is None:
            return units if not view.is_bigram else view.raw_view()[:n].tobytes()
        if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
            if len(value) != given:
                raise ValueError(f"len(value) must equal len(key): got {len(value)} != {given}")
            return value
        packed = as_int64_bytes(value)
        if len(packed) != given * TOKEN_BYTES:
            raise ValueError(
                f"len(value) must equal len(key): got {len(packed) // TOKEN_BYTES} != {given}"
            )
        return packed

    def _add_leaf(
        self,
        path: list[TreeNode],
        partial: TreeNode | None,
        key: bytes,
        value: bytes,
        ns: Any,
        priority: int,
    ) -> TreeNode:
        """Hang a new leaf under the walk's last node (or merge it into that node, an
        unpinned leaf, under ``merge``), refreshing the walk; the leaf is the newest tick
        and evictable. The path loses its last node when it is merged away."""
        parent = path[-1] if path else self.root
        leaf = self._new_node(key, value, parent, ns)
        for c in self._components:
            c.new_leaf(leaf, parent)
        if path:  # the path's last node gains a child, so it needs no re-index
            self._touch(path, priority, reindex=False)
            if partial is not None and not self.precise:
                self._touch_lower(partial)
        self._clock += 1
        leaf.last_access = leaf.created = self._clock
        leaf.priority = priority
        self._evictable += len(value) >> 3
        if self.merge_chains and path and not parent.children and not parent.lock_ref:
            self._absorb(leaf, parent)
            path.pop()  # the parent's units are the leaf's now
        elif parent.children:
            parent.children[self.child_key(parent, leaf)] = leaf
        else:
            parent.children = {self.child_key(parent, leaf): leaf}
        self.order.push(leaf)
        return leaf

    def _tell_inserted(
        self, path: list[TreeNode], leaf: TreeNode | None, start: int, n: int, extras: Any
    ) -> None:
        extras = extras or {}
        for c in self._inserters:
            x = extras.get(c.name)
            c.inserted(path, leaf, start, n, x[:n] if x is not None else None)  # type: ignore[misc]

    def _absorb(self, leaf: TreeNode, parent: TreeNode) -> None:
        """Make ``leaf`` (new, not yet linked) take the place of ``parent``, an unpinned
        leaf, holding ``parent``'s units followed by its own; ``parent`` leaves the tree
        (its heap entries die with it)."""
        grand = parent.parent
        assert grand is not None
        for c in self._components:
            c.merge(leaf, parent)
        shared = parent.key_bytes is parent.value_bytes and leaf.key_bytes is leaf.value_bytes
        leaf.key_bytes = parent.key_bytes + leaf.key_bytes
        leaf.value_bytes = leaf.key_bytes if shared else parent.value_bytes + leaf.value_bytes
        leaf.parent = grand
        leaf.created, leaf.hit_count = parent.created, parent.hit_count
        leaf.priority = max(leaf.priority, parent.priority)
        grand.children[self.child_key(grand, leaf)] = leaf
        parent.parent = None
        self._num_nodes -= 1

    def detach_leaf(self, node: TreeNode, units: int | None = None) -> torch.Tensor:
        """Remove an unlocked leaf, or its last ``units`` units (whole pages), *without*
        freeing their slots, and return them: undoes an insert whose caller cannot finish
        (the slots go back to the caller, who owns them again). An insert whose units
        were merged into an existing leaf is undone with ``units`` = what it added.

        Raises:
            ValueError: ``node`` is not an unlocked leaf of this cache, or ``units`` is
                not a positive multiple of the page size up to its length; nothing
                changes.
        """
        self.path_to_root(node, "detach_leaf")
        if node is self.root or node.children or node.lock_ref:
            raise ValueError(f"detach_leaf: node {node.id} is not an unlocked leaf")
        if units is not None:
            units = as_count(units, "units")
            if not 0 < units <= len(node) or units % self.page_size:
                raise ValueError(
                    f"detach_leaf: units must be a positive multiple of page_size "
                    f"{self.page_size} up to {len(node)}, got {units}"
                )
            if units < len(node):
                self._split(node, len(node) - units)  # node keeps its identity: the tail
        for c in self._components:
            c.detach(node)
        parent = node.parent
        assert parent is not None
        del parent.children[self.child_key(parent, node)]
        if not parent.children:
            parent.children = NO_CHILDREN
        node.parent = None
        self._num_nodes -= 1
        self._evictable -= len(node.value_bytes) >> 3
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self.order.push(parent)
        for c in self._components:
            c.detached(node, parent)
        return bytes_to_tensor([node.value_bytes])

    # --- eviction ----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``min(num_tokens, evictable_size())`` tokens in the policy's order.

        Whole unlocked leaves are removed until that many are freed (SGLang's semantics:
        the last one can overshoot by up to its length). With ``precise`` the last
        one is trimmed from its tail (whole pages) instead, overshooting by less than a
        page.
        The removed slot indices go to ``allocator.free`` in a single call, made after the
        victims are chosen and before any of them is unlinked: if it raises, the tree is
        unchanged and the error propagates.

        Returns:
            The number of tokens evicted.
        """
        need = as_count(num_tokens, "num_tokens")
        if self.disable or need == 0:
            return 0
        chosen = self.order.choose(need, self.page_size, self.precise, self.root)
        if not chosen.nodes and chosen.trim is None:
            return 0  # only dead index entries were taken
        return self._remove(chosen)

    def evict_leaf(self, node: TreeNode, units: int | None = None) -> int:
        """Evict one chosen unlocked leaf: whole, or its last ``units`` (whole pages),
        for a caller with an eviction order of its own (a hybrid cache's utility).
        Frees as `evict` does (components told, one ``allocator.free``).

        Raises:
            ValueError: ``node`` is not an unlocked leaf of this cache, or ``units`` is
                not a positive multiple of the page size up to its length.
        """
        self.path_to_root(node, "evict_leaf")
        if node is self.root or node.children or node.lock_ref:
            raise ValueError(f"evict_leaf: node {node.id} is not an unlocked leaf")
        length = len(node)
        units = length if units is None else as_count(units, "units")
        if not 0 < units <= length or units % self.page_size:
            raise ValueError(f"evict_leaf: units must be whole pages in (0, {length}], "
                             f"got {units}")  # fmt: skip
        if units < length:
            return self._remove(Victims([], (node, units), [], []))
        return self._remove(Victims([node], None, [], [(node.parent,)]))

    def _remove(self, chosen: Victims) -> int:
        """Free and unlink chosen victims (see `evict`)."""
        victims, trim = chosen.nodes, chosen.trim
        freed = [v.value_bytes for v in victims]
        if trim is not None:
            node, take = trim
            freed.append(node.value_bytes[(len(node) - take) * TOKEN_BYTES :])
        slots = bytes_to_tensor(freed)
        for c in self._components:
            c.evicting(victims, trim, slots)
        if self.allocator is not None:
            try:
                self.allocator.free(slots)
            except BaseException:
                self.order.put_back(chosen.popped)
                raise
        evicted = self._unlink(victims, chosen.uncovered)
        if trim is not None:
            evicted += self._trim(*trim)
        for c in self._components:
            c.evicted(victims, trim)
        self._evictable -= evicted
        return evicted

    def _unlink(self, victims: list[TreeNode], uncovered: list[Any]) -> int:
        """Take the victims out of the tree; index the parents left childless. Returns
        the tokens they held."""
        root, step = self.root, self.page_size * self.unit_bytes
        evicted = 0
        for node in victims:
            parent = node.parent
            first = node.key_bytes[:step]
            del parent.children[
                (node.extra_key, first) if parent is root and node.extra_key is not None else first
            ]
            node.parent = None
            if not parent.children:
                parent.children = NO_CHILDREN
            evicted += len(node.value_bytes) >> 3
        self._num_nodes -= len(victims)
        for entry in uncovered:  # left childless, and not victims themselves
            parent = entry[-1]
            if parent.parent is not None and not parent.children:
                self.order.push(parent)
        return evicted

    def _trim(self, node: TreeNode, take: int) -> int:
        """Cut ``take`` units from ``node``'s tail (its slots are freed)."""
        keep = (len(node.value_bytes) >> 3) - take
        shared = node.key_bytes is node.value_bytes
        node.key_bytes = node.key_bytes[: keep * self.unit_bytes]
        node.value_bytes = node.key_bytes if shared else node.value_bytes[: keep * TOKEN_BYTES]
        self.order.push(node)
        return take

    # --- components --------------------------------------------------------------------
    def add_component(self, component: TreeComponent) -> None:
        """Join a component to the tree (only while the cache is empty).

        Raises:
            TypeError: not a `TreeComponent`. ValueError: the cache holds pages, or the
                component belongs to a cache already.
        """
        if not isinstance(component, TreeComponent):
            raise TypeError(f"component must be a TreeComponent, got {type(component).__name__}")
        if self._num_nodes:
            raise ValueError("add_component: the cache must be empty (reset it first)")
        if component.index >= 0:
            raise ValueError(f"component {component.name!r} belongs to a cache already")
        self._own.append(component)
        self._set_components(self._own + self._hash_components())

    def changed(self, source: TreeComponent, node: TreeNode) -> None:
        """``source``'s data of ``node`` changed: every other component with ``heard``
        hears it (`radixkv.tree.component`). O(listeners)."""
        for c in self._listeners:
            if c is not source:
                c.heard(source, node)  # type: ignore[misc]

    def component(self, name: str) -> TreeComponent | None:
        """The component called ``name``, if the cache has one."""
        return next((c for c in self._components if c.name == name), None)

    @property
    def components(self) -> tuple[TreeComponent, ...]:
        return tuple(self._components)

    def _set_components(self, components: list[TreeComponent]) -> None:
        """Make ``components`` the cache's, in ``node.ext`` order. Ones that leave hear
        nothing more (an event component is flushed first); every node's entries follow."""
        old = self._components
        for c in old:
            if c not in components and isinstance(c, EventHashes):
                c.flush()  # the old sink hears of every page it was told would come
        keep = {id(c): i for i, c in enumerate(old)}
        for i, c in enumerate(components):
            if id(c) not in keep:
                c.attach(self, i)
            c.index = i
        self._components = components
        self._empty_ext = [c.empty for c in components]
        self._lockers = [c for c in components if c.lock is not None]
        self._limiters = [c for c in components if c.match_limit is not None]
        self._inserters = [c for c in components if c.inserted is not None]
        self._listeners = [c for c in components if c.heard is not None]
        for node in (self.root, *self.iter_nodes()):
            if components:  # a removed component's entries go; new ones start empty
                node.ext = [
                    node.ext[keep[id(c)]] if id(c) in keep and node.ext else c.empty
                    for c in components
                ]
            else:
                node.ext = None
        for c in old:
            if c not in components:
                c.index = -1

    def set_event_sink(self, sink: CacheEventSink | None) -> None:
        """Report pages entering and leaving the cache to ``sink`` (``None``: stop). Only
        while the cache is empty, so every page the sink hears of has a hash.

        Raises:
            ValueError: the cache holds pages.
        """
        if sink is not None and self._num_nodes:
            raise ValueError("set_event_sink: the cache must be empty (reset it first)")
        for name in ("stored", "removed", "cleared"):
            if sink is not None and not callable(getattr(sink, name, None)):
                raise TypeError(f"event_sink must have a {name}() method")
        self._sink = sink
        self._set_hash_components()

    def set_evict_hook(self, hook: Any) -> None:
        """Call ``hook(page_hashes, slots)`` with the pages `evict` is about to free
        (`HASH_BYTES` block hashes concatenated, and their slots in the same order), before the
        allocator reuses them: a host tier copies them out. Only while the cache is empty.

        Raises:
            ValueError: the cache holds pages.
        """
        if hook is not None and self._num_nodes:
            raise ValueError("set_evict_hook: the cache must be empty (reset it first)")
        self._evict_hook = hook
        self._set_hash_components()

    def _set_hash_components(self) -> None:
        """Which chains the nodes keep (`radixkv.tree.hashes.hash_components`): new ones
        only while empty; a chain no longer asked for leaves at any time."""
        if self._num_nodes:
            wanted = self._hash_components()
            kinds = {type(c) for c in wanted}
            now = [c for c in self._components if c in self._own or type(c) in kinds]
        else:
            now = self._own + self._hash_components()
        self._set_components(now)
        gated = self._event_gated()
        if gated is not None and not any(c.gated is gated for c in now):
            gated.event_gate(None, None)  # type: ignore[misc]  (no sink hears of it any more)

    def _event_gated(self) -> TreeComponent | None:
        """The component (of the cache's own) whose data gates what KV events tell."""
        return next((c for c in self._own if c.event_gate is not None), None)

    def _hash_components(self) -> list[TreeComponent]:
        """The chains the sink and the evict hook ask for; with a component that gates
        events (sliding-window KV: `TreeComponent.event_gate`), the sink hears only
        through its gate, which reads the chain's hashes."""
        sink, hook, gated = self._sink, self._evict_hook, self._event_gated()
        if gated is None or sink is None:
            return hash_components(sink, hook)
        strong = bool(getattr(sink, "strong_hashes", False))
        out: list[TreeComponent] = hash_components(Muted(strong), hook)
        chain = next(c for c in out if isinstance(c, BlockHashes if strong else EventHashes))
        gate = gated.event_gate(sink, chain)  # type: ignore[misc]
        return [*out, gate] if gate is not None else out

    def flush_events(self) -> None:
        """Hash the pages inserted since the last flush and report them to the event
        sink (`radixkv.tree.hashes.EventHashes.flush`, a gate's); a no-op without one."""
        for c in self._components:
            if c.tells_events:
                c.flush()

    # --- locks -------------------------------------------------------------------------
    def path_to_root(self, node: TreeNode, op: str) -> list[TreeNode]:
        """``node`` up to the root's child; ``op`` names the caller in the error."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{op}: node must be a TreeNode, got {type(node).__name__}")
        path = []
        x: TreeNode | None = node
        while x is not None and x is not self.root:
            path.append(x)
            x = x.parent
        if x is not self.root:
            raise ValueError(f"{op}: node {node.id} is not in this cache (evicted or foreign)")
        return path

    def path_values(self, node: TreeNode) -> torch.Tensor:
        """The slot indices from the root down to ``node`` (what a match ending exactly
        there returns), without touching anything. O(depth)."""
        path = self.path_to_root(node, "path_values")
        return bytes_to_tensor([x.value_bytes for x in reversed(path)])

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from ``node`` to the root; returns the change in evictable size
        (zero or negative)."""
        if self.disable:
            return 0
        delta = 0
        path = self.path_to_root(node, "inc_lock_ref")
        for x in path:
            if x.lock_ref == 0:
                delta -= len(x.value_bytes) >> 3
            x.lock_ref += 1
        self._evictable += delta
        self._protected -= delta
        if self._lockers:
            for c in self._lockers:
                c.lock(path)  # type: ignore[misc]
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock on the path from ``node`` to the root; returns the change in
        evictable size (zero or positive).

        Raises:
            ValueError: ``node`` is not locked (or not in this cache); nothing changes.
        """
        if self.disable:
            return 0
        path = self.path_to_root(node, "dec_lock_ref")
        if path and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: node {node.id} is not locked")
        delta = 0
        for x in path:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                delta += len(x.value_bytes) >> 3
                if not x.children:
                    self.order.push(x)
        self._evictable += delta
        self._protected -= delta
        if self._lockers:
            for c in self._lockers:
                c.unlock(path)  # type: ignore[misc]
        return delta

    # --- inspection --------------------------------------------------------------------
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children (iterative DFS)."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def all_values(self) -> torch.Tensor:
        """Every slot index held by the tree, as one int64 tensor (no recursion)."""
        return bytes_to_tensor([node.value_bytes for node in self.iter_nodes()])

    def format_tree(self, max_units: int = 10) -> str:
        """The tree as indented text, one node a line."""
        return inspection.format_tree(self, max_units)

    def pretty_print(self, file: IO[str] | None = None) -> None:
        """Print `format_tree` (to stdout by default)."""
        import sys

        print(self.format_tree(), file=file or sys.stdout)

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch (`radixkv.tree.inspection.check_integrity`).

        Raises:
            AssertionError: naming the first violated invariant and the node.
        """
        inspection.check_integrity(self)

    def check_locks(self, holders: Iterable[TreeNode]) -> None:
        """Every node's locks are its ``holders``' (one lock each on its path: a running
        request's last node, a pin...); `radixkv.tree.inspection.check_locks`.

        Raises:
            AssertionError: naming the first node whose locks differ.
        """
        inspection.check_locks(self, holders)
