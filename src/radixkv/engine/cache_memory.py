"""`CacheMemory`: an engine's cache memory, built from its config and its model's layer
specs, and what it reports: bytes held and evicted per kind, usage, a summary, checks.

Two shapes, chosen by `EngineConfig`:
    one arena     ``cache_bytes`` (``cache_split="one"``): full-attention KV pages,
                  window KV pages and checkpoints draw units from one arena
                  (`radixkv.kvcache.arena`); a short kind frees units through the
                  room, in the simulator's ``radixkv`` order (`HybridBudget`)
    pools         ``kv_tokens``, ``window_tokens``, ``max_checkpoints``: separate pools,
                  each evicting its own (or ``cache_split="sglang"``: ``cache_bytes``
                  split into them by SGLang's fixed ratios)

Owns: which shape, and the reports over it. Must not touch: requests and the step (the
engine's), how each part is built (the loader's).
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.loader import build_memory, build_states, plan_arena, split_budget
from radixkv.kvcache.arena import ArenaCheckpoints, ArenaRoom
from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.recurrent import RecurrentStates

MIB = 2**-20


class CacheMemory:
    """The cache, its KV, its request lifecycle (``mgr``), and on a model with them the
    window slots and the recurrent states, as ``cfg`` shapes them for ``model``."""

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        mc = model.config  # type: ignore[attr-defined]
        specs = mc.layer_specs()
        if cfg.checkpoint_every and specs.recurrent is None:
            raise ValueError(f"checkpoint_every: {mc.architecture} has no recurrent "
                             "layers to checkpoint")  # fmt: skip
        self.pools = pools = split_budget(cfg, mc)  # cache_split="sglang": the three pools
        try:
            self.arena = plan_arena(pools, mc, device) if pools.one_arena else None
        except ValueError as e:  # "auto" was sized by kv_tokens: name that
            if cfg.cache_bytes != "auto":
                raise
            raise ValueError(
                f"kv_tokens: {pools.pool_tokens:,} tokens size the budget "
                f"(--cache-bytes auto): {str(e).removeprefix('cache_bytes: ')}"
            ) from None
        self.recurrent: RecurrentStates | None = None
        managers: tuple = ()
        if specs.recurrent is not None:
            pool = build_states(pools, specs.recurrent, device)
            model.use_states(pool)  # type: ignore[operator]
            store, cap = None, pools.checkpoint_cap
            if self.arena is not None:
                store = ArenaCheckpoints(self.arena.arena, specs.recurrent.state_bytes)
                cap = cap or max(1, self.arena.arena.num_units // store.per)
            self.recurrent = RecurrentStates(pool, cap or 1, cfg.checkpoint_every // cfg.page_size,
                                             store=store)  # fmt: skip
            managers = (self.recurrent,)
        memory = build_memory(pools, mc, device, managers, self.arena)
        self.cache, self.kv, self.mgr = memory.cache, memory.kv, memory.mgr
        self.window = memory.window  # the sliding layers' own slot space, if any
        self.why_not_window = memory.why_not_window
        self.budget: HybridBudget | None = None
        self.room: ArenaRoom | None = None
        if self.arena is not None:
            self._use_room(cfg.page_size, cfg.eviction_policy)

    def _use_room(self, p: int, policy: str) -> None:
        """One arena: its room frees units across kinds in the budget's order (its own,
        or under ``session`` the priorities the session order stamps); every kind's
        allocation goes through it."""
        plan = self.arena
        assert plan is not None
        unit = plan.arena.unit_bytes
        win = self.window.component if self.window is not None else None
        self.budget = HybridBudget(  # a hit's worth: the tokens it saves (the budget's default)
            self.cache, self.recurrent.component if self.recurrent is not None else None, win,
            token_bytes=plan.full_columns * unit // p, window_bytes=plan.window_columns * unit // p,
            order="priority" if policy == "session" else "greedy-dual",
        )  # fmt: skip
        self.room = ArenaRoom(plan.arena, self.budget, plan.full_columns, win,
                              max(plan.window_columns, 1), p)  # fmt: skip
        if plan.full_columns:  # (every layer sliding: full slots cost no unit)
            self.mgr.room = self.room
        if self.window is not None:
            self.window.room = self.room
        if self.recurrent is not None:
            self.recurrent.room = self.room.make

    # --- reports ------------------------------------------------------------------------
    def summary(self) -> list[str]:
        """The memory as sized at start, one line each."""
        if self.arena is not None:
            return self._arena_summary()
        kv, a = self.kv, self.mgr.allocator
        full_layers = kv.num_layers - len(kv.window_layers)
        lines = [f"full-attention KV: {a.size:,} tokens x {full_layers} layers = "
                 f"{a.size * kv.bytes_per_token() * MIB:,.1f} MiB"]  # fmt: skip
        if self.window is not None:
            w = self.window
            lines.append(f"sliding-window KV: {w.allocator.size:,} tokens x "
                         f"{len(kv.window_layers)} layers = "
                         f"{w.allocator.size * kv.window_bytes_per_token() * MIB:,.1f} MiB "
                         f"(window {w.window}: a running request keeps its last window; "
                         f"cached windows stay while there is room, those no match end "
                         f"needs go first)")  # fmt: skip
        elif self.why_not_window:
            lines.append(f"sliding-window KV: in the full pool ({self.why_not_window})")
        if self.recurrent is not None:
            rec = self.recurrent
            rows = rec.pool.first + rec.pool.spare
            lines.append(f"recurrent states: {rows} rows x {rec.row_size * MIB:.2f} MiB = "
                         f"{rows * rec.row_size * MIB:,.1f} MiB")  # fmt: skip
        return lines

    def _arena_summary(self) -> list[str]:
        plan = self.arena
        assert plan is not None
        ar = plan.arena
        kinds = ["full-attention KV"] if plan.full_columns else []
        kinds += ["sliding-window KV"] if plan.window_columns else []
        kinds += ["recurrent-state checkpoints"] if self.recurrent is not None else []
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
        if plan.window_columns:
            lines.append(f"sliding-window KV page: {plan.window_columns} units (window "
                         f"{plan.window}: a running request keeps its last window"
                         f"{capped(plan.window_cap)})")  # fmt: skip
        if self.recurrent is not None:
            rec = self.recurrent
            rows = rec.pool.first + rec.pool.spare
            lines.append(f"checkpoint: {plan.state_units} units; running and pending "
                         f"states outside the budget: {rows} rows x "
                         f"{rec.row_size * MIB:.2f} MiB")  # fmt: skip
        return lines

    def held_bytes(self) -> dict[str, int]:
        """Bytes the cache and the running requests hold, per kind (``full``,
        ``window``, ``states``): the arena's units, or each pool's handed-out pages."""
        if self.arena is not None:
            return self.arena.arena.held_bytes()
        kv, a = self.kv, self.mgr.allocator
        held = {"full": (a.size - a.available_size()) * kv.bytes_per_token(), "window": 0,
                "states": 0}  # fmt: skip
        if self.window is not None:
            w = self.window.allocator
            held["window"] = (w.size - w.available_size()) * kv.window_bytes_per_token()
        if self.recurrent is not None:
            held["states"] = len(self.recurrent.component.held) * self.recurrent.row_size
        return held

    def evicted_bytes(self) -> dict[str, int]:
        """Bytes evicted to make room since the start, per kind."""
        if self.arena is not None:
            ar = self.arena.arena
            return {k: n * ar.unit_bytes for k, n in ar.evicted.items()}
        kv = self.kv
        gone = {"full": self.mgr.evicted_tokens * kv.bytes_per_token(), "window": 0, "states": 0}
        if self.window is not None:
            gone["window"] = self.window.evicted * kv.window_bytes_per_token()
        if self.recurrent is not None:
            gone["states"] = self.recurrent.component.evictions * self.recurrent.row_size
        return gone

    def usage(self) -> float:
        """Fraction in use: of the arena, or of the full KV pool."""
        if self.arena is not None:
            ar = self.arena.arena
            return 1.0 - ar.free_units() / ar.num_units
        a = self.mgr.allocator
        return 1.0 - a.available_size() / a.size

    def check(self) -> None:
        """With an arena: every unit is free or held once, by the kind that says so."""
        if self.arena is None:
            return
        full = [self.mgr.allocator.source.units()] if self.arena.full_columns else []
        holders: dict[str, list[Any]] = {"full": full, "window": [], "states": []}
        if self.window is not None:
            holders["window"] = [self.window.allocator.source.units()]
        if self.recurrent is not None and self.recurrent.store is not None:
            holders["states"] = self.recurrent.store.units()
        self.arena.arena.check(holders)


__all__ = ["CacheMemory"]
