"""`CacheMemory`: an engine's cache memory, allocated as `radixkv.kvcache.plan` sized it
from the config's memory knobs and the model's layer specs (after the machine's check),
the tiers below it, and what it reports: bytes held and evicted per kind, usage, a
summary, checks.

Two shapes, chosen by `EngineConfig` (`radixkv.kvcache.shapes` answers for each):
    one arena     ``cache_bytes`` (``cache_split="one"``): full-attention KV pages,
                  window KV pages and checkpoints draw units from one arena
                  (`radixkv.kvcache.arena`); a short kind frees units through the
                  room, in the simulator's ``radixkv`` order (`HybridBudget`)
    pools         ``kv_tokens``, ``window_tokens``, ``max_checkpoints``: separate pools,
                  each evicting its own (or ``cache_split="sglang"``: ``cache_bytes``
                  split into them by SGLang's fixed ratios)

Each layer type beyond full attention is built by its entry in
`radixkv.kvcache.layer_types` (its manager and tree component); this module builds the
full KV's allocator and the tree over every component; the shape, the KV tensors and the
arena's room.

Owns: the allocation of what the plan sized, and the reports over it. Must not touch:
the sizes (the plan's), requests and the step (the engine's), the model (the loader's).
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.machine import check_fits
from radixkv.kvcache.arena import ArenaPages
from radixkv.kvcache.layer_types import build_managers
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.plan import MemoryPlan, plan_memory, request_table
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.shapes import Pools, memory_shape
from radixkv.tree import RadixCache

# an index-only cache's host bytes: per slot (its owner flag and its number in its page's
# row: 9) and per page or arena unit (free stacks, counts, owners; measured with the
# slots: 49 bytes an arena unit of one 4-slot page, tiny Qwen3.5)
SLOT_INDEX_BYTES, PAGE_INDEX_BYTES = 9, 32


class CacheMemory:
    """The cache, its KV, its request lifecycle (``mgr``), and on a model with them the
    window slots and the recurrent states, as ``cfg`` shapes them for ``model``: sized
    by `plan_memory` (``plan``), checked against the machine, then allocated in the
    plan's shape (``shape``: `radixkv.kvcache.shapes`, which answers the reports).

    Raises:
        ValueError: a size this model cannot take or this machine cannot hold, naming
            the knob (`radixkv.kvcache.plan`, `radixkv.engine.machine`).
    """

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        mc = model.config  # type: ignore[attr-defined]
        self.plan = plan = plan_memory(mc.layer_specs(), cfg.cache_config, mc.architecture)
        self.shape = shape = memory_shape(plan)
        _check_fits(plan, cfg, device, shape)
        shape.allocate(device)
        self.arena = shape.arena
        managers = build_managers(plan, self.arena, device, model)  # each layer type's
        self.cache, self.allocator = _tree(plan, cfg, shape.full_pages(), device, managers)
        self.kv = shape.make_kv(mc.num_key_value_heads, mc.head_dim, self.allocator, managers,
                                device)  # fmt: skip
        req_pool = ReqToTokenPool(cfg.max_running, cfg.max_context_len, device=device)
        room = shape.make_room(self.cache, managers, cfg.eviction_policy)
        self.mgr = CacheManager(self.cache, self.allocator, req_pool, *managers, room=room)
        shape.wire(self.mgr, self.kv)
        self.budget, self.room = shape.budget, shape.room

    def layer(self, kind: str) -> LayerManager | None:
        """The manager of layer type ``kind`` (`radixkv.kvcache.layer_types`), if any."""
        return next((m for m in self.mgr.managers if m.kind == kind), None)

    # --- reports: the shape's -----------------------------------------------------------
    def summary(self) -> list[str]:
        """The memory as sized at start, one line each."""
        return self.shape.summary()

    def held_bytes(self) -> dict[str, int]:
        """Bytes the cache and the running requests hold, per kind (``full``,
        ``window``, ``states``): the arena's units, or each pool's handed-out pages."""
        return self.shape.held_bytes()

    def evicted_bytes(self) -> dict[str, int]:
        """Bytes evicted to make room since the start, per kind."""
        return self.shape.evicted_bytes()

    def usage(self) -> float:
        """Fraction in use: of the arena, or of the full KV pool."""
        return self.shape.usage()

    def check(self) -> None:
        """With an arena: every unit is free or held once, by the kind that says so."""
        self.shape.check()


def _check_fits(plan: MemoryPlan, cfg: EngineConfig, device: torch.device, shape: Pools) -> None:
    """Refuse a plan this machine cannot hold, naming the knob that sized it. An
    index-only cache (the ``meta`` device) holds no KV, only its indices, on the CPU."""
    needs, where = plan.needs, device
    if device.type == "meta":
        slots = plan.index_slots
        pages = slots // cfg.page_size + shape.index_units
        index = SLOT_INDEX_BYTES * slots + PAGE_INDEX_BYTES * pages
        needs = {"its indices": index, **request_table(plan.config)}
        where = torch.device("cpu")
    try:
        check_fits(needs, where)
    except ValueError as e:
        raise ValueError(shape.explain(cfg.cache_bytes == "auto", cfg.pool_tokens, e)) from None


def _tree(
    plan: MemoryPlan, cfg: EngineConfig, pages: ArenaPages | None, device: torch.device,
    managers: tuple[LayerManager, ...],
) -> tuple[RadixCache, TokenToKVPoolAllocator]:  # fmt: skip
    """The full KV's allocator (drawing from ``pages``, else its own) and the tree over
    it, with the managers' tree components. The engine locks every node it keeps right
    after matching or inserting it, so it opts in to chain merging (LRU, where every
    manager allows it) and precise eviction (see `radixkv.tree`)."""
    p = cfg.page_size
    allocator = TokenToKVPoolAllocator(plan.full_slots, p, device, pages=pages,
                                       capacity=plan.full_capacity)  # fmt: skip
    merge = cfg.eviction_policy == "lru" and all(m.allows_merge for m in managers)
    cache = RadixCache(p, cfg.eviction_policy, allocator, disable=not cfg.prefix_cache,
                       eviction_mode="merge" if merge else "precise",
                       components=tuple(m.component for m in managers))  # fmt: skip
    return cache, allocator


def build_tiers(cfg: EngineConfig, memory: Any, identity: bytes) -> Any:
    """The host pool and shared store below the device (`radixkv.storage.tier`), or
    ``None`` when ``cfg`` asks for neither."""
    if cfg.storage is None and not cfg.host_tokens:
        return None
    import os

    from radixkv.storage.store import open_store
    from radixkv.storage.tier import KVTiers

    secret = cfg.storage_secret or os.environ.get("RADIXKV_STORAGE_SECRET") or None
    store = open_store(cfg.storage, cfg.storage_max_bytes) if cfg.storage is not None else None
    return KVTiers(
        memory.kv, memory.cache, identity, store, cfg.host_tokens // cfg.page_size,
        cfg.write_policy, secret.encode() if secret else None,
    )  # fmt: skip


__all__ = ["CacheMemory", "build_tiers"]
