"""`CacheMemory`: an engine's cache memory, allocated as `radixkv.kvcache.plan` sized it
from the config's memory knobs and the model's layer specs (after the machine's check),
the tiers below it, and what it reports: bytes held and evicted per kind, usage, a
summary, checks.

Two shapes, chosen by `EngineConfig`:
    one arena     ``cache_bytes`` (``cache_split="one"``): full-attention KV pages,
                  window KV pages and checkpoints draw units from one arena
                  (`radixkv.kvcache.arena`); a short kind frees units through the
                  room, in the simulator's ``radixkv`` order (`HybridBudget`)
    pools         ``kv_tokens``, ``window_tokens``, ``max_checkpoints``: separate pools,
                  each evicting its own (or ``cache_split="sglang"``: ``cache_bytes``
                  split into them by SGLang's fixed ratios)

Each layer type beyond full attention is built by its entry in
`radixkv.kvcache.layer_types` (its manager and tree component); this module builds the
full KV's allocator, the tree over every component, the KV tensors, and the arena's room.

Owns: the allocation of what the plan sized, and the reports over it. Must not touch:
the sizes (the plan's), requests and the step (the engine's), the model (the loader's).
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.machine import check_fits
from radixkv.kvcache.arena import KINDS, Arena, ArenaPages, ArenaRoom, arena_kv
from radixkv.kvcache.budget import HybridBudget, arena_room
from radixkv.kvcache.layer_types import build_managers
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.managers import LayerManager
from radixkv.kvcache.memory import KVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixkv.kvcache.plan import MemoryPlan, plan_memory, request_table
from radixkv.tree import RadixCache

MIB = 2**-20
# an index-only cache's host bytes: per slot (its owner flag and its number in its page's
# row: 9) and per page or arena unit (free stacks, counts, owners; measured with the
# slots: 49 bytes an arena unit of one 4-slot page, tiny Qwen3.5)
SLOT_INDEX_BYTES, PAGE_INDEX_BYTES = 9, 32


class CacheMemory:
    """The cache, its KV, its request lifecycle (``mgr``), and on a model with them the
    window slots and the recurrent states, as ``cfg`` shapes them for ``model``: sized
    by `plan_memory` (``plan``), checked against the machine, then allocated.

    Raises:
        ValueError: a size this model cannot take or this machine cannot hold, naming
            the knob (`radixkv.kvcache.plan`, `radixkv.engine.machine`).
    """

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        mc = model.config  # type: ignore[attr-defined]
        self.plan = plan = plan_memory(mc.layer_specs(), cfg.cache_config, mc.architecture)
        _check_fits(plan, cfg, device)
        self.arena = Arena(plan.arena.units, plan.arena.unit_bytes, device) if plan.arena else None
        managers = build_managers(plan, self.arena, device, model)  # each layer type's
        self.cache, self.allocator = _tree(plan, cfg, self.arena, device, managers)
        self.kv = _kv(plan, mc, self.arena, self.allocator, managers, device)
        req_pool = ReqToTokenPool(cfg.max_running, cfg.max_context_len, device=device)
        self.mgr = CacheManager(self.cache, self.allocator, req_pool, *managers)
        self.budget: HybridBudget | None = None
        self.room: ArenaRoom | None = None
        if self.arena is not None:
            self._use_room(cfg.page_size, cfg.eviction_policy)

    def _use_room(self, p: int, policy: str) -> None:
        """One arena: its room frees units across kinds in the budget's order (its own,
        or under ``session`` the priorities the session order stamps); every kind's
        allocation goes through it."""
        plan, arena = self.plan.arena, self.arena
        assert plan is not None and arena is not None
        order = "priority" if policy == "session" else "greedy-dual"
        self.budget, self.room = arena_room(arena, plan, self.cache, self.mgr.managers, p, order)
        if plan.full_columns:  # (every layer sliding: full slots cost no unit)
            self.mgr.room = self.room

    def layer(self, kind: str) -> LayerManager | None:
        """The manager of layer type ``kind`` (`radixkv.kvcache.layer_types`), if any."""
        return next((m for m in self.mgr.managers if m.kind == kind), None)

    # --- reports ------------------------------------------------------------------------
    def summary(self) -> list[str]:
        """The memory as sized at start, one line each."""
        if self.arena is not None:
            return self._arena_summary()
        kv, a = self.kv, self.mgr.allocator
        full_layers = kv.num_layers - len(self.plan.kv_layout[0])
        lines = [f"full-attention KV: {a.size:,} tokens x {full_layers} layers = "
                 f"{a.size * kv.bytes_per_token() * MIB:,.1f} MiB"]  # fmt: skip
        return lines + self.plan.notes() + [x for m in self.mgr.managers if (x := m.summary())]

    def _arena_summary(self) -> list[str]:
        plan, ar = self.plan.arena, self.arena
        assert plan is not None and ar is not None
        kinds = ["full-attention KV"] if plan.full_columns else []
        kinds += [m.title for m in self.mgr.managers if m.title]
        layers = f"{plan.group} attention layer" + ("s'" if plan.group > 1 else "'s")
        lines = [f"one cache budget: {ar.nbytes * MIB:,.1f} MiB, {ar.num_units:,} units of "
                 f"{ar.unit_bytes:,} bytes (a page of {layers} KV); "
                 f"{', '.join(kinds)} draw from it, evicted in the simulator's "
                 f"{'session' if self.budget.order == 'priority' else 'radixkv'} "
                 f"order"]  # fmt: skip
        p = self.mgr.allocator.page_size
        capped = lambda cap: f"; capped at {cap * p:,} tokens" if cap else ""  # noqa: E731
        if plan.full_columns:
            lines.append(f"full-attention KV page: {plan.full_columns} units (one request "
                         f"holds at most {self.mgr.allocator.capacity:,} tokens"
                         f"{capped(plan.full_cap)})")  # fmt: skip
        else:
            lines.append(f"full-attention KV: none (every layer slides); the tree indexes "
                         f"up to {self.mgr.allocator.size:,} tokens")  # fmt: skip
        return lines + [x for m in self.mgr.managers if (x := m.arena_summary(plan))]

    def held_bytes(self) -> dict[str, int]:
        """Bytes the cache and the running requests hold, per kind (``full``,
        ``window``, ``states``): the arena's units, or each pool's handed-out pages."""
        if self.arena is not None:
            return self.arena.held_bytes()
        kv, a = self.kv, self.mgr.allocator
        full = (a.size - a.available_size()) * kv.bytes_per_token()
        held = {**dict.fromkeys(KINDS, 0), "full": full}
        return held | {m.kind: m.held_bytes() for m in self.mgr.managers}

    def evicted_bytes(self) -> dict[str, int]:
        """Bytes evicted to make room since the start, per kind."""
        if self.arena is not None:
            ar = self.arena
            return {k: n * ar.unit_bytes for k, n in ar.evicted.items()}
        full = self.mgr.evicted_tokens * self.kv.bytes_per_token()
        gone = {**dict.fromkeys(KINDS, 0), "full": full}
        return gone | {m.kind: m.evicted_bytes() for m in self.mgr.managers}

    def usage(self) -> float:
        """Fraction in use: of the arena, or of the full KV pool."""
        if self.arena is not None:
            ar = self.arena
            return 1.0 - ar.free_units() / ar.num_units
        a = self.mgr.allocator
        return 1.0 - a.available_size() / a.size

    def check(self) -> None:
        """With an arena: every unit is free or held once, by the kind that says so."""
        if self.arena is None:
            return
        shape = self.plan.arena
        assert shape is not None
        full = [self.mgr.allocator.source.units()] if shape.full_columns else []
        holders: dict[str, list[Any]] = {"full": full}
        self.arena.check(holders | {m.kind: m.arena_units() for m in self.mgr.managers})


def _check_fits(plan: MemoryPlan, cfg: EngineConfig, device: torch.device) -> None:
    """Refuse a plan this machine cannot hold, naming the knob that sized it. An
    index-only cache (the ``meta`` device) holds no KV, only its indices, on the CPU."""
    needs, where = plan.needs, device
    if device.type == "meta":
        slots = plan.index_slots
        pages = slots // cfg.page_size + (plan.arena.units if plan.arena else 0)
        index = SLOT_INDEX_BYTES * slots + PAGE_INDEX_BYTES * pages
        needs = {"its indices": index, **request_table(plan.config)}
        where = torch.device("cpu")
    try:
        check_fits(needs, where)
    except ValueError as e:
        if plan.arena is not None and cfg.cache_bytes == "auto":
            raise ValueError(f"kv_tokens: {cfg.pool_tokens:,} tokens size the budget "
                             f"(--cache-bytes auto): {e}") from None  # fmt: skip
        raise ValueError(f"{plan.sized_by}: {e}" if plan.sized_by else str(e)) from None


def _tree(
    plan: MemoryPlan, cfg: EngineConfig, arena: Arena | None, device: torch.device,
    managers: tuple[LayerManager, ...],
) -> tuple[RadixCache, TokenToKVPoolAllocator]:  # fmt: skip
    """The full KV's allocator and the tree over it, with the managers' tree components.
    The engine locks every node it keeps right after matching or inserting it, so it
    opts in to chain merging (LRU, where every manager allows it) and precise eviction
    (see `radixkv.tree`)."""
    p, shape = cfg.page_size, plan.arena
    pages = None
    if shape is not None and arena is not None and shape.full_columns:
        pages = ArenaPages(arena, "full", shape.full_columns, shape.full_cap)
    # (every layer sliding: full slots index tokens and hold no KV)
    allocator = TokenToKVPoolAllocator(plan.full_slots, p, device, pages=pages,
                                       capacity=plan.full_capacity)  # fmt: skip
    merge = cfg.eviction_policy == "lru" and all(m.allows_merge for m in managers)
    cache = RadixCache(p, cfg.eviction_policy, allocator, disable=not cfg.prefix_cache,
                       eviction_mode="merge" if merge else "precise",
                       components=tuple(m.component for m in managers))  # fmt: skip
    return cache, allocator


def _kv(
    plan: MemoryPlan, mc: Any, arena: Arena | None, allocator: TokenToKVPoolAllocator,
    managers: tuple[LayerManager, ...], device: torch.device,
) -> Any:  # fmt: skip
    """The K and V tensors: one pool per kind, or views into the arena's units."""
    cfg, heads, dim, layers = plan.config, mc.num_key_value_heads, mc.head_dim, plan.specs.kv_layers
    if arena is None:
        return KVPool(layers, heads, dim, allocator.size, cfg.dtype, device, *plan.kv_layout)
    shape = plan.arena
    assert shape is not None
    full = allocator.source if shape.full_columns else None
    return arena_kv(arena, shape, layers, heads, dim, cfg.dtype, cfg.page_size, full, managers)


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
