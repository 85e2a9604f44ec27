"""Eviction policies: each is a sort key over a node's statistics; the smallest is
evicted first.

All statistics come from the cache's *logical clock* (one tick per node touched), never
wall time, so the same sequence of operations always evicts in the same order.

| policy     | evicts first                                   | tie-break                    |
|------------|------------------------------------------------|------------------------------|
| `lru`      | least recently used (oldest `last_access`)     | node id (creation order)     |
| `mru`      | most recently used                             | node id                      |
| `fifo`     | earliest created (`created`)                   | node id                      |
| `filo`     | latest created                                 | node id                      |
| `lfu`      | fewest hits (`hit_count`)                      | then LRU, then node id       |
| `priority` | lowest `priority` (set by `insert(priority=)`) | then LRU, then node id       |
| `slru`     | probationary segment (`hit_count < 2`) before  | then LRU within a segment,   |
|            | the protected one (`hit_count >= 2`)           | then node id                 |
| `session`  | `priority`'s order, the priorities stamped by  | then LRU, then node id       |
|            | the engine from each agent session's predicted |                              |
|            | return (`radixkv.kvcache.sessions`)            |                              |

A node split in two keeps its statistics on both halves (the upper half was created and
used exactly when the lower one was). `hit_count` counts every `match_prefix` and
`insert` that passes through a node after it was created.

Owns: the eviction orders. Must not touch: the tree's index (it only supplies sort
keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.tree.node import TreeNode

PolicyKey = Callable[["TreeNode"], tuple[Any, ...]]

SLRU_PROTECTED_HITS = 2


def _lru(n: TreeNode) -> tuple[int, int]:
    return (n.last_access, n.id)


def _mru(n: TreeNode) -> tuple[int, int]:
    return (-n.last_access, n.id)


def _fifo(n: TreeNode) -> tuple[int, int]:
    return (n.created, n.id)


def _filo(n: TreeNode) -> tuple[int, int]:
    return (-n.created, n.id)


def _lfu(n: TreeNode) -> tuple[int, int, int]:
    return (n.hit_count, n.last_access, n.id)


def _priority(n: TreeNode) -> tuple[int, int, int]:
    return (n.priority, n.last_access, n.id)


def _slru(n: TreeNode) -> tuple[int, int, int]:
    return (1 if n.hit_count >= SLRU_PROTECTED_HITS else 0, n.last_access, n.id)


POLICIES: dict[str, PolicyKey] = {
    "lru": _lru,
    "lfu": _lfu,
    "fifo": _fifo,
    "mru": _mru,
    "filo": _filo,
    "priority": _priority,
    "slru": _slru,
    "session": _priority,  # (the engine stamps the priorities: radixkv.kvcache.sessions)
}


def get_policy(name: str | PolicyKey) -> PolicyKey:
    """The sort-key function of policy ``name``, or ``name`` itself when it is callable.

    A custom sort key (the simulator's Belady policy is one) returns a tuple, of the same
    length for every node (the cache flattens it into its heap entries), and must change
    only when the cache touches the node: the cache re-indexes a leaf when a match or
    insert passes through it, when it becomes a leaf, when it is unlocked and when it is
    trimmed.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"eviction_policy must be a str, got {type(name).__name__}")
    try:
        return POLICIES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown eviction_policy {name!r}; valid: {', '.join(POLICIES)}"
        ) from None
