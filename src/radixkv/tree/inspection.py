"""Looking at a `RadixCache` without changing it: every invariant checked from scratch,
and the tree as text.

Owns: ``check_integrity`` (the invariants listed in `radixkv.tree.core`, and each
component's own through its ``check_node`` / ``check``), ``check_locks`` (the locks
against their holders' ledger) and ``format_tree``. Must not
touch: anything; both only read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from radixkv.key import TOKEN_BYTES

if TYPE_CHECKING:
    from radixkv.tree.core import RadixCache
    from radixkv.tree.node import TreeNode

# format_tree indents at most this many levels, then writes the depth as a number
_MAX_INDENT = 32


def format_tree(cache: RadixCache, max_units: int = 10) -> str:
    """The tree as indented text, one node a line."""
    lines = [
        f"root  total={cache.total_size()} evictable={cache.evictable_size()} "
        f"protected={cache.protected_size()} nodes={cache.num_nodes()}"
    ]
    stack = [(c, 1) for c in reversed(cache.root.children.values())]
    while stack:
        node, depth = stack.pop()
        # a deep chain would make the indentation quadratic in size: cap it
        indent = "  " * depth if depth <= _MAX_INDENT else "  " * _MAX_INDENT + f"[{depth}] "
        units = np.frombuffer(node.key_bytes, dtype=np.int64)
        if node.is_bigram:
            shown = [tuple(p) for p in units.reshape(-1, 2)[:max_units].tolist()]
        else:
            shown = units[:max_units].tolist()
        more = "..." if len(node) > max_units else ""
        ns = f" ns={node.extra_key!r}" if node.extra_key is not None else ""
        lines.append(
            f"{indent}#{node.id} len={len(node)} lock={node.lock_ref} "
            f"hits={node.hit_count}{ns} {shown}{more}"
        )
        stack.extend((c, depth + 1) for c in reversed(node.children.values()))
    return "\n".join(lines)


def _fail(msg: str) -> None:
    raise AssertionError(f"RadixCache integrity: {msg}")


def check_integrity(cache: RadixCache) -> None:
    """Recompute every invariant from scratch.

    Raises:
        AssertionError: naming the first violated invariant and the node.
    """
    root, page, width = cache.root, cache.page_size, cache.unit_bytes
    if root.parent is not None or root.key_bytes or root.value_bytes or root.lock_ref != 1:
        _fail("root must have no parent, an empty key and lock_ref 1")
    comps = cache.components
    evictable = protected = count = 0
    evictable_leaves: dict[int, TreeNode] = {}
    seen: set[int] = {id(root)}
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for dict_key, child in node.children.items():
            where = f"node {child.id} (child of {node.id})"
            if id(child) in seen:
                _fail(f"{where} reached twice: the tree has a cycle or shared node")
            seen.add(id(child))
            if child.parent is not node:
                _fail(f"{where}: parent link points elsewhere")
            nv, nk = len(child.value_bytes), len(child.key_bytes)
            if nv == 0 or nv % TOKEN_BYTES or nk != (nv // TOKEN_BYTES) * width:
                _fail(f"{where}: key of {nk} bytes and value of {nv} bytes disagree")
            units = nv // TOKEN_BYTES
            if units % page:
                _fail(f"{where}: length {units} is not a multiple of page_size {page}")
            if dict_key != cache.child_key(node, child):
                _fail(f"{where}: stored under a dict key that is not its first page")
            if node is not root and child.extra_key != node.extra_key:
                _fail(f"{where}: namespace {child.extra_key!r} != parent's")
            if child.lock_ref < 0:
                _fail(f"{where}: negative lock_ref {child.lock_ref}")
            if max(child.last_access, child.created) > cache.clock or child.hit_count < 0:
                _fail(f"{where}: statistics ahead of the clock or negative")
            if child.id >= cache.next_id:
                _fail(f"{where}: id beyond the id counter")
            if (child.ext is None) != (not comps) or (comps and len(child.ext) != len(comps)):  # type: ignore[arg-type]
                _fail(f"{where}: {len(child.ext or ())} component entries, {len(comps)} "
                      "components")  # fmt: skip
            for c in comps:
                try:
                    c.check_node(child, node)
                except AssertionError as e:
                    _fail(f"{c.name}: {where}: {e}")
            child_locks += child.lock_ref
            if child.lock_ref:
                protected += units
            else:
                evictable += units
                if not child.children:
                    evictable_leaves[id(child)] = child
            count += 1
            stack.append(child)
        if node is not root and node.lock_ref < child_locks:
            _fail(f"node {node.id}: lock_ref {node.lock_ref} < children's sum {child_locks}")
    if count != cache.num_nodes():
        _fail(f"node count {count} != recorded {cache.num_nodes()}")
    for c in comps:
        try:
            c.check(seen)
        except AssertionError as e:
            _fail(f"{c.name}: {e}")
    if (evictable, protected) != (cache.evictable_size(), cache.protected_size()):
        _fail(
            f"sizes recomputed (evictable={evictable}, protected={protected}) != recorded "
            f"(evictable={cache.evictable_size()}, protected={cache.protected_size()})"
        )
    try:
        cache.order.check(evictable_leaves)
    except AssertionError as e:
        _fail(str(e))


def check_locks(cache: RadixCache, holders: Iterable[TreeNode]) -> None:
    """Every node's ``lock_ref`` is what ``holders`` account for: one lock each, held on
    its path to the root (``inc_lock_ref``). A lock taken and never released (or
    released twice) shows here, naming the node, rather than as a cache that cannot
    make room. O(nodes + the holders' path lengths).

    Raises:
        AssertionError: naming the first node whose locks differ.
    """
    want: dict[int, int] = {}
    for holder in holders:
        try:
            path = cache.path_to_root(holder, "check_locks")
        except ValueError:
            _fail(f"a lock holder's node {holder.id} is not in the tree")
        for node in path:
            want[id(node)] = want.get(id(node), 0) + 1
    for node in cache.iter_nodes():
        held = want.get(id(node), 0)
        if node.lock_ref != held:
            _fail(f"node {node.id}: lock_ref {node.lock_ref}, but its holders account for "
                  f"{held} (a lock leaked, or was released twice)")  # fmt: skip
