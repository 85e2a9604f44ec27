"""`StateCheckpoints`: recurrent-state snapshots (Mamba2, Gated DeltaNet, ...) as a tree
component.

A recurrent layer keeps one fixed-size state, updated in place token by token; a cached
prefix helps it only where a snapshot of that state exists. A checkpoint is such a
snapshot, taken after the prefix that ends at a position of the tree, held in a slot of
a state pool (the conv and SSM / DeltaNet states of every recurrent layer).

The contract (besides `radixkv.tree.component`'s):

* **Where.** A checkpoint sits at a page-aligned position inside a node, ``offset``
  units from the node's start (``0 < offset <= len(node)``; at the node's end when
  ``offset == len(node)``). A node may hold several (a merged chain keeps its turns'
  checkpoints). A split hands each checkpoint to the half that holds its position, a
  merge shifts the absorbed leaf's ones, a trimmed tail and an evicted node free theirs.
* **Matching.** A match may keep only up to the deepest checkpoint it passes
  (``match_limit``): the full-attention KV beyond it is useless to the recurrent
  layers. With ``split`` the match ends exactly there, so ``at(last_node)`` is the
  checkpoint to start from.
* **Copy, never lend.** A hit copies the checkpoint's state into the request's own
  slot (`at` gives the slot to copy from): the request updates its copy in place, the
  checkpoint stays as it was, so no lock is needed once the copy is made (the copy is
  made right after the match, on the thread that owns the cache).
* **Budget and eviction.** At most ``max_states`` checkpoints are held. Adding one
  beyond evicts others by the policy: ``lru`` (least recently used), or ``utility``
  (Marconi's idea: recency and prefill compute saved per byte, each normalised over the
  candidates, ``score = recency + alpha x efficiency``; the lowest goes). Evicting a
  checkpoint frees its slot (``allocator.free``) and leaves the node and its full KV.
* **Admission** (`plan`): where a request should be snapshotted, at page granularity:
  the end of its prompt, a branch point (where it leaves a cached path that has no
  checkpoint there, so the next request sharing that prefix hits), every
  ``every_pages`` pages of a long prefill (0: never), and boundaries the caller knows
  (a chat template's end of the system message, a prompt-cache breakpoint). The end of
  each output is the caller's to add when the request finishes.
* **Use history.** A checkpoint counts its ``uses`` (hits through it). One the caller
  drops for its worth (`drop`: an eviction order's victim; not a superseded one) leaves
  its count behind, keyed by a hash of its prefix (namespace and units), for the last
  ``history`` drops; a checkpoint taken again at that prefix starts from it, plus one:
  the prefix came back after it was evicted, a use the cache missed. An eviction order
  that weighs ``uses`` (`radixkv.kvcache.budget`) then tells a prefix that keeps
  returning from one seen once, across evictions (ARC's ghost lists, TinyLFU's history,
  for one count). A hash collision can only move a count, never what a match serves.
  A superseded checkpoint (`drop_superseded`) leaves no count; if requests went on from
  it twice or more, the next checkpoint on its path starts with one use.

Invariants (``check``): every checkpoint is at a page-aligned position of its node, held
once, its slot held once; ``len(held) <= max_states``; at most ``history`` counts are
remembered.

Owns: the checkpoints (positions, slots, use, utility). Must not touch: the tree's
structure, the full KV, the state pool's contents (the engine copies states).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.tree.component import TreeComponent
from radixkv.tree.node import units_before

if TYPE_CHECKING:
    from radixkv.tree.node import TreeNode

STATE_POLICIES = ("lru", "utility")
# why a checkpoint was taken: a sequence's end (prompt or output), a branch point, a
# template boundary, every N pages, a prompt's end less its last page (where it resent
# starts)
KINDS = ("end", "branch", "boundary", "interval", "resend")
SUPERSEDABLE = ("end", "interval", "resend")  # kinds a longer sequence through them supersedes
UTILITY_ALPHA = 1.0  # Marconi's weight of efficiency against recency
HISTORY = 4096  # dropped checkpoints whose use counts are remembered (the use history)


class Checkpoint:
    """One snapshot: where it sits, its slot, when it was last used (``tick``; ``age``:
    `StateCheckpoints.age` then, the clock a Greedy-Dual order reads), what it saves
    (``flops``: computed for the ``utility`` policy only, which reads it; 0.0 under
    ``lru``), and ``uses``: the hits that resumed from it or from a checkpoint past it on
    the same path (`StateCheckpoints.used`; it moves with the checkpoint through splits
    and merges, where a node's counts would not), and those of an earlier checkpoint at
    the same prefix that was dropped, plus one (the use history). ``passing``: the
    running requests that will cache a longer sequence through it (`pass_through`)."""

    __slots__ = ("age", "flops", "kind", "node", "offset", "passing", "slot", "tick", "uses")

    def __init__(
        self, node: TreeNode, offset: int, slot: int, tick: int, flops: float, kind: str
    ) -> None:
        self.node, self.offset, self.slot, self.tick, self.flops = node, offset, slot, tick, flops
        self.kind = kind
        self.uses = 0
        self.age = 0.0
        self.passing = 0

    def __repr__(self) -> str:
        return f"Checkpoint(node={self.node.id}, offset={self.offset}, slot={self.slot})"


class StateCheckpoints(TreeComponent):
    """Recurrent-state checkpoints in a radix tree (see the module docstring).

    Args:
        max_states: the most checkpoints held (the state pool's slots for the tree).
        allocator: ``free(slots)`` takes back the slots of evicted checkpoints (``None``:
            dropped).
        policy: ``lru`` or ``utility`` (Marconi's).
        prefill_flops: FLOPs to prefill a prefix of ``n`` tokens (the utility policy's
            compute saved; the default counts tokens, which ranks alike for one model).
        state_bytes: bytes of one checkpoint (the utility policy's cost).
        every_pages: `plan` also snapshots every this many pages (0: never).
        history: how many dropped checkpoints' use counts are remembered (0: none;
            the module docstring's use history).
        on_evict: told of the checkpoints `evict` drops by the policy.

    A change to a node's checkpoints (taken, dropped, passed through) is told to the
    cache's other components (`RadixCache.changed`): an eviction order follows them.
    """

    name = "state"

    def __init__(
        self,
        max_states: int,
        allocator: Any = None,
        policy: str = "lru",
        prefill_flops: Callable[[int], float] | None = None,
        state_bytes: int = 1,
        every_pages: int = 0,
        history: int = HISTORY,
        on_evict: Callable[[list[Checkpoint]], None] | None = None,
    ) -> None:
        if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
            raise ValueError(f"max_states must be a positive int, got {max_states!r}")
        if policy not in STATE_POLICIES:
            raise ValueError(f"policy must be one of {STATE_POLICIES}, got {policy!r}")
        if isinstance(every_pages, bool) or not isinstance(every_pages, int) or every_pages < 0:
            raise ValueError(f"every_pages must be a non-negative int, got {every_pages!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ValueError(f"history must be a non-negative int, got {history!r}")
        if allocator is not None and not callable(getattr(allocator, "free", None)):
            raise TypeError("allocator must have a free(slots) method")
        self.max_states, self.allocator, self.policy = max_states, allocator, policy
        self.prefill_flops = prefill_flops or float
        self.state_bytes, self.every_pages = state_bytes, every_pages
        self.history = history
        self._remembered: dict[int, int] = {}  # prefix hash -> uses, oldest drop first
        self.held: dict[int, Checkpoint] = {}  # slot -> checkpoint
        self._clock = itertools.count(1)
        # Greedy-Dual's clock L, raised by an eviction order that reads it (`HybridBudget`):
        # a checkpoint keeps the value it had when last used or taken (`Checkpoint.age`)
        self.age = 0.0
        self._lru: list[tuple[int, int]] = []  # (tick, slot), lazily invalidated
        self.evictions = 0  # checkpoints evicted to stay within max_states
        self.hits = 0  # matches served from a checkpoint
        self.added = 0  # checkpoints taken
        self.protected: dict[int, int] = {}  # slot -> protections (never evicted)
        # told of the checkpoints `evict` just dropped by the policy (a caller's own
        # `drop` is not told): the simulator's SGLang row drops their leaves with them
        self.on_evict = on_evict

    # --- reading ------------------------------------------------------------------------
    def _of(self, node: TreeNode) -> tuple[Checkpoint, ...]:
        return node.ext[self.index] or ()  # type: ignore[index]

    def checkpoints(self, node: TreeNode) -> tuple[Checkpoint, ...]:
        """The checkpoints inside ``node``, by offset."""
        return node.ext[self.index] or ()  # type: ignore[index]

    def at(self, node: TreeNode) -> int | None:
        """The slot of the checkpoint at ``node``'s end, if there is one."""
        for c in self._of(node):
            if c.offset == len(node):
                return c.slot
        return None

    def held_bytes(self) -> int:
        return len(self.held) * self.state_bytes

    def depth(self, c: Checkpoint) -> int:
        """Units from the root to the checkpoint's position."""
        return units_before(c.node) + c.offset

    # --- matching -----------------------------------------------------------------------
    def match_limit(self, path: list[TreeNode], partial: TreeNode | None, units: int) -> int:
        """Units from the root up to the deepest checkpoint within the match."""
        off = sum(map(len, path))
        if partial is not None:
            best = max((c.offset for c in self._of(partial) if c.offset <= units), default=0)
            if best:
                return off + best
        for node in reversed(path):
            off -= len(node)
            cps = self._of(node)
            if cps:
                return off + max(c.offset for c in cps)
        return 0

    def used(self, node: TreeNode) -> int | None:
        """A match ended at ``node``'s checkpoint and its state is being copied:
        count the hit and refresh its recency; returns the slot. Every checkpoint on the
        path to it counts one more use (one request's hit passed them all). O(depth)."""
        for c in self._of(node):
            if c.offset == len(node):
                self._touch(c)
                self.hits += 1
                x: TreeNode | None = node
                while x is not None:
                    for p in self._of(x):
                        p.uses += 1
                    x = x.parent
                return c.slot
        return None

    def _touch(self, c: Checkpoint) -> None:
        c.tick, c.age = next(self._clock), self.age
        heapq.heappush(self._lru, (c.tick, c.slot))

    # --- adding -------------------------------------------------------------------------
    def add(self, node: TreeNode, slot: int, offset: int | None = None, kind: str = "end") -> bool:
        """Keep ``slot``'s state as the checkpoint at ``offset`` units into ``node`` (its
        end by default). Returns False (the caller keeps its slot) when one is there
        already, and refreshes that one's recency (SGLang's unified cache does too);
        may evict others, never this one, to stay within ``max_states``.

        Raises:
            ValueError: ``node`` is not in the cache, the position is not a page
                boundary inside it, or ``slot`` is held already.
        """
        cache = self.cache
        cache.path_to_root(node, "StateCheckpoints.add")
        offset = len(node) if offset is None else offset
        if not 0 < offset <= len(node) or offset % cache.page_size:
            raise ValueError(f"offset {offset} is not a page boundary inside node {node.id}")
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot must be a non-negative int, got {slot!r}")
        if slot in self.held:
            raise ValueError(f"slot {slot} holds a checkpoint already")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        cps = self._of(node)
        for c in cps:
            if c.offset == offset:  # the same state again: it was just reached, refresh it
                self._touch(c)
                return False
        # the compute it saves: only the utility policy reads it (an O(depth) walk)
        flops = self.prefill_flops(units_before(node) + offset) if self.policy == "utility" else 0.0
        c = Checkpoint(node, offset, slot, next(self._clock), flops, kind)
        c.age = self.age
        if self._remembered:  # the prefix came back after its checkpoint was dropped
            before = self._remembered.pop(self._prefix_hash(node, offset), None)
            if before is not None:
                c.uses = before + 1
        node.ext[self.index] = (  # type: ignore[index]
            tuple(sorted((*cps, c), key=lambda x: x.offset)) if cps else (c,)
        )
        self.held[slot] = c
        self.added += 1
        self.cache.changed(self, node)  # (an eviction order follows: `HybridBudget`)
        heapq.heappush(self._lru, (c.tick, slot))
        if len(self._lru) > 2 * len(self.held) + 64:  # compact the lazy entries
            self._lru = [(x.tick, s) for s, x in self.held.items()]
            heapq.heapify(self._lru)
        if len(self.held) > self.max_states:
            self.evict(len(self.held) - self.max_states, keep=slot)
        return True

    # --- admission ----------------------------------------------------------------------
    def plan(
        self,
        prompt_units: int,
        full_hit: int,
        state_hit: int,
        boundaries: tuple[int, ...] = (),
        prompt_end: bool = True,
        resend: bool = False,
    ) -> list[tuple[int, str]]:
        """Positions (units from the root, page-aligned, increasing) to snapshot a
        request at during its prefill, with their kinds: its prompt's end, the branch
        point where it leaves a cached path without a checkpoint (``full_hit``, the
        full-attention match, when it lies beyond ``state_hit``, where the request
        starts), every ``every_pages`` pages, and ``boundaries`` (the end of a system
        message, breakpoints). A position two reasons share takes the first of branch,
        boundary, end, resend, interval. ``prompt_end=False`` when the output will be
        cached and checkpointed at its end: the prompt's end would be superseded at
        once. ``resend``: also the last page boundary strictly before the prompt's end
        (kind ``resend``), where the same prompt sent again starts (a request computes
        at least its last token, so a checkpoint at a page-aligned prompt's end serves
        no resend of it)."""
        page = self.cache.page_size
        end = prompt_units - prompt_units % page
        marks: dict[int, str] = {}
        if self.every_pages:
            step = self.every_pages * page
            marks.update(
                (p, "interval") for p in range(state_hit - state_hit % step + step, end, step)
            )
        if resend:
            last = prompt_units - 1
            marks[last - last % page] = "resend"
        if prompt_end:
            marks[end] = "end"
        marks.update((b - b % page, "boundary") for b in boundaries)
        if full_hit > state_hit:
            marks[full_hit - full_hit % page] = "branch"
        return sorted((p, k) for p, k in marks.items() if state_hit < p <= end)

    def superseded(self, c: Checkpoint) -> bool:
        """A sequence's end (or an interval's) that a longer cached sequence passes
        through with no branch there (a chat's earlier turn): only a request that leaves
        the path exactly there starts from it. Branch points and boundaries never are.
        So is one with nothing cached below it yet that a running request will cache a
        longer sequence through (`pass_through`): that request's own checkpoint past it
        lands only once the tree holds its pages, and until then the budget would drop
        what other sequences need in its place."""
        if c.kind not in SUPERSEDABLE:
            return False
        node = c.node
        if c.passing and not node.children:
            return True
        if c.offset < len(node):  # a later checkpoint here, or the path goes on below
            return c is not self._of(node)[-1] or bool(node.children)
        return len(node.children) == 1

    def pass_through(self, c: Checkpoint, by: int) -> None:
        """A running request will (``by=1``), or no longer will (``-1``: it left), cache a
        longer sequence through ``c``: the request took it and has computed a page past
        it since (`RecurrentStates`). One that was dropped meanwhile is left alone. O(1)."""
        if self.held.get(c.slot) is c:
            c.passing += by
            self.cache.changed(self, c.node)

    # --- eviction -----------------------------------------------------------------------
    def serving(self, node: TreeNode) -> tuple[Checkpoint, ...]:
        """The checkpoints a hit on the prefix ending at ``node``'s end starts from: the
        one at its end (a request going on past it), and the deepest strictly before
        it on the path (the same prefix sent again as a whole prompt, whose last token
        is always computed). O(depth) at worst."""
        end = tuple(c for c in self._of(node) if c.offset == len(node))
        inside = [c for c in self._of(node) if c.offset < len(node)]
        before = inside[-1] if inside else None
        x = node.parent
        while before is None and x is not None and x.id:
            cps = self._of(x)
            before = cps[-1] if cps else None
            x = x.parent
        return end + ((before,) if before is not None else ())

    def protect(self, c: Checkpoint) -> None:
        """Keep checkpoint ``c`` from eviction (a retained prefix, `radixkv.kvcache.retention`,
        which bounds how many) until `unprotect`; protections count."""
        if self.held.get(c.slot) is not c:
            raise ValueError(f"{c!r} is not held")
        self.protected[c.slot] = self.protected.get(c.slot, 0) + 1

    def unprotect(self, c: Checkpoint) -> None:
        """Undo one `protect` of ``c`` (gone already, its slot maybe reused by another
        checkpoint: nothing to do)."""
        if self.held.get(c.slot) is not c:
            return
        left = self.protected.get(c.slot, 0) - 1
        if left > 0:
            self.protected[c.slot] = left
        else:
            self.protected.pop(c.slot, None)

    def evict(self, n: int, keep: int | None = None) -> int:
        """Evict ``n`` checkpoints by the policy (never slot ``keep`` nor a protected
        one); returns how many."""
        if self.policy == "utility":
            victims = self._lowest_utility(n, keep)
        else:
            victims, kept = [], []
            while len(victims) < n and self._lru:
                tick, slot = heapq.heappop(self._lru)
                c = self.held.get(slot)
                if c is None or c.tick != tick:  # a stale entry
                    continue
                if slot == keep or slot in self.protected:
                    kept.append((tick, slot))
                    continue
                victims.append(c)
            for entry in kept:
                heapq.heappush(self._lru, entry)
        self.drop(victims)
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        return len(victims)

    def _lowest_utility(self, n: int, keep: int | None) -> list[Checkpoint]:
        cands = [c for s, c in self.held.items() if s != keep and s not in self.protected]
        if not cands:
            return []
        ticks = [c.tick for c in cands]
        score = utility(ticks, [c.flops for c in cands], [self.state_bytes] * len(cands),
                        UTILITY_ALPHA)  # fmt: skip
        order = sorted(range(len(cands)), key=lambda i: (score[i], ticks[i]))
        return [cands[i] for i in order[:n]]

    def drop(self, victims: list[Checkpoint]) -> None:
        """Evict these checkpoints (a caller's own order): forget them, free their
        slots (one ``allocator.free``; a failed one stays pending, see `release`), and
        remember their use counts (the module docstring's use history)."""
        if self.history:
            remembered = self._remembered
            for c in victims:
                key = self._prefix_hash(c.node, c.offset)
                remembered.pop(key, None)  # (a prefix dropped again is the newest drop)
                remembered[key] = c.uses
            while len(remembered) > self.history:
                del remembered[next(iter(remembered))]
        self._drop(victims)
        self.evictions += len(victims)

    def drop_superseded(self, victims: list[Checkpoint]) -> None:
        """Evict checkpoints a longer cached sequence passes through (`superseded`: a
        chat's earlier turns). They go for the conversation's sake, not their worth, so
        their counts are not remembered (the hits through them counted on the later
        checkpoints of their path too); one that requests went on from more than once
        (a resent prompt, a retried turn, a document two requests shared) hands the next
        checkpoint on its path, where the conversation is now, one use: the prefix is
        one requests come back to. Once is no sign (every chat's next turn does it; on
        fixed-length chats it foretells an end as often as a return), nor is the whole
        count handed on (it kept long conversations after they ended): docs/hybrid.md."""
        gone = {id(c) for c in victims}
        for c in victims:
            nxt = self._next(c, gone) if c.uses >= 2 else None
            if nxt is not None and not nxt.uses:
                nxt.uses = 1
        self._drop(victims)
        self.evictions += len(victims)

    def _prefix_hash(self, node: TreeNode, offset: int) -> int:
        """A hash of the prefix that ends ``offset`` units into ``node``: its namespace
        and every unit from the root. O(depth)."""
        parts = [node.key_bytes[: offset * self.cache.unit_bytes]]
        x = node.parent
        while x is not None and x.id:
            parts.append(x.key_bytes)
            x = x.parent
        parts.reverse()
        return hash((node.extra_key, b"".join(parts)))

    def _next(self, c: Checkpoint, skip: set[int]) -> Checkpoint | None:
        """The first checkpoint past ``c`` on its path (not one in ``skip``), down its
        node and the single-child chain below it. O(chain)."""
        node: TreeNode = c.node
        later = [x for x in self._of(node) if x.offset > c.offset and id(x) not in skip]
        while not later and len(node.children) == 1:
            node = next(iter(node.children.values()))
            later = [x for x in self._of(node) if id(x) not in skip]
        return later[0] if later else None

    def _drop(self, victims: list[Checkpoint]) -> None:
        """Forget checkpoints and free their slots."""
        if not victims:
            return
        i = self.index
        for c in victims:
            del self.held[c.slot]
            self.protected.pop(c.slot, None)
            node = c.node
            node.ext[i] = tuple(x for x in node.ext[i] if x is not c) or None  # type: ignore[index]
            self.cache.changed(self, node)
        self.release(torch.tensor([c.slot for c in victims], dtype=torch.int64))

    # --- hooks --------------------------------------------------------------------------
    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        cps = self._of(lower)
        if not cps:
            return
        up = tuple(c for c in cps if c.offset <= units)
        down = tuple(c for c in cps if c.offset > units)
        for c in up:
            c.node = upper
        for c in down:
            c.offset -= units
        upper.ext[self.index] = up or None  # type: ignore[index]
        lower.ext[self.index] = down or None  # type: ignore[index]

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        shift = len(parent)
        ours, theirs = self._of(leaf), self._of(parent)
        for c in ours:
            c.offset += shift
        for c in theirs:
            c.node = leaf
        leaf.ext[self.index] = (*theirs, *ours) or None  # type: ignore[index]

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        gone = [c for v in victims for c in self._of(v)]
        if trim is not None:
            node = trim[0]  # already trimmed by the core
            gone += [c for c in self._of(node) if c.offset > len(node)]
        self._drop(gone)

    def detach(self, node: TreeNode) -> None:
        self._drop(list(self._of(node)))

    def reset(self) -> None:
        if self.held:
            self.release(torch.tensor(list(self.held), dtype=torch.int64))
        self.held.clear()
        self._lru.clear()
        self.protected.clear()
        self._remembered.clear()
        self.age = 0.0

    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        page = self.cache.page_size
        offsets = [c.offset for c in self._of(node)]
        if offsets != sorted(set(offsets)):
            raise AssertionError(f"node {node.id}: checkpoints out of order or twice")
        for c in self._of(node):
            if c.node is not node or not 0 < c.offset <= len(node) or c.offset % page:
                raise AssertionError(f"node {node.id}: checkpoint at {c.offset} is not inside it")
            if self.held.get(c.slot) is not c:
                raise AssertionError(f"node {node.id}: checkpoint slot {c.slot} not held")

    def check(self, nodes: set[int]) -> None:
        if len(self.held) > self.max_states:
            raise AssertionError(f"{len(self.held)} checkpoints, at most {self.max_states}")
        if len(self._remembered) > self.history:
            raise AssertionError(f"{len(self._remembered)} counts kept, at most {self.history}")
        if not self.protected.keys() <= self.held.keys():
            raise AssertionError(
                f"protected slots not held: {self.protected.keys() - self.held.keys()}"
            )
        for c in self.held.values():
            if id(c.node) not in nodes:
                raise AssertionError(f"checkpoint slot {c.slot} sits on a node not in the tree")
            if c.age > self.age:
                raise AssertionError(f"checkpoint slot {c.slot}: its age is past the clock")
            if c.passing < 0:
                raise AssertionError(f"checkpoint slot {c.slot}: passed through {c.passing} times")


def utility(ticks: list[float], value: list[float], cost: list[float], alpha: float) -> list[float]:
    """Marconi's score of each candidate: recency plus ``alpha`` x value per byte, each
    scaled to [0, 1] over the candidates (the lowest goes first)."""
    arrays = (np.asarray(x, dtype=np.float64) for x in (ticks, value, cost))
    return utility_array(*arrays, alpha).tolist()  # (the same arithmetic as floats)


def utility_array(
    ticks: np.ndarray, value: np.ndarray, cost: np.ndarray, alpha: float
) -> np.ndarray:
    """`utility` over arrays (the same arithmetic, element by element)."""
    t0, t1 = ticks.min(), ticks.max()
    eff = value / np.maximum(cost, 1.0)
    e0, e1 = eff.min(), eff.max()
    rec = (ticks - t0) / (t1 - t0) if t1 > t0 else np.ones_like(ticks)
    return rec + alpha * ((eff - e0) / (e1 - e0) if e1 > e0 else np.ones_like(eff))


__all__ = ["KINDS", "STATE_POLICIES", "SUPERSEDABLE", "Checkpoint", "StateCheckpoints", "utility"]
