"""The two shapes of a cache's memory (`radixkv.kvcache.plan.MemoryPlan.arena`), behind
one interface, so that the engine asks the shape and never which one it is:

    Pools       separate pools: the full KV allocator's tokens and each layer manager's
                own (``kv_tokens``, ``window_tokens``, ``max_checkpoints``, or SGLang's
                split of ``cache_bytes``), each evicting its own
    OneArena    one arena every kind draws units from (`radixkv.kvcache.arena`), its room
                freeing units across kinds in the budget's order (`radixkv.kvcache.budget`)

The steps, in the order the engine's memory takes them: `memory_shape(plan)` (nothing
allocated yet: the machine check reads ``index_units`` and names the knob through
``explain``), ``allocate(device)`` (the arena, if any: the managers draw from it),
``full_pages()`` (what the full KV allocator draws from), ``make_kv(...)`` (the K and V
tensors), ``wire(mgr, kv, policy)`` (the room, handed to the lifecycle and the
managers). Then the reports: ``summary``, ``held_bytes``, ``evicted_bytes``,
``usage``, ``check``, ``metrics``. Each is O(kinds) but ``check`` (O(units)).

Owns: what differs between the shapes. Must not touch: the sizes (the plan's), the
managers' own pools (their hooks report them).
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.kvcache.arena import KINDS, Arena, ArenaPages, arena_kv
from radixkv.kvcache.budget import HybridBudget, arena_room
from radixkv.kvcache.memory import KVPool

MIB = 2**-20


class Pools:
    """Separate pools (see the module docstring)."""

    arena: Arena | None = None
    budget: HybridBudget | None = None
    room: Any = None

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.mgr: Any = None
        self.kv: Any = None

    index_units = 0  # arena units an index-only cache keeps beside its slots

    def explain(self, knob_auto: bool, pool_tokens: int, error: ValueError) -> str:
        """A machine check's error, naming the knob that sized what it refused."""
        plan = self.plan
        return f"{plan.sized_by}: {error}" if plan.sized_by else str(error)

    def allocate(self, device: torch.device) -> None:
        """Nothing beyond the pools each part allocates itself."""

    def full_pages(self) -> ArenaPages | None:
        return None  # (the full KV allocator's own pages)

    def make_kv(self, heads: int, dim: int, allocator: Any, managers: Any, device: Any) -> Any:
        plan, cfg = self.plan, self.plan.config
        return KVPool(plan.specs.kv_layers, heads, dim, allocator.size, cfg.dtype, device,
                      *plan.kv_layout)  # fmt: skip

    def make_room(self, cache: Any, managers: Any, policy: str) -> Any:
        """What the lifecycle makes room through (`CacheManager`'s ``room``): none, the
        tree evicts for each pool."""
        return None

    def wire(self, mgr: Any, kv: Any) -> None:
        self.mgr, self.kv = mgr, kv

    def summary(self) -> list[str]:
        kv, a = self.kv, self.mgr.allocator
        full_layers = kv.num_layers - len(self.plan.kv_layout[0])
        lines = [f"full-attention KV: {a.size:,} tokens x {full_layers} layers = "
                 f"{a.size * kv.bytes_per_token() * MIB:,.1f} MiB"]  # fmt: skip
        return lines + self.plan.notes() + [x for m in self.mgr.managers if (x := m.summary())]

    def held_bytes(self) -> dict[str, int]:
        a = self.mgr.allocator
        full = (a.size - a.available_size()) * self.kv.bytes_per_token()
        held = {**dict.fromkeys(KINDS, 0), "full": full}
        return held | {m.kind: m.held_bytes() for m in self.mgr.managers}

    def evicted_bytes(self) -> dict[str, int]:
        full = self.mgr.evicted_tokens * self.kv.bytes_per_token()
        gone = {**dict.fromkeys(KINDS, 0), "full": full}
        return gone | {m.kind: m.evicted_bytes() for m in self.mgr.managers}

    def usage(self) -> float:
        a = self.mgr.allocator
        return 1.0 - a.available_size() / a.size

    def check(self) -> None:
        """Each pool checks its own (the lifecycle's and the managers' `check`)."""

    def metrics(self) -> list[tuple[str, str, str, float]]:
        return []


class OneArena(Pools):
    """One arena for every kind (see the module docstring)."""

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.shape = plan.arena
        self.index_units = self.shape.units

    def explain(self, knob_auto: bool, pool_tokens: int, error: ValueError) -> str:
        if knob_auto:
            return (f"kv_tokens: {pool_tokens:,} tokens size the budget (--cache-bytes auto): "
                    f"{error}")
        return super().explain(knob_auto, pool_tokens, error)

    def allocate(self, device: torch.device) -> None:
        self.arena = Arena(self.shape.units, self.shape.unit_bytes, device)

    def full_pages(self) -> ArenaPages | None:
        shape = self.shape
        assert self.arena is not None
        if not shape.full_columns:  # (every layer sliding: full slots index tokens only)
            return None
        return ArenaPages(self.arena, "full", shape.full_columns, shape.full_cap)

    def make_kv(self, heads: int, dim: int, allocator: Any, managers: Any, device: Any) -> Any:
        cfg, shape = self.plan.config, self.shape
        assert self.arena is not None
        full = allocator.source if shape.full_columns else None
        return arena_kv(self.arena, shape, self.plan.specs.kv_layers, heads, dim, cfg.dtype,
                        cfg.page_size, full, managers)  # fmt: skip

    def make_room(self, cache: Any, managers: Any, policy: str) -> Any:
        """The room frees units across kinds in the budget's order (its own, or under
        ``session`` the priorities the session order stamps); every kind's allocation
        goes through it, the full KV's too, unless its slots cost no unit (every
        layer sliding)."""
        order = "priority" if policy == "session" else "greedy-dual"
        p = self.plan.config.page_size
        self.budget, self.room = arena_room(self.arena, self.shape, cache, managers, p, order)
        return self.room if self.shape.full_columns else None

    def summary(self) -> list[str]:
        shape, ar, mgr = self.shape, self.arena, self.mgr
        assert ar is not None and self.budget is not None
        kinds = ["full-attention KV"] if shape.full_columns else []
        kinds += [m.title for m in mgr.managers if m.title]
        layers = f"{shape.group} attention layer" + ("s'" if shape.group > 1 else "'s")
        lines = [f"one cache budget: {ar.nbytes * MIB:,.1f} MiB, {ar.num_units:,} units of "
                 f"{ar.unit_bytes:,} bytes (a page of {layers} KV); "
                 f"{', '.join(kinds)} draw from it, evicted in the simulator's "
                 f"{'session' if self.budget.order == 'priority' else 'radixkv'} "
                 f"order"]  # fmt: skip
        p = mgr.allocator.page_size
        if shape.full_columns:
            cap = shape.full_cap
            capped = f"; capped at {cap * p:,} tokens" if cap else ""
            lines.append(f"full-attention KV page: {shape.full_columns} units (one request "
                         f"holds at most {mgr.allocator.capacity:,} tokens{capped})")  # fmt: skip
        else:
            lines.append(f"full-attention KV: none (every layer slides); the tree indexes "
                         f"up to {mgr.allocator.size:,} tokens")  # fmt: skip
        return lines + [x for m in mgr.managers if (x := m.arena_summary(shape))]

    def held_bytes(self) -> dict[str, int]:
        assert self.arena is not None
        return self.arena.held_bytes()

    def evicted_bytes(self) -> dict[str, int]:
        ar = self.arena
        assert ar is not None
        return {k: n * ar.unit_bytes for k, n in ar.evicted.items()}

    def usage(self) -> float:
        ar = self.arena
        assert ar is not None
        return 1.0 - ar.free_units() / ar.num_units

    def check(self) -> None:
        """Every unit is free or held once, by the kind that says so."""
        assert self.arena is not None
        mgr = self.mgr
        full = [mgr.allocator.source.units()] if self.shape.full_columns else []
        holders: dict[str, list[Any]] = {"full": full}
        self.arena.check(holders | {m.kind: m.arena_units() for m in mgr.managers})

    def metrics(self) -> list[tuple[str, str, str, float]]:
        assert self.arena is not None
        return [("gauge", "cache_budget_bytes", "The one byte budget every kind of cache "
                 "memory draws from (--cache-bytes)", self.arena.nbytes)]  # fmt: skip


def memory_shape(plan: Any) -> Pools:
    """The shape ``plan`` sized (`Pools` or `OneArena`), nothing allocated yet."""
    return OneArena(plan) if plan.arena is not None else Pools(plan)


__all__ = ["OneArena", "Pools", "memory_shape"]
