"""The recurrent layer type's part of a cache, built as `radixkv.kvcache.plan` sized
it: the state pool (a row per running request, spare rows for checkpoints and pending
snapshots) handed to the model, the checkpoints' store in the arena if there is one, and
the manager.

Owns: building them. Must not touch: the sizes (the plan's), the tree, the model's
layers (it hands the model its pool through ``use_states``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.kvcache.arena import ArenaCheckpoints
from radixkv.kvcache.recurrent.manager import RecurrentStates
from radixkv.kvcache.recurrent.pool import StatePool

if TYPE_CHECKING:
    from radixkv.kvcache.arena import Arena
    from radixkv.kvcache.plan import MemoryPlan


def build(plan: MemoryPlan, arena: Arena | None, device: Any, model: Any) -> RecurrentStates | None:
    """The recurrent manager of a model with recurrent layers, or None."""
    spec, cfg = plan.specs.recurrent, plan.config
    if spec is None:
        return None
    pool = StatePool(spec, cfg.max_running, plan.state_rows, device)
    model.use_states(pool)
    store = ArenaCheckpoints(arena, spec.state_bytes) if arena is not None else None
    return RecurrentStates(pool, plan.checkpoints or 1, cfg.checkpoint_every // cfg.page_size,
                           store=store)  # fmt: skip


__all__ = ["build"]
