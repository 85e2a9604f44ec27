"""The tiers of each layer type beyond full attention, by the kind of its manager
(`radixkv.kvcache.managers.LayerManager.kind`): what the engine asks for one model's
layers without naming them.

    "window"  `WindowTiers`: the sliding layers' pages, loaded after the full pages
              (`radixkv.storage.windows`)
    "states"  `StateTiers`: a recurrent model's checkpoints, whose load brings the
              prompt's pages only up to a checkpoint (`radixkv.storage.states`)

Each tier the engine gets answers the same calls: ``loads_pages`` (its ``load`` brings
the prompt's full pages too, in place of `KVTiers.load`), ``load(tokens, ns, usable,
alloc, ahead)`` (``ahead``: for a waiting session before its request, counted apart),
``save(tokens, ns, row, n, hashes, resend)`` at a request's finish, ``check()``,
and a tier whose load brings pages ``reach(tokens, ns, usable)`` (the end a load of the
KV must reach before it serves more: a load ahead loads toward it a chunk a step),
``metrics()`` (its counters for ``/metrics``). Its manager is handed it
(`LayerManager.use_tiers`).

Owns: which tier a manager kind gets. Must not touch: any tier's data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _windows(tiers: Any, slots: Any, cache: Any, host_pages: int, host_states: int) -> Any:
    from radixkv.storage.windows import WindowTiers

    return WindowTiers(tiers, slots, host_pages)


def _states(tiers: Any, rows: Any, cache: Any, host_pages: int, host_states: int) -> Any:
    from radixkv.storage.states import StateTiers

    return StateTiers(tiers, rows, cache, host_states)


LAYER_TIERS: dict[str, Callable[..., Any]] = {"window": _windows, "states": _states}


def layer_tiers(
    tiers: Any, managers: Sequence[Any], cache: Any, host_pages: int, host_states: int
) -> list[Any]:
    """The tiers of ``managers``' layer types below `KVTiers` ``tiers``, in their order
    (``host_pages`` window pages, ``host_states`` checkpoints in the host pool)."""
    out = []
    for m in managers:
        make = LAYER_TIERS.get(m.kind)
        if make is not None:
            out.append(make(tiers, m, cache, host_pages, host_states))
            m.use_tiers(out[-1])
    return out


__all__ = ["LAYER_TIERS", "layer_tiers"]
