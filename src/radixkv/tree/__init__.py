"""The radix tree: a core that walks, splits, inserts and evicts, and components that keep
per-node data beside the full-attention KV.

    core.py        `RadixCache`: the tree's structure, slots, locks, sizes, clock,
                   eviction, and the components it hosts
    eviction.py    `EvictionOrder` (the index of evictable leaves), the eviction modes
    policy.py      the eviction policies: a sort key of a node each
    component.py   `TreeComponent`: the hooks a component hears, and its contract
    hashes.py      the two block hash chains as components (`BlockHashes`, `EventHashes`;
                   the hash functions: `radixkv.hashing`)
    inspection.py  ``check_integrity`` and ``format_tree``
    node.py        `TreeNode`, `MatchResult`, `MatchParts`, `InsertResult`

Nothing here imports the engine, the server, the router or storage.

Owns: the package's names. Must not touch: anything above the tree.
"""

from radixkv.hashing import HASH_BYTES, chain_hashes, page_hash  # (their home: radixkv.hashing)
from radixkv.tree.component import TreeComponent
from radixkv.tree.core import MAX_PAGE_SIZE, RadixCache
from radixkv.tree.eviction import EVICTION_MODES
from radixkv.tree.hashes import BlockHashes, CacheEventSink, EventHashes
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
