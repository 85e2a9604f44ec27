"""The cache runtime: the memory a prefix cache manages and the steps that join it to
the tree, between the tree (`radixkv.tree`) and the engine (`radixkv.engine`).

    memory.py        `TokenToKVPoolAllocator` (KV slots in whole pages), `KVPool` (the
                     K and V tensors)
    req_table.py     `ReqToTokenPool` (the running requests' rows of slots)
    lifecycle.py     `CacheManager` and `Req`: match, allocate, cache, release; the one
                     place that joins the pools and the tree
    retention.py     `Retention`: prefixes kept on request (prompt-cache retention)
    budget.py        `HybridBudget`: one byte budget over full KV, window KV and
                     recurrent-state checkpoints, and the order it evicts in
    spec.py          layer specs: what each layer type keeps (full attention, sliding
                     window, recurrent), declared by each model's config
    plan.py          `CacheConfig` (the memory knobs) and `plan_memory`: every pool's
                     size, or the one arena's, from the specs; no tensor, no device
    layer_types.py   the registry of the layer types below: each one's ``build``
    window/          the sliding-window layer type in one home: its tree component
                     (`WindowKV`), its event gate, its manager (`WindowSlots`)
    recurrent/       the recurrent layer type in one home: its tree component
                     (`StateCheckpoints`), its manager (`RecurrentStates`), its pool
                     (`StatePool`)

The engine and the simulator both drive it: `radixkv simulate`'s hybrid policies evict
through the same `HybridBudget`. Nothing here imports the engine, the server, the router
or storage.

Owns: the package's names. Must not touch: anything above it.
"""

from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import KVPool, TokenToKVPoolAllocator
from radixkv.kvcache.recurrent.pool import StatePool
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.retention import Retention
from radixkv.kvcache.spec import FullAttentionSpec, LayerSpecs, RecurrentSpec, SlidingWindowSpec
from radixkv.kvcache.window.slots import WindowSlots

__all__ = [
    "CacheManager",
    "FullAttentionSpec",
    "HybridBudget",
    "KVPool",
    "LayerSpecs",
    "RecurrentSpec",
    "Req",
    "ReqToTokenPool",
    "Retention",
    "SlidingWindowSpec",
    "StatePool",
    "TokenToKVPoolAllocator",
    "WindowSlots",
]
