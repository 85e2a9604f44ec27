"""Shared KV stores: pages of KV that outlive one pool and one process.

The interface is prefix-shaped, like SGLang HiCache's storage backends:

    exists_prefix(keys) -> int        how many leading pages the store has
    get(keys) -> list[bytes | None]   their values (None: missing or unreadable)
    set(keys, values) -> int          write pages; how many were written

A key names a page and its whole prefix (a 128-bit chained page hash, salted with the
request's namespace) under the model's identity (`radixkv.storage.identity`: every weight
byte, config, tokenizer, dtype, layout, page size), so another model's pages, or another
tenant's, can never match. A value is one page's K and V for every layer behind a header
(format version, identity, the key's own hash, payload length, CRC-32, and with a storage
secret a keyed MAC) that is checked on every read: a page that fails the check is a miss,
counted, never used, and is written again when it is next computed.

Modules: ``page.py`` the stored value's format (header, CRC, MAC), ``base.py`` the store
interface and soft failures, ``store.py`` the
backends (`open_store`: ``memory://`` for tests, ``file:///DIR`` for one machine and
several processes with atomic renames, ``redis://`` and ``rediss://``), ``resp.py`` the
RESP client of the Redis hot paths, ``identity.py`` the model identity, ``tier.py`` the
host pool and store behind a device pool. Nothing here imports the engine, the server or
the router.

Store failures are soft: a down or full store costs a warning and a recompute, never a
crash, and a store that failed is not asked again for ``retry_s`` seconds, so it cannot
stall the engine.

Owns: the package's names and the write policies. Must not touch: the engine, the
server, the router.
"""

from radixkv.storage.base import MemoryStore, PageStore, StoreStats
from radixkv.storage.files import FileStore
from radixkv.storage.page import PageCodec
from radixkv.storage.store import RedisStore, open_store

# when pages reach the store (`radixkv.storage.tier`); here, so a config can name them
# without importing the tier (torch, threads)
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

__all__ = [
    "WRITE_POLICIES",
    "FileStore",
    "MemoryStore",
    "PageCodec",
    "PageStore",
    "RedisStore",
    "StoreStats",
    "open_store",
]
