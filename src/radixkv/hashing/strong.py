"""Page hashes for what must not collide: BLAKE2b-128 a page, chained from the parent
page's hash (a page's hash names its whole prefix and namespace).

Owns: the strong page hash chain. Must not touch: the tree (its `BlockHashes` component
keeps these hashes per node), the store (which keys pages by them).
"""

from __future__ import annotations

import hashlib
from typing import Any

from radixkv.key import TOKEN_BYTES, RadixKey

HASH_BYTES = 16  # a page's block hash (page_hash): 128 bits


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


def hash_ints(hashes: bytes) -> list[int]:
    """The event wire's 64-bit block hashes: the first 8 bytes of each page's hash."""
    return [int.from_bytes(hashes[i : i + 8], "big") for i in range(0, len(hashes), HASH_BYTES)]
