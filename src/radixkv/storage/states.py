"""`StateTiers`: a recurrent model's state checkpoints below the device, in a host pool
and the shared store, beside the KV pages of `radixkv.storage.tier`.

A cached prefix helps a recurrent layer only from a checkpoint of its state
(`radixkv.kvcache.recurrent`), so the KV pages of a prefix alone are no hit on such a
model: the tiers keep the checkpoints too.

    key      the KV page key of the page a checkpoint ends (model identity + the page's
             chained hash, which names its whole prefix and namespace) + ``b"S"``
    value    the checkpoint's row (every recurrent layer's conv and SSM / DeltaNet state)
             in the page format (`PageCodec`: header, CRC, and a MAC with a storage
             secret) under a state variant of the identity that names the row layout,
             so a state is never read as a KV page, nor one model's state as another's
    write    ``write_through`` (and ``_selective``): each checkpoint when it is made;
             ``write_back``: when it leaves the last tier above the store
    host     ``host_states`` checkpoints the device evicted, least recently used first
             (exclusive, as the KV's host pool: one loaded back leaves it), and at most
             as many as fit in the bytes of the KV's host pool: ``--host-tokens`` bounds
             the host memory a state tier takes too (at most that pool's bytes again;
             the device's count alone, with one budget, was the budget's bytes again)
    load     before admission: the deepest page of the prompt, beyond what the device
             can serve, whose state the host pool or the store holds; the prompt's KV is
             brought up to there (`KVTiers.load`), then the state into a checkpoint row,
             and it becomes a checkpoint of the tree, so the request starts from it.
             A state whose KV is not all there, or that fails its checks, is not used.

Invariants (``check``): every held row's key is known; the host pool holds at most
``host_states`` values, each of a row's size.

Owns: the state keys, the host pool of states, what states go to the store. Must not
touch: the tree's structure (it inserts through the engine's `RecurrentStates`), the KV
pages (`KVTiers`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from radixkv.hashing import chain_hashes
from radixkv.key import RadixKey
from radixkv.storage.page import PageCodec, PageError

STATE_SUFFIX = b"S"  # a state's key: its page's key + this
STATE_LAYOUT = "row[conv[layer][channel][kernel-1]][ssm[layer][head][key][value]]"


def state_identity(identity: bytes) -> bytes:
    """The identity states are stored under: the model's, and the row layout."""
    h = hashlib.blake2b(identity + STATE_LAYOUT.encode(), digest_size=16, person=b"rkv-states")
    return h.digest()


class StateTiers:
    """Host pool and store for state checkpoints (see the module docstring).

    Args:
        tiers: the engine's `KVTiers` (its store, writer, keys and policy).
        rows: the engine's `RecurrentStates` (``row_size``, ``row_bytes``, ``adopt``).
        cache: the engine's radix tree.
        host_states: checkpoints the host pool keeps (0: none), at most as many as
            fit in the bytes of ``tiers``' host pool of KV pages.
    """

    def __init__(self, tiers: Any, rows: Any, cache: Any, host_states: int = 0) -> None:
        if host_states < 0:
            raise ValueError(f"host_states must be >= 0, got {host_states}")
        self.tiers, self.rows, self.cache = tiers, rows, cache
        self.host_states = min(host_states, tiers.host.nbytes // rows.row_size)
        self.codec = PageCodec(state_identity(tiers.prefix), tiers.codec.secret)
        self.host: OrderedDict[bytes, bytes] = OrderedDict()  # key -> row bytes, LRU first
        self.keys: dict[int, tuple[bytes, bytes]] = {}  # row -> (key, page hash)
        self.loaded = 0  # checkpoints brought back (host or store)
        self.loaded_ahead = 0  # of them, for a session before its request
        self.host_loaded = 0
        self.bad = 0  # store values that failed their checks
        self.written = 0  # queued for the store

    def _hash(self, key: RadixKey) -> bytes:
        page = self.tiers.page
        return chain_hashes(key.token_ids, key.extra_key, page, len(key) // page)[-1]

    # --- the device makes and evicts checkpoints ----------------------------------------
    def added(self, row: int, key: RadixKey) -> None:
        """Row ``row`` became the checkpoint that ends ``key`` (page-aligned)."""
        h = self._hash(key)
        k = self.tiers.prefix + h + STATE_SUFFIX
        self.keys[row] = (k, h)
        tiers = self.tiers
        if tiers.store is not None and tiers.write_policy != "write_back" and not tiers.knows(k):
            self._write(k, h, self.rows.row_bytes(row))

    def _write(self, k: bytes, h: bytes, data: bytes) -> None:
        self.tiers.queue_values([k], [self.codec.encode(h, data)])
        self.written += 1

    def evicted(self, rows: list[int]) -> None:
        """These rows' checkpoints left the device (their contents are still there)."""
        tiers = self.tiers
        back = tiers.store is not None and tiers.write_policy == "write_back"
        for row in rows:
            entry = self.keys.pop(row, None)
            if entry is None:
                continue
            k, h = entry
            if self.host_states:
                self.host[k] = self.rows.row_bytes(row)
                self.host.move_to_end(k)
                while len(self.host) > self.host_states:
                    old, data = self.host.popitem(last=False)
                    if back and not tiers.knows(old):
                        self._write(old, old[len(tiers.prefix) : -1], data)
            elif back and not tiers.knows(k):
                self._write(k, h, self.rows.row_bytes(row))

    # --- a request arrives --------------------------------------------------------------
    loads_pages = True  # the prompt's pages up to a checkpoint (`radixkv.storage.layers`)

    def metrics(self) -> list[tuple[str, str, str, float]]:
        """Its counters for ``/metrics``: (counter or gauge, name, help, value)."""
        return [
            ("counter", "state_checkpoints_loaded", "Checkpoints brought back from the "
             "host tier or the shared store", self.loaded),
            ("counter", "state_checkpoints_loaded_ahead", "Of them, loaded for a waiting "
             "session before its request", self.loaded_ahead),
            ("gauge", "host_state_checkpoints", "Checkpoints held by the host tier",
             len(self.host)),
            ("counter", "state_checkpoints_bad", "Stored checkpoints refused: corrupt or "
             "unauthenticated", self.bad),
        ]  # fmt: skip

    def save(self, tokens: Any, ns: Any, row: int, n: int, hashes: Any, resend: int) -> None:
        """A request finished: nothing to write here (each checkpoint went down as the
        manager took it)."""

    def load(self, tokens: Any, ns: Any, usable: int, alloc: Any, ahead: bool = False) -> int:
        """Bring the deepest checkpoint of ``tokens[:usable]`` the device lacks (and the
        KV up to it) from the host pool or the store; ``ahead``: for a session before
        its request (counted apart, as `KVTiers.load` counts its pages). Returns KV
        tokens loaded."""
        tiers = self.tiers
        key = RadixKey(tokens, ns)
        _, hashes, keys, best, deeper = self._below(key, usable)
        if tiers.store is not None and deeper:
            found = tiers.store.exists([keys[j] for j in deeper])
            for j in reversed([j for j, ok in zip(deeper, found, strict=True) if ok]):
                data = self._read(keys[j], hashes[j])
                if data is not None:
                    return self._adopt(key, j, data, hashes, alloc, False, ahead)
        if best >= 0:
            return self._adopt(key, best, self.host[keys[best]], hashes, alloc, True, ahead)
        return 0

    def reach(self, tokens: Any, ns: Any, usable: int) -> int:
        """The end of the deepest checkpoint of ``tokens[:usable]`` beyond what the device
        serves that the host pool or the store holds (0: none): how far the KV must be
        loaded before a `load` serves more. Asks the store whether it holds the deeper
        ones (what it holds may still fail its checks when read)."""
        page, store = self.tiers.page, self.tiers.store
        _, _, keys, best, deeper = self._below(RadixKey(tokens, ns), usable)
        if store is not None and deeper:
            found = store.exists([keys[j] for j in deeper])
            best = max([best, *(j for j, ok in zip(deeper, found, strict=True) if ok)])
        return (best + 1) * page

    def _below(self, key: RadixKey, usable: int) -> tuple[int, list, list, int, list]:
        """What the tiers below may hold of ``key[:usable]``'s checkpoints: (pages the
        device serves, the page hashes, the state keys, the deepest page beyond them
        whose state the host pool holds or -1, the pages deeper than both)."""
        tiers, page = self.tiers, self.tiers.page
        n_pages = usable // page
        have = self.cache.match_len(key[: n_pages * page]) // page  # what the device serves
        if have >= n_pages:
            return have, [], [], -1, []
        hashes = tiers.page_hashes(key.token_ids, key.extra_key, n_pages)
        keys = [tiers.prefix + h + STATE_SUFFIX for h in hashes]
        best = max((j for j in range(have, n_pages) if keys[j] in self.host), default=-1)
        return have, hashes, keys, best, list(range(max(best, have - 1) + 1, n_pages))

    def _read(self, k: bytes, h: bytes) -> bytes | None:
        """The state stored at ``k``, checked; read only when its size is a state's
        (`PageStore.get_into`: a value of another size, a huge one planted there
        included, is refused unread)."""
        payload, header, mac = bytearray(self.rows.row_size), bytearray(), bytearray()

        def parts(_: int, length: int) -> list[memoryview] | None:
            nonlocal header, mac
            split = self.codec.value_parts(length, len(payload))
            if split is None:
                return None
            header, mac = bytearray(split[0]), bytearray(split[1])
            return [memoryview(header), memoryview(payload), memoryview(mac)]

        got = self.tiers.store.get_into([k], parts)[0]
        if got is None:
            return None
        try:
            if not got:
                raise PageError("corrupt")
            self.codec.check(h, memoryview(header), memoryview(payload), memoryview(mac))
            return bytes(payload)
        except PageError:
            self.bad += 1
            self.tiers.mark_rewrite(k)
            return None

    def _adopt(
        self, key: RadixKey, j: int, data: bytes, hashes: list[bytes], alloc: Any, host: bool,
        ahead: bool,
    ) -> int:  # fmt: skip
        """Page ``j``'s state (``hashes``: the prompt's page hashes): its KV up to
        there, then the checkpoint."""
        end = (j + 1) * self.tiers.page
        got = self.tiers.load(key.token_ids, key.extra_key, end, alloc, hashes, ahead)
        if self.cache.match_len(key[:end], full=True) < end:
            return got  # the KV is not all there: the state is no use without it
        k = self.tiers.prefix + hashes[j] + STATE_SUFFIX
        if not host:
            self.tiers.remember(k)  # the store has it: adopting it writes nothing
        if self.rows.adopt(key[:end], data, self.cache):
            self.loaded += 1
            self.loaded_ahead += ahead
            if host:
                self.host_loaded += 1
                self.host.pop(k, None)
        return got

    def check(self) -> None:
        """Raises AssertionError (see the module docstring)."""
        if len(self.host) > self.host_states:
            raise AssertionError(f"{len(self.host)} host states, at most {self.host_states}")
        if any(len(v) != self.rows.row_size for v in self.host.values()):
            raise AssertionError("a host state is not a row's size")
        if not self.keys.keys() <= self.rows.component.held.keys():
            raise AssertionError("a state key names a row that holds no checkpoint")


__all__ = ["STATE_LAYOUT", "StateTiers", "state_identity"]
