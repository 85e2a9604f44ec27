"""`SharedTier`: the engine's side of a shared store (write-through).

Before a request is admitted, the pages of its prompt that the device cache lacks are
looked up in the store (``exists_prefix``), read, checked, written into the KV pool and
inserted into the radix tree, so the request finds them cached. When a request finishes,
the whole pages of its prompt and output that the store lacks are written to it by a
background thread (the engine does not wait on the network).

Keys: ``fingerprint (16 bytes) + page hash (8 bytes)``, the page hash chained over the
pages and salted with the namespace (`radixkv.tree.page_hash`), the fingerprint naming
the model's weights, dtype, page size and KV layout (`model_fingerprint`).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import torch

from radixkv.key import RadixKey
from radixkv.memory import KVPool
from radixkv.storage.store import PageCodec, PageStore
from radixkv.tree import RadixCache, page_hash

log = logging.getLogger("radixkv.storage")
KNOWN_KEYS = 1 << 16  # keys remembered as stored, to skip asking the store again
WRITE_QUEUE = 256  # pages batches waiting for the writer; beyond, writes are dropped


def model_fingerprint(model: torch.nn.Module, dtype: torch.dtype, page_size: int) -> bytes:
    """16 bytes naming what a page's bytes mean: the model's config, its weights (every
    tensor's shape and a sample of its values: the first and last 256 elements, so a
    fingerprint costs milliseconds, not a pass over gigabytes), dtype and page size."""
    h = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    h.update(repr(getattr(config, "to_dict", lambda: config)()).encode())
    h.update(f"{dtype}|page={page_size}".encode())
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(flat[:256].to("cpu", torch.float32).numpy().tobytes())
        h.update(flat[-256:].to("cpu", torch.float32).numpy().tobytes())
    return h.digest()


class SharedTier:
    """Load and save a request's pages through ``store``.

    Args:
        store: the page store.
        kv: the engine's KV pool.
        cache: the device radix tree (pages loaded are inserted there).
        fingerprint: from `model_fingerprint`.
    """

    def __init__(self, store: PageStore, kv: KVPool, cache: RadixCache, fingerprint: bytes) -> None:
        self.store, self.kv, self.cache = store, kv, cache
        self.page = cache.page_size
        self.codec = PageCodec(fingerprint)
        self.prefix = fingerprint
        self.stats = store.stats
        self.hit_tokens = 0  # prompt tokens served from the store
        self._known: OrderedDict[bytes, None] = OrderedDict()  # engine thread only
        self._failed: deque[bytes] = deque()  # written by the writer, drained by save
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kv-writer", daemon=True)
        self._writer.start()

    # --- keys ---------------------------------------------------------------------------
    def page_hashes(self, tokens: Any, ns: Any, n_pages: int) -> list[bytes]:
        raw = RadixKey(tokens).unit_bytes()
        step = self.page * 8
        out, prev = [], None
        for i in range(n_pages):
            prev = page_hash(prev, ns, raw[i * step : (i + 1) * step])
            out.append(prev)
        return out

    def _key(self, h: bytes) -> bytes:
        return self.prefix + h

    # --- pages <-> pool -----------------------------------------------------------------
    def _payload(self, slots: torch.Tensor) -> bytes:
        k = torch.stack([self.kv.k[i][slots] for i in range(self.kv.num_layers)])
        v = torch.stack([self.kv.v[i][slots] for i in range(self.kv.num_layers)])
        return torch.stack((k, v)).cpu().contiguous().numpy().tobytes()

    def _write_pool(self, slots: torch.Tensor, payloads: list[memoryview]) -> bool:
        """Write whole pages (each ``[2, layers, page, heads, dim]``) at ``slots``: one
        copy into a fresh array, then one indexed write per layer for K and for V."""
        k0 = self.kv.k[0]
        dtype = torch.empty(0, dtype=k0.dtype).numpy().dtype
        page_shape = (2, self.kv.num_layers, self.page, k0.shape[1], k0.shape[2])
        if any(len(x) != int(np.prod(page_shape)) * dtype.itemsize for x in payloads):
            return False
        flat = np.concatenate([np.frombuffer(x, dtype=dtype) for x in payloads])
        data = torch.from_numpy(flat).view(len(payloads), *page_shape).to(k0.device)
        by_page = slots.view(len(payloads), self.page)  # a 2-D index: no reshaping copy
        for i in range(self.kv.num_layers):
            self.kv.k[i][by_page] = data[:, 0, i]
            self.kv.v[i][by_page] = data[:, 1, i]
        return True

    # --- load ---------------------------------------------------------------------------
    def load(self, tokens: Any, ns: Any, usable: int, alloc: Any) -> int:
        """Bring the store's pages of ``tokens[:usable]`` that the device lacks into the
        pool and the tree. ``alloc(n)`` gives ``n`` slots or ``None``. Returns tokens
        loaded."""
        p = self.page
        key = RadixKey(tokens, ns)
        n_pages = usable // p
        have = self.cache.match_len(key[:usable]) // p
        if have >= n_pages:
            return 0
        hashes = self.page_hashes(tokens, ns, n_pages)
        t0 = time.perf_counter()
        keys = [self._key(h) for h in hashes[have:]]
        found = self.store.exists_prefix(keys)
        if not found:
            return 0
        values = self.store.get(keys[:found])
        good: list[memoryview] = []
        for h, v in zip(hashes[have : have + found], values, strict=True):
            payload = self.codec.decode(h, v)
            if payload is None:
                if v is not None:
                    self.stats.corrupt += 1
                break
            good.append(payload)
        if not good:
            return 0
        slots = alloc(len(good) * p)
        if slots is None:
            return 0
        if not self._write_pool(slots, good):  # a page of the wrong size (layout changed)
            self.stats.corrupt += 1
            self.cache.allocator.free(slots)
            return 0
        hit = self.cache.match_prefix(key[: have * p])
        end = (have + len(good)) * p
        self.cache.insert(key[:end], torch.cat((hit.indices, slots)))
        n = len(good)
        self.stats.pages_read += n
        self.stats.bytes_read += sum(len(x) for x in good)
        self.stats.read_s += time.perf_counter() - t0
        for h in hashes[have : have + n]:
            self._remember(self._key(h))
        return n * p

    # --- save ---------------------------------------------------------------------------
    def save(self, tokens: Any, ns: Any, slots: torch.Tensor) -> None:
        """Queue the whole pages of ``tokens`` (whose KV sits at ``slots``) that the
        store lacks for writing; never blocks the engine."""
        while self._failed:
            self._known.pop(self._failed.popleft(), None)
        p = self.page
        n_pages = len(slots) // p
        if not n_pages:
            return
        hashes = self.page_hashes(tokens, ns, n_pages)
        keys = [self._key(h) for h in hashes]
        first = 0
        while first < n_pages and keys[first] in self._known:
            first += 1
        if first == n_pages:
            return
        first += self.store.exists_prefix(keys[first:])
        todo = [i for i in range(first, n_pages) if keys[i] not in self._known]
        if not todo:
            return
        values = [self.codec.encode(hashes[i], self._payload(slots[i * p : (i + 1) * p]))
                  for i in todo]  # fmt: skip
        try:
            self._queue.put_nowait(([keys[i] for i in todo], values))
        except queue.Full:
            self.stats.errors += 1
            return
        for i in todo:
            self._remember(keys[i])

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            keys, values = item
            t0 = time.perf_counter()
            n = self.store.set(keys, values)
            self.stats.pages_written += n
            self.stats.bytes_written += sum(len(v) for v in values[:n])
            self.stats.write_s += time.perf_counter() - t0
            self._failed.extend(keys[n:])
            self._queue.task_done()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
