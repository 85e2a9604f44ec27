"""One memory for a hybrid model's cache: full-attention KV pages, sliding-window KV pages
and recurrent-state checkpoints all drawn from one byte budget (`EngineConfig.cache_bytes`).

Why one arena carved into units, not pools that move under one cap. Pools that move
must be sized for the most each could ever hold (three times the budget reserved) or be
resized, which moves live KV and rewrites every slot index the tree and the request
table hold. An arena of fixed units needs neither: it is allocated once, at the budget,
and a unit is whatever kind needs it next.

    unit          one page (``page_size`` tokens) of K and V over ``group`` attention
                  layers, ``group`` a divisor of the gcd of the full and the sliding
                  layers' counts (vLLM groups layers the same way for one block pool):
                  the one that wastes the least of a checkpoint (`layer_group`)
    full page     ``full layers / group`` units (``columns``); its page id is its first
                  unit, so a full layer of the first column reads its KV by slot, as the
                  separate pool did; the other columns go through ``ArenaPages.table``
    window page   the same, over the sliding layers
    checkpoint    ``ceil(state bytes / unit bytes)`` units, anywhere: a state is copied
                  into them from the request's running row when the tree takes it, and
                  back into a running row on a hit (copy, never lend), as SGLang copies
                  a mamba state on a hit

Each kind's allocator (`TokenToKVPoolAllocator` with an `ArenaPages` source) keeps its
own slot bookkeeping; only its free pages come from the arena. When a kind is short, the
engine's `ArenaRoom` frees units in the simulator's `radixkv` order (`HybridBudget`):
spare windows, dead KV, superseded checkpoints, then the lowest utility; it never
livelocks: when nothing more can go, the caller is told (the scheduler preempts).

Invariants (``check``): every unit is free or held by exactly one page of one kind or
one checkpoint; the per-kind counts equal what they hold.

Owns: the units, who holds each, the KV and state views over them. Must not touch: the
tree (the budget evicts through it), the slots within a page (the allocators').
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from radixkv.units import div_ceil

KINDS = ("full", "window", "states")


class Arena:
    """``num_units`` units of ``unit_bytes`` bytes, one tensor on ``device``."""

    def __init__(self, num_units: int, unit_bytes: int, device: Any = "cpu") -> None:
        if num_units < 1 or unit_bytes < 1:
            raise ValueError(f"an arena needs units, got {num_units} of {unit_bytes} bytes")
        self.num_units, self.unit_bytes = num_units, unit_bytes
        self.data = torch.zeros((num_units, unit_bytes), dtype=torch.uint8, device=device)
        self._stack = np.arange(num_units - 1, -1, -1, dtype=np.int64)  # lowest first
        self._n = num_units
        self.owner = np.full(num_units, -1, dtype=np.int8)  # index into KINDS, -1 free
        self.held = dict.fromkeys(KINDS, 0)  # units per kind
        self.evicted = dict.fromkeys(KINDS, 0)  # units freed by eviction, per kind

    @property
    def nbytes(self) -> int:
        return self.num_units * self.unit_bytes

    def free_units(self) -> int:
        return self._n

    def peek(self, k: int) -> np.ndarray:
        """The next ``k`` free units (in the order `pop` takes them)."""
        return self._stack[self._n - k : self._n][::-1].copy()

    def pop(self, units: np.ndarray, kind: str) -> None:
        """Take ``units``, which `peek` named, for ``kind``."""
        self._n -= len(units)
        self.owner[units] = KINDS.index(kind)
        self.held[kind] += len(units)

    def take(self, k: int, kind: str) -> np.ndarray | None:
        """``k`` free units for ``kind``, or ``None`` (nothing changes)."""
        if k > self._n:
            return None
        units = self.peek(k)
        self.pop(units, kind)
        return units

    def push(self, units: np.ndarray, kind: str) -> None:
        """Units of ``kind`` back.

        Raises:
            ValueError: a unit ``kind`` does not hold (nothing changes).
        """
        if len(units) and (self.owner[units] != KINDS.index(kind)).any():
            raise ValueError(f"arena: a unit given back as {kind} is not held by it")
        if len(np.unique(units)) != len(units):
            raise ValueError("arena: a unit is given back twice in one call")
        self.owner[units] = -1
        n = self._n
        self._stack[n : n + len(units)] = units
        self._n = n + len(units)
        self.held[kind] -= len(units)

    def held_bytes(self) -> dict[str, int]:
        """Bytes held per kind."""
        return {k: v * self.unit_bytes for k, v in self.held.items()}

    def check(self, holders: dict[str, list[np.ndarray]]) -> None:
        """Every unit is free or held once, by the kind the owners say (``holders``:
        the units each kind's holders name). Raises ``AssertionError``."""
        free = self._stack[: self._n]
        every = np.concatenate([free, *(u for us in holders.values() for u in us)])
        count = np.bincount(every, minlength=self.num_units)
        if (count > 1).any():
            raise AssertionError(f"arena: unit {np.flatnonzero(count > 1)[0]} is held twice")
        if (count == 0).any():
            raise AssertionError(f"arena: unit {np.flatnonzero(count == 0)[0]} is lost")
        assert (self.owner[free] == -1).all(), "arena: a free unit has an owner"
        for kind, us in holders.items():
            units = np.concatenate(us) if us else np.empty(0, dtype=np.int64)
            i = KINDS.index(kind)
            assert (self.owner[units] == i).all(), f"arena: a {kind} unit is marked otherwise"
            assert len(units) == self.held[kind] == int((self.owner == i).sum()), (
                f"arena: the {kind} count is off"
            )


class ArenaPages:
    """A kind's pages from the arena (a `radixkv.kvcache.memory.PageSource`): a page is
    ``columns`` units; its id is its first unit, ``table[page]`` all of them. ``cap``:
    the most pages the kind may hold (``None``: as many as the arena has)."""

    def __init__(self, arena: Arena, kind: str, columns: int, cap: int | None = None) -> None:
        if kind not in KINDS[:2] or columns < 1 or (cap is not None and cap < 1):
            raise ValueError(f"pages of kind {kind!r} with {columns} columns, cap {cap}")
        self.arena, self.kind, self.columns, self.cap = arena, kind, columns, cap
        self.num_pages = arena.num_units
        self.table = np.full((self.num_pages, columns), -1, dtype=np.int64)
        self.table_t = torch.from_numpy(self.table)  # the same memory, for KV indexing
        self._peeked = np.empty((0, columns), dtype=np.int64)  # the last peek's units

    def clear(self) -> None:
        bound = self.out_mask()
        if bound.any():
            self.arena.push(self.table[bound].ravel(), self.kind)
        self.table[:] = -1

    def held_pages(self) -> int:
        return self.arena.held[self.kind] // self.columns

    def over_cap(self, pages: int) -> int:
        """Pages the kind must free before ``pages`` more fit under its cap."""
        return 0 if self.cap is None else self.held_pages() + pages - self.cap

    def count(self) -> int:
        free = self.arena.free_units() // self.columns
        return free if self.cap is None else max(0, min(free, self.cap - self.held_pages()))

    def peek(self, k: int) -> np.ndarray:
        self._peeked = self.arena.peek(k * self.columns).reshape(k, self.columns)
        return self._peeked[:, 0].copy()

    def pop(self, pages: np.ndarray) -> None:
        """Take the pages the last `peek` named (the allocator's commit step)."""
        units = self._peeked
        assert np.array_equal(units[:, 0], pages), "pop: not the pages peek named"
        self.arena.pop(units.ravel(), self.kind)
        self.table[pages] = units

    def push(self, pages: np.ndarray) -> None:
        self.arena.push(self.table[pages].ravel(), self.kind)
        self.table[pages] = -1

    def out_mask(self) -> np.ndarray:
        return self.table[:, 0] >= 0

    def units(self) -> np.ndarray:
        """Every unit this kind's pages hold."""
        return self.table[self.out_mask()].ravel()

    def check(self) -> None:
        out = self.out_mask()
        assert (self.table[out, 0] == np.flatnonzero(out)).all(), "a page's id is not its unit"
        assert (self.table[~out] == -1).all(), "a free page names units"


class ArenaKV:
    """K and V of every attention layer, as views over the arena (the interface of
    `radixkv.kvcache.memory.KVPool`: ``write``, ``read``, the byte sizes).

    Args:
        arena: the units; ``unit_bytes`` must be one page of ``group`` layers' K and V.
        full, window: the two kinds' pages (``None``: no such layers); layer ``l`` of
            ``window_layers`` is a window layer, every other one a full layer.
    """

    def __init__(
        self, arena: Arena, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
        page_size: int, group: int, full: ArenaPages | None, window: ArenaPages | None,
        window_layers: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.num_layers, self.dtype, self.page = num_layers, dtype, page_size
        self.window_layers = tuple(sorted(window_layers))
        self._layer = 2 * kv_heads * head_dim * dtype.itemsize  # one token of one layer
        if arena.unit_bytes != page_size * group * self._layer:
            raise ValueError("the arena's unit is not one page of the layer group")
        self._rows = arena.data.view(dtype).view(arena.num_units * page_size, group, 2,
                                                 kv_heads, head_dim)  # fmt: skip
        fulls = [i for i in range(num_layers) if i not in self.window_layers]
        self._where: list[tuple[ArenaPages, int, int]] = []  # per layer: pages, column, sub
        for i in range(num_layers):
            kind = self.window_layers if i in self.window_layers else fulls
            pages = window if i in self.window_layers else full
            assert pages is not None, f"layer {i} has no pages"
            j = kind.index(i)
            self._where.append((pages, j // group, j % group))

    @property
    def token_shape(self) -> tuple[int, int]:
        """One token's K (or V) of one layer: ``(kv heads, head dim)``."""
        return (self._rows.shape[3], self._rows.shape[4])

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def bytes_per_token(self) -> int:
        return (self.num_layers - len(self.window_layers)) * self._layer

    def window_bytes_per_token(self) -> int:
        return len(self.window_layers) * self._layer

    def nbytes(self) -> int:
        return self._rows.numel() * self.dtype.itemsize

    def _rows_of(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, int]:
        pages, col, sub = self._where[layer]
        if col == 0:  # a page's id is its first unit: the slot is the row
            return slots, sub
        p = self.page
        if p == 1:
            return pages.table_t[slots, col], sub
        return pages.table_t[slots // p, col] * p + slots % p, sub

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows, sub = self._rows_of(layer, slots)
        self._rows[rows, sub, 0] = k
        self._rows[rows, sub, 1] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, sub = self._rows_of(layer, slots)
        kv = self._rows[rows, sub]
        return kv[:, 0], kv[:, 1]


class ArenaCheckpoints:
    """Recurrent-state checkpoints in arena units: ``units(id)`` of each, where a
    checkpoint's id is its first unit (what the tree's `StateCheckpoints` holds as its
    slot). ``state_bytes`` bytes each, in ``per`` units."""

    def __init__(self, arena: Arena, state_bytes: int) -> None:
        self.arena, self.state_bytes = arena, state_bytes
        self.per = div_ceil(state_bytes, arena.unit_bytes)
        self._units: dict[int, np.ndarray] = {}

    @property
    def held_ids(self) -> list[int]:
        return list(self._units)

    def store(self, flat: torch.Tensor) -> int | None:
        """A new checkpoint of ``flat`` (a state's bytes, uint8); ``None``: no units."""
        units = self.arena.take(self.per, "states")
        if units is None:
            return None
        pad = self.per * self.arena.unit_bytes - flat.numel()
        data = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
        dev = self.arena.data.device
        self.arena.data[torch.from_numpy(units).to(dev)] = data.view(self.per, -1).to(dev)
        self._units[int(units[0])] = units
        return int(units[0])

    def load(self, cid: int) -> torch.Tensor:
        """Checkpoint ``cid``'s state bytes (a uint8 copy)."""
        units = torch.from_numpy(self._units[cid]).to(self.arena.data.device)
        return self.arena.data[units].view(-1)[: self.state_bytes]

    def give(self, ids: list[int]) -> None:
        for cid in ids:
            self.arena.push(self._units.pop(cid), "states")

    def units(self) -> list[np.ndarray]:
        return list(self._units.values())


class ArenaRoom:
    """Frees arena units on demand, in the simulator's ``radixkv`` order: windows no
    match end needs, then `HybridBudget` (dead KV, superseded checkpoints, lowest
    utility). ``make(units)`` returns whether that many are free now; it stops when
    nothing more can go (the caller then waits or preempts: never a livelock)."""

    def __init__(
        self, arena: Arena, budget: Any, full_columns: int, window: Any = None,
        window_columns: int = 1, page: int = 1,
    ) -> None:  # fmt: skip
        self.arena, self.budget, self.window = arena, budget, window
        self.full_columns, self.window_columns, self.page = full_columns, window_columns, page

    def make(self, units: int) -> bool:
        arena = self.arena
        if arena.free_units() < units:
            self._counted(lambda: self._free(units))
        return arena.free_units() >= units

    def _free(self, units: int) -> None:
        arena = self.arena
        if self.window is not None:  # windows no match can end at go first
            short = units - arena.free_units()
            self.window.evict_spare(div_ceil(short, self.window_columns) * self.page)
        while arena.free_units() < units:
            short = units - arena.free_units()
            if self.budget.evict_bytes(short * arena.unit_bytes) <= 0:
                break

    def _evict_own(self, kind: str, tokens: int) -> None:
        """A kind at its cap: its own least recently used pages go (window KV: the spare
        windows first)."""
        if kind == "full":
            self.budget.cache.evict(tokens)
        elif self.window is not None:
            freed = self.window.evict_spare(tokens)
            if freed < tokens and self.budget.cache.order.floor is None:  # (under a
                self.window.evict(tokens - freed)  # floor: only what no match can use)

    def _counted(self, evict: Any) -> None:
        """Run ``evict``, adding what each kind lost to the arena's evicted counts."""
        before = dict(self.arena.held)
        evict()
        for kind, n in before.items():
            self.arena.evicted[kind] += max(0, n - self.arena.held[kind])

    def evict_for(self, allocator: Any, need: int) -> int:
        """Free units until ``allocator`` (a kind's pages) has ``need`` more slots
        free; returns the full-attention tokens the tree lost. A kind at its cap frees
        its own pages first (full KV: the tree's least recently used leaves; window KV:
        the spare windows, then the least recently used)."""
        src, p = allocator.source, self.page
        cache = self.budget.cache
        before = cache.total_size()
        over = src.over_cap(allocator.available_size() // p + div_ceil(need, p))
        if over > 0:
            self._counted(lambda: self._evict_own(src.kind, over * p))
        self.make((allocator.available_size() // p + div_ceil(need, p)) * src.columns)
        return max(0, before - cache.total_size())

    def available(self, allocator: Any) -> int:
        """Slots of ``allocator``'s kind that can be had now: free units and the full
        KV eviction may free; with no lock held (nothing running), every held unit
        (evicting every node frees its windows and checkpoints too). Windows and
        checkpoints beside locks are not counted: an admission waits rather than
        evict what running requests' neighbours cached."""
        cache, arena, src = self.budget.cache, self.arena, allocator.source
        if not cache.protected_size():
            full = cache.evictable_size() // self.page * self.full_columns
            units = arena.num_units - arena.held["full"] + full
        else:
            units = arena.free_units() + cache.evictable_size() // self.page * self.full_columns
        slots = units // src.columns * self.page
        if src.cap is not None:  # what its cap leaves, and what of its own may go
            if src.kind == "full":
                evictable = cache.evictable_size()
            else:
                evictable = self.window.evictable_units() if self.window is not None else 0
            slots = min(slots, (src.cap - src.held_pages()) * self.page + evictable)
        return slots


def layer_group(full: int, window: int, layer_page: int, state_bytes: int = 0) -> int:
    """Layers a unit spans: a divisor of the gcd of the two kinds' layer counts (a page of
    either kind is then whole units). The one whose units waste the least of a
    checkpoint (``state_bytes``, rounded up to whole units), the largest of those (fewer
    units a page, fewer table lookups): a tiny Qwen3.5-like model's 33 KiB state took 40
    KiB in units of two layers' page and takes 36 KiB in one layer's, which lifted the
    tightest budget's hit rate from 0.341 to 0.385. ``layer_page``: one layer's page."""
    g = math.gcd(full, window)
    divisors = [d for d in range(g, 0, -1) if g % d == 0]
    return min(divisors, key=lambda d: div_ceil(state_bytes, d * layer_page) * d * layer_page)


def arena_kv(
    arena: Arena, shape: Any, layers: int, heads: int, dim: int, dtype: torch.dtype,
    page: int, full: ArenaPages | None, managers: Any,
) -> ArenaKV:  # fmt: skip
    """The K and V views over ``arena`` (``shape``: the plan's `ArenaPlan`): the full
    pages ``full``, the window pages of the window manager among ``managers``, if any."""
    window = next((m.allocator.source for m in managers if m.kind == "window"), None)
    return ArenaKV(arena, layers, heads, dim, dtype, page, shape.group, full, window,
                   shape.window_layers)  # fmt: skip


__all__ = ["Arena", "ArenaCheckpoints", "ArenaKV", "ArenaPages", "ArenaRoom", "arena_kv",
           "layer_group"]  # fmt: skip
