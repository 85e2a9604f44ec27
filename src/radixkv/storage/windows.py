"""`WindowTiers`: the sliding-window layers' KV pages below the device, in a host pool and
the shared store, beside the full-attention pages of `radixkv.storage.tier`.

With the sliding layers' KV in a slot space of its own (`radixkv.kvcache.window.slots`),
a cached prefix serves a match only where the window before its end is held
(`radixkv.kvcache.window.component`), so the full pages of a prefix alone are no hit: the tiers keep
window pages too, apart from the full ones.

    key      the KV page key of its page (the page's chained hash, which names its whole
             prefix and namespace) under the window variant of the model identity
    value    the window layers' K and V of the page's tokens, in the page format
             (`PageCodec`: header, CRC, a MAC with a storage secret) under that identity,
             so a window page is never read as a full one, nor one layout as another
    write    ``write_through`` (and ``_selective``): at a request's finish, the whole
             pages of its tokens whose window slots it still has (its last window and
             chunk) and the window before its prompt's resend point, which the tree
             keeps (the same prompt sent again matches up to its last whole page
             before its last token); ``write_back``: when they leave the last tier
             above the store
    host     ``host_pages`` window pages the device evicted with their nodes
             (`WindowKV.demote`), least recently used first; exclusive, as the KV's
    load     before admission, once the full pages are back (`KVTiers.load`): the
             deepest end of the prompt's full-attention match, past what the device
             serves, whose window (its last ``span`` units) is all in the host pool or
             the store: those pages come back into window slots and the tree takes
             them, so a match may end there. Pages that fail their checks are refused
             and written again when next computed.

Invariants (``check``): the host pool holds at most ``host_pages`` pages, each of a
page's size.

Owns: the window page keys, their host pool, what window pages go to the store. Must
not touch: the tree's structure (it inserts through the tree's API), the full pages
(`KVTiers`), the window slots of running requests.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from radixkv.hashing import HASH_BYTES
from radixkv.key import RadixKey
from radixkv.storage.page import PageCodec, PageError, layout_identity
from radixkv.storage.tier import gather_pages, scatter_pages

log = logging.getLogger("radixkv.storage")


class WindowTiers:
    """Host pool and store for window pages (see the module docstring).

    Args:
        tiers: the engine's `KVTiers` (its store, writer, keys, policy and identity).
        slots: the engine's `WindowSlots` (the window slot space and the tree's
            `WindowKV`).
        host_pages: window pages the host pool keeps (0: none).
    """

    def __init__(self, tiers: Any, slots: Any, host_pages: int = 0) -> None:
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        kv = tiers.kv
        self.tiers, self.slots, self.kv = tiers, slots, kv
        self.cache, self.page = tiers.cache, tiers.page
        self.window = slots.component
        self.layers = list(kv.window_layers)
        self.prefix = layout_identity(tiers.identity, f"window-layers{self.layers}")
        self.codec = PageCodec(self.prefix, tiers.codec.secret)
        self._shape = (2, len(self.layers), self.page, *kv.token_shape)
        self.page_bytes = int(np.prod(self._shape)) * kv.dtype.itemsize
        self.host_pages = host_pages
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> page, LRU first
        self.loaded = 0  # window pages brought back (host or store)
        self.loaded_ahead = 0  # of them, for a session before its request
        self.host_loaded = 0
        self.bad = 0  # store values that failed their checks
        self.written = 0  # queued for the store
        if host_pages or (tiers.store is not None and tiers.write_policy == "write_back"):
            self.window.demote = self._demote

    def _key(self, h: bytes) -> bytes:
        return self.prefix + h

    # --- writing ------------------------------------------------------------------------
    def save(
        self, tokens: Any, ns: Any, row: int, n: int, hashes: list[bytes] | None = None,
        resend: int = 0,
    ) -> None:  # fmt: skip
        """A request finished with ``n`` tokens computed (whole pages): queue the pages
        whose window slots row ``row`` still has, and those of the window before
        ``resend`` (its prompt's resend point, which the tree keeps: the same prompt
        sent again matches up to there), as the write policy says. ``hashes``: the
        pages' hashes, when the caller has them (`KVTiers.save` returns them)."""
        tiers = self.tiers
        if tiers.store is None or tiers.write_policy == "write_back":
            return
        p, table = self.page, self.slots.table[row]
        n_pages = n // p
        held = (table[: n_pages * p] >= 0).reshape(n_pages, p).all(axis=1) if n_pages else []
        first = next((j for j in range(n_pages) if held[j]), n_pages)
        if first < n_pages and not held[first:].all():
            first = n_pages  # (a row's window slots are one run up to its end)
        pages = {j: table[j * p : (j + 1) * p] for j in range(first, n_pages)}
        pages.update(self._resend_window(tokens, ns, resend, first))
        if not pages:
            return
        if hashes is None or len(hashes) < n_pages:
            hashes = tiers.page_hashes(tokens, ns, n_pages)
        order = sorted(pages)
        keys = [self._key(hashes[j]) for j in order]
        if tiers.write_policy == "write_through_selective":
            keep = [i for i, k in enumerate(keys) if tiers.seen(k) >= 2]  # (counted here)
        else:
            keep = list(range(len(keys)))
        keep = [i for i in keep if not tiers.knows(keys[i])]
        if not keep:
            return
        at = torch.from_numpy(np.concatenate([pages[order[i]] for i in keep]).astype(np.int64))
        data = gather_pages(self.kv, self.layers, at, p)
        self._write([keys[i] for i in keep], [hashes[order[i]] for i in keep], data)

    def _resend_window(self, tokens: Any, ns: Any, resend: int, first: int) -> dict:
        """The window slots the tree holds before ``resend``, by page, for the pages
        before ``first`` (the row's own run): what a resend's match end needs."""
        p, span = self.page, -(-self.window.span // self.page)
        end = resend // p
        lo = max(0, end - span)
        if end <= 0 or lo >= min(first, end):
            return {}
        hit = self.cache.match_prefix(RadixKey(tokens[: end * p], ns), full=True)
        if hit.prefix_len < end * p:
            return {}
        try:
            slots = self.window.tail_slots(hit.last_node, (end - lo) * p).numpy()
        except ValueError:  # the tree keeps no window there (evicted meanwhile)
            return {}
        return {j: slots[(j - lo) * p : (j - lo + 1) * p] for j in range(lo, min(first, end))}

    def _write(self, keys: list[bytes], hashes: list[bytes], pages: torch.Tensor) -> None:
        cpu = pages.to("cpu").contiguous().view(torch.uint8).numpy()
        values = [self.codec.encode(h, cpu[i].tobytes()) for i, h in enumerate(hashes)]
        self.tiers.queue_values(keys, values)
        self.written += len(keys)

    # --- the device evicts (WindowKV.demote) --------------------------------------------
    def _demote(self, node: Any, start: int, slots: torch.Tensor) -> None:
        """The window slots of ``node``'s units from ``start`` on are about to be freed
        (the node evicted, or its window under pressure): copy their whole pages into
        the host pool, or with ``write_back`` and no host pool to the store."""
        # the tree's BLAKE2b chain (the KV tier's evict hook's), looked up here: a sink
        # set later (KV events) rebuilds the cache's hash components
        chain = self.cache.component("block_hashes")
        if chain is None:
            return
        p = self.page
        lo = -(-start // p)  # the node's first page wholly among the freed units
        hi = (start + len(slots)) // p
        if hi <= lo:
            return
        hashes = node.ext[chain.index]
        keys = [hashes[j * HASH_BYTES : (j + 1) * HASH_BYTES] for j in range(lo, hi)]
        at = slots[lo * p - start : hi * p - start]
        data = gather_pages(self.kv, self.layers, at, p).to("cpu")
        if not self.host_pages:  # write_back with no host pool: straight to the store
            fresh = [i for i, h in enumerate(keys) if not self.tiers.knows(self._key(h))]
            if fresh:
                self._write([self._key(keys[i]) for i in fresh], [keys[i] for i in fresh],
                            data[fresh])  # fmt: skip
            return
        for h, page in zip(keys, data, strict=True):
            k = self._key(h)
            self.host[k] = page.clone()
            self.host.move_to_end(k)
        back = self.tiers.store is not None and self.tiers.write_policy == "write_back"
        while len(self.host) > self.host_pages:
            k, page = self.host.popitem(last=False)
            if back and not self.tiers.knows(k):
                self._write([k], [k[len(self.prefix) :]], page[None])

    # --- a request arrives --------------------------------------------------------------
    loads_pages = False  # after the full pages (`radixkv.storage.layers`)

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """Its counters for ``/metrics``: (counter or gauge, name, help, value)."""
        return [
            ("counter", "window_pages_loaded", "Window pages brought back from the host "
             "tier or the shared store", self.loaded),
            ("counter", "window_pages_loaded_ahead", "Of them, loaded for a waiting "
             "session before its request", self.loaded_ahead),
            ("gauge", "host_window_pages", "Window pages held by the host tier",
             len(self.host)),
            ("counter", "window_pages_bad", "Stored window pages refused: corrupt or "
             "unauthenticated", self.bad),
        ]  # fmt: skip

    def load(self, tokens: Any, ns: Any, usable: int, alloc: Any = None,
             ahead: bool = False) -> int:  # fmt: skip
        """Bring back the window of the deepest end of ``tokens[:usable]`` whose full KV
        the device holds and whose window the host pool or the store has, past what the
        device serves; ``ahead``: for a session before its request (counted apart).
        Returns the tokens that became servable. (``alloc``, the full slots' allocator,
        is not used: window slots come from the window's own.)"""
        p, cache = self.page, self.cache
        key = RadixKey(tokens, ns)
        n_pages = usable // p
        m = cache.match_parts(key[: n_pages * p], split=False)  # one read-only walk
        full, served = m.full // p, m.hit // p
        if full <= served:
            return 0
        span = -(-self.window.span // p)  # pages of window a match end needs
        hashes = self.tiers.page_hashes(tokens, ns, full)
        keys = [self._key(h) for h in hashes]
        lo = max(0, served + 1 - span)  # the first page any useful end's window starts at
        have = [k in self.host for k in keys[lo:full]]
        if self.tiers.store is not None and not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            found = self.tiers.store.exists([keys[lo + i] for i in missing])
            for i, ok in zip(missing, found, strict=True):
                have[i] = ok
        for end in range(full, served, -1):  # the deepest end whose window is all there
            first = max(0, end - span)
            if all(have[first - lo : end - lo]):
                return self._bring(key, keys, hashes, first, end, ahead)
        return 0

    def _bring(self, key: RadixKey, keys: list[bytes], hashes: list[bytes], first: int,
               end: int, ahead: bool) -> int:  # fmt: skip
        """Pages ``first .. end - 1``'s window into window slots, then into the tree (the
        full KV up to ``end`` is there); their read checked first."""
        p, cache = self.page, self.cache
        want = [j for j in range(first, end) if keys[j] not in self.host]
        read = self._read([keys[j] for j in want], [hashes[j] for j in want]) if want else []
        if any(page is None for page in read):
            return 0
        got = dict(zip(want, read, strict=True))
        pages = [got[j] if j in got else self.host[keys[j]] for j in range(first, end)]
        hit = cache.match_prefix(key[: end * p], full=True)
        if hit.prefix_len < end * p:
            return 0
        cache.inc_lock_ref(hit.last_node)  # allocating below may evict: not this path
        try:
            slots = self.slots.take((end - first) * p)
            if slots is None:
                return 0
            scatter_pages(self.kv, self.layers, slots, p, torch.stack(pages))
            given = np.full(end * p, -1, dtype=np.int64)
            given[first * p :] = slots.numpy()
            before = cache.match_len(key[: end * p])
            cache.insert_node(key[: end * p], extras={"window": given})
            taken = self.window.taken
            left = slots[~torch.from_numpy(taken[first * p : end * p].copy())]
            if len(left):  # (the tree had some of them: a window recovered in part)
                self.window.release(left)
        finally:
            cache.dec_lock_ref(hit.last_node)
        for j in range(first, end):
            if self.host.pop(keys[j], None) is not None:
                self.host_loaded += 1
            else:
                self.tiers.remember(keys[j])
        self.loaded += end - first
        self.loaded_ahead += (end - first) if ahead else 0
        return max(0, cache.match_len(key[: end * p]) - before)

    def _read(self, keys: list[bytes], hashes: list[bytes]) -> list[torch.Tensor | None]:
        """The window pages stored at ``keys`` (one store call), each checked; a value is
        read only when its size is a page's (one of another size, a huge one planted
        there included, is refused unread). ``None`` for one missing or bad."""
        if self.tiers.store is None:
            return [None] * len(keys)
        payloads = [bytearray(self.page_bytes) for _ in keys]
        headers: list[bytearray] = [bytearray() for _ in keys]
        macs: list[bytearray] = [bytearray() for _ in keys]

        def parts(i: int, length: int) -> list[memoryview] | None:
            split = self.codec.value_parts(length, self.page_bytes)
            if split is None:
                return None
            headers[i], macs[i] = bytearray(split[0]), bytearray(split[1])
            return [memoryview(headers[i]), memoryview(payloads[i]), memoryview(macs[i])]

        out: list[torch.Tensor | None] = []
        dtype = self.kv.dtype
        for i, got in enumerate(self.tiers.store.get_into(keys, parts)):
            if got is None:  # missing
                out.append(None)
                continue
            try:
                if not got:
                    raise PageError("corrupt")
                self.codec.check(hashes[i], memoryview(headers[i]), memoryview(payloads[i]),
                                 memoryview(macs[i]))  # fmt: skip
            except PageError:
                self.bad += 1
                self.tiers.mark_rewrite(keys[i])
                out.append(None)
                continue
            raw = torch.frombuffer(payloads[i], dtype=torch.uint8)
            out.append(raw.view(dtype).view(self._shape))
        return out

    def check(self) -> None:
        """Raises AssertionError (see the module docstring)."""
        if len(self.host) > self.host_pages:
            raise AssertionError(f"{len(self.host)} host window pages, at most {self.host_pages}")
        if any(t.shape != self._shape for t in self.host.values()):
            raise AssertionError("a host window page is not a page's shape")


__all__ = ["WindowTiers"]
