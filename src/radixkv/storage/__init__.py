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

Backends (`open_store`): ``memory://`` (tests), ``file:///DIR`` (one machine, several
processes; atomic renames), ``redis://`` and ``rediss://`` (redis-py, pipelined). Store
failures are soft: a down or full store costs a warning and a recompute, never a crash,
and a store that failed is not asked again for ``retry_s`` seconds, so it cannot stall
the engine.
"""

from radixkv.storage.store import (
    FileStore,
    MemoryStore,
    PageCodec,
    PageStore,
    RedisStore,
    StoreStats,
    open_store,
)

__all__ = [
    "FileStore",
    "MemoryStore",
    "PageCodec",
    "PageStore",
    "RedisStore",
    "StoreStats",
    "open_store",
]
