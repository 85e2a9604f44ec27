"""`TreeNode` and `RadixCache`: a radix tree over token ids whose nodes hold KV slot indices.

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
      `radixkv.policy`): a queue of entries pushed in order (under LRU nearly all: a
      touched or new leaf has the newest key) and a binary heap for the rest; the smaller
      head of the two is the next victim. Entries are invalidated lazily: an entry is live
      when its version equals the node's ``_ver`` and the node is still an evictable leaf.
      Each change that makes a node an evictable leaf, or changes the sort key of one,
      pushes a fresh entry; the index is compacted once it holds more than twice as many
      entries as there are nodes. ``evict`` therefore costs O((k + 1) log n) for k nodes
      removed, and O(k + 1) when the queue serves them. An entry is flat,
      ``(*sort key, version, node)``, so comparisons stop at the first int (a policy's
      keys all have one length).

Invariants (all checked from scratch by ``check_integrity``):
    * every non-root node has a non-empty key, a multiple of ``page_size`` units long, and
      as many value indices as key units; its parent's dict key is its first page;
    * ``lock_ref(node) >= sum(lock_ref(child))`` (locks walk to the root);
    * ``evictable_size`` is the token count of unlocked nodes, ``protected_size`` that of
      locked ones, and their sum is ``total_size``;
    * every evictable leaf has exactly one live heap entry, holding its current sort key;
    * with an event sink of the fast kind, each node keeps its pages' event hashes, but
      for the last pages of the nodes waiting in ``_unhashed`` for `flush_events` (they
      are in the tree, each once).

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
``tests/test_sglang_diff.py`` replays operation sequences recorded from SGLang's own
``RadixCache`` (pages 1/2/4/16, EAGLE on and off, namespaces) on the default cache and
compares every prefix length, matched slot, size, lock delta and evicted slot.

Two opt-in optimizations change what a caller can observe, so they are off by default:

* ``precise=True``: radixkv's own eviction semantics. ``evict(n)`` trims the last
  victim's tail (whole pages) instead of dropping the whole leaf, so it frees ``n``
  tokens rounded up to a page; and a match or insert that ends inside a node refreshes
  the recency of the part it matched only (SGLang also refreshes the unmatched rest).
* ``merge_chains=True`` (LRU only; implies ``precise``): multi-turn chats and
  chunked prefills grow a chain one node per turn or chunk, and a walk pays a dict lookup
  and a ``memcmp`` per node. When an insert extends a leaf that nothing pins (no lock, no
  child), the new units join that leaf instead of hanging under it as a new child: the
  merged node is a fresh node that replaces the leaf (the old leaf object is detached, as
  an evicted one is, so an unlocked reference to it fails loudly instead of silently
  covering more tokens). This breaks the contract above for unlocked nodes: a node you
  hold without a lock can be merged away by any insert, so lock what you keep (radixkv's
  own lifecycle and engine do, and opt in).

Why LRU's order is exactly kept by merging: without merging, the insert touches the leaf
(tick t) and gives the new child tick t + 1; no other node can ever hold a tick between
the two, and every later walk that reaches the child touches the leaf right before it. So
the child is always evicted before the leaf, and the leaf right after it (no other leaf
can come between): the pair behaves as one node with the child's tick whose tail goes
first, which is what a precise ``evict`` does to a merged node (it trims the last victim
from its tail, whole pages). A match or insert that ends or branches inside a merged node
splits it, as it would split the leaf. The differential test (``test_tree_merge.py``) runs
the same operations with and without merging and checks every match, every evicted slot
and the sizes agree. Other policies order by ``created``, ``hit_count`` or ``priority``,
which differ along a chain, so they keep one node per insert (``merge_chains=True`` with
another policy is refused). A merged node keeps the chain's first ``created`` tick and
its ``hit_count``.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import sys
from array import array
from collections import deque
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import IO, Any, NamedTuple, Protocol

import numpy as np
import torch

from radixkv.blockhash import (
    EVENT_HASH_BYTES,
    chain_runs,
    chain_states,
    last_state,
    published,
    root_state,
)
from radixkv.key import (
    TOKEN_BYTES,
    RadixKey,
    _to_token_array,
    as_bool,
    as_count,
    common_prefix_units,
)
from radixkv.policy import get_policy

_EMPTY = b""
# every leaf shares this read-only empty mapping (an empty dict is 64 bytes a leaf)
_NO_CHILDREN: Mapping[Any, Any] = MappingProxyType({})
log = logging.getLogger("radixkv.tree")
HASH_BYTES = 16  # a page's block hash (page_hash): 128 bits
MAX_PAGE_SIZE = 1 << 16  # tokens; larger pages are a units mistake (bytes for tokens?)
# format_tree indents at most this many levels, then writes the depth as a number
_MAX_INDENT = 32


class TreeNode:
    """A node of the radix tree: a run of key units and the KV slot indices they occupy.

    Attributes:
        children: mapping from the first page of a child's key to the child (leaves share
            one read-only empty mapping; a node gets its own dict with its first child).
        parent: the parent node; ``None`` for the root and for evicted nodes.
        lock_ref: number of holders whose locked path passes through this node; a node
            with ``lock_ref > 0`` is never evicted.
        last_access: logical-clock tick of the last match/insert through this node.
        hit_count: matches and inserts through this node since it was created.
        created: logical-clock tick of creation (inherited by both halves of a split).
        priority: the highest ``priority`` any insert through this node gave.
        id: unique, increasing creation number (the final tie-break of every policy).
        extra_key: the namespace of the key this node belongs to.
    """

    __slots__ = (
        "_ehash",
        "_hashes",
        "_key",
        "_value",
        "_ver",
        "children",
        "created",
        "extra_key",
        "hit_count",
        "id",
        "last_access",
        "lock_ref",
        "parent",
        "priority",
    )

    def __init__(self, node_id: int, key: bytes = _EMPTY, value: bytes = _EMPTY) -> None:
        self.children: Mapping[Any, TreeNode] = _NO_CHILDREN  # a dict once it has one
        self.parent: TreeNode | None = None
        self._key = key
        self._value = value
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.created = 0
        self.priority = 0
        self.id = node_id
        self.extra_key: Any = None
        self._ver = 0
        self._hashes = _EMPTY  # HASH_BYTES a page: its BLAKE2b chain (tiers, private events)
        self._ehash = _EMPTY  # EVENT_HASH_BYTES a page: its event chain state (events)

    def __len__(self) -> int:
        """Number of logical units (tokens or bigram pairs) in this node."""
        return len(self._value) >> 3

    @property
    def is_bigram(self) -> bool:
        return len(self._key) == 2 * len(self._value) and len(self._value) > 0

    @property
    def key(self) -> RadixKey:
        """This node's key units as a `RadixKey` (a fresh copy)."""
        raw = np.frombuffer(self._key, dtype=np.int64)
        if self.is_bigram:
            pairs = raw.reshape(-1, 2)
            raw = np.concatenate((pairs[:, 0], pairs[-1:, 1]))
        out = array("q")
        out.frombytes(raw.tobytes())
        return RadixKey(out, self.extra_key, is_bigram=self.is_bigram)

    @property
    def value(self) -> torch.Tensor:
        """This node's slot indices as a 1-D int64 tensor (a fresh copy)."""
        return _bytes_to_tensor([self._value])

    @property
    def last_access_time(self) -> int:
        """Alias of ``last_access`` under SGLang's name (a logical tick, not seconds)."""
        return self.last_access

    @property
    def evicted(self) -> bool:
        """True once the node has been removed from its tree (root never is)."""
        return self.parent is None and self.id != 0

    def __repr__(self) -> str:
        keys = np.frombuffer(self._key, dtype=np.int64)[:10].tolist()
        more = "..." if len(self._key) > 80 else ""
        return (
            f"TreeNode(id={self.id}, len={len(self)}, lock_ref={self.lock_ref}, key={keys}{more})"
        )


class CacheEventSink(Protocol):
    """Receives the pages (blocks) entering and leaving a cache (see `radixkv.events`).

    ``block_hashes`` chain page by page: each names its whole prefix and namespace (the
    fast chain of `radixkv.blockhash`; BLAKE2b `page_hash` for a sink whose
    ``strong_hashes`` is true). ``token_ids`` are the pages' tokens, in order (under
    EAGLE, the first token of each bigram unit): a list, or a read-only int64 array for
    a sink whose ``arrays`` is true (its ``block_hashes`` are then a uint64 array too).
    A sink with ``attach(flush)`` hears of stored pages when it calls ``flush``
    (`RadixCache.flush_events`), all of them in one batch."""

    def stored(
        self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
        block_size: int, extra_key: Any,
    ) -> None: ...  # fmt: skip

    def removed(self, block_hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


def page_hash(parent: bytes | None, extra_key: Any, page: bytes) -> bytes:
    """The block hash of a page, `HASH_BYTES` long: BLAKE2b-128 over the parent's hash
    (or, for a first page, the namespace's ``repr``) and the page's packed units, so it
    names the page's whole prefix. Collision-resistant (128 bits: a shared store keys
    pages by it), and deterministic across processes and machines (Python's ``hash`` is
    salted per process). KV events carry its first 8 bytes as vLLM's 64-bit integer."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else b"root:" + repr(extra_key).encode())
    h.update(page)
    return h.digest()


def chain_hashes(tokens: Any, extra_key: Any, page_size: int, n_pages: int) -> list[bytes]:
    """The block hashes (`page_hash`) a cache gives the first ``n_pages`` whole pages of
    ``tokens`` (token ids, not an EAGLE bigram view) in namespace ``extra_key``: what a
    tier keys the store by and a router compares with hash-only KV events."""
    raw = RadixKey(tokens).unit_bytes()
    step = page_size * TOKEN_BYTES
    out, prev = [], None
    for i in range(n_pages):
        prev = page_hash(prev, extra_key, raw[i * step : (i + 1) * step])
        out.append(prev)
    return out


def _hash_ints(hashes: bytes) -> list[int]:
    """The event wire's 64-bit block hashes: the first 8 bytes of each page's hash."""
    return [int.from_bytes(hashes[i : i + 8], "big") for i in range(0, len(hashes), HASH_BYTES)]


class MatchResult(NamedTuple):
    """Result of `RadixCache.match_prefix`.

    Attributes:
        indices: 1-D int64 CPU tensor of the cached prefix's slot indices.
        last_node: the node where the match ends (lock it to keep the prefix).
        prefix_len: number of logical units matched (``len(indices)``).
    """

    indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int


class InsertResult(NamedTuple):
    """Result of `RadixCache.insert_node`.

    Attributes:
        prefix_len: leading units that were cached before the call.
        last_node: the node where the inserted key ends.
    """

    prefix_len: int
    last_node: TreeNode


def _bytes_to_tensor(parts: list[bytes]) -> torch.Tensor:
    """Concatenate packed int64 chunks into one 1-D int64 tensor (one copy)."""
    buf = bytearray().join(parts)
    if not buf:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


def _check_slots(packed: bytes) -> None:
    """Slot indices a node would store must be distinct and non-negative (a negative or
    repeated slot would alias another token's KV)."""
    slots = np.frombuffer(packed, dtype=np.int64)
    if len(slots) == 1:
        if slots[0] < 0:
            raise ValueError(f"value holds a negative slot index {int(slots[0])}")
        return
    if slots[0] >= 0 and (slots[1:] > slots[:-1]).all():
        return  # increasing from a non-negative start: distinct, O(k) (the common case)
    ordered = np.sort(slots)
    if ordered[0] < 0:
        raise ValueError(f"value holds a negative slot index {int(ordered[0])}")
    if (ordered[1:] == ordered[:-1]).any():
        dup = ordered[1:][ordered[1:] == ordered[:-1]][0]
        raise ValueError(f"value holds slot index {int(dup)} twice")


def as_int64_bytes(values: Any, name: str = "value") -> bytes:
    """Pack a 1-D sequence of integers (tensor, ndarray, array, list) as int64 bytes.

    Raises:
        TypeError: the elements are not integers.
        ValueError: the input is not 1-D.
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype == torch.int64 and values.device.type == "cpu":
            return values.numpy(force=True).tobytes()  # fast path: slot indices as given
        if values.is_floating_point() or values.is_complex():
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        return values.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    if isinstance(values, array) and values.typecode == "q":
        return values.tobytes()
    return _to_token_array(values, name).tobytes()


class RadixCache:
    """A prefix cache: the longest cached prefix of a key and the KV slots it occupies.

    Args:
        page_size: units per page; keys are truncated to whole pages and nodes split only
            at page boundaries.
        eviction_policy: one of ``lru lfu fifo mru filo priority slru``, or a custom
            sort-key function of a node (see `radixkv.policy.get_policy`).
        allocator: anything with ``free(indices: torch.Tensor)``; ``evict`` hands it the
            removed slot indices (one call per ``evict``). ``None`` drops them.
        is_eagle: key every sequence by its bigram view (EAGLE speculative decoding).
        disable: a cache that never matches and never stores.
        event_sink: reports pages stored and removed (see `CacheEventSink`).
        merge_chains: opt-in, LRU only: extend an unpinned leaf in place of adding a child
            under it (see the module docstring); an unlocked node can then be merged away.
        precise: opt-in: ``evict(n)`` trims the last victim's tail instead of
            dropping whole leaves, and a walk ending inside a node refreshes only what it
            matched. ``None`` (the default): on exactly when ``merge_chains``.

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
    ) -> None:
        page_size = as_count(page_size, "page_size")
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got {page_size}")
        if allocator is not None and not callable(getattr(allocator, "free", None)):
            raise TypeError("allocator must have a free(indices) method")
        self.is_eagle = as_bool(is_eagle, "is_eagle")
        self.disable = as_bool(disable, "disable")
        self._policy_key = get_policy(eviction_policy)
        lru = isinstance(eviction_policy, str) and eviction_policy.lower() == "lru"
        merge_chains = as_bool(merge_chains, "merge_chains")
        if merge_chains and not lru:
            raise ValueError(
                f"merge_chains keeps only LRU's eviction order; eviction_policy is "
                f"{eviction_policy!r}"
            )
        if precise is None:
            precise = merge_chains
        elif not as_bool(precise, "precise") and merge_chains:
            raise ValueError("merge_chains needs precise (a merged chain is evicted "
                             "from its tail, as its nodes would be one by one)")  # fmt: skip
        self.precise = precise
        self.merge_chains = merge_chains
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.allocator = allocator
        self._width = 2 * TOKEN_BYTES if self.is_eagle else TOKEN_BYTES
        self._sink: CacheEventSink | None = None
        self._evict_hook: Any = None
        self._hashing = False  # BLAKE2b block hashes are kept (an evict hook, private events)
        self._fast = False  # event chain states are kept (a sink of the default kind)
        self._lazy = False  # the sink asks for stored events (it has attach(flush))
        self._arrays = False  # the sink takes token ids and block hashes as arrays
        self.reset()
        self.set_event_sink(event_sink)

    # --- state -------------------------------------------------------------------------
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
        self.flush_events()  # the old sink hears of every page it was told would come
        self._sink = sink
        self._set_hashing()
        attach = getattr(sink, "attach", None)
        self._lazy = self._fast and callable(attach)
        self._arrays = bool(getattr(sink, "arrays", False))
        if self._lazy:
            attach(self.flush_events)

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
        self._set_hashing()

    def _set_hashing(self) -> None:
        """Which chains the nodes keep: the fast event hashes (`radixkv.blockhash`) for a
        sink, BLAKE2b-128 (`page_hash`) for an evict hook (store keys) and for a sink
        whose ``strong_hashes`` is true (hash-only events, where the hash is all a
        subscriber sees and must not give the tokens away)."""
        strong = bool(getattr(self._sink, "strong_hashes", False))
        self._fast = self._sink is not None and not strong
        self._hashing = self._evict_hook is not None or (self._sink is not None and strong)

    def reset(self) -> None:
        """Drop every node (without calling the allocator) and restart the clock; an
        event sink hears ``cleared``."""
        if getattr(self, "_sink", None) is not None and self._num_nodes:
            self.flush_events()  # the stream reads as if each insert had reported at once
            self._sink.cleared()
        self.root = TreeNode(0)
        self.root.lock_ref = 1  # the root is never evictable
        self._next_id = 1
        self._clock = 0
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0
        # entries (*sort key, version, node): flat, so a comparison is one int compare;
        # those pushed in order queue up in _run, the others go to the heap
        self._heap: list[tuple[Any, ...]] = []
        self._run: deque[tuple[Any, ...]] = deque()
        # nodes whose last pages have no event hashes yet and whose stored event has not
        # gone out (`flush_events`)
        self._unhashed: list[TreeNode] = []

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

    def _dict_key(self, parent: TreeNode, node: TreeNode) -> Any:
        first = node._key[: self.page_size * self._width]
        if parent is self.root and node.extra_key is not None:
            return (node.extra_key, first)
        return first

    def _new_node(self, key: bytes, value: bytes, parent: TreeNode, extra_key: Any) -> TreeNode:
        node = TreeNode(self._next_id, key, value)
        self._next_id += 1
        self._num_nodes += 1
        node.parent = parent
        node.extra_key = extra_key
        return node

    # --- the walk ----------------------------------------------------------------------
    def _descend(
        self, units: bytes, n: int, ns: Any
    ) -> tuple[list[TreeNode], int, TreeNode | None, int]:
        """Walk from the root along ``units`` without changing anything.

        Returns:
            (path of fully matched nodes, units they cover, the child where the match
            ends inside it or None, page-aligned units matched inside that child).
        """
        path: list[TreeNode] = []
        if n == 0:
            return path, 0, None, 0
        width, page = self._width, self.page_size
        first = units[: page * width]
        child = self.root.children.get(first if ns is None else (ns, first))
        off = 0
        while child is not None:
            ob = off * width
            if units.startswith(child._key, ob):
                path.append(child)
                off += len(child._value) >> 3
                if off == n:
                    break
                child = child.children.get(units[off * width : (off + page) * width])
            else:
                limit = min(n - off, len(child._value) >> 3)
                m = common_prefix_units(units, ob, child._key, width, limit)
                return path, off, child, m - m % page
        return path, off, None, 0

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` units; return the new upper node (child keeps its
        identity as the lower part, so existing references and locks stay valid)."""
        width = self._width
        parent = child.parent
        assert parent is not None
        if self._unhashed and self._pending(child):
            self.flush_events()
        shared = child._key is child._value
        upper = self._new_node(child._key[: m * width], _EMPTY, parent, child.extra_key)
        upper._value = upper._key if shared else child._value[: m * TOKEN_BYTES]
        child._key = child._key[m * width :]
        child._value = child._key if shared else child._value[m * TOKEN_BYTES :]
        if child._hashes:
            cut = m // self.page_size * HASH_BYTES
            upper._hashes, child._hashes = child._hashes[:cut], child._hashes[cut:]
        if child._ehash:
            cut = m // self.page_size * EVENT_HASH_BYTES
            upper._ehash, child._ehash = child._ehash[:cut], child._ehash[cut:]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.created = child.created
        upper.priority = child.priority
        parent.children[self._dict_key(parent, upper)] = upper
        upper.children = {child._key[: self.page_size * width]: child}
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
            self._push(last)

    def _touch_lower(self, lower: TreeNode) -> None:
        """SGLang refreshes the recency of a node a walk ends inside, before splitting it:
        its unmatched lower part too (``precise`` refreshes only what was matched)."""
        lower.last_access = self._clock
        if not lower.children and lower.lock_ref == 0:
            self._push(lower)

    # --- eviction index ----------------------------------------------------------------
    def _push(self, node: TreeNode) -> None:
        node._ver += 1
        entry = (*self._policy_key(node), node._ver, node)
        run, heap = self._run, self._heap
        if not run or entry > run[-1]:
            run.append(entry)
        else:
            heapq.heappush(heap, entry)
        if len(heap) + len(run) > 2 * self._num_nodes + 64:
            live = self._live
            self._run = deque(e for e in run if live(e))  # still in order
            heap[:] = [e for e in heap if live(e)]
            heapq.heapify(heap)

    @staticmethod
    def _live(entry: tuple[Any, ...]) -> bool:
        node = entry[-1]
        return (
            entry[-2] == node._ver
            and node.parent is not None
            and not node.children
            and node.lock_ref == 0
        )

    # --- public operations -------------------------------------------------------------
    def match_prefix(self, key: RadixKey, split: bool = True) -> MatchResult:
        """Find the longest cached prefix of ``key``.

        Args:
            key: a `RadixKey` (or a sequence of ints); truncated to whole pages.
            split: when True (the default) a match ending inside a node splits it so
                ``last_node`` is exact, and recency/hit counts are refreshed along the
                path. When False the lookup is read-only: nothing is split or touched,
                and ``last_node`` is the deepest node lying wholly inside the match.

        Returns:
            `MatchResult` (indices, last_node, prefix_len).
        """
        parts, last, n = self.match_parts(key, split)
        return MatchResult(_bytes_to_tensor(parts), last, n)

    def match_parts(self, key: RadixKey, split: bool = True) -> tuple[list[bytes], TreeNode, int]:
        """`match_prefix` without building the tensor: the matched slot indices as packed
        int64 ``bytes`` chunks (one per node on the path, in order; read-only), the last
        node and the prefix length. For callers that copy the slots somewhere anyway (a
        request's row) and so would pay for the tensor twice."""
        split = as_bool(split, "split")
        units, n, ns, _ = self._prepare(key)
        if self.disable:
            return [], self.root, 0
        path, off, partial, m = self._descend(units, n, ns)
        parts = [node._value for node in path]
        if not split:
            if partial is not None:
                parts.append(partial._value[: m * TOKEN_BYTES])
            return parts, path[-1] if path else self.root, off + m
        if partial is not None:
            upper = self._split(partial, m)
            path.append(upper)
            parts.append(upper._value)
            off += m
        if path:
            self._touch(path)
            if partial is not None and not self.precise:
                self._touch_lower(partial)
            return parts, path[-1], off
        return parts, self.root, 0

    def match_len(self, key: RadixKey) -> int:
        """Read-only hit length of ``key`` in units: no split, no recency change, no tensor.
        For schedulers and routers that only rank requests by cache hit."""
        units, n, ns, _ = self._prepare(key)
        if self.disable:
            return 0
        _, off, _, m = self._descend(units, n, ns)
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
        self, key: RadixKey, value: Any = None, priority: int = 0, *, slots_checked: bool = False
    ) -> InsertResult:
        """Cache ``key`` with slot indices ``value``, and say where it ends.

        Args:
            key: a `RadixKey` (or a sequence of ints); truncated to whole pages.
            value: slot indices, one per unit of ``key`` as given (1-D ints: tensor,
                ndarray, array or list); defaults to the token ids.
            priority: for the ``priority`` policy; nodes on the path keep the maximum.
            slots_checked: the caller vouches that ``value`` holds distinct non-negative
                slots (an allocator's, as `radixkv.lifecycle` passes): skips the
                O(k log k) check of the new slots.

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
        units, n, ns, view = self._prepare(key)
        given = len(key) if isinstance(key, RadixKey) else view.raw_len()
        if (
            isinstance(value, torch.Tensor)
            and value.dtype == torch.int64
            and value.is_cpu
            and value.dim() == 1
        ):
            value = value.numpy()  # a view: the fast path below
        if value is None:
            tail: Any = units if not view.is_bigram else view.raw_view()[:n].tobytes()
        elif type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
            tail = value  # packed below, only the part the tree does not have yet
            if len(value) != given:
                raise ValueError(f"len(value) must equal len(key): got {len(value)} != {given}")
        else:
            tail = as_int64_bytes(value)
            if len(tail) != given * TOKEN_BYTES:
                raise ValueError(
                    f"len(value) must equal len(key): got {len(tail) // TOKEN_BYTES} != {given}"
                )
        if self.disable or n == 0:
            return InsertResult(0, self.root)
        path, off, partial, m = self._descend(units, n, ns)
        start = off + m  # units cached already
        width = self._width
        if start < n:
            leaf_key = units[start * width :] if start else units
            if tail is units:
                leaf_value = leaf_key
            elif isinstance(tail, np.ndarray):
                leaf_value = tail[start:n].tobytes()
            else:
                leaf_value = tail[start * TOKEN_BYTES : n * TOKEN_BYTES]
            if value is not None and not slots_checked:
                _check_slots(leaf_value)
        if partial is not None:
            path.append(self._split(partial, m))
        off = start
        if off == n:
            self._touch(path, priority)
            if partial is not None and not self.precise:
                self._touch_lower(partial)
            return InsertResult(off, path[-1])
        parent = path[-1] if path else self.root
        leaf = self._new_node(leaf_key, leaf_value, parent, ns)
        if self._hashing or self._fast:
            self._report_stored(leaf, parent)
        if path:  # the path's last node gains a child, so it needs no re-index
            self._touch(path, priority, reindex=False)
            if partial is not None and not self.precise:
                self._touch_lower(partial)
        self._clock += 1
        leaf.last_access = leaf.created = self._clock
        leaf.priority = priority
        self._evictable += n - off
        if self.merge_chains and path and not parent.children and not parent.lock_ref:
            self._absorb(leaf, parent)
        elif parent.children:
            parent.children[self._dict_key(parent, leaf)] = leaf
        else:
            parent.children = {self._dict_key(parent, leaf): leaf}
        self._push(leaf)
        return InsertResult(off, leaf)

    def _absorb(self, leaf: TreeNode, parent: TreeNode) -> None:
        """Make ``leaf`` (new, not yet linked) take the place of ``parent``, an unpinned
        leaf, holding ``parent``'s units followed by its own; ``parent`` leaves the tree
        (its heap entries die with it)."""
        grand = parent.parent
        assert grand is not None
        shared = parent._key is parent._value and leaf._key is leaf._value
        leaf._key = parent._key + leaf._key
        leaf._value = leaf._key if shared else parent._value + leaf._value
        leaf._hashes = parent._hashes + leaf._hashes
        leaf._ehash = parent._ehash + leaf._ehash
        leaf.parent = grand
        leaf.created, leaf.hit_count = parent.created, parent.hit_count
        leaf.priority = max(leaf.priority, parent.priority)
        grand.children[self._dict_key(grand, leaf)] = leaf
        parent.parent = None
        self._num_nodes -= 1

    def _report_stored(self, leaf: TreeNode, parent: TreeNode) -> None:
        """Hash the new leaf's pages (chained from its parent's last page) and tell the
        sink, if any. Event hashes of the fast kind wait for `flush_events` when the sink
        asks for them (a whole step's inserts then hash in one batch)."""
        key, top = leaf._key, parent is self.root
        if self._hashing:
            step = self.page_size * self._width
            prev = None if top else parent._hashes[-HASH_BYTES:]
            hashes = bytearray()
            for off in range(0, len(key), step):
                prev = page_hash(prev, leaf.extra_key, key[off : off + step])
                hashes += prev
            leaf._hashes = bytes(hashes)
        if self._sink is None:
            return
        if self._fast:
            if self._unhashed and not top and self._pending(parent):
                self.flush_events()  # the leaf's chain starts at its parent's last hash
            self._unhashed.append(leaf)
            if not self._lazy:
                self.flush_events()
            return
        block_hashes = _hash_ints(leaf._hashes)
        parent_hash = None if top else _hash_ints(parent._hashes[-HASH_BYTES:])[0]
        units = np.frombuffer(key, dtype=np.int64)
        tokens = units[::2] if self.is_eagle else units
        self._sink.stored(
            block_hashes, parent_hash, tokens.tolist(), self.page_size, leaf.extra_key
        )

    def _pending(self, node: TreeNode) -> bool:
        """``node``'s last pages wait for `flush_events` (fewer event hashes than pages)."""
        pages = len(node._value) // TOKEN_BYTES // self.page_size
        return len(node._ehash) // EVENT_HASH_BYTES < pages

    def flush_events(self) -> None:
        """Hash the pages inserted since the last flush and report them to the sink, in
        the order they were inserted. All of them hash in one batch (`chain_runs`), so a
        step of many inserts pays a few numpy calls, not a few per insert. A sink with
        ``attach`` calls this before it hands its events out (`EventCollector.drain`);
        the cache calls it first whenever it needs those hashes or reports a removal, so
        the sink hears of every page in order. O(pages) and O(1) numpy calls."""
        pending = self._unhashed
        if not pending:
            return
        self._unhashed = []
        page_units = self.page_size * (self._width // TOKEN_BYTES)
        if len(pending) == 1:  # a step of one insert: ~2 µs less than gathering a batch
            key, prev, start = self._unhashed_run(pending[0])
            units = np.frombuffer(key, dtype=np.int64)
            self._tell_stored(pending[0], chain_states(units, page_units, start), units, prev)
            return
        runs = [self._unhashed_run(node) for node in pending]
        counts = [len(key) // TOKEN_BYTES // page_units for key, _, _ in runs]
        units = np.frombuffer(b"".join([key for key, _, _ in runs]), dtype=np.int64)
        states = chain_runs(units, page_units, [start for _, _, start in runs], counts)
        at = 0
        for node, (_, prev, _), n in zip(pending, runs, counts, strict=True):
            end = at + n
            self._tell_stored(node, states[at:end], units[at * page_units : end * page_units], prev)
            at = end

    def _unhashed_run(self, node: TreeNode) -> tuple[bytes, int | None, int]:
        """The key bytes of ``node``'s pages that have no event hashes yet, the hash
        before them (``None``: the first page of a namespace) and the chain state they
        continue from."""
        done = len(node._ehash) // EVENT_HASH_BYTES  # pages that came with a merge
        if done:
            prev = last_state(node._ehash)
            return node._key[done * self.page_size * self._width :], prev, prev
        parent = node.parent
        assert parent is not None, "a pending node left the tree without a flush"
        if parent is self.root:
            return node._key, None, root_state(node.extra_key)
        prev = last_state(parent._ehash)
        return node._key, prev, prev

    def _tell_stored(
        self, node: TreeNode, states: np.ndarray, units: np.ndarray, prev: int | None
    ) -> None:
        """Keep ``node``'s new event hashes and report its new pages to the sink."""
        assert self._sink is not None
        node._ehash += states.astype("<u8", copy=False).tobytes()
        tokens = units[::2] if self.is_eagle else units
        if self._arrays:
            self._sink.stored(states, prev, tokens, self.page_size, node.extra_key)
        else:
            self._sink.stored(
                states.tolist(), prev, tokens.tolist(), self.page_size, node.extra_key
            )

    def _event_hashes(self, node: TreeNode, first_page: int = 0) -> list[int]:
        """The event hashes of ``node``'s pages from ``first_page`` on."""
        if self._fast:
            return published(node._ehash[first_page * EVENT_HASH_BYTES :])
        return _hash_ints(node._hashes[first_page * HASH_BYTES :])

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
        if self._unhashed:
            self.flush_events()  # stored before removed, and every victim hashed
        page, root = self.page_size, self.root
        heap, run, pop, push = self._heap, self._run, heapq.heappop, heapq.heappush
        policy_key = self._policy_key
        popped: list[Any] = []  # entries taken off the heap: put back if the free fails
        uncovered: list[Any] = []  # parents that become leaves once their children go
        gone: dict[TreeNode, int] = {}  # parent -> its children chosen as victims
        victims: list[TreeNode] = []
        trim: tuple[TreeNode, int] | None = None
        freed: list[bytes] = []
        gone_hashes = bytearray()  # the freed pages' block hashes, in the same order
        gone_events = bytearray()  # their event chain states (a sink of the fast kind)
        hashing, precise, fast = self._hashing, self.precise, self._fast
        evicted = 0
        while need > 0:
            from_run = bool(run) and (not heap or run[0] < heap[0])  # the smaller head
            first = run[0] if from_run else heap[0] if heap else None
            if uncovered and (first is None or uncovered[0][:-2] < first[:-2]):
                node = pop(uncovered)[-1]
            elif first is not None:
                entry = run.popleft() if from_run else pop(heap)
                popped.append(entry)
                node = entry[-1]
                if entry[-2] != node._ver or node.children or node.lock_ref or node.parent is None:
                    continue
            else:
                break
            value = node._value
            length = len(value) >> 3
            if need < length and precise:  # the last victim: trim its tail (whole pages)
                take = -(-need // page) * page
                if take < length:
                    freed.append(value[(length - take) * TOKEN_BYTES :])
                    if hashing:
                        gone_hashes += node._hashes[(length - take) // page * HASH_BYTES :]
                    if fast:
                        gone_events += node._ehash[(length - take) // page * EVENT_HASH_BYTES :]
                    trim = (node, take)
                    evicted += take
                    break
            victims.append(node)
            freed.append(value)
            if hashing:
                gone_hashes += node._hashes
            if fast:
                gone_events += node._ehash
            evicted += length
            need -= length
            parent = node.parent
            left = gone[parent] = gone.get(parent, 0) + 1
            if parent is not root and left == len(parent.children) and not parent.lock_ref:
                push(uncovered, (*policy_key(parent), 0, parent))
        if freed and self._evict_hook is not None:
            try:  # best effort (a host tier copying the pages out): never blocks eviction
                self._evict_hook(bytes(gone_hashes), _bytes_to_tensor(freed))
            except Exception:
                log.exception("the evict hook failed; the pages are dropped")
        if freed and self.allocator is not None:
            try:
                self.allocator.free(_bytes_to_tensor(freed))
            except BaseException:
                for entry in popped:
                    push(heap, entry)
                raise
        step = page * self._width
        for node in victims:
            parent = node.parent
            first = node._key[:step]
            del parent.children[
                (node.extra_key, first) if parent is root and node.extra_key is not None else first
            ]
            node.parent = None
            if not parent.children:
                parent.children = _NO_CHILDREN
        self._num_nodes -= len(victims)
        for entry in uncovered:  # left childless, and not victims themselves
            parent = entry[-1]
            if parent.parent is not None and not parent.children:
                self._push(parent)
        if trim is not None:
            node, take = trim
            keep = (len(node._value) >> 3) - take
            shared = node._key is node._value
            node._key = node._key[: keep * self._width]
            node._value = node._key if shared else node._value[: keep * TOKEN_BYTES]
            if node._hashes:
                node._hashes = node._hashes[: keep // page * HASH_BYTES]
            if node._ehash:
                node._ehash = node._ehash[: keep // page * EVENT_HASH_BYTES]
            self._push(node)
        self._evictable -= evicted
        if self._sink is not None and (gone_events or gone_hashes):
            gone = published(gone_events) if fast else _hash_ints(bytes(gone_hashes))
            self._sink.removed(gone)
        return evicted

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
        self._path_to_root(node, "detach_leaf")
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
        if self._unhashed:
            self.flush_events()  # stored before removed
        parent = node.parent
        assert parent is not None
        del parent.children[self._dict_key(parent, node)]
        if not parent.children:
            parent.children = _NO_CHILDREN
        node.parent = None
        self._num_nodes -= 1
        self._evictable -= len(node._value) >> 3
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)
        if self._sink is not None:
            self._sink.removed(self._event_hashes(node))
        return _bytes_to_tensor([node._value])

    def _path_to_root(self, node: TreeNode, op: str) -> list[TreeNode]:
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
        path = self._path_to_root(node, "path_values")
        return _bytes_to_tensor([x._value for x in reversed(path)])

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from ``node`` to the root; returns the change in evictable size
        (zero or negative)."""
        if self.disable:
            return 0
        delta = 0
        for x in self._path_to_root(node, "inc_lock_ref"):
            if x.lock_ref == 0:
                delta -= len(x._value) >> 3
            x.lock_ref += 1
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock on the path from ``node`` to the root; returns the change in
        evictable size (zero or positive).

        Raises:
            ValueError: ``node`` is not locked (or not in this cache); nothing changes.
        """
        if self.disable:
            return 0
        path = self._path_to_root(node, "dec_lock_ref")
        if path and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: node {node.id} is not locked")
        delta = 0
        for x in path:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                delta += len(x._value) >> 3
                if not x.children:
                    self._push(x)
        self._evictable += delta
        self._protected -= delta
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
        return _bytes_to_tensor([node._value for node in self.iter_nodes()])

    def format_tree(self, max_units: int = 10) -> str:
        """The tree as indented text, one node a line."""
        lines = [
            f"root  total={self.total_size()} evictable={self._evictable} "
            f"protected={self._protected} nodes={self._num_nodes}"
        ]
        stack = [(c, 1) for c in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            # a deep chain would make the indentation quadratic in size: cap it
            indent = "  " * depth if depth <= _MAX_INDENT else "  " * _MAX_INDENT + f"[{depth}] "
            units = np.frombuffer(node._key, dtype=np.int64)
            if node.is_bigram:
                shown = [tuple(p) for p in units.reshape(-1, 2)[:max_units].tolist()]
            else:
                shown = units[:max_units].tolist()
            more = "..." if len(node) > max_units else ""
            ns = f" ns={node.extra_key!r}" if node.extra_key is not None else ""
            lines.append(
                f"{indent}#{node.id} len={len(node)} lock={node.lock_ref} "
                f"hits={node.hit_count}{ns} {shown}{more}"
            )
            stack.extend((c, depth + 1) for c in reversed(node.children.values()))
        return "\n".join(lines)

    def pretty_print(self, file: IO[str] | None = None) -> None:
        """Print `format_tree` (to stdout by default)."""
        print(self.format_tree(), file=file or sys.stdout)

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch.

        Raises:
            AssertionError: naming the first violated invariant and the node.
        """

        def fail(msg: str) -> None:
            raise AssertionError(f"RadixCache integrity: {msg}")

        root, page, width = self.root, self.page_size, self._width
        if root.parent is not None or root._key or root._value or root.lock_ref != 1:
            fail("root must have no parent, an empty key and lock_ref 1")
        unhashed = {id(n) for n in self._unhashed}  # their stored events wait for a flush
        if len(unhashed) != len(self._unhashed) or (unhashed and not self._fast):
            fail("a node waits twice for its event hashes, or without a sink of the fast kind")
        evictable = protected = count = 0
        evictable_leaves: dict[int, TreeNode] = {}
        seen: set[int] = {id(root)}
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for dict_key, child in node.children.items():
                where = f"node {child.id} (child of {node.id})"
                if id(child) in seen:
                    fail(f"{where} reached twice: the tree has a cycle or shared node")
                seen.add(id(child))
                if child.parent is not node:
                    fail(f"{where}: parent link points elsewhere")
                nv, nk = len(child._value), len(child._key)
                if nv == 0 or nv % TOKEN_BYTES or nk != (nv // TOKEN_BYTES) * width:
                    fail(f"{where}: key of {nk} bytes and value of {nv} bytes disagree")
                units = nv // TOKEN_BYTES
                if units % page:
                    fail(f"{where}: length {units} is not a multiple of page_size {page}")
                if dict_key != self._dict_key(node, child):
                    fail(f"{where}: stored under a dict key that is not its first page")
                if node is not root and child.extra_key != node.extra_key:
                    fail(f"{where}: namespace {child.extra_key!r} != parent's")
                if child.lock_ref < 0:
                    fail(f"{where}: negative lock_ref {child.lock_ref}")
                if max(child.last_access, child.created) > self._clock or child.hit_count < 0:
                    fail(f"{where}: statistics ahead of the clock or negative")
                if child.id >= self._next_id:
                    fail(f"{where}: id beyond the id counter")
                if self._hashing:
                    prev = node._hashes[-HASH_BYTES:] if node is not root else None
                    step = page * width
                    for j in range(0, nk, step):
                        prev = page_hash(prev, child.extra_key, child._key[j : j + step])
                        at = j // step * HASH_BYTES
                        if child._hashes[at : at + HASH_BYTES] != prev:
                            fail(f"{where}: block hash of page {j // step} is not its chain's")
                    if len(child._hashes) != units // page * HASH_BYTES:
                        got = len(child._hashes) // HASH_BYTES
                        fail(f"{where}: {got} hashes, {units // page} pages")
                if self._fast:
                    start = root_state(child.extra_key) if node is root else last_state(node._ehash)
                    units_arr = np.frombuffer(child._key, dtype=np.int64)
                    want = chain_states(units_arr, page * (width // TOKEN_BYTES), start)
                    want_bytes = want.astype("<u8", copy=False).tobytes()
                    if not want_bytes.startswith(child._ehash):
                        fail(f"{where}: event hashes are not their chain's")
                    if len(child._ehash) < len(want_bytes) and id(child) not in unhashed:
                        fail(f"{where}: pages without event hashes, and no flush pending")
                child_locks += child.lock_ref
                if child.lock_ref:
                    protected += units
                else:
                    evictable += units
                    if not child.children:
                        evictable_leaves[id(child)] = child
                count += 1
                stack.append(child)
            if node is not root and node.lock_ref < child_locks:
                fail(f"node {node.id}: lock_ref {node.lock_ref} < children's sum {child_locks}")
        if count != self._num_nodes:
            fail(f"node count {count} != recorded {self._num_nodes}")
        if not unhashed <= seen:
            fail("a node waiting for its event hashes is no longer in the tree")
        if (evictable, protected) != (self._evictable, self._protected):
            fail(
                f"sizes recomputed (evictable={evictable}, protected={protected}) != recorded "
                f"(evictable={self._evictable}, protected={self._protected})"
            )
        heap, run = self._heap, list(self._run)
        for i in range(1, len(heap)):
            if heap[i][:-1] < heap[(i - 1) >> 1][:-1]:
                fail(f"eviction heap order broken at entry {i}")
        for i in range(1, len(run)):
            if run[i][:-1] < run[i - 1][:-1]:
                fail(f"eviction queue out of order at entry {i}")
        live: dict[int, int] = {}
        for entry in heap + run:
            if self._live(entry):
                node = entry[-1]
                if id(node) not in evictable_leaves:
                    fail(f"eviction index holds node {node.id}, which is not in the tree")
                if entry[:-2] != tuple(self._policy_key(node)):
                    fail(f"eviction index holds a stale sort key for node {node.id}")
                live[id(node)] = live.get(id(node), 0) + 1
        for ident, node in evictable_leaves.items():
            if live.get(ident, 0) != 1:
                fail(f"evictable leaf {node.id} has {live.get(ident, 0)} live index entries")
