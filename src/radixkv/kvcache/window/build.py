"""The sliding-window layer type's part of a cache, built as `radixkv.kvcache.plan`
sized it: the window slot space (its own pool, or window pages of the arena), the tree
component over it and its manager.

Owns: building them. Must not touch: the sizes (the plan's), the full KV, the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.kvcache.arena import ArenaPages
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.window.component import WindowKV
from radixkv.kvcache.window.slots import WindowSlots

if TYPE_CHECKING:
    from radixkv.kvcache.arena import Arena
    from radixkv.kvcache.plan import MemoryPlan


def build(plan: MemoryPlan, arena: Arena | None, device: Any, model: Any) -> WindowSlots | None:
    """The window manager of a model whose sliding layers keep their KV apart, or None
    (no such layers, or kept in the full pool: `WindowPlan.why_not`)."""
    win, shape, cfg = plan.window, plan.arena, plan.config
    if not win.layers:
        return None
    p = cfg.page_size
    pages = None
    if shape is not None and arena is not None:
        pages = ArenaPages(arena, "window", shape.window_columns, shape.window_cap)
    slots = TokenToKVPoolAllocator(win.tokens, p, device, pages=pages)
    # windows stay while there is room; under pressure the spare ones go first
    kv = WindowKV(win.window, slots, retain="all")
    spec = plan.specs.window  # (its layers are the plan's: those that live apart)
    assert spec is not None and spec.layers == win.layers
    return WindowSlots(kv, slots, cfg.max_running, cfg.max_context_len, win.window,
                       spec.token_bytes(cfg.dtype), len(spec.layers))  # fmt: skip


__all__ = ["build"]
