"""Eviction order: the index of evictable leaves (`EvictionOrder`), choosing victims in
the policy's order, and the eviction modes. A `RadixCache` owns one `EvictionOrder`; its
``evict`` asks it for victims, then frees and unlinks them itself.

Owns: the order in which leaves leave (the policy's sort key over a queue and a heap),
choosing victims, and resolving the eviction mode. Must not touch: the tree's structure
(the cache unlinks and trims), what components keep per node.

Why LRU's order is exactly kept by merging: without merging, the insert touches the leaf
(tick t) and gives the new child tick t + 1; no other node can ever hold a tick between
the two, and every later walk that reaches the child touches the leaf right before it. So
the child is always evicted before the leaf, and the leaf right after it (no other leaf
can come between): the pair behaves as one node with the child's tick whose tail goes
first, which is what a precise ``evict`` does to a merged node (it trims the last victim
from its tail, whole pages). A match or insert that ends or branches inside a merged node
splits it, as it would split the leaf. The differential test (``test_tree_merge.py``) runs
the same operations with and without merging and checks every match, every evicted slot
and the sizes agree. Other policies order by ``created``, ``hit_count`` or ``priority``,
which differ along a chain, so they keep one node per insert (``"merge"`` with another
policy is refused). A merged node keeps the chain's first ``created`` tick and its
``hit_count``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from radixkv.key import as_bool
from radixkv.units import align_up

if TYPE_CHECKING:
    from radixkv.tree.node import TreeNode

EVICTION_MODES = ("leaf", "precise", "merge")


def resolve_eviction_mode(
    eviction_policy: Any, mode: str | None, precise: bool | None, merge_chains: bool
) -> str:
    """The one eviction mode the arguments ask for, validated (see the module docstring).

    Raises:
        ValueError: the arguments disagree, or ``"merge"`` with a policy other than LRU.
    """
    merge_chains = as_bool(merge_chains, "merge_chains")
    lru = isinstance(eviction_policy, str) and eviction_policy.lower() == "lru"
    if (merge_chains or mode == "merge") and not lru:
        raise ValueError(
            f"merge_chains keeps only LRU's eviction order; eviction_policy is {eviction_policy!r}"
        )
    if precise is not None:
        precise = as_bool(precise, "precise")
    if merge_chains and precise is False:
        raise ValueError("merge_chains needs precise (a merged chain is evicted "
                         "from its tail, as its nodes would be one by one)")  # fmt: skip
    implied = "merge" if merge_chains else "precise" if precise else None
    if mode is None:
        mode = implied or "leaf"
    elif mode not in EVICTION_MODES:
        raise ValueError(f"eviction_mode must be one of {EVICTION_MODES}, got {mode!r}")
    elif (implied is not None and implied != mode) or (precise is False and mode != "leaf"):
        raise ValueError(f"eviction_mode {mode!r} disagrees with precise={precise}, "
                         f"merge_chains={merge_chains}")  # fmt: skip
    return mode


class Victims(NamedTuple):
    """What `EvictionOrder.choose` picked.

    Attributes:
        nodes: whole leaves to remove, in the policy's order.
        trim: ``(node, units)``: the last victim's tail to cut instead (precise), or None.
        popped: the index entries taken (put back with `EvictionOrder.put_back` if the
            free fails).
        uncovered: parents left without children once the victims go (heap entries).
    """

    nodes: list[TreeNode]
    trim: tuple[TreeNode, int] | None
    popped: list[Any]
    uncovered: list[Any]


class EvictionOrder:
    """The evictable leaves in the policy's order: entries ``(*sort key, version, node)``,
    flat so a comparison is one tuple compare. Entries pushed in order (LRU's, nearly
    always) queue up in a deque; the others go to a heap; the smaller head of the two is
    next. An entry is live while its version is the node's ``heap_version`` and the node
    is still an unlocked leaf in the tree; dead ones are skipped when popped and dropped
    when the entries outnumber the nodes twice over (plus 64; the count of nodes is read
    when the entries pass the last bound, so after nodes go the drop may come later).

    Args:
        policy_key: the sort key of a node (`radixkv.tree.policy.get_policy`).
        num_nodes: the tree's node count now (bounds the dead entries kept).

    Complexity: ``push`` O(1) in order, O(log n) otherwise; ``choose`` O((k + 1) log n)
    for k victims; ``peek`` O((d + 1) log n) for d dead entries dropped.
    """

    def __init__(self, policy_key: Callable[[TreeNode], Any], num_nodes: Callable[[], int]):
        self.policy_key = policy_key
        # `below`: while set, no victim whose sort key starts at or above it (a priority)
        self.floor: Any = None
        # the key of a parent whose children a choice takes (it is a leaf once they go):
        # an order whose key becoming a leaf changes sets it (the session order's: a
        # stale stamp counts as none), so one choice of many victims takes what the
        # same victims chosen a few at a time would
        self.uncovered_key = policy_key
        self._num_nodes = num_nodes
        self.clear()

    def clear(self) -> None:
        self._heap: list[tuple[Any, ...]] = []
        self._run: deque[tuple[Any, ...]] = deque()
        # entries held before the node count is read again (2 x nodes + 64 when last read)
        self._bound = 64

    def push(self, node: TreeNode) -> None:
        """Index ``node`` under its current sort key (an older entry of it goes stale)."""
        node.heap_version += 1
        entry = (*self.policy_key(node), node.heap_version, node)
        run, heap = self._run, self._heap
        if not run or entry > run[-1]:
            run.append(entry)
        else:
            heapq.heappush(heap, entry)
        if len(heap) + len(run) > self._bound:
            self._compact()

    def _compact(self) -> None:
        """Drop the dead entries once they outnumber the nodes twice over (the node
        count is read only here, not on every push)."""
        self._bound = 2 * self._num_nodes() + 64
        run, heap = self._run, self._heap
        if len(heap) + len(run) > self._bound:
            live = self.live
            self._run = deque(e for e in run if live(e))  # still in order
            heap[:] = [e for e in heap if live(e)]
            heapq.heapify(heap)

    @staticmethod
    def live(entry: tuple[Any, ...]) -> bool:
        node = entry[-1]
        return (
            entry[-2] == node.heap_version
            and node.parent is not None
            and not node.children
            and node.lock_ref == 0
        )

    def peek(self) -> tuple[tuple[Any, ...], TreeNode] | None:
        """The next victim `choose` would take first and its sort key, without taking it
        (dead entries at the heads are dropped); None when no leaf is evictable."""
        heap, run = self._heap, self._run
        while run or heap:
            from_run = bool(run) and (not heap or run[0] < heap[0])
            entry = run[0] if from_run else heap[0]
            if self.live(entry):
                return entry[:-2], entry[-1]
            if from_run:
                run.popleft()
            else:
                heapq.heappop(heap)
        return None

    @contextmanager
    def below(self, floor: Any) -> Iterator[None]:
        """Within the block, every eviction through this order (and through a budget
        that reads ``floor``: `radixkv.kvcache.budget.HybridBudget`) takes only leaves
        whose sort key starts below ``floor`` (with a priority order: what ranks below
        it); what would come after them stays. For a caller making room for something
        that must not push out what ranks above it (`radixkv.engine.ahead`)."""
        old, self.floor = self.floor, floor
        try:
            yield
        finally:
            self.floor = old

    def size_below(self, floor: Any, enough: int) -> int:
        """Units an eviction under `below` ``floor`` could take now, counted until
        ``enough``: each evictable leaf whose sort key starts below it, with the
        chain of unlocked single-child parents above it that rank below it too (a
        prompt inserted chunk by chunk is such a chain). Never more than it could take
        (a parent of several children is not counted). O(entries + chains) at most."""
        total, live, key = 0, self.live, self.uncovered_key
        for entry in itertools.chain(self._run, self._heap):
            if entry[0] >= floor or not live(entry):
                continue
            node = entry[-1]
            while True:
                total += len(node.value_bytes) >> 3
                node = node.parent
                if (node.parent is None or len(node.children) != 1 or node.lock_ref
                        or key(node)[0] >= floor):  # fmt: skip
                    break
            if total >= enough:
                break
        return total

    def put_back(self, popped: list[Any]) -> None:
        """Return entries `choose` took (the free of their slots failed)."""
        for entry in popped:
            heapq.heappush(self._heap, entry)

    def choose(self, need: int, page: int, precise: bool, root: TreeNode) -> Victims:
        """Pick whole leaves in the policy's order until ``need`` units; with ``precise``
        the last one may be a tail ``(node, units)`` instead. Nothing changes but the
        index entries taken, and the parents that become leaves once their children go
        (``uncovered``)."""
        heap, run, pop, push = self._heap, self._run, heapq.heappop, heapq.heappush
        policy_key = self.uncovered_key
        popped: list[Any] = []
        uncovered: list[Any] = []
        gone: dict[TreeNode, int] = {}  # parent -> its children chosen as victims
        victims: list[TreeNode] = []
        floor = self.floor
        while need > 0:
            from_run = bool(run) and (not heap or run[0] < heap[0])  # the smaller head
            first = run[0] if from_run else heap[0] if heap else None
            if uncovered and (first is None or uncovered[0][:-2] < first[:-2]):
                if floor is not None and uncovered[0][0] >= floor:
                    break  # (in order: all that is left ranks at or above it)
                node = pop(uncovered)[-1]
            elif first is not None:
                if floor is not None and first[0] >= floor:
                    break
                entry = run.popleft() if from_run else pop(heap)
                popped.append(entry)
                node = entry[-1]
                if (entry[-2] != node.heap_version or node.children or node.lock_ref
                        or node.parent is None):  # fmt: skip
                    continue
            else:
                break
            length = len(node.value_bytes) >> 3
            if need < length and precise:  # the last victim: trim its tail
                take = align_up(need, page)
                if take < length:
                    return Victims(victims, (node, take), popped, uncovered)
            victims.append(node)
            need -= length
            parent = node.parent
            left = gone[parent] = gone.get(parent, 0) + 1
            if parent is not root and left == len(parent.children) and not parent.lock_ref:
                push(uncovered, (*policy_key(parent), 0, parent))
        return Victims(victims, None, popped, uncovered)

    def check(self, evictable_leaves: dict[int, TreeNode]) -> None:
        """Every evictable leaf has exactly one live entry, holding its current sort key;
        both halves of the index are in order.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        heap, run = self._heap, list(self._run)
        if any(heap[i][:-1] < heap[(i - 1) >> 1][:-1] for i in range(1, len(heap))):
            raise AssertionError("eviction heap order broken")
        if any(run[i][:-1] < run[i - 1][:-1] for i in range(1, len(run))):
            raise AssertionError("eviction queue out of order")
        live: dict[int, int] = {}
        for entry in heap + run:
            if self.live(entry):
                node = entry[-1]
                if id(node) not in evictable_leaves:
                    raise AssertionError(
                        f"eviction index holds node {node.id}, which is not in the tree"
                    )
                if entry[:-2] != tuple(self.policy_key(node)):
                    raise AssertionError(
                        f"eviction index holds a stale sort key for node {node.id}"
                    )
                live[id(node)] = live.get(id(node), 0) + 1
        for ident, node in evictable_leaves.items():
            if live.get(ident, 0) != 1:
                raise AssertionError(
                    f"evictable leaf {node.id} has {live.get(ident, 0)} live index entries"
                )
