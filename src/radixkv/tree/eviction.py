"""Eviction: the index of evictable leaves, `evict`, and the eviction modes.

Owns: the order in which leaves leave (the policy's sort key over a queue and a heap),
choosing victims, unlinking them and trimming a tail, and resolving the eviction mode.
Must not touch: what components keep per node (they hear ``evicting`` / ``evicted``).

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
from collections import deque
from typing import TYPE_CHECKING, Any

from radixkv.key import TOKEN_BYTES, as_bool, as_count
from radixkv.tree.node import NO_CHILDREN, bytes_to_tensor
from radixkv.units import align_up

if TYPE_CHECKING:
    from radixkv.tree.core import RadixCache
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


class Eviction:
    """`RadixCache`'s eviction (a mixin: the cache's fields are its own)."""

    # --- eviction index ----------------------------------------------------------------
    def _push(self: RadixCache, node: TreeNode) -> None:
        node._ver += 1
        entry = (*self._policy_key(node), node._ver, node)
        run, heap = self._run, self._heap
        if not run or entry > run[-1]:
            run.append(entry)
        else:
            heapq.heappush(heap, entry)
        if len(heap) + len(run) > 2 * self._num_nodes + 64:
            live = self._live
            self._run = deque(e for e in run if live(e))  # still in order
            heap[:] = [e for e in heap if live(e)]
            heapq.heapify(heap)

    @staticmethod
    def _live(entry: tuple[Any, ...]) -> bool:
        node = entry[-1]
        return (
            entry[-2] == node._ver
            and node.parent is not None
            and not node.children
            and node.lock_ref == 0
        )

    # --- eviction ----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``min(num_tokens, evictable_size())`` tokens in the policy's order.

        Whole unlocked leaves are removed until that many are freed (SGLang's semantics:
        the last one can overshoot by up to its length). With ``precise`` the last
        one is trimmed from its tail (whole pages) instead, overshooting by less than a
        page.
        The removed slot indices go to ``allocator.free`` in a single call, made after the
        victims are chosen and before any of them is unlinked: if it raises, the tree is
        unchanged and the error propagates.

        Returns:
            The number of tokens evicted.
        """
        need = as_count(num_tokens, "num_tokens")
        if self.disable or need == 0:
            return 0
        victims, trim, popped, uncovered = self._choose_victims(need)
        if not victims and trim is None:
            return 0  # only dead index entries were taken
        return self._remove(victims, trim, popped, uncovered)

    def evict_leaf(self, node: TreeNode, units: int | None = None) -> int:
        """Evict one chosen unlocked leaf: whole, or its last ``units`` (whole pages),
        for a caller with an eviction order of its own (a hybrid cache's utility).
        Frees as `evict` does (components told, one ``allocator.free``).

        Raises:
            ValueError: ``node`` is not an unlocked leaf of this cache, or ``units`` is
                not a positive multiple of the page size up to its length.
        """
        self.path_to_root(node, "evict_leaf")
        if node is self.root or node.children or node.lock_ref:
            raise ValueError(f"evict_leaf: node {node.id} is not an unlocked leaf")
        length = len(node)
        units = length if units is None else as_count(units, "units")
        if not 0 < units <= length or units % self.page_size:
            raise ValueError(f"evict_leaf: units must be whole pages in (0, {length}], "
                             f"got {units}")  # fmt: skip
        if units < length:
            return self._remove([], (node, units), [], [])
        return self._remove([node], None, [], [(node.parent,)])

    def _remove(
        self,
        victims: list[TreeNode],
        trim: tuple[TreeNode, int] | None,
        popped: list[Any],
        uncovered: list[Any],
    ) -> int:
        """Free and unlink chosen victims (see `evict`)."""
        freed = [v._value for v in victims]
        if trim is not None:
            node, take = trim
            freed.append(node._value[(len(node) - take) * TOKEN_BYTES :])
        slots = bytes_to_tensor(freed)
        for c in self._components:
            c.evicting(victims, trim, slots)
        if self.allocator is not None:
            try:
                self.allocator.free(slots)
            except BaseException:
                for entry in popped:
                    heapq.heappush(self._heap, entry)
                raise
        evicted = self._unlink(victims, uncovered)
        if trim is not None:
            evicted += self._trim(*trim)
        for c in self._components:
            c.evicted(victims, trim)
        self._evictable -= evicted
        return evicted

    def _choose_victims(
        self, need: int
    ) -> tuple[list[TreeNode], tuple[TreeNode, int] | None, list[Any], list[Any]]:
        """Pick whole leaves in the policy's order until ``need`` tokens; with ``precise``
        the last one may be a tail ``(node, units)`` instead. Nothing changes but the
        index entries taken (returned, to put back if the free fails), and the parents
        that become leaves once their children go (``uncovered``)."""
        page, root = self.page_size, self.root
        heap, run, pop, push = self._heap, self._run, heapq.heappop, heapq.heappush
        policy_key = self._policy_key
        popped: list[Any] = []
        uncovered: list[Any] = []
        gone: dict[TreeNode, int] = {}  # parent -> its children chosen as victims
        victims: list[TreeNode] = []
        while need > 0:
            from_run = bool(run) and (not heap or run[0] < heap[0])  # the smaller head
            first = run[0] if from_run else heap[0] if heap else None
            if uncovered and (first is None or uncovered[0][:-2] < first[:-2]):
                node = pop(uncovered)[-1]
            elif first is not None:
                entry = run.popleft() if from_run else pop(heap)
                popped.append(entry)
                node = entry[-1]
                if entry[-2] != node._ver or node.children or node.lock_ref or node.parent is None:
                    continue
            else:
                break
            length = len(node._value) >> 3
            if need < length and self.precise:  # the last victim: trim its tail
                take = align_up(need, page)
                if take < length:
                    return victims, (node, take), popped, uncovered
            victims.append(node)
            need -= length
            parent = node.parent
            left = gone[parent] = gone.get(parent, 0) + 1
            if parent is not root and left == len(parent.children) and not parent.lock_ref:
                push(uncovered, (*policy_key(parent), 0, parent))
        return victims, None, popped, uncovered

    def _unlink(self, victims: list[TreeNode], uncovered: list[Any]) -> int:
        """Take the victims out of the tree; index the parents left childless. Returns
        the tokens they held."""
        root, step = self.root, self.page_size * self._width
        evicted = 0
        for node in victims:
            parent = node.parent
            first = node._key[:step]
            del parent.children[
                (node.extra_key, first) if parent is root and node.extra_key is not None else first
            ]
            node.parent = None
            if not parent.children:
                parent.children = NO_CHILDREN
            evicted += len(node._value) >> 3
        self._num_nodes -= len(victims)
        for entry in uncovered:  # left childless, and not victims themselves
            parent = entry[-1]
            if parent.parent is not None and not parent.children:
                self._push(parent)
        return evicted

    def _trim(self, node: TreeNode, take: int) -> int:
        """Cut ``take`` units from ``node``'s tail (its slots are freed)."""
        keep = (len(node._value) >> 3) - take
        shared = node._key is node._value
        node._key = node._key[: keep * self._width]
        node._value = node._key if shared else node._value[: keep * TOKEN_BYTES]
        self._push(node)
        return take
