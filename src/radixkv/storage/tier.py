"""`KVTiers`: the device pool's KV backed by a host pool and a shared store.

    device   the KV pool and its radix tree (the engine's)
    host     ``host_pages`` pages of KV in host memory (pinned when the device is CUDA),
             LRU; pages the device tree evicts are copied here first (demotion), and a
             page loaded back leaves it (the tiers are exclusive, so device + host hold
             as much as one pool of their total size)
    store    a shared page store (`radixkv.storage.store`): Redis, a folder, memory

Before a request is admitted, the pages of its prompt the device lacks are looked for in
the host pool, then in the store; those found are copied into the KV pool and inserted
into the tree, so the request finds them cached (promotion). Write policies, as SGLang
HiCache names them, decide when pages reach the store:

    write_through            every whole page of a finished request
    write_through_selective  a page the second time a finished request carries it
    write_back               a page when it leaves the last tier above the store (the
                             host pool, or the device when there is no host pool)

Writes go through a background thread (the engine never waits on the network); reads
are synchronous (the prefill needs the data).

Keys: ``model identity (16 bytes) + page hash (16 bytes)``, the page hash chained over
the pages and salted with the namespace (`radixkv.tree.page_hash`, BLAKE2b-128), the
identity naming every byte of the weights, the config, tokenizer, dtype, page size and
KV layout (`radixkv.storage.identity`). With the sliding layers' KV apart (a slot space
of their own), a page holds the full-attention layers only, under a variant of the
identity that names them (`layout_identity`): the window layers' pages are
`radixkv.storage.windows`', and neither layout is ever read as the other.

Self-repair: the writer remembers which pages the store has, to skip asking again. A
page a read finds missing is forgotten; one it finds corrupt or unauthenticated is
forgotten and marked for rewriting (the store says it exists, but its value is bad); a
write that fails is forgotten. So the next time such a page is computed it is written
again, and a store that lost pages (a restart without persistence, ``maxmemory``
eviction) or holds bad ones heals as traffic passes.

Invariants (``check``): every host page is either free or holds exactly one key; the
host index and the free list together cover the pool once.

Owns: the host pool, what goes to the store and when, and repairing the store. Must not
touch: the tree's structure (it inserts and matches through the API, and hears evictions
through the evict hook).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import torch

from radixkv.hashing import HASH_BYTES, chain_hashes
from radixkv.key import RadixKey
from radixkv.storage import WRITE_POLICIES
from radixkv.storage.base import PageStore, StoreStats
from radixkv.storage.page import PageCodec, PageError, layout_identity
from radixkv.tree import RadixCache

log = logging.getLogger("radixkv.storage")
KNOWN_KEYS = 1 << 16  # keys remembered as stored, to skip asking the store again
STAGING_MAX_BYTES = 256 << 20  # the staging buffer a tier keeps between loads, at most
WRITE_QUEUE = 256  # page batches waiting for the writer; beyond, writes are dropped


def gather_pages(kv: Any, layers: list[int], slots: torch.Tensor, page: int) -> torch.Tensor:
    """``layers``' KV at ``slots`` (whole pages) as ``[pages, 2, layers, page, H, D]``,
    read through the pool's ``read`` (separate pools or one arena alike)."""
    n = len(slots) // page
    if not layers:  # (every layer slides: a full page holds no tensor)
        return torch.empty((n, 2, 0, page, *kv.token_shape), dtype=kv.dtype)
    shape = (n, page, *kv.token_shape)
    read = [kv.read(i, slots) for i in layers]  # per layer: K and V, [n * page, H, D]
    k = torch.stack([kl.view(shape) for kl, _ in read], dim=1)
    v = torch.stack([vl.view(shape) for _, vl in read], dim=1)
    return torch.stack((k, v), dim=1)


def scatter_pages(
    kv: Any, layers: list[int], slots: torch.Tensor, page: int, pages: torch.Tensor
) -> None:
    """Write ``[pages, 2, layers, page, H, D]`` into ``layers``' KV at ``slots``."""
    pages = pages.to(kv.device, non_blocking=True)
    for j, i in enumerate(layers):
        kv.write(i, slots, pages[:, 0, j].reshape(-1, *kv.token_shape),
                 pages[:, 1, j].reshape(-1, *kv.token_shape))  # fmt: skip


class TierStats(StoreStats):
    """Store traffic (`StoreStats`) plus the host pool's."""

    def __init__(self) -> None:
        super().__init__()
        self.host_hit_tokens = 0
        self.store_hit_tokens = 0
        self.demoted_pages = 0
        self.host_evicted_pages = 0
        self.host_load_bytes = 0
        self.host_load_s = 0.0
        self.ahead_tokens = 0  # loaded for a session before its request (`load` ahead)


class KVTiers:
    """Host pool and shared store behind a device KV pool and its tree.

    Args:
        kv: the engine's KV pool.
        cache: the device radix tree; its evictions demote to the host pool.
        fingerprint: the model's identity (`radixkv.storage.identity.model_identity`).
        store: a page store, or ``None`` (host pool only).
        host_pages: pages the host pool holds (0: none).
        write_policy: one of `WRITE_POLICIES`.
        secret: the storage secret: pages carry a MAC and unauthenticated ones are
            refused (`PageCodec`).
    """

    def __init__(
        self,
        kv: Any,
        cache: RadixCache,
        fingerprint: bytes,
        store: PageStore | None = None,
        host_pages: int = 0,
        write_policy: str = "write_through",
        secret: bytes | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        self.kv, self.cache, self.store = kv, cache, store
        self.page = cache.page_size
        self.identity = fingerprint  # the model's (window pages and states derive theirs)
        # the layers a page holds: every layer, or the full-attention ones when the
        # sliding layers' KV is apart (their pages are `radixkv.storage.windows`')
        self.layers = [i for i in range(kv.num_layers) if i not in kv.window_layers]
        if kv.window_layers:
            fingerprint = layout_identity(fingerprint, f"full-layers{self.layers}")
        self.codec = PageCodec(fingerprint, secret)
        self.prefix = fingerprint
        self.write_policy = write_policy
        self.stats = TierStats()
        self._page_shape = (2, len(self.layers), self.page, *kv.token_shape)
        self._page_bytes = int(np.prod(self._page_shape)) * kv.dtype.itemsize
        self._staging: np.ndarray | None = None  # store pages on their way to the device
        self.host_pages = host_pages
        self.host = torch.empty(
            (host_pages, *self._page_shape),
            dtype=kv.dtype,
            pin_memory=kv.device.type == "cuda",
        )
        self._host_free = list(range(host_pages - 1, -1, -1))
        self._host_index: OrderedDict[bytes, int] = OrderedDict()  # key -> page, LRU first
        self._known: OrderedDict[bytes, None] = OrderedDict()  # keys the store has
        # keys whose stored value a read found bad: written even though the store has them.
        # Shared with the writer thread, which drops a key once a write queued after the
        # mark is done; each mark has a number, so a write queued before it (which may
        # have landed before the value went bad) never drops it. Guarded by _lock.
        self._rewrite: OrderedDict[bytes, int] = OrderedDict()
        self._marks = 0
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # selective: finishes per key
        self._failed: deque[bytes] = deque()  # written by the writer, drained by save
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = None
        if store is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-writer", daemon=True)
            self._writer.start()
        if host_pages or (store is not None and write_policy == "write_back"):
            cache.set_evict_hook(self._demote)

    @property
    def errors(self) -> int:
        """Store calls that failed (down, full, timed out) and writes dropped."""
        return self.stats.errors + (self.store.stats.errors if self.store is not None else 0)

    def store_stats(self, name: str) -> int:
        """A counter of the store's own (0 without a store)."""
        return getattr(self.store.stats, name, 0) if self.store is not None else 0

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens served from below the device: host pool and store."""
        return self.stats.host_hit_tokens + self.stats.store_hit_tokens

    # --- keys ---------------------------------------------------------------------------
    def page_hashes(self, tokens: Any, ns: Any, n_pages: int) -> list[bytes]:
        return chain_hashes(tokens, ns, self.page, n_pages)

    def _key(self, h: bytes) -> bytes:
        return self.prefix + h

    # --- pages <-> pools ----------------------------------------------------------------
    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Device pages at ``slots`` (whole pages) as ``[pages, 2, layers, page, H, D]``."""
        return gather_pages(self.kv, self.layers, slots, self.page)

    def _scatter(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Write ``[pages, 2, layers, page, H, D]`` into the device at ``slots``."""
        scatter_pages(self.kv, self.layers, slots, self.page, pages)

    def _staging_pages(self, n: int) -> np.ndarray:
        """A ``[n, page bytes]`` buffer for store pages on their way to the device, kept
        between loads (up to `STAGING_MAX_BYTES`): a fresh buffer a load would fault in
        every memory page of it first (measured: 128 ms of a 687 ms, 371 MB load)."""
        size = self._page_bytes
        if n * size > STAGING_MAX_BYTES:
            return np.empty((n, size), dtype=np.uint8)  # a huge load: not kept afterwards
        if self._staging is None or len(self._staging) < n * size:
            self._staging = np.empty(n * size, dtype=np.uint8)
        return self._staging[: n * size].reshape(n, size)

    def _as_pages(self, raw: np.ndarray) -> torch.Tensor:
        """``[n, page bytes]`` as ``[n, 2, layers, page, H, D]`` in the pool's dtype."""
        flat = torch.from_numpy(raw.reshape(-1)).view(self.kv.dtype)
        return flat.view(len(raw), *self._page_shape)

    def _read_store(self, hashes: list[bytes], keys: list[bytes]) -> np.ndarray:
        """The store's pages for ``keys`` as ``[n, page bytes]``, read straight into the
        staging buffer (`PageStore.get_into`) and checked in place: the pages up to the
        first missing or bad one. Each bad page is counted and marked, to be written
        again when it is computed."""
        assert self.store is not None
        staging = self._staging_pages(len(keys))
        headers: list[bytearray] = [bytearray() for _ in keys]
        macs: list[bytearray] = [bytearray() for _ in keys]
        size = self._page_bytes

        def parts(i: int, length: int) -> list[memoryview] | None:
            split = self.codec.value_parts(length, size)
            if split is None:
                return None
            headers[i], macs[i] = bytearray(split[0]), bytearray(split[1])
            return [memoryview(headers[i]), memoryview(staging[i]), memoryview(macs[i])]

        got = self.store.get_into(keys, parts)
        usable = 0
        for i, (h, k, read) in enumerate(zip(hashes, keys, got, strict=True)):
            ok = False
            if read:
                try:
                    self.codec.check(
                        h, memoryview(headers[i]), memoryview(staging[i]), memoryview(macs[i])
                    )
                    ok = True
                except PageError as e:
                    setattr(self.stats, e.kind, getattr(self.stats, e.kind) + 1)
            elif read is False:  # not a page of this layout (another model or format)
                self.stats.corrupt += 1
            if not ok and read is not None:
                self._mark_rewrite(k)
            if ok and usable == i:
                usable += 1
        return staging[:usable]

    # --- demotion (the device evicts) ---------------------------------------------------
    def _demote(self, hashes: bytes, slots: torch.Tensor) -> None:
        n = len(hashes) // HASH_BYTES
        if not n or len(slots) != n * self.page:
            return
        split = [hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(n)]
        keys = [self._key(h) for h in split]
        if not self.host_pages:  # write_back with no host pool: straight to the store
            self._queue_write(keys, split, self._gather(slots))
            return
        new = [i for i in range(n) if keys[i] not in self._host_index]
        for i in range(n):
            if keys[i] in self._host_index:
                self._host_index.move_to_end(keys[i])
        if not new:
            return
        new = new[-self.host_pages :]  # more than the pool holds: keep the last ones
        targets = [self._take_host_page() for _ in new]
        idx = torch.tensor(new, dtype=torch.int64)
        pages = self._gather(slots.view(n, self.page)[idx].reshape(-1))
        self.host[torch.tensor(targets)] = pages.to("cpu")
        for i, t in zip(new, targets, strict=True):
            self._host_index[keys[i]] = t
        self.stats.demoted_pages += len(new)

    def _take_host_page(self) -> int:
        if self._host_free:
            return self._host_free.pop()
        key, page = self._host_index.popitem(last=False)  # the least recently used
        self.stats.host_evicted_pages += 1
        if self.store is not None and self.write_policy == "write_back":
            h = key[len(self.prefix) :]
            self._queue_write([key], [h], self.host[page : page + 1].clone())
        return page

    # --- promotion (a request arrives) --------------------------------------------------
    def load(
        self, tokens: Any, ns: Any, usable: int, alloc: Any, hashes: list[bytes] | None = None,
        ahead: bool = False,
    ) -> int:  # fmt: skip
        """Bring the pages of ``tokens[:usable]`` that the device lacks, from the host
        pool then the store, into the pool and the tree. ``alloc(n)`` gives ``n`` slots
        or ``None`` (then nothing is loaded and nothing leaves the host pool);
        ``hashes``: the pages' `page_hashes`, when the caller has them; ``ahead``: for a
        session before its request (counted apart from the hits). Returns tokens loaded."""
        p = self.page
        key = RadixKey(tokens, ns)
        n_pages = usable // p
        hit = self.cache.match_prefix(key[: n_pages * p], full=True)  # the KV, whatever else
        have = hit.prefix_len // p
        if have >= n_pages:
            return 0
        self.cache.inc_lock_ref(hit.last_node)  # allocating below may evict: not this
        try:
            if hashes is None or len(hashes) < n_pages:
                hashes = self.page_hashes(tokens, ns, n_pages)
            return self._load_after(key, hashes[:n_pages], have, n_pages, hit.indices, alloc,
                                    ahead)  # fmt: skip
        finally:
            self.cache.dec_lock_ref(hit.last_node)

    def host_run(self, hashes: list[bytes], have: int) -> int:
        """How many of the pages ``hashes`` names (`page_hashes`) the host pool holds in a
        run from page ``have`` on (what a `load` would bring from it), looking nothing up
        in the store."""
        keys = [self._key(h) for h in hashes[have:]]
        return next((i for i, k in enumerate(keys) if k not in self._host_index), len(keys))

    def _load_after(
        self, key: RadixKey, hashes: list[bytes], have: int, n_pages: int,
        device: torch.Tensor, alloc: Any, ahead: bool,
    ) -> int:  # fmt: skip
        p = self.page
        keys = [self._key(h) for h in hashes]
        host = []
        j = have
        while j < n_pages and keys[j] in self._host_index:
            self._host_index.move_to_end(keys[j])
            host.append(self._host_index[keys[j]])
            j += 1
        t0 = time.perf_counter()
        stored = np.empty((0, self._page_bytes), dtype=np.uint8)
        if self.store is not None and j < n_pages:
            found = self.store.exists_prefix(keys[j:])
            if found:
                stored = self._read_store(hashes[j : j + found], keys[j : j + found])
            for k in keys[j + len(stored) :]:  # not (usably) in the store: forget them
                self._known.pop(k, None)
        total = len(host) + len(stored)
        if not total:
            return 0
        host_data = self.host[torch.tensor(host)].clone() if host else None  # before alloc
        slots = alloc(total * p)  # may evict, and so demote into the host pool
        if slots is None:  # nothing loaded, nothing lost: the pages stay in the host pool
            return 0
        for k in keys[have : have + len(host)]:  # exclusive: a page lives on the device or
            i = self._host_index.pop(k, None)  # in the host pool, not both (the demotion
            if i is not None:  # may have pushed it out already: its data is copied)
                self._host_free.append(i)
        if host_data is not None:
            t1 = time.perf_counter()
            self._scatter(slots[: len(host) * p], host_data)
            self.stats.host_load_s += time.perf_counter() - t1
            self.stats.host_load_bytes += host_data.numel() * host_data.element_size()
        if len(stored):
            self._scatter(slots[len(host) * p :], self._as_pages(stored))
            self.stats.pages_read += len(stored)
            self.stats.bytes_read += stored.nbytes
            self.stats.read_s += time.perf_counter() - t0
            for k in keys[j : j + len(stored)]:
                self._remember(k)
        self.cache.insert(key[: (have + total) * p], torch.cat((device[: have * p], slots)))
        if ahead:  # (not a prompt's hit: its request is yet to come)
            self.stats.ahead_tokens += total * p
        else:
            self.stats.host_hit_tokens += len(host) * p
            self.stats.store_hit_tokens += len(stored) * p
        return total * p

    # --- writing to the store -----------------------------------------------------------
    def save(self, tokens: Any, ns: Any, slots: torch.Tensor) -> list[bytes] | None:
        """A request finished: queue the whole pages of ``tokens`` (whose KV sits at
        ``slots``) that the write policy sends to the store and it lacks. Returns the
        pages' hashes when it computed them (the window pages reuse them), else
        ``None``."""
        if self.store is None or self.write_policy == "write_back":
            return None
        while self._failed:
            self._known.pop(self._failed.popleft(), None)
        p = self.page
        n_pages = len(slots) // p
        if not n_pages:
            return None
        hashes = self.page_hashes(tokens, ns, n_pages)
        keys = [self._key(h) for h in hashes]
        wanted = list(range(n_pages))
        if self.write_policy == "write_through_selective":
            wanted = [i for i in wanted if self.seen(keys[i]) >= 2]
        with self._lock:
            rewrite = {k for k in keys if k in self._rewrite}
        wanted = [i for i in wanted if keys[i] not in self._known or keys[i] in rewrite]
        if not wanted:
            return hashes
        first = wanted[0]
        present = self.store.exists_prefix(keys[first:])
        wanted = [i for i in wanted if i >= first + present or keys[i] in rewrite]
        for i in range(first, first + present):
            if keys[i] not in rewrite:
                self._remember(keys[i])
        if not wanted:
            return hashes
        idx = torch.tensor(wanted, dtype=torch.int64)
        pages = self._gather(slots.view(n_pages, p)[idx].reshape(-1))
        self._queue_write([keys[i] for i in wanted], [hashes[i] for i in wanted], pages)
        return hashes

    def seen(self, key: bytes) -> int:
        """Count one more finish carrying ``key`` (``write_through_selective``: written
        from the second); returns the count."""
        n = self._seen.get(key, 0) + 1
        self._seen[key] = n
        self._seen.move_to_end(key)
        if len(self._seen) > KNOWN_KEYS:
            self._seen.popitem(last=False)
        return n

    def _queue_write(self, keys: list[bytes], hashes: list[bytes], pages: torch.Tensor) -> None:
        if self.store is None:
            return
        # as bytes: numpy has no bfloat16
        cpu = pages.to("cpu").contiguous().view(torch.uint8).numpy()
        values = [self.codec.encode(h, cpu[i].tobytes()) for i, h in enumerate(hashes)]
        self.queue_values(keys, values)

    def queue_values(self, keys: list[bytes], values: list[bytes]) -> None:
        """Queue encoded values for the writer (KV pages, or another kind that shares
        the store: `radixkv.storage.states`); dropped and counted when the queue is full."""
        if self.store is None:
            return
        with self._lock:  # the marks this write answers: those made before it was queued
            marks = [self._rewrite.get(k) for k in keys]
        try:
            self._queue.put_nowait((keys, values, marks))
        except queue.Full:
            self.stats.errors += 1
            return
        for k in keys:
            self._remember(k)

    def knows(self, key: bytes) -> bool:
        """The store has ``key``, as far as this tier knows (and no read found it bad)."""
        if key not in self._known:
            return False
        with self._lock:
            return key not in self._rewrite

    def remember(self, key: bytes) -> None:
        """The store has ``key`` (another kind of entry's, `radixkv.storage.states`)."""
        self._remember(key)

    def mark_rewrite(self, key: bytes) -> None:
        """A read found ``key``'s value bad: write it again when it is made."""
        self._mark_rewrite(key)

    def _mark_rewrite(self, key: bytes) -> None:
        self._known.pop(key, None)
        with self._lock:
            self._marks += 1
            self._rewrite[key] = self._marks
            self._rewrite.move_to_end(key)
            if len(self._rewrite) > KNOWN_KEYS:
                self._rewrite.popitem(last=False)

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        assert self.store is not None
        while True:
            keys, values, marks = self._queue.get()
            t0 = time.perf_counter()
            n = self.store.set(keys, values)
            self.stats.pages_written += n
            self.stats.bytes_written += sum(len(v) for v in values[:n])
            self.stats.write_s += time.perf_counter() - t0
            self._failed.extend(keys[n:])
            with self._lock:  # a mark made after this write was queued stays
                for k, mark in zip(keys[:n], marks, strict=False):
                    if mark is not None and self._rewrite.get(k) == mark:
                        del self._rewrite[k]
            self._queue.task_done()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # --- inspection ---------------------------------------------------------------------
    def host_keys(self) -> dict[bytes, int]:
        return dict(self._host_index)

    def check(self) -> None:
        """The host pool's bookkeeping; raises AssertionError."""
        used = list(self._host_index.values())
        assert len(set(used)) == len(used), "a host page holds two keys"
        assert not set(used) & set(self._host_free), "a host page is both used and free"
        assert len(used) + len(self._host_free) == self.host_pages, "a host page is lost"
