"""`TreeNode`, the results of a lookup, and the packed-bytes helpers the tree is built on.

Owns: the node's fields and what they mean, `MatchResult` / `InsertResult`, and the
conversions between packed int64 ``bytes`` and tensors. Must not touch: the tree's
structure (`radixkv.tree.core` links and unlinks nodes) or any component's data
(``ext`` holds one entry per component, each read and written by its component only).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

from radixkv.key import RadixKey, to_token_array

_EMPTY = b""
# every leaf shares this read-only empty mapping (an empty dict is 64 bytes a leaf)
NO_CHILDREN: Mapping[Any, Any] = MappingProxyType({})


class TreeNode:
    """A node of the radix tree: a run of key units and the KV slot indices they occupy.

    Attributes:
        children: mapping from the first page of a child's key to the child (leaves share
            one read-only empty mapping; a node gets its own dict with its first child).
        parent: the parent node; ``None`` for the root and for evicted nodes.
        lock_ref: number of holders whose locked path passes through this node; a node
            with ``lock_ref > 0`` is never evicted.
        last_access: logical-clock tick of the last match/insert through this node.
        hit_count: matches and inserts through this node since it was created.
        created: logical-clock tick of creation (inherited by both halves of a split).
        priority: the highest ``priority`` any insert through this node gave.
        id: unique, increasing creation number (the final tie-break of every policy).
        extra_key: the namespace of the key this node belongs to.
        ext: the tree components' data (`radixkv.tree.component`), one entry per
            component in the cache's order; ``None`` in a cache without components.
        key_bytes: the key units, packed int64 (``len(node)`` of them; pairs under EAGLE).
        value_bytes: the slot indices, packed int64 (``len(node)`` of them).
        heap_version: bumped each time the eviction order indexes the node; an index
            entry with another version is stale.

    ``key_bytes``, ``value_bytes`` and ``heap_version`` are the raw form that the tree's
    walks and components read without a copy (`key` and `value` copy). Only the tree
    (`radixkv.tree.core`, `radixkv.tree.eviction`) writes them.
    """

    __slots__ = (
        "children",
        "created",
        "ext",
        "extra_key",
        "heap_version",
        "hit_count",
        "id",
        "key_bytes",
        "last_access",
        "lock_ref",
        "parent",
        "priority",
        "value_bytes",
    )

    def __init__(self, node_id: int, key: bytes = _EMPTY, value: bytes = _EMPTY) -> None:
        self.children: Mapping[Any, TreeNode] = NO_CHILDREN  # a dict once it has one
        self.parent: TreeNode | None = None
        self.key_bytes = key
        self.value_bytes = value
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.created = 0
        self.priority = 0
        self.id = node_id
        self.extra_key: Any = None
        self.heap_version = 0
        self.ext: list[Any] | None = None

    def __len__(self) -> int:
        """Number of logical units (tokens or bigram pairs) in this node."""
        return len(self.value_bytes) >> 3

    @property
    def is_bigram(self) -> bool:
        return len(self.key_bytes) == 2 * len(self.value_bytes) and len(self.value_bytes) > 0

    @property
    def key(self) -> RadixKey:
        """This node's key units as a `RadixKey` (a fresh copy)."""
        raw = np.frombuffer(self.key_bytes, dtype=np.int64)
        if self.is_bigram:
            pairs = raw.reshape(-1, 2)
            raw = np.concatenate((pairs[:, 0], pairs[-1:, 1]))
        out = array("q")
        out.frombytes(raw.tobytes())
        return RadixKey(out, self.extra_key, is_bigram=self.is_bigram)

    @property
    def value(self) -> torch.Tensor:
        """This node's slot indices as a 1-D int64 tensor (a fresh copy)."""
        return bytes_to_tensor([self.value_bytes])

    @property
    def last_access_time(self) -> int:
        """Alias of ``last_access`` under SGLang's name (a logical tick, not seconds)."""
        return self.last_access

    @property
    def evicted(self) -> bool:
        """True once the node has been removed from its tree (root never is)."""
        return self.parent is None and self.id != 0

    def __repr__(self) -> str:
        keys = np.frombuffer(self.key_bytes, dtype=np.int64)[:10].tolist()
        more = "..." if len(self.key_bytes) > 80 else ""
        return (
            f"TreeNode(id={self.id}, len={len(self)}, lock_ref={self.lock_ref}, key={keys}{more})"
        )


def units_before(node: TreeNode) -> int:
    """Units from the root to where ``node`` starts: its ancestors' lengths (the root,
    id 0, has none). O(depth). A prefix's length at ``offset`` units into ``node`` is
    ``units_before(node) + offset``."""
    units, x = 0, node.parent
    while x is not None and x.id:
        units += len(x.value_bytes) >> 3
        x = x.parent
    return units


class MatchParts(NamedTuple):
    """Result of `RadixCache.match_parts`: one walk, for a caller that copies slots.

    Attributes:
        parts: the slot indices as packed int64 ``bytes`` chunks (per node; read-only).
        last_node: the node where the match ends.
        hit: units matched (what every component can serve).
        full: the full-attention KV's match, before the components' cut (a hybrid
            request's branch point).
    """

    parts: list[bytes]
    last_node: TreeNode
    hit: int
    full: int


class MatchResult(NamedTuple):
    """Result of `RadixCache.match_prefix`.

    Attributes:
        indices: 1-D int64 CPU tensor of the cached prefix's slot indices.
        last_node: the node where the match ends (lock it to keep the prefix).
        prefix_len: number of logical units matched (``len(indices)``).
    """

    indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int


class InsertResult(NamedTuple):
    """Result of `RadixCache.insert_node`.

    Attributes:
        prefix_len: leading units that were cached before the call.
        last_node: the node where the inserted key ends.
    """

    prefix_len: int
    last_node: TreeNode


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch: a tensor exists only
    once torch is loaded (the tree runs without it: a router's trees hold no slots)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def bytes_to_tensor(parts: list[bytes]) -> torch.Tensor:
    """Concatenate packed int64 chunks into one 1-D int64 tensor (one copy)."""
    import torch

    buf = bytearray().join(parts)
    if not buf:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buf, dtype=torch.int64)


def check_slots(packed: bytes) -> None:
    """Slot indices a node would store must be distinct and non-negative (a negative or
    repeated slot would alias another token's KV)."""
    slots = np.frombuffer(packed, dtype=np.int64)
    if len(slots) == 1:
        if slots[0] < 0:
            raise ValueError(f"value holds a negative slot index {int(slots[0])}")
        return
    if slots[0] >= 0 and (slots[1:] > slots[:-1]).all():
        return  # increasing from a non-negative start: distinct, O(k) (the common case)
    ordered = np.sort(slots)
    if ordered[0] < 0:
        raise ValueError(f"value holds a negative slot index {int(ordered[0])}")
    if (ordered[1:] == ordered[:-1]).any():
        dup = ordered[1:][ordered[1:] == ordered[:-1]][0]
        raise ValueError(f"value holds slot index {int(dup)} twice")


def as_int64_bytes(values: Any, name: str = "value") -> bytes:
    """Pack a 1-D sequence of integers (tensor, ndarray, array, list) as int64 bytes.

    Raises:
        TypeError: the elements are not integers.
        ValueError: the input is not 1-D.
    """
    if is_tensor(values):
        import torch

        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype == torch.int64 and values.device.type == "cpu":
            return values.numpy(force=True).tobytes()  # fast path: slot indices as given
        if values.is_floating_point() or values.is_complex():
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        return values.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    if isinstance(values, array) and values.typecode == "q":
        return values.tobytes()
    return to_token_array(values, name).tobytes()
