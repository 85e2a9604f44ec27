"""Block hash chains as tree components, and the event sink they report to.

Two chains, two components (`radixkv.tree.component`):

(Which name a prefix gets where, and why: `radixkv.hashing`.)

* `BlockHashes`: BLAKE2b-128 a page (`radixkv.hashing.page_hash`), chained from the
  parent page. A
  shared store keys pages by it (the evict hook hands a host tier the pages it is about
  to free, hashed), and hash-only KV events publish it (a subscriber sees nothing but
  the hash, so it must not give the tokens away). Hashed as each leaf is inserted.
* `EventHashes`: the fast 64-bit chain of `radixkv.hashing.fast`, for KV events that carry
  token ids. It owns the pending nodes and `EventHashes.flush`: an insert only notes
  the new leaf; the pages of every insert since the last flush hash in one batch when
  the sink is drained (a sink with ``attach``), or at once (a sink without). It
  flushes first whenever it needs those hashes: a split or a child of a pending node,
  an eviction, a detach, a reset; so the sink always hears stored before removed.

Owns: the per-node hash bytes (``node.ext[index]``: 16 bytes a page, or 8 bytes a
page's chain state), the pending list and what the sink hears. Must not touch: the
tree's structure, locks or sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from radixkv.hashing import (
    EVENT_HASH_BYTES,
    HASH_BYTES,
    chain_runs,
    chain_states,
    hash_ints,
    last_state,
    page_hash,
    published,
    root_state,
)
from radixkv.key import TOKEN_BYTES
from radixkv.tree.component import TreeComponent

if TYPE_CHECKING:
    import torch

    from radixkv.tree.node import TreeNode

_EMPTY = b""


class CacheEventSink(Protocol):
    """Receives the pages (blocks) entering and leaving a cache (see `radixkv.events`).

    ``block_hashes`` chain page by page: each names its whole prefix and namespace (the
    fast chain of `radixkv.hashing.fast`; BLAKE2b `page_hash` for a sink whose
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


class _Chain(TreeComponent):
    """What both chains share: bytes a page per node, cut and joined with the node."""

    unit_bytes = HASH_BYTES  # per page
    empty = _EMPTY

    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        i = self.index
        data = lower.ext[i]  # type: ignore[index]
        if data:
            cut = units // self.cache.page_size * self.unit_bytes
            upper.ext[i], lower.ext[i] = data[:cut], data[cut:]  # type: ignore[index]

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        i = self.index
        leaf.ext[i] = parent.ext[i] + leaf.ext[i]  # type: ignore[index]

    def _gone(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> bytes:
        """The bytes of every page leaving the cache, victims first, then the trim."""
        i = self.index
        parts = [v.ext[i] for v in victims]  # type: ignore[index]
        if trim is not None:
            node, take = trim
            keep = (len(node) - take) // self.cache.page_size
            parts.append(node.ext[i][keep * self.unit_bytes :])  # type: ignore[index]
        return b"".join(parts)

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        if trim is not None:
            node = trim[0]
            keep = len(node) // self.cache.page_size  # already trimmed by the core
            node.ext[self.index] = node.ext[self.index][: keep * self.unit_bytes]  # type: ignore[index]


class BlockHashes(_Chain):
    """BLAKE2b-128 block hashes (`page_hash`) for every page, kept as it is inserted.

    Args:
        evict_hook: ``hook(page_hashes, slots)`` with the pages an eviction is about to
            free (hashes concatenated, slots in the same order): a host tier copies them
            out. Best effort: a hook that raises is logged and eviction goes on.
        sink: a sink of the hash-only kind (``strong_hashes``), told of every page.
    """

    name = "block_hashes"

    def __init__(self, evict_hook: Any = None, sink: CacheEventSink | None = None) -> None:
        self.evict_hook, self.sink = evict_hook, sink
        self._gone_hashes = _EMPTY

    def new_leaf(self, leaf: TreeNode, parent: TreeNode) -> None:
        cache, i = self.cache, self.index
        key, top = leaf.key_bytes, parent is cache.root
        step = cache.page_size * cache.unit_bytes
        prev = None if top else parent.ext[i][-HASH_BYTES:]  # type: ignore[index]
        hashes = bytearray()
        for off in range(0, len(key), step):
            prev = page_hash(prev, leaf.extra_key, key[off : off + step])
            hashes += prev
        leaf.ext[i] = bytes(hashes)  # type: ignore[index]
        if self.sink is not None:
            parent_hash = None if top else hash_ints(parent.ext[i][-HASH_BYTES:])[0]  # type: ignore[index]
            units = np.frombuffer(key, dtype=np.int64)
            tokens = units[::2] if cache.is_eagle else units  # an EAGLE unit's first token
            self.sink.stored(
                hash_ints(leaf.ext[i]), parent_hash, tokens.tolist(), cache.page_size,  # type: ignore[index]
                leaf.extra_key,
            )  # fmt: skip

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: torch.Tensor
    ) -> None:
        self._gone_hashes = self._gone(victims, trim)
        if self.evict_hook is not None and len(slots):
            try:  # best effort (a host tier copying the pages out): never blocks eviction
                self.evict_hook(self._gone_hashes, slots)
            except Exception:
                import logging

                logging.getLogger("radixkv.tree").exception(
                    "the evict hook failed; the pages are dropped"
                )

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        super().evicted(victims, trim)
        gone, self._gone_hashes = self._gone_hashes, _EMPTY
        if self.sink is not None and gone:
            self.sink.removed(hash_ints(gone))

    def detach(self, node: TreeNode) -> None:
        if self.sink is not None:
            self.sink.removed(hash_ints(node.ext[self.index]))  # type: ignore[index]

    def reset(self) -> None:
        if self.sink is not None and self.cache.num_nodes():
            self.sink.cleared()

    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        cache, i = self.cache, self.index
        prev = parent.ext[i][-HASH_BYTES:] if parent is not cache.root else None  # type: ignore[index]
        step = cache.page_size * cache.unit_bytes
        key, hashes = node.key_bytes, node.ext[i]  # type: ignore[index]
        for j in range(0, len(key), step):
            prev = page_hash(prev, node.extra_key, key[j : j + step])
            at = j // step * HASH_BYTES
            if hashes[at : at + HASH_BYTES] != prev:
                raise AssertionError(
                    f"node {node.id}: block hash of page {j // step} is not its chain's"
                )
        pages = len(node) // cache.page_size
        if len(hashes) != pages * HASH_BYTES:
            raise AssertionError(f"node {node.id}: {len(hashes) // HASH_BYTES} hashes, "
                                 f"{pages} pages")  # fmt: skip


class EventHashes(_Chain):
    """The fast event chain (`radixkv.hashing.fast`) of every page, for a sink of KV events
    with token ids; hashed in batches at `flush` (see the module docstring).

    Args:
        sink: the sink; one with ``attach(flush)`` gets the stored events when it asks
            (a step's inserts in one batch), one without at each insert; one whose
            ``arrays`` is true gets token ids and block hashes as arrays.
    """

    name = "event_hashes"
    unit_bytes = EVENT_HASH_BYTES
    tells_events = True

    def __init__(self, sink: CacheEventSink) -> None:
        self.sink = sink
        self.lazy = callable(getattr(sink, "attach", None))
        self.arrays = bool(getattr(sink, "arrays", False))
        # nodes whose last pages have no event hashes yet and whose stored event has not
        # gone out, in insertion order
        self.pending: list[TreeNode] = []
        self._gone_states = _EMPTY

    def attach(self, cache: Any, index: int) -> None:
        super().attach(cache, index)
        self._page_bytes = cache.page_size * TOKEN_BYTES  # a page's slots, as bytes
        if self.lazy:
            self.sink.attach(self.flush)  # type: ignore[attr-defined]

    def is_pending(self, node: TreeNode) -> bool:
        """``node``'s last pages wait for `flush` (fewer event hashes than pages)."""
        pages = len(node.value_bytes) // self._page_bytes
        return len(node.ext[self.index]) // EVENT_HASH_BYTES < pages  # type: ignore[index]

    def new_leaf(self, leaf: TreeNode, parent: TreeNode) -> None:
        if self.pending and parent.id and self.is_pending(parent):  # (the root's id is 0)
            self.flush()  # the leaf's chain starts at its parent's last hash
        self.pending.append(leaf)
        if not self.lazy:
            self.flush()

    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        if self.pending and self.is_pending(lower):
            self.flush()
        super().split(lower, upper, units)

    def flush(self) -> None:
        """Hash the pages inserted since the last flush and report them to the sink, in
        the order they were inserted. All of them hash in one batch (`chain_runs`), so a
        step of many inserts pays a few numpy calls, not a few per insert. O(pages) and
        O(1) numpy calls."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        cache = self.cache
        page_units = cache.page_size * (cache.unit_bytes // TOKEN_BYTES)
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
        cache, i = self.cache, self.index
        done = len(node.ext[i]) // EVENT_HASH_BYTES  # type: ignore[index]
        if done:  # pages that came with a merge
            prev = last_state(node.ext[i])  # type: ignore[index]
            return node.key_bytes[done * cache.page_size * cache.unit_bytes :], prev, prev
        parent = node.parent
        assert parent is not None, "a pending node left the tree without a flush"
        if parent is cache.root:
            return node.key_bytes, None, root_state(node.extra_key)
        prev = last_state(parent.ext[i])  # type: ignore[index]
        return node.key_bytes, prev, prev

    def _tell_stored(
        self, node: TreeNode, states: np.ndarray, units: np.ndarray, prev: int | None
    ) -> None:
        """Keep ``node``'s new event hashes and report its new pages to the sink."""
        node.ext[self.index] += states.astype("<u8", copy=False).tobytes()  # type: ignore[index]
        cache = self.cache
        tokens = units[::2] if cache.is_eagle else units  # an EAGLE unit's first token
        page, ns = cache.page_size, node.extra_key
        if self.arrays:
            self.sink.stored(states, prev, tokens, page, ns)  # type: ignore[arg-type]
        else:
            self.sink.stored(states.tolist(), prev, tokens.tolist(), page, ns)

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: torch.Tensor
    ) -> None:
        self.flush()  # stored before removed, and every victim hashed
        self._gone_states = self._gone(victims, trim)

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        super().evicted(victims, trim)
        gone, self._gone_states = self._gone_states, _EMPTY
        if gone:
            self.sink.removed(published(gone))

    def detach(self, node: TreeNode) -> None:
        self.flush()  # stored before removed
        self.sink.removed(published(node.ext[self.index]))  # type: ignore[index]

    def reset(self) -> None:
        if self.cache.num_nodes():
            self.flush()  # the stream reads as if each insert had reported at once
            self.sink.cleared()
        self.pending = []

    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        cache, i = self.cache, self.index
        root = cache.root
        start = root_state(node.extra_key) if parent is root else last_state(parent.ext[i])  # type: ignore[index]
        units = np.frombuffer(node.key_bytes, dtype=np.int64)
        want = chain_states(units, cache.page_size * (cache.unit_bytes // TOKEN_BYTES), start)
        want_bytes = want.astype("<u8", copy=False).tobytes()
        have = node.ext[i]  # type: ignore[index]
        if not want_bytes.startswith(have):
            raise AssertionError(f"node {node.id}: event hashes are not their chain's")
        if len(have) < len(want_bytes) and all(p is not node for p in self.pending):
            raise AssertionError(f"node {node.id}: pages without event hashes, and no "
                                 "flush pending")  # fmt: skip

    def check(self, nodes: set[int]) -> None:
        ids = {id(n) for n in self.pending}
        if len(ids) != len(self.pending):
            raise AssertionError("a node waits twice for its event hashes")
        if not ids <= nodes:
            raise AssertionError("a node waiting for its event hashes is no longer in the tree")


def hash_components(
    sink: CacheEventSink | None, evict_hook: Callable[..., Any] | None
) -> list[TreeComponent]:
    """The chains a cache keeps for an event sink and an evict hook: BLAKE2b for the
    hook (store keys) and for a hash-only sink, the fast chain for a sink with tokens."""
    strong = sink is not None and bool(getattr(sink, "strong_hashes", False))
    out: list[TreeComponent] = []
    if evict_hook is not None or strong:
        out.append(BlockHashes(evict_hook, sink if strong else None))
    if sink is not None and not strong:
        out.append(EventHashes(sink))
    return out


class Muted:
    """The chain component's sink under an event gate (`TreeComponent.event_gate`, as
    the window's `ServableBlocks`): it hears nothing; its lazy flush is the gate's to
    call."""

    def __init__(self, strong: bool = False) -> None:
        self.strong_hashes = strong

    def stored(self, *args: Any) -> None:
        pass

    def removed(self, block_hashes: Any) -> None:
        pass

    def cleared(self) -> None:
        pass

    def attach(self, flush: Any) -> None:
        pass

__all__ = ["BlockHashes", "CacheEventSink", "EventHashes", "Muted", "hash_components"]
