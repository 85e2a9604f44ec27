"""`KvIndex`: which worker holds which pages, built from the workers' KV events.

Keys are built from the events' token ids, never from the workers' hashes, so workers
that hash differently (radixkv, vLLM) share one index: a page's key is an interned id of
``(parent page's id, namespace, page tokens)``, so equal ids mean equal whole prefixes.
Each worker's block hashes map to those ids (``parent_block_hash`` links a stored run to
what the worker stored before).

Workers that publish block hashes only (``radixkv serve --kv-events-mode hashes``: no
token ids, no namespaces) are indexed by their hashes instead: a page's key is
``("hash", block hash)``, and the router computes a request's hashes the way radixkv's
cache does (`radixkv.tree.page_hash`, chained from the salt), so such a fleet must hash
alike.

``overlap(token_ids)`` walks the request's whole pages from the root and returns, per
worker, how many leading pages it holds: O(pages + workers matched).

Workers with recurrent layers (``sparse``: their cards say ``"events": "checkpoints"``)
serve a prefix only up to a state checkpoint, so their events store one block per
checkpoint, never the pages between (`radixkv.kvcache.recurrent`): such a block stands
alone, its parent is not told. Their blocks are keyed by hash (``("fast", hash)`` for
the event chain of `radixkv.hashing.fast`, ``("hash", hash)`` for hash-only events), and a
worker's overlap is the deepest page of the request whose hash it holds, not a run.

Trust: a batch is checked whole before any of it is applied (`KvIndex.validate`): the
block size must be the worker's (the fleet's, from the workers' ``/v1/models`` cards,
never set by an event), token ids must fit the blocks, hashes and namespaces must be
plain values, a batch may carry at most `MAX_BATCH_BLOCKS` blocks, and a worker may hold
at most what its card says its pool holds (``max_blocks``). A batch that fails raises
`BadBatch` naming the kind, and changes nothing.

Invariants (checked by ``check``): ``holders[id]`` contains worker ``w`` iff some block
hash of ``w`` maps to ``id``; an id is interned exactly while some worker holds it, so
the index's memory follows what the fleet holds, not everything it was ever told (ids
are never reused: a child interned under a forgotten parent id is unreachable and goes
when its own holders do).

Owns: the index and its memory bound. Must not touch: routing decisions
(`radixkv.router.core`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple

from radixkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class Lookup(NamedTuple):
    """`BlockIndex.lookup`: each worker's overlap, and the shared leading pages."""

    overlap: dict[Hashable, int]  # worker -> leading pages it holds
    shared: int  # leading pages that end where many cached pages continue


SHARED_FANOUT = 4  # continuations that make a page the end of a shared prefix
MAX_BATCH_BLOCKS = 1 << 16  # blocks one batch may store or remove (a step stores far fewer)
DEFAULT_MAX_BLOCKS = 1 << 22  # blocks a worker whose card does not say may hold
_PLAIN = (int, str, bytes)  # what a block hash or a namespace tag may be
_HASH_KINDS = ("hash", "fast")  # keys of pages known by hash alone


class BadBatch(ValueError):
    """A batch the index refuses, whole; ``kind`` names why (for counting)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class KvIndex:
    """A global prefix index over workers' KV events.

    Args:
        block_size: tokens per page, the fleet's (its workers' cards say it); a worker's
            events in another size are refused. ``None``: every batch is refused until
            it is set.
    """

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self.max_blocks: dict[Hashable, int] = {}  # per worker (its card's pool)
        self._ids: dict[tuple[int, Any, tuple[int, ...]], int] = {}
        self._keys: dict[int, Any] = {}  # id -> its key in _ids
        self._next_id = 1
        self.holders: dict[int, set[Hashable]] = {}
        self._blocks: dict[Hashable, dict[Any, int]] = {}  # worker -> its hash -> page id
        self._refs: dict[Hashable, Counter[int]] = {}  # worker -> page id -> its hashes
        self._fanout: Counter[int] = Counter()  # id -> interned pages continuing it
        self.unknown_parents = 0  # stored runs whose parent hash the index never saw
        self.hash_keyed = False  # some worker publishes hashes only
        self.sparse: set[Hashable] = set()  # workers whose blocks are checkpoints
        self._sparse_kinds: set[str] = set()  # key kinds sparse workers have stored

    # --- events -------------------------------------------------------------------------
    def validate(self, worker: Hashable, batch: KVEventBatch) -> None:
        """Check a whole batch before any of it is applied.

        Raises:
            BadBatch: naming the kind (``block_size``, ``token_count``, ``not_plain``,
                ``too_many_blocks``, ``over_capacity``, ``not_an_event``).
        """
        size = self.block_size
        if size is None:
            raise BadBatch("block_size", "the fleet's block size is not known yet")
        stored = removed = 0
        for e in batch.events:
            if isinstance(e, BlockStored):
                if e.block_size != size:
                    raise BadBatch("block_size", f"block size {e.block_size}, the fleet's {size}")
                if e.token_ids and len(e.token_ids) != size * len(e.block_hashes):
                    raise BadBatch("token_count", f"{len(e.token_ids)} token ids for "
                                   f"{len(e.block_hashes)} blocks of {size}")  # fmt: skip
                if e.parent_block_hash is not None and not isinstance(e.parent_block_hash, _PLAIN):
                    raise BadBatch("not_plain", "a parent block hash that is not a value")
                if e.extra_keys is not None and not all(
                    k is None or all(isinstance(x, _PLAIN) for x in k) for k in e.extra_keys
                ):
                    raise BadBatch("not_plain", "extra_keys that are not plain values")
                stored += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed += len(e.block_hashes)
            elif not isinstance(e, AllBlocksCleared):
                raise BadBatch("not_an_event", f"not a KV event: {type(e).__name__}")
            hashes = getattr(e, "block_hashes", ())
            if not all(isinstance(h, _PLAIN) for h in hashes):
                raise BadBatch("not_plain", "block hashes that are not values")
        if stored + removed > MAX_BATCH_BLOCKS:
            raise BadBatch("too_many_blocks", f"{stored + removed} blocks in one batch (at "
                           f"most {MAX_BATCH_BLOCKS})")  # fmt: skip
        limit = self.max_blocks.get(worker, DEFAULT_MAX_BLOCKS)
        if self.num_blocks(worker) + stored > limit + removed:
            raise BadBatch("over_capacity", f"the worker would hold over {limit} blocks, more "
                           "than its pool holds")  # fmt: skip

    def apply(self, worker: Hashable, batch: KVEventBatch) -> None:
        """Apply one batch of ``worker``'s events, in order (`validate` it first)."""
        for event in batch.events:
            self.apply_event(worker, event)

    @staticmethod
    def slices(batch: KVEventBatch, blocks: int = 1024) -> list[Any]:
        """The batch's events cut into runs of at most ``blocks`` blocks, which applied
        in order do what the batch does: a caller can release its lock between them."""
        out: list[Any] = []
        for e in batch.events:
            if isinstance(e, BlockStored) and len(e.block_hashes) > blocks:
                size, parent = e.block_size, e.parent_block_hash
                for a in range(0, len(e.block_hashes), blocks):
                    b = a + blocks
                    tokens = e.token_ids[a * size : b * size] if e.token_ids else []
                    extra = e.extra_keys[a:b] if e.extra_keys is not None else None
                    out.append(BlockStored(e.block_hashes[a:b], parent, tokens, size,
                                           extra_keys=extra))  # fmt: skip
                    parent = e.block_hashes[b - 1] if b <= len(e.block_hashes) else None
            elif isinstance(e, BlockRemoved) and len(e.block_hashes) > blocks:
                out += [BlockRemoved(e.block_hashes[a : a + blocks])
                        for a in range(0, len(e.block_hashes), blocks)]  # fmt: skip
            else:
                out.append(e)
        return out

    def apply_event(self, worker: Hashable, event: Any) -> None:
        """One event of a validated batch (a caller may release its lock between)."""
        if isinstance(event, BlockStored):
            self._stored(worker, event)
        elif isinstance(event, BlockRemoved):
            self._removed(worker, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_worker(worker)
            self._blocks[worker] = {}

    def _stored(self, worker: Hashable, e: BlockStored) -> None:
        size = e.block_size
        if worker in self.sparse:  # checkpoints: each block alone, keyed by its hash
            self._stored_hashes(worker, e, "fast" if e.token_ids else "hash")
            return
        if not e.token_ids and e.block_hashes:  # hashes only: keyed by the hash itself
            self._stored_hashes(worker, e)
            return
        blocks = self._blocks.setdefault(worker, {})
        parent = 0  # the root
        if e.parent_block_hash is not None:
            parent = blocks.get(e.parent_block_hash, -1)
            if parent < 0:  # the parent's event was lost: the run's keys cannot be known
                self.unknown_parents += 1
                return
        ns = None
        for i, block_hash in enumerate(e.block_hashes):
            if e.extra_keys is not None and i < len(e.extra_keys) and e.extra_keys[i]:
                ns = tuple(e.extra_keys[i])
            key = (
                parent,
                ns if parent == 0 else None,
                tuple(e.token_ids[i * size : (i + 1) * size]),
            )
            pid = self._intern(key)
            old = blocks.get(block_hash)
            if old != pid:
                if old is not None:
                    self._drop(worker, old)
                blocks[block_hash] = pid
                self._refs.setdefault(worker, Counter())[pid] += 1
                self.holders.setdefault(pid, set()).add(worker)
            parent = pid

    def _stored_hashes(self, worker: Hashable, e: BlockStored, kind: str = "hash") -> None:
        if worker in self.sparse:
            self._sparse_kinds.add(kind)
        else:
            self.hash_keyed = True
        blocks = self._blocks.setdefault(worker, {})
        for block_hash in e.block_hashes:
            pid = self._intern((kind, block_hash))
            if blocks.get(block_hash) != pid:
                blocks[block_hash] = pid
                self._refs.setdefault(worker, Counter())[pid] += 1
                self.holders.setdefault(pid, set()).add(worker)

    def _intern(self, key: Any) -> int:
        pid = self._ids.get(key)
        if pid is None:
            pid = self._ids[key] = self._next_id
            self._keys[pid] = key
            self._next_id += 1
            if key[0] not in _HASH_KINDS:
                self._fanout[key[0]] += 1
        return pid

    def _forget(self, pid: int) -> None:
        """Nobody holds ``pid`` any more: drop it and its key."""
        del self.holders[pid]
        key = self._keys.pop(pid)
        del self._ids[key]
        if key[0] not in _HASH_KINDS:
            self._fanout[key[0]] -= 1
            if not self._fanout[key[0]]:
                del self._fanout[key[0]]

    def _removed(self, worker: Hashable, hashes: Iterable[Any]) -> None:
        blocks = self._blocks.get(worker, {})
        for h in hashes:
            pid = blocks.pop(h, None)
            if pid is not None:
                self._drop(worker, pid)

    def _drop(self, worker: Hashable, pid: int) -> None:
        """One of ``worker``'s hashes for page ``pid`` is gone."""
        refs = self._refs[worker]
        refs[pid] -= 1
        if refs[pid] > 0:
            return
        del refs[pid]
        held = self.holders[pid]
        held.discard(worker)
        if not held:
            self._forget(pid)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget everything ``worker`` holds (it left, or cleared its cache)."""
        self._blocks.pop(worker, None)
        for pid in self._refs.pop(worker, {}):
            held = self.holders[pid]
            held.discard(worker)
            if not held:
                self._forget(pid)

    # --- queries ------------------------------------------------------------------------
    def overlap(
        self, token_ids: Sequence[int], namespace: Any = None, salt: Any = None
    ) -> dict[Hashable, int]:
        """Per worker, how many leading whole pages of ``token_ids`` it holds (workers
        holding none are left out). ``namespace`` is the request's namespace as the
        events carry it (`radixkv.events.salt_tag` of its cache salt); ``salt`` the salt
        itself, which hash-only workers chain into their block hashes."""
        return self.lookup(token_ids, namespace, salt)[0]

    def lookup(self, token_ids: Sequence[int], namespace: Any = None, salt: Any = None) -> Lookup:
        """`overlap`, and how many leading pages of the request end in a page that at
        least ``SHARED_FANOUT`` cached pages continue: a prefix many prompts share (a
        system prompt), as opposed to one conversation's history (by token ids only:
        hash-keyed pages do not say what continues them)."""
        size = self.block_size
        if not size:
            return Lookup({}, 0)
        shared = 0
        ns = None if namespace is None else (namespace,)
        out: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        parent = 0
        hashes = self._request_hashes(token_ids, salt) if self.hash_keyed else None
        for i in range(len(token_ids) // size):
            key = (parent, ns if parent == 0 else None, tuple(token_ids[i * size : (i + 1) * size]))
            pid = self._ids.get(key)
            if pid is None and hashes is not None:
                pid = self._ids.get(("hash", hashes[i]))
            held = self.holders.get(pid) if pid is not None else None
            if not held:
                break
            alive = set(held) if alive is None else alive & held
            if not alive:
                break
            for w in alive:
                out[w] = i + 1
            if self._fanout.get(pid, 0) >= SHARED_FANOUT:
                shared = i + 1
            parent = pid
        if self._sparse_kinds:
            self._sparse_lookup(token_ids, salt, out, hashes)
        return Lookup(out, shared)

    def _sparse_lookup(
        self, token_ids: Sequence[int], salt: Any, out: dict, strong: list[int] | None
    ) -> None:
        """Checkpoint workers' overlaps into ``out``: per worker, the deepest page of the
        request whose hash it holds (``strong``: its BLAKE2b hashes, when computed)."""
        size = self.block_size or 1
        pages = len(token_ids) // size
        for kind in sorted(self._sparse_kinds):
            if kind == "fast":
                from radixkv.hashing.fast import event_hashes

                hashes = event_hashes(list(token_ids), salt, size, pages)
            else:
                hashes = strong if strong is not None else self._request_hashes(token_ids, salt)
            for i, h in enumerate(hashes):
                pid = self._ids.get((kind, h))
                for w in self.holders.get(pid, ()) if pid is not None else ():
                    if w in self.sparse:
                        out[w] = max(out.get(w, 0), i + 1)

    def _request_hashes(self, token_ids: Sequence[int], salt: Any) -> list[int]:
        """The 64-bit block hashes a radixkv worker gives the request's whole pages."""
        from radixkv.hashing import chain_hashes

        size = self.block_size or 1
        hashes = chain_hashes(list(token_ids), salt, size, len(token_ids) // size)
        return [int.from_bytes(h[:8], "big") for h in hashes]

    def num_blocks(self, worker: Hashable) -> int:
        return len(self._blocks.get(worker, {}))

    def check(self) -> None:
        """Recompute ``holders`` from the workers' block maps; raises AssertionError."""
        want: dict[int, set[Hashable]] = {}
        for worker, blocks in self._blocks.items():
            for pid in blocks.values():
                want.setdefault(pid, set()).add(worker)
        assert want == self.holders, "KvIndex: holders disagree with the workers' blocks"
        assert set(self._keys) == set(self.holders), "KvIndex: an id interned but not held"
        assert all(self._ids[k] == pid for pid, k in self._keys.items()), "KvIndex: keys"
        fanout = Counter(k[0] for k in self._keys.values() if k[0] not in _HASH_KINDS)
        assert fanout == self._fanout, "KvIndex: fan-out counts disagree with the keys"
