"""radixkv: automatic prefix caching for LLM KV caches.

``import radixkv`` is light (no torch, no numpy): the names below load on first use, so
``from radixkv import RadixCache`` (or ``radixkv.RadixCache``) imports the tree and numpy
(torch only once a caller hands it tensors, or asks for them back), while the command
line starts without them. The engine, the simulator, the server and plotting import
from their own subpackages.

Owns: the package's public names and their lazy loading. Must not touch: anything heavy
at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    # the cache runtime (radixkv.kvcache; these lived at the package root before)
    "CacheManager": "radixkv.kvcache",
    "HybridBudget": "radixkv.kvcache",
    "KVPool": "radixkv.kvcache",
    "Req": "radixkv.kvcache",
    "ReqToTokenPool": "radixkv.kvcache",
    "Retention": "radixkv.kvcache",
    "TokenToKVPoolAllocator": "radixkv.kvcache",
    "WindowSlots": "radixkv.kvcache",
    "StatePool": "radixkv.kvcache",
    "SlidingWindowSpec": "radixkv.kvcache",
    "RecurrentSpec": "radixkv.kvcache",
    "LayerSpecs": "radixkv.kvcache",
    "FullAttentionSpec": "radixkv.kvcache",
    "RadixKey": "radixkv.key",
    "POLICIES": "radixkv.tree.policy",
    "InsertResult": "radixkv.tree",
    "MatchResult": "radixkv.tree",
    "RadixCache": "radixkv.tree",
    "TreeNode": "radixkv.tree",
}

__all__ = [
    "POLICIES",
    "CacheManager",
    "FullAttentionSpec",
    "HybridBudget",
    "InsertResult",
    "KVPool",
    "LayerSpecs",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "RecurrentSpec",
    "Req",
    "ReqToTokenPool",
    "Retention",
    "SlidingWindowSpec",
    "StatePool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "WindowSlots",
    "__version__",
]

if TYPE_CHECKING:
    from radixkv.key import RadixKey
    from radixkv.kvcache import (
        CacheManager,
        FullAttentionSpec,
        HybridBudget,
        KVPool,
        LayerSpecs,
        RecurrentSpec,
        Req,
        ReqToTokenPool,
        Retention,
        SlidingWindowSpec,
        StatePool,
        TokenToKVPoolAllocator,
        WindowSlots,
    )
    from radixkv.tree import InsertResult, MatchResult, RadixCache, TreeNode
    from radixkv.tree.policy import POLICIES


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
