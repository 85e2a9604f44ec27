"""`HybridBudget`: one byte budget over a hybrid model's cache (full-attention KV,
sliding-window KV, recurrent-state checkpoints) and the order it evicts in.

A hybrid prefix is worth something only up to its deepest checkpoint (the recurrent
layers start there) and only where the window layers' last ``window`` tokens are held,
so bytes are not all alike. `evict_bytes` frees, in this order, until enough is free:

1. **Dead KV**: an unlocked leaf's tail past the last place a match may end in it (its
   last checkpoint: no recurrent layer can start further; with a window, a leaf whose
   end lost its window KV is dead whole), least recently used first.
2. **Superseded checkpoints** (`StateCheckpoints.superseded`: an earlier turn's end
   that the conversation went on from, with no branch there, or that a running request
   is going on from: `StateCheckpoints.pass_through`), least recently used first; the
   KV stays, the conversation's later checkpoint still needs it (and starts with one
   use if requests went on from the dropped one twice or more:
   `StateCheckpoints.drop_superseded`).
3. **Leaf segments by worth**: a leaf's last checkpoint and the KV that dropping it
   frees (back to the checkpoint before it on the path, a branch point or a lock). Its
   worth per byte is what a hit there saves (``flops`` of the whole prefix: by default
   its units, the tokens a hit saves; Marconi counts prefill FLOPs) times how often hits
   came through it (``1 + uses`` of the checkpoint, whose count outlives an eviction:
   `StateCheckpoints`' use history; ``frequency=False``: once) over the bytes it frees.
   The default order, Greedy-Dual-Size-Frequency (Cherkasova, 1998), drops the lowest
   ``age + worth`` first, where ``age`` is a clock that rises to each victim's score
   and a checkpoint keeps the clock's value from when it was last used or taken
   (`Checkpoint.age`): a segment left alone long enough goes, however much it saves,
   and no weight needs tuning. ``order="utility"`` is Marconi's: the lowest
   ``recency + alpha x worth``, each term scaled to [0, 1] over the candidates.
   ``order="priority"`` drops the leaf with the lowest tree ``priority`` first (least
   recently used among equals): the order someone else stamps, as the session order
   does (`radixkv.kvcache.sessions`: what returns last goes first). Its KV turns dead
   and goes by step 1.
   (Counting only the FLOPs over the checkpoint before it, or the node's bytes, lost 3-5
   points on one trace or the other; counting hits gained up to 0.05 on Marconi's trace
   and the synthetic chat; greedy-dual over utility gained up to 0.08 on both and in
   the engine; worth in tokens rather than FLOPs did as well or better nearly
   everywhere, in FLOPs saved too; the use history gained up to 0.07 at the tightest
   sizes and lost at most 0.003; the hand-on of a superseded checkpoint's use gained
   0.003 on Mooncake's trace and moved nothing else: docs/hybrid.md.)

With a window and no recurrent layers, step 3 evicts whole leaves, least recently used
first (trimming a leaf's tail would leave its new end without window KV); a `WindowKV`
with ``retain="ends"`` frees window KV no useful end needs as the tree changes. With
neither, the tree's own eviction (its policy's order) frees full KV.

Under a floor (`radixkv.tree.eviction.EvictionOrder.below`, read from the cache's
order), steps 1 and 2 stay (what they free serves no match) and step 3 passes over the
leaves whose ``priority`` is at or above it (a load ahead's room: `radixkv.engine.ahead`).

A last resort outside that order (`drop_held_checkpoint`, for the scheduler only): a
request running alone whose own locked path holds the units its KV needs gets them from
the checkpoints on that path (a hit copied what it needed at admission).

Invariants: only unlocked nodes lose KV; a checkpoint a running request holds a lock
under is never dropped by steps 1 and 3 (its node is locked), only by the last resort,
and a retained (protected) one never; every byte freed goes
through the tree's or a component's eviction (their allocators, their hooks).

Incremental: the budget is a tree component (it joins the cache at construction,
while the cache is empty). The tree's hooks, a lock's path and the checkpoints' own
changes (heard through `RadixCache.changed`) mark the nodes they touch; a round first
re-reads those alone and keeps three sets current: the unlocked leaves, those with
dead KV and the superseded checkpoints (with each leaf's depth). ``check`` recomputes
them from scratch (the tree's ``check_integrity`` runs it).

Complexity: a round is O(marked nodes + dead leaves + superseded checkpoints + leaves
with checkpoints), never a walk of the whole tree (each candidate's segment is an
O(chain) walk up its single-child chain); with a window, O(leaves) for their windows.
A round frees at least one segment, a tail or a checkpoint.

Owns: the order of eviction across components. Must not touch: the components' data
(it calls their API) or the tree's structure (it evicts through `RadixCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.kvcache.arena import ArenaRoom
from radixkv.kvcache.recurrent.component import utility, utility_array
from radixkv.tree.component import TreeComponent
from radixkv.tree.node import units_before
from radixkv.units import div_ceil

_LRU = attrgetter("last_access", "id")  # least recently used first (ids break ties)
_STAMPED = attrgetter("priority", "last_access", "id")  # order="priority": lowest first
_TICK = attrgetter("tick")
_USES = attrgetter("uses")
_AGE = attrgetter("age")
ORDERS = ("greedy-dual", "utility", "priority")  # step 3's order (the module docstring)

if TYPE_CHECKING:
    from radixkv.kvcache.recurrent.component import Checkpoint, StateCheckpoints
    from radixkv.kvcache.window.component import WindowKV
    from radixkv.tree.core import RadixCache
    from radixkv.tree.node import TreeNode


class HybridBudget(TreeComponent):
    """Bytes held by a hybrid cache, and eviction by worth (see the module docstring).

    Args:
        cache: the tree (empty: the budget joins it as a component); ``state`` and
            ``window``: its components, if the model has them.
        token_bytes: full-attention KV bytes of one unit (all full layers together).
        window_bytes: window-layer KV bytes of one unit.
        flops: what a hit at a prefix of ``n`` units saves (default: ``n``, its tokens;
            Marconi's worth is its prefill FLOPs, `radixkv.kvcache.spec.prefill_flops`).
        alpha: weight of efficiency against recency (``order="utility"`` only).
        frequency: weigh what a segment saves by how many hits came through its
            checkpoint (``1 + Checkpoint.uses``); ``False``: Marconi's efficiency alone.
        order: step 3's order, ``greedy-dual``, ``utility`` (Marconi's) or
            ``priority`` (the leaves' stamped ``priority``, lowest first).

    Raises:
        ValueError: bad sizes, an unknown ``order`` (or ``alpha`` without the utility
            order), or a cache that holds pages already.
    """

    name = "budget"

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
        frequency: bool = True,
        order: str = "greedy-dual",
    ) -> None:
        if token_bytes < 0 or window_bytes < 0 or token_bytes + window_bytes < 1:
            raise ValueError("token_bytes and window_bytes must be >= 0, one of them > 0")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if alpha != 1.0 and order != "utility":
            raise ValueError(f"alpha weighs the utility order only, not {order!r}")
        self.state, self.window = state, window
        self.token_bytes, self.window_bytes = token_bytes, window_bytes
        self.flops, self.alpha, self.frequency = flops, alpha, frequency
        self.order = order
        self._marked: set[TreeNode] = set()  # touched since the last round
        self._leaves: set[TreeNode] = set()  # unlocked leaves
        self._dead: set[TreeNode] = set()  # unlocked leaves with dead KV (no window)
        self._old: dict[TreeNode, tuple[Checkpoint, ...]] = {}  # superseded, by node
        self._segs: set[TreeNode] = set()  # unlocked leaves with checkpoints
        self._value: dict[TreeNode, float] = {}  # their prefix FLOPs (what a hit saves)
        self._cost: dict[TreeNode, float] = {}  # bytes dropping their last one frees
        self._last: dict[TreeNode, Checkpoint] = {}  # their last checkpoint
        self._parents: list[TreeNode | None] = []  # an eviction's victims' parents
        cache.add_component(self)

    def heard(self, source: TreeComponent, node: TreeNode) -> None:
        """The state's checkpoints of ``node`` changed (`RadixCache.changed`)."""
        if source is self.state:
            self._mark(node)

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
        self._refresh()
        window = self.window is not None
        freed = 0
        for node in sorted(self._leaves if window else self._dead, key=_LRU):
            dead = len(node) - self._usable(node)  # 1. dead KV
            dead -= dead % cache.page_size
            if dead > 0:
                cache.evict_leaf(node, dead)
                freed += dead * per_unit
                if freed >= over:
                    return True
        if freed:
            return True
        floor = cache.order.floor  # (a caller's `EvictionOrder.below`: nothing at or above)
        if state is None:  # a window's leaf is whole or useless: least recent goes whole
            leaves = sorted(self._leaves, key=_STAMPED if self.order == "priority" else _LRU)
            if floor is not None:
                leaves = [x for x in leaves if x.priority < floor]
            for node in leaves:
                cache.evict_leaf(node)
                freed += len(node) * per_unit
                if freed >= over:
                    break
            return bool(leaves)
        old = sorted((c for cps in self._old.values() for c in cps), key=_TICK)
        if old:  # 2. superseded checkpoints
            state.drop_superseded(old[: max(1, div_ceil(over, max(state.state_bytes, 1)))])
            return True
        segs = sorted(self._segs, key=_LRU)  # 3. leaf segments (ties: least recent first)
        if floor is not None:
            segs = [x for x in segs if x.priority < floor]
        if not segs:
            return False
        last = list(map(self._last.__getitem__, segs))
        n = len(segs)
        value = np.fromiter(map(self._value.__getitem__, segs), np.float64, n)
        cost = np.fromiter(map(self._cost.__getitem__, segs), np.float64, n)
        if self.frequency:  # the hits that came through it (read now: they count at once)
            value *= 1.0 + np.fromiter(map(_USES, last), np.float64, n)
        if self.order == "greedy-dual":  # the clock when last used + what it saves per byte
            score = np.fromiter(map(_AGE, last), np.float64, n) + value / np.maximum(cost, 1.0)
        elif self.order == "priority":  # stamped by someone else (exact: ints below 2^63)
            score = np.fromiter((x.priority for x in segs), np.int64, n)
        else:
            ticks = np.fromiter(map(_TICK, last), np.float64, n)
            score = utility_array(ticks, value, cost, self.alpha)
        drop: list[Checkpoint] = []
        gone = 0.0
        for i in np.argsort(score, kind="stable").tolist():
            drop.append(last[i])
            gone += cost[i]
            if gone >= over:
                break
        if self.order == "greedy-dual":  # the clock moves to the last victim's score
            state.age = max(state.age, float(score[i]))
        state.drop(drop)  # their KV is dead now: the next round frees it
        return True

    def drop_held_checkpoint(self) -> bool:
        """The last resort, never part of `evict_bytes`: drop the least recently used
        checkpoint still held, one under a running request's lock included (never a
        retained one). A hit copies its checkpoint (never lends it), so none is needed
        by the requests running; but a request running alone whose own path holds the
        units its KV needs can go on no other way (a burst at the tightest budget
        stalled so). The scheduler calls it for such a request only. False: none held."""
        state = self.state
        if state is None:
            return False
        held = [c for c in state.held.values() if c.slot not in state.protected]
        if not held:
            return False
        state.drop([min(held, key=_TICK)])
        return True

    def _segment(self, leaf: TreeNode) -> int:
        """Units that dropping ``leaf``'s last checkpoint frees: its KV back to the
        checkpoint before it on the path, or to a branch point or a lock, whichever
        comes first."""
        of = self.state.checkpoints  # type: ignore[union-attr]
        cps = of(leaf)
        if len(cps) > 1:
            return len(leaf) - cps[-2].offset
        freed, x = len(leaf), leaf.parent
        while x is not None and x.id and len(x.children) == 1 and not x.lock_ref:
            cps = of(x)
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
            cps = self.state.checkpoints(node)
            usable = cps[-1].offset if cps else 0
        if self.window is not None and usable and not self.window.servable(node):
            usable = 0  # (retain="ends" keeps no window inside a leaf)
        return usable

    # --- the candidate sets -------------------------------------------------------------
    def _refresh(self) -> None:
        """Re-read the nodes marked since the last round."""
        marked = list(self._marked)  # (the set stays: `heard` adds to it)
        self._marked.clear()
        for node in marked:
            self._reread(node)

    def _reread(self, node: TreeNode) -> None:
        state = self.state
        if node.parent is None:  # gone (or the root)
            self._forget(node)
            return
        if state is not None:
            old = tuple(c for c in state.checkpoints(node) if state.superseded(c))
            if old:
                self._old[node] = old
            else:
                self._old.pop(node, None)
        if node.children or node.lock_ref:
            self._forget(node, keep_old=True)
            return
        self._leaves.add(node)
        if self.window is None:
            dead = len(node) - self._usable(node)
            if dead >= self.cache.page_size:
                self._dead.add(node)
            else:
                self._dead.discard(node)
        if state is not None and (cps := state.checkpoints(node)):
            self._segs.add(node)
            self._last[node] = cps[-1]
            self._value[node] = self.flops(units_before(node) + len(node))
            self._cost[node] = state.state_bytes + self._segment(node) * self.token_bytes
        else:
            self._not_a_segment(node)

    def _not_a_segment(self, node: TreeNode) -> None:
        self._segs.discard(node)
        self._value.pop(node, None)
        self._cost.pop(node, None)
        self._last.pop(node, None)

    def _forget(self, node: TreeNode, keep_old: bool = False) -> None:
        self._leaves.discard(node)
        self._dead.discard(node)
        self._not_a_segment(node)
        if not keep_old:
            self._old.pop(node, None)

    def _mark(self, node: TreeNode) -> None:
        """Mark ``node`` and the leaf whose segment may run through it: the end of its
        single-child chain (a lock, a checkpoint or a branch there moves where that
        leaf's segment stops). O(chain)."""
        self._marked.add(node)
        x = node
        while len(x.children) == 1:
            x = next(iter(x.children.values()))
        if x is not node and not x.children:
            self._marked.add(x)

    # --- the tree's hooks: mark what they touch -----------------------------------------
    def new_leaf(self, leaf: TreeNode, parent: TreeNode) -> None:
        self._marked.add(leaf)
        self._mark(parent)  # (not linked yet: its single child's segment stops here now)

    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        self._marked.update((lower, upper))  # (a segment through them is unchanged)

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        self._marked.update((leaf, parent))

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: Any
    ) -> None:
        marked = self._marked
        marked.update(victims)
        self._parents = [v.parent for v in victims]  # (a retry overwrites it)
        if trim is not None:
            marked.add(trim[0])

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        for p in self._parents:
            if p is not None:
                self._mark(p)
        self._parents = []

    def detach(self, node: TreeNode) -> None:
        self._marked.add(node)

    def detached(self, node: TreeNode, parent: TreeNode) -> None:
        self._mark(parent)

    def lock(self, path: list[TreeNode]) -> int:
        if path:
            self._mark(path[0])  # its leaf, or the leaf below whose segment stops there
        return 0

    unlock = lock

    def reset(self) -> None:
        for s in (self._marked, self._leaves, self._dead, self._segs, self._old,
                  self._value, self._cost, self._last):  # fmt: skip
            s.clear()

    def check(self, nodes: set[int]) -> None:
        """The candidate sets equal their recomputation from scratch."""
        self._refresh()
        state = self.state
        leaves = {n for n in self.cache.iter_nodes() if not n.children and not n.lock_ref}
        if self._leaves != leaves:
            raise AssertionError("budget: the unlocked leaves it keeps are not the tree's")
        if self.window is None:
            dead = {n for n in leaves if len(n) - self._usable(n) >= self.cache.page_size}
            if self._dead != dead:
                raise AssertionError("budget: the leaves with dead KV are not the tree's")
        if state is None:
            return
        old = {c.slot for c in state.held.values() if state.superseded(c)}
        if {c.slot for cps in self._old.values() for c in cps} != old:
            raise AssertionError("budget: the superseded checkpoints are not the tree's")
        if self._segs != {n for n in leaves if state.checkpoints(n)}:
            raise AssertionError("budget: the leaves with checkpoints are not the tree's")
        if any(d.keys() != self._segs for d in (self._value, self._cost, self._last)):
            raise AssertionError("budget: it keeps a depth or segment for a non-candidate")
        for n in self._segs:
            cost = state.state_bytes + self._segment(n) * self.token_bytes
            if (
                self._value[n] != self.flops(units_before(n) + len(n))
                or self._cost[n] != cost
                or (self._last[n] is not state.checkpoints(n)[-1])
            ):
                raise AssertionError(f"budget: leaf {n.id}'s depth or segment is stale")


def arena_room(
    arena: Any, shape: Any, cache: Any, managers: Sequence[Any], page: int, order: str
) -> tuple[HybridBudget, ArenaRoom]:
    """One arena's budget over ``cache`` and the managers' components, in ``order``, and
    the room every kind allocates through (`radixkv.kvcache.arena.ArenaRoom`), handed to
    each manager (``shape``: the plan's `ArenaPlan`). A hit's worth: the tokens it saves."""
    parts = {m.kind: m.component for m in managers}
    unit = shape.unit_bytes
    budget = HybridBudget(cache, parts.get("states"), parts.get("window"),
                          token_bytes=shape.full_columns * unit // page,
                          window_bytes=shape.window_columns * unit // page,
                          order=order)  # fmt: skip
    room = ArenaRoom(arena, budget, shape.full_columns, parts.get("window"),
                     max(shape.window_columns, 1), page)  # fmt: skip
    for m in managers:
        m.use_room(room)
    return budget, room


__all__ = ["ORDERS", "HybridBudget", "arena_room", "utility"]
