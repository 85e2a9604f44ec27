"""`TreeComponent`: how per-node data other than the full-attention KV joins the tree.

The core (`radixkv.tree.core`) walks, splits, inserts, merges, trims and evicts nodes;
it knows nothing of block hashes, event streams, sliding-window KV or recurrent state.
Each of those is a component: it keeps one entry per node in ``node.ext[index]`` and
hears of every structural change through the hooks below, in the order they happen.

The contract (what the core promises, and what a component must do):

* **Creation.** Every node of the cache (the root included) gets the component's
  ``empty`` entry (immutable: every new node shares it) when it is created; a component
  sees a new node first in ``new_leaf`` (an insert's new leaf, before it is linked) or
  ``split`` (the upper half of a split).
* **Split** ``split(lower, upper, units)``: called *before* the core cuts ``lower``'s
  key, so the node is still whole (its key, its parent link); ``upper`` is new and
  empty, not linked yet. The component divides its data: the first ``units`` units go
  to ``upper``, the rest stay with ``lower`` (which keeps its identity, as the node
  contract says). It must move lock counts so that every lock still covers the same
  tokens.
* **Merge** ``merge(leaf, parent)``: under chain merging an insert's new ``leaf``
  takes the place of ``parent`` (an unlocked leaf): the component concatenates.
* **Eviction** ``evicting(victims, trim, slots)`` runs after the core chose its
  victims (whole leaves, and with ``precise`` eviction one node's tail ``trim = (node,
  units)``) and before the allocator frees their ``slots``; nothing is unlinked yet, and
  if the allocator raises, the tree stays as it was, so ``evicting`` must change no
  state a retry would see twice. ``evicted(victims, trim)`` runs once they are gone.
* **Insert** (optional) ``inserted(path, leaf, start, n, extra)``: after an insert of
  ``n`` units linked everything; ``path`` covers the ``start`` units cached before,
  ``leaf`` (or ``None``: nothing new) holds the rest as its tail (merged: its whole
  node), and ``extra`` is what the caller handed this component for the key
  (``insert_node(..., extras={name: ...})``, one entry per unit), if anything.
* **Detach** ``detach(node)``: before `RadixCache.detach_leaf` unlinks a leaf;
  ``detached(node, parent)`` after.
* **Reset** ``reset()``: before the whole tree is dropped.
* **Locks** (optional: a component without ``lock`` is not called) ``lock(path)`` and
  ``unlock(path)`` get the path from the locked node up to the root's child, after the
  core changed ``lock_ref``; each returns the change in the component's own evictable
  size (the core's full-attention sizes are the core's).
* **Matching** (optional) ``match_limit(path, partial, units)``: a match may use only
  what every component can serve (a sliding window needs its last W tokens present, a
  recurrent layer a state checkpoint). ``path`` is the fully matched nodes, ``partial``
  the node the match ends inside (``units`` of it matched) or ``None``. It returns how
  many units from the root the match may keep; the core cuts the match there (a veto
  is a cut to 0). Called before anything is split or touched.
* **Event gates** (optional) ``event_gate(sink, chain)``: a component whose data
  decides which pages KV events may tell (a sliding window: only those a match can end
  at) builds the component that tells them, given the real event sink and the hash
  chain component (whose own sink is then muted); the core hosts it beside the chain.
  ``event_gate(None, None)``: no sink listens any more. The gate names its component
  in ``gated``; a component whose ``flush`` reports events sets ``tells_events``.
* **Changes** (optional) ``heard(source, node)``: a component whose data of ``node``
  changed outside the hooks above (a checkpoint taken or dropped, a window's slots)
  tells the cache (`RadixCache.changed`), and every other component with ``heard``
  hears it, in the cache's order: how one component follows another's data (an
  eviction order, an event gate) without either holding a callback of the other's.
* **Checks** ``check_node(node, parent)`` for every node, then ``check(nodes)`` with the
  set of node ids in the tree: raise ``AssertionError`` naming the violation.
* **Freeing** (`release`): a component hands the slots it lets go to its allocator
  from inside the hooks, after the tree changed, so it must not raise there: a free
  that fails keeps its slots pending (``pending``), retried by the next `release` or
  `flush`; the error is counted in ``free_failures``. A slot is never lost, never freed
  twice.

A component may read the core's node fields; it never links, unlinks or re-keys a node.

Owns: the hooks and their contract. Must not touch: any one component's data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixkv.tree.core import RadixCache
    from radixkv.tree.node import TreeNode


class TreeComponent:
    """Base of the tree's components: every hook is a no-op (see the module contract).
    Subclasses set ``name`` and override what they need."""

    name = "component"
    index = -1  # its entry in ``node.ext``; set by the cache
    empty: Any = None  # a new node's entry (immutable: shared by every new node)
    cache: RadixCache
    # set to a callable by a component that takes part (see the module docstring)
    lock: Callable[[list[TreeNode]], int] | None = None
    unlock: Callable[[list[TreeNode]], int] | None = None
    match_limit: Callable[[list[TreeNode], TreeNode | None, int], int] | None = None
    inserted: Callable[..., None] | None = None
    event_gate: Callable[[Any, Any], TreeComponent | None] | None = None
    heard: Callable[[TreeComponent, TreeNode], None] | None = None
    gated: TreeComponent | None = None  # an event gate: the component it tells for
    tells_events = False  # its ``flush`` reports KV events (a hash chain, a gate)

    allocator: Any = None  # ``free(slots)``; ``None``: released slots are dropped
    pending: list[torch.Tensor]  # slots whose free failed, retried
    free_failures = 0

    def release(self, slots: torch.Tensor | None = None) -> None:
        """Hand ``slots`` (and any still pending) to the allocator; never raises (see
        the module contract)."""
        pending = self.__dict__.setdefault("pending", [])
        if slots is not None and len(slots):
            pending.append(slots)
        if not pending or self.allocator is None:
            pending.clear()
            return
        import torch

        batch = torch.cat(pending) if len(pending) > 1 else pending[0]
        try:
            self.allocator.free(batch)
        except Exception:
            self.free_failures += 1
            pending[:] = [batch]
            return
        pending.clear()

    def flush(self) -> int:
        """Retry the pending frees; returns how many slots are still pending."""
        self.release()
        return sum(len(t) for t in self.__dict__.get("pending", []))

    def attach(self, cache: RadixCache, index: int) -> None:
        """The cache takes the component (while empty); its data lives at ``index``."""
        self.cache, self.index = cache, index

    def new_leaf(self, leaf: TreeNode, parent: TreeNode) -> None:
        pass

    def split(self, lower: TreeNode, upper: TreeNode, units: int) -> None:
        pass

    def merge(self, leaf: TreeNode, parent: TreeNode) -> None:
        pass

    def evicting(
        self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None, slots: torch.Tensor
    ) -> None:
        pass

    def evicted(self, victims: list[TreeNode], trim: tuple[TreeNode, int] | None) -> None:
        pass

    def detach(self, node: TreeNode) -> None:
        pass

    def detached(self, node: TreeNode, parent: TreeNode) -> None:
        pass

    def reset(self) -> None:
        pass

    def check_node(self, node: TreeNode, parent: TreeNode) -> None:
        pass

    def check(self, nodes: set[int]) -> None:
        pass


__all__ = ["TreeComponent"]
