"""The layer types beyond full attention, each a folder of its own (`radixkv.kvcache.window`,
`radixkv.kvcache.recurrent`): the registry the engine builds a model's cache from.

Each entry's ``build(plan, arena, device, model)`` returns the type's manager
(`radixkv.kvcache.managers.LayerManager`, its tree component in ``component``) for a
model whose specs have that type, else None. The managers run in this order. A new
layer type is a folder with its ``build`` and its entry here (and its spec in
`radixkv.kvcache.spec`, its size in `radixkv.kvcache.plan`).

Owns: the registry. Must not touch: any type's parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.kvcache.recurrent import build as recurrent
from radixkv.kvcache.window import build as window

LAYER_TYPES: dict[str, Callable[..., Any]] = {"window": window.build, "states": recurrent.build}
# an engine's attribute naming each type's manager (``engine.window``), kept public
ENGINE_NAMES = {"window": "window", "recurrent": "states"}


def build_managers(plan: Any, arena: Any, device: Any, model: Any) -> tuple[Any, ...]:
    """The managers of every layer type ``plan``'s specs have, in the registry's order."""
    built = (make(plan, arena, device, model) for make in LAYER_TYPES.values())
    return tuple(m for m in built if m is not None)


__all__ = ["ENGINE_NAMES", "LAYER_TYPES", "build_managers"]
