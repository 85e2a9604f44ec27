"""The radix tree: a core that walks, splits, inserts and evicts, and components that keep
per-node data beside the full-attention KV.

    core.py        `RadixCache`: the tree's structure, slots, locks, sizes, clock,
                   eviction, and the components it hosts
    eviction.py    `EvictionOrder` (the index of evictable leaves), the eviction modes
    component.py   `TreeComponent`: the hooks a component hears, and its contract
    hashes.py      the two block hash chains (`BlockHashes`, `EventHashes`)
    inspection.py  ``check_integrity`` and ``format_tree``
    node.py        `TreeNode`, `MatchResult`, `MatchParts`, `InsertResult`

Nothing here imports the engine, the server, the router or storage.

Owns: the package's names. Must not touch: anything above the tree.
"""

from radixkv.tree.component import TreeComponent
from radixkv.tree.core import MAX_PAGE_SIZE, RadixCache
from radixkv.tree.eviction import EVICTION_MODES
from radixkv.tree.hashes import (
    HASH_BYTES,
    BlockHashes,
    CacheEventSink,
    EventHashes,
    chain_hashes,
    page_hash,
)
from radixkv.tree.node import InsertResult, MatchParts, MatchResult, TreeNode, as_int64_bytes

__all__ = [
    "EVICTION_MODES",
    "HASH_BYTES",
    "MAX_PAGE_SIZE",
    "BlockHashes",
    "CacheEventSink",
    "EventHashes",
    "InsertResult",
    "MatchParts",
    "MatchResult",
    "RadixCache",
    "TreeComponent",
    "TreeNode",
    "as_int64_bytes",
    "chain_hashes",
    "page_hash",
]
