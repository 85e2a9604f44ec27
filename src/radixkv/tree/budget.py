"""`HybridBudget`: one byte budget over a hybrid model's cache (full-attention KV,
sliding-window KV, recurrent-state checkpoints) and the order it evicts in.

A hybrid prefix is worth something only up to its deepest checkpoint (the recurrent
layers start there) and only where the window layers' last ``window`` tokens are held,
so bytes are not all alike. `evict_bytes` frees, in this order, until enough is free:

1. **Dead KV**: an unlocked leaf's tail past the last place a match may end in it (its
   last checkpoint: no recurrent layer can start further; with a window, a leaf whose
   end lost its window KV is dead whole), least recently used first.
2. **Superseded checkpoints** (`StateCheckpoints.superseded`: an earlier turn's end
   that the conversation went on from, with no branch there), least recently used
   first; the KV stays, the conversation's later checkpoint still needs it.
3. **Leaf segments by utility**: a leaf's last checkpoint and the KV that dropping it
   frees (back to the checkpoint before it on the path, a branch point or a lock), the
   lowest ``recency + alpha x efficiency`` first, where efficiency is the prefill FLOPs
   a hit there saves (the whole prefix's, as Marconi counts) per byte it frees, each
   term scaled to [0, 1] over the candidates. Its KV turns dead and goes by step 1.
   (Counting only the FLOPs over the checkpoint before it, or the node's bytes, lost
   3-5 points on one trace or the other; see docs/hybrid.md.)

With a window and no recurrent layers, step 3 evicts whole leaves, least recently used
first (trimming a leaf's tail would leave its new end without window KV); a `WindowKV`
with ``retain="ends"`` frees window KV no useful end needs as the tree changes. With
neither, the tree's own eviction (its policy's order) frees full KV.

Invariants: only unlocked nodes lose KV; a checkpoint a running request holds a lock
under is never dropped by steps 1 and 3 (its node is locked); every byte freed goes
through the tree's or a component's eviction (their allocators, their hooks).

Complexity: each round is O(nodes + checkpoints); a round frees at least one segment,
a tail or a checkpoint.

Owns: the order of eviction across components. Must not touch: the components' data
(it calls their API) or the tree's structure (it evicts through `RadixCache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixkv.units import div_ceil

if TYPE_CHECKING:
    from radixkv.tree.core import RadixCache
    from radixkv.tree.node import TreeNode
    from radixkv.tree.state import Checkpoint, StateCheckpoints
    from radixkv.tree.window import WindowKV


def utility(ticks: list[float], value: list[float], cost: list[float], alpha: float) -> list[float]:
    """Marconi's score of each candidate: recency plus ``alpha`` x value per byte, each
    scaled to [0, 1] over the candidates (the lowest goes first)."""
    t0, t1 = min(ticks), max(ticks)
    eff = [v / max(c, 1.0) for v, c in zip(value, cost, strict=True)]
    e0, e1 = min(eff), max(eff)
    return [
        ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        + alpha * ((e - e0) / (e1 - e0) if e1 > e0 else 1.0)
        for t, e in zip(ticks, eff, strict=True)
    ]


class HybridBudget:
    """Bytes held by a hybrid cache, and eviction by worth (see the module docstring).

    Args:
        cache: the tree; ``state`` and ``window``: its components, if the model has them.
        token_bytes: full-attention KV bytes of one unit (all full layers together).
        window_bytes: window-layer KV bytes of one unit.
        flops: prefill FLOPs of a prefix of ``n`` units (what a hit saves).
        alpha: weight of efficiency against recency.
    """

    def __init__(
        self,
        cache: RadixCache,
        state: StateCheckpoints | None = None,
        window: WindowKV | None = None,
        *,
        token_bytes: int,
        window_bytes: int = 0,
        flops: Callable[[int], float] = float,
        alpha: float = 1.0,
    ) -> None:
        if token_bytes < 1 or window_bytes < 0:
            raise ValueError("token_bytes must be >= 1 and window_bytes >= 0")
        self.cache, self.state, self.window = cache, state, window
        self.token_bytes, self.window_bytes = token_bytes, window_bytes
        self.flops, self.alpha = flops, alpha

    def held(self) -> dict[str, int]:
        """Bytes held now: ``full``, ``window``, ``states``."""
        return {
            "full": self.cache.total_size() * self.token_bytes,
            "window": self.window.held_units() * self.window_bytes if self.window else 0,
            "states": self.state.held_bytes() if self.state else 0,
        }

    def total(self) -> int:
        return sum(self.held().values())

    def fit(self, capacity: int) -> int:
        """Evict until at most ``capacity`` bytes are held (or nothing more can go);
        returns the bytes freed."""
        start = now = self.total()
        while now > capacity:
            if not self._round(now - capacity):
                break
            now = self.total()
        return start - now

    def evict_bytes(self, nbytes: int) -> int:
        """Free at least ``nbytes`` bytes where that many can go; returns those freed."""
        return self.fit(max(self.total() - nbytes, 0))

    # --- one round ----------------------------------------------------------------------
    def _round(self, over: int) -> bool:
        """One step of the order; False when nothing could go."""
        cache, state = self.cache, self.state
        per_unit = self.token_bytes + self.window_bytes
        if state is None and self.window is None:
            return cache.evict(max(cache.page_size, div_ceil(over, per_unit))) > 0
        leaves = [n for n in cache.iter_nodes() if not n.children and not n.lock_ref]
        leaves.sort(key=lambda n: n.last_access)
        freed = 0
        for node in leaves:  # 1. dead KV
            dead = len(node) - self._usable(node)
            dead -= dead % cache.page_size
            if dead > 0:
                cache.evict_leaf(node, dead)
                freed += dead * per_unit
                if freed >= over:
                    return True
        if freed:
            return True
        if state is None:  # a window's leaf is whole or useless: least recent goes whole
            for node in leaves:
                cache.evict_leaf(node)
                freed += len(node) * per_unit
                if freed >= over:
                    break
            return bool(leaves)
        old = sorted((c for c in state.held.values() if state.superseded(c)), key=lambda c: c.tick)
        if old:  # 2. superseded checkpoints
            state.drop(old[: max(1, div_ceil(over, max(state.state_bytes, 1)))])
            return True
        segs = [(n, cps[-1]) for n in leaves if (cps := state._of(n))]
        if not segs:  # 3. leaf segments
            return False
        value, cost = [], []
        for node, _ in segs:
            freed = self._segment(node)
            value.append(self.flops(self._depth(node)))
            cost.append(state.state_bytes + freed * self.token_bytes)
        ticks = [float(c.tick) for _, c in segs]
        score = utility(ticks, value, cost, self.alpha)
        order = sorted(range(len(segs)), key=score.__getitem__)
        drop: list[Checkpoint] = []
        gone = 0.0
        for i in order:
            drop.append(segs[i][1])
            gone += cost[i]
            if gone >= over:
                break
        state.drop(drop)  # their KV is dead now: the next round frees it
        return True

    def _segment(self, leaf: TreeNode) -> int:
        """Units that dropping ``leaf``'s last checkpoint frees: its KV back to the
        checkpoint before it on the path, or to a branch point or a lock, whichever
        comes first."""
        state = self.state
        cps = state._of(leaf)  # type: ignore[union-attr]
        if len(cps) > 1:
            return len(leaf) - cps[-2].offset
        freed, x = len(leaf), leaf.parent
        while x is not None and x.id and len(x.children) == 1 and not x.lock_ref:
            cps = state._of(x)  # type: ignore[union-attr]
            if cps:
                return freed + len(x) - cps[-1].offset
            freed += len(x)
            x = x.parent
        return freed

    def _usable(self, node: TreeNode) -> int:
        """Units of leaf ``node`` up to the last place a match may end in it (a
        checkpoint, a served window)."""
        usable = len(node)
        if self.state is not None:
            cps = self.state._of(node)
            usable = cps[-1].offset if cps else 0
        if self.window is not None and usable and not self.window.servable(node):
            usable = 0  # (retain="ends" keeps no window inside a leaf)
        return usable

    @staticmethod
    def _depth(node: TreeNode) -> int:
        depth, x = 0, node
        while x is not None and x.id:
            depth += len(x)
            x = x.parent
        return depth


__all__ = ["HybridBudget", "utility"]
