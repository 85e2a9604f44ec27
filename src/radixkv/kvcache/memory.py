"""KV memory: the slot allocator and the KV tensor pool (the request-to-token table is
`radixkv.kvcache.req_table`).

A *slot* is one token's place in the KV pool. The allocator hands slots out in whole
pages of ``page_size`` slots (slot ``s`` lives in page ``s // page_size``) and takes them
back exactly once. The radix tree and the running requests hold slot indices; the
allocator knows which slots are handed out, so ``free`` can refuse a double free.

Invariants of `TokenToKVPoolAllocator` (checked by ``check``):
    * a page is on the free stack iff none of its slots is handed out;
    * ``page_count[p]`` equals the number of handed-out slots of page ``p``;
    * ``available_size() + handed_out + reserved_tail_size() == size``, where the reserved
      tail is the not-yet-handed-out rest of pages that are partly handed out (the
      owner's ``alloc_extend`` fills it; zero with ``page_size == 1``).

Owns: slots and KV tensors. Must not touch: the tree (`radixkv.kvcache.lifecycle` joins
the two), the request rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from radixkv.key import as_count
from radixkv.units import div_ceil


class Extension(NamedTuple):
    """Per request of a batch extension (`TokenToKVPoolAllocator.alloc_extend_batch`)."""

    continues: np.ndarray  # bool: it continues a partial page of its last slot
    tail: np.ndarray  # slots that fill that page
    pages: np.ndarray  # fresh pages the rest takes


def _as_index_array(indices: Any, name: str = "indices") -> np.ndarray:
    if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
        return indices
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.int64 and indices.device.type == "cpu" and indices.dim() == 1:
            return indices.numpy(force=True)
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {indices.dtype}")
        arr = indices.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(indices)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


_check_count = as_count


def usable_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, checked by placing a tensor there, so a pool is
    never built for a device this torch cannot use (every later call would fail).

    Raises:
        TypeError / ValueError: not a device name, or a device this machine lacks.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"device {str(device)!r} is not usable here: {first}") from None
    return dev


def index_device(device: torch.device) -> torch.device:
    """Where index tensors (slots, rows) live beside KV on ``device``: there, or on the
    CPU for an index-only cache (the ``meta`` device: KV tensors with shapes and no
    bytes, for replays that decide what a cache holds without computing it)."""
    return torch.device("cpu") if device.type == "meta" else device


def runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``starts[i] .. starts[i] + lengths[i] - 1``."""
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


class PageSource(Protocol):
    """Where an allocator's free pages come from: its own stack (`FreePageStack`), or an
    arena that other kinds of memory draw from too (`radixkv.kvcache.arena`). ``peek(k)``
    names the next ``k`` pages without taking them; ``pop`` takes exactly those."""

    num_pages: int

    def clear(self) -> None: ...
    def count(self) -> int: ...
    def peek(self, k: int) -> np.ndarray: ...
    def pop(self, pages: np.ndarray) -> None: ...
    def push(self, pages: np.ndarray) -> None: ...
    def out_mask(self) -> np.ndarray: ...
    def check(self) -> None: ...


class FreePageStack:
    """An allocator's own free pages: a stack; popping from the end hands out pages
    0, 1, 2, ... first."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.clear()

    def clear(self) -> None:
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._n = self.num_pages

    def count(self) -> int:
        return self._n

    def peek(self, k: int) -> np.ndarray:
        return self._stack[self._n - k : self._n][::-1].copy()

    def pop(self, pages: np.ndarray) -> None:
        self._n -= len(pages)

    def push(self, pages: np.ndarray) -> None:
        n = self._n
        self._stack[n : n + len(pages)] = pages
        self._n = n + len(pages)

    def out_mask(self) -> np.ndarray:
        out = np.ones(self.num_pages, dtype=bool)
        out[self._stack[: self._n]] = False
        return out

    def check(self) -> None:
        free = self._stack[: self._n]
        assert len(np.unique(free)) == len(free), "a page is on the free stack twice"


class TokenToKVPoolAllocator:
    """Hands out KV slots in whole pages; every slot is returned exactly once.

    Args:
        size: number of slots (rounded down to whole pages).
        page_size: slots per page.
        device: where returned index tensors live.
        pages: where pages come from (an arena's columns; default: its own free stack).
        capacity: the most tokens one request may hold (an arena's share; default: all).

    ``alloc``/``alloc_extend`` cost O(pages); ``free`` O(k log k) for k slots (numpy).
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        pages: PageSource | None = None,
        capacity: int | None = None,
    ) -> None:
        size = _check_count(size, "size")
        page_size = _check_count(page_size, "page_size")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.capacity = self.size if capacity is None else _check_count(capacity, "capacity")
        self.device = index_device(usable_device(device))
        self._group: list[np.ndarray] | None = None
        if pages is not None and pages.num_pages != self.num_pages:
            raise ValueError(f"the page source has {pages.num_pages} pages, the allocator "
                             f"{self.num_pages}")  # fmt: skip
        self._pages: PageSource = pages if pages is not None else FreePageStack(self.num_pages)
        self.clear()

    def clear(self) -> None:
        """Every slot free again."""
        self._pages.clear()
        self._pages_out = 0  # pages off the free stack (some slot of each handed out)
        self._owned = np.zeros(self.size, dtype=bool)
        # slot numbers by page: one row gather hands out pages (8 bytes a slot)
        self._page_slots = np.arange(self.size, dtype=np.int64).reshape(
            self.num_pages, self.page_size
        )
        self._page_count = np.zeros(self.num_pages, dtype=np.int64)
        self._page_offsets = np.arange(self.page_size, dtype=np.int64)
        self._handed_out = 0

    @property
    def source(self) -> PageSource:
        """Where its free pages come from."""
        return self._pages

    # --- sizes -----------------------------------------------------------------------------
    def available_size(self) -> int:
        """Slots in free pages (what ``alloc`` can hand out)."""
        return self._pages.count() * self.page_size

    def unbound_size(self) -> int:
        """Slots of pages this allocator has not handed out (``available_size`` too,
        unless its pages come from an arena that other kinds draw from)."""
        return (self.num_pages - self._pages_out) * self.page_size

    def handed_out_size(self) -> int:
        """Slots handed out and not yet freed."""
        return self._handed_out

    def reserved_tail_size(self) -> int:
        """Slots not handed out that sit in partly handed-out pages."""
        return self._pages_out * self.page_size - self._handed_out

    def free_slots(self) -> np.ndarray:
        """Every slot not handed out (free pages and reserved tails), ascending."""
        return np.flatnonzero(~self._owned)

    # --- alloc ----------------------------------------------------------------------------
    def _tensor(self, slots: np.ndarray) -> torch.Tensor:
        """``slots`` as an index tensor on the pool's device (a zero-copy view on the CPU)."""
        out = torch.from_numpy(slots)
        return out if self.device.type == "cpu" else out.to(self.device)

    def _fresh(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(pages, slots): ``n`` slots from the top ``ceil(n / page_size)`` pages of the
        free stack (the caller checked there are enough). Changes nothing."""
        taken = self._pages.peek(div_ceil(n, self.page_size))
        if self.page_size == 1:
            return taken, taken
        return taken, self._page_slots[taken].ravel()[:n]

    def _hand_out(
        self, slots: np.ndarray, pages: np.ndarray, extended: int = -1, tail: int = 0
    ) -> torch.Tensor:
        """Commit an allocation: the tensor first (the one step that can fail, e.g. on a
        device), then the bookkeeping, so a failure leaves the allocator unchanged.
        ``pages`` come off the free stack; ``extended`` is a page gaining ``tail`` slots."""
        out = self._tensor(slots)
        p = self.page_size
        self._take(pages)
        if len(pages):
            self._page_count[pages] = p
            self._page_count[pages[-1]] -= len(pages) * p - (len(slots) - tail)
        if tail:
            self._page_count[extended] += tail
        self._owned[slots] = True
        self._handed_out += len(slots)
        return out

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots from ``ceil(n / page_size)`` fresh pages, or ``None`` (never a
        partial result) when not enough pages are free. The rest of the last page stays
        reserved for ``alloc_extend`` by the same owner."""
        n = _check_count(n, "n")
        if div_ceil(n, self.page_size) > self._pages.count():
            return None
        pages, slots = self._fresh(n)
        return self._hand_out(slots, pages)

    def alloc_extend(self, last_slot: int, n: int) -> torch.Tensor | None:
        """``n`` slots continuing a sequence whose last slot is ``last_slot``: first the
        rest of that slot's page, then fresh pages (SGLang's ``alloc_extend``). Pass
        ``last_slot=-1`` for a sequence that ends on a page boundary. ``None`` when not
        enough pages are free; nothing changes then.

        Raises:
            ValueError: ``last_slot`` is not a handed-out slot, or the rest of its page was
                handed out already (two owners extending one page).
        """
        n = _check_count(n, "n")
        p = self.page_size
        if isinstance(last_slot, bool) or not isinstance(last_slot, (int, np.integer)):
            raise TypeError(f"last_slot must be an int, got {type(last_slot).__name__}")
        if last_slot < 0 or p == 1 or (last_slot + 1) % p == 0:
            return self.alloc(n)
        if last_slot >= self.size or not self._owned[last_slot]:
            raise ValueError(f"alloc_extend: last_slot {last_slot} is not handed out")
        stop = min(last_slot + 1 + n, (last_slot // p + 1) * p)
        tail = np.arange(last_slot + 1, stop, dtype=np.int64)
        if self._owned[tail].any():
            raise ValueError(f"alloc_extend: the page of slot {last_slot} is already extended")
        rest = n - len(tail)
        if div_ceil(rest, p) > self._pages.count():
            return None
        pages, fresh = self._fresh(rest)
        slots = np.concatenate((tail, fresh)) if rest else tail
        return self._hand_out(slots, pages, last_slot // p, len(tail))

    def _check_extends(self, ends: np.ndarray) -> None:
        """Raise ``ValueError`` unless each of ``ends`` (last slots whose pages a batch
        extends) is handed out, with the rest of its page free, one request a page."""
        if not len(ends):
            return
        if ends.max() >= self.size or not self._owned[ends].all():
            bad = ends[(ends >= self.size) | ~self._owned[np.minimum(ends, self.size - 1)]]
            raise ValueError(f"alloc_extend_batch: last slot {bad[0]} is not handed out")
        if self._owned[ends + 1].any():  # the rest of a page belongs to one owner
            raise ValueError("alloc_extend_batch: a page is already extended")
        pages_ext = np.sort(ends // self.page_size)
        if (pages_ext[1:] == pages_ext[:-1]).any():
            raise ValueError("alloc_extend_batch: two requests extend the same page")

    def _alloc_decode(self, last: np.ndarray) -> torch.Tensor | None:
        """`alloc_extend_batch` of one slot each (a decode step; SGLang's
        ``alloc_decode``): the slot after each ``last`` inside its page, else the first
        of a fresh page (in request order); the same slots and bookkeeping in a few
        numpy calls."""
        p = self.page_size
        ext = (last >= 0) & ((last + 1) % p != 0) if p > 1 else np.zeros(len(last), dtype=bool)
        self._check_extends(last[ext])
        fresh = ~ext
        k = int(fresh.sum())
        if k > self._pages.count():
            return None
        taken = self._pages.peek(k)
        slots = last + 1
        slots[fresh] = self._page_slots[taken, 0]
        out = self._tensor(slots)  # the one step that can fail: first
        self._take(taken)
        self._page_count[taken] = 1
        self._page_count[last[ext] // p] += 1
        self._owned[slots] = True
        self._handed_out += len(slots)
        return out

    def _extension(self, last: np.ndarray, n: np.ndarray) -> Extension:
        """Per request of a batch extension: whether it continues a partial page of
        ``last``, the slots that fill that page, and the fresh pages the rest takes."""
        p = self.page_size
        ext = (last >= 0) & ((last + 1) % p != 0) if p > 1 else np.zeros(len(n), dtype=bool)
        tail = np.minimum(np.where(ext, p - 1 - last % p, 0), n)
        return Extension(ext, tail, div_ceil(n - tail, p))

    def shortfall(self, last_slots: np.ndarray, counts: np.ndarray) -> int:
        """Slots (whole pages) to free before `alloc_extend_batch` with these arguments
        can succeed; 0 or less when it can now: what a caller evicts."""
        last = np.asarray(last_slots, dtype=np.int64)
        _, _, pages = self._extension(last, np.asarray(counts, dtype=np.int64))
        return int(pages.sum()) * self.page_size - self.available_size()

    def alloc_extend_batch(self, last_slots: np.ndarray, counts: np.ndarray) -> torch.Tensor | None:
        """`alloc_extend` for a whole batch in one call (SGLang's batched ``alloc_extend``):
        request ``i`` gets ``counts[i]`` slots continuing ``last_slots[i]`` (-1: none),
        first the rest of that slot's page, then fresh pages taken off the free stack in
        request order, so the result equals calling `alloc_extend` request by request.
        Returns every request's slots concatenated, in order; ``None`` (nothing
        changed) when not enough pages are free. O(slots + requests), a fixed number of
        numpy calls.

        Raises:
            ValueError: the arrays differ in length, a count is negative, a last slot is
                not handed out, or a page would be extended twice (by two requests, or
                one handed out already); the allocator is unchanged.
        """
        last = np.asarray(last_slots, dtype=np.int64)
        n = np.asarray(counts, dtype=np.int64)
        if last.ndim != 1 or last.shape != n.shape:
            raise ValueError("alloc_extend_batch: last_slots and counts must be 1-D, equal length")
        if len(n) and n.min() < 0:
            raise ValueError(f"alloc_extend_batch: counts must be >= 0, got {int(n.min())}")
        p = self.page_size
        if len(n) and n.min() == 1 == n.max():
            return self._alloc_decode(last)
        ext, tail, pages = self._extension(last, n)  # tail: slots filling a partial page
        self._check_extends(last[ext])
        rest = n - tail
        total_pages = int(pages.sum())
        if total_pages > self._pages.count():
            return None
        total = int(n.sum())
        taken = self._pages.peek(total_pages)
        # fresh slots: each request's pages in turn, less the unused end of its last page
        fresh = taken if p == 1 else self._page_slots[taken].ravel()
        page_ends = np.cumsum(pages)
        unused = pages * p - rest
        if unused.any():
            keep = np.ones(len(fresh), dtype=bool)
            keep[runs(page_ends * p - unused, unused)] = False
            fresh = fresh[keep]
        # then each request's tail (the rest of its partial page) goes in front of them
        if tail.any():
            starts = np.cumsum(n) - n
            slots = np.empty(total, dtype=np.int64)
            at = runs(starts, tail)
            slots[at] = at - np.repeat(starts - last - 1, tail)
            is_fresh = np.ones(total, dtype=bool)
            is_fresh[at] = False
            slots[is_fresh] = fresh
        else:
            slots = fresh
        out = self._tensor(slots)  # the one step that can fail: first
        self._take(taken)
        if total_pages:
            self._page_count[taken] = p
            some = pages > 0
            self._page_count[taken[page_ends[some] - 1]] -= unused[some]  # last pages
        if ext.any():
            self._page_count[last[ext] // p] += tail[ext]
        self._owned[slots] = True
        self._handed_out += total
        return out

    # --- free -----------------------------------------------------------------------------
    def free(self, indices: Any) -> None:
        """Return slots. Inside ``free_group()`` the call is deferred to the group's end.

        Raises:
            ValueError: a slot out of range, repeated, or not handed out (double free);
                the allocator is unchanged.
        """
        slots = _as_index_array(indices)
        if self._group is not None:
            self._group.append(slots)
            return
        self._free(slots)

    def _free(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        if self.page_size > 1 and not len(slots) % self.page_size and self._free_pages_whole(slots):
            return
        # A sort finds range errors and repeats at once (np.unique's hash path is ~10x
        # slower on the few hundred slots a request frees).
        s = np.sort(slots)
        if s[0] < 0 or s[-1] >= self.size:
            bad = s[0] if s[0] < 0 else s[-1]
            raise ValueError(f"free: slot {bad} is out of range [0, {self.size})")
        if len(s) > 1 and (s[1:] == s[:-1]).any():
            raise ValueError("free: the same slot appears twice in one call")
        owned = self._owned[s]
        if not owned.all():
            raise ValueError(
                f"free: slot {s[~owned][0]} is not handed out (double free, or never allocated)"
            )
        self._owned[s] = False
        self._handed_out -= len(s)
        p = self.page_size
        if p == 1:
            self._page_count[s] = 0
            emptied = s
        else:
            # runs of equal pages in the sorted slots (C-level calls only: numpy's Python
            # wrappers diff/append/flatnonzero cost more than the work here)
            pages = s // p
            bounds = np.concatenate(((0,), (pages[1:] != pages[:-1]).nonzero()[0] + 1, (len(s),)))
            firsts = pages[bounds[:-1]]
            self._page_count[firsts] -= bounds[1:] - bounds[:-1]
            emptied = firsts[self._page_count[firsts] == 0]
        self._give(emptied)

    def _take(self, pages: np.ndarray) -> None:
        """Pages (from ``peek``) leave the free stack."""
        self._pages.pop(pages)
        self._pages_out += len(pages)

    def _give(self, pages: np.ndarray) -> None:
        """Emptied pages go back on the free stack."""
        if len(pages):
            self._pages.push(pages)
            self._pages_out -= len(pages)

    def _free_pages_whole(self, slots: np.ndarray) -> bool:
        """The fast path of `_free` for whole pages (what eviction frees): each run of
        ``page_size`` slots is one page, in order, from its first slot. Frees them and
        returns True; returns False, changing nothing, when the slots are not whole
        pages of fully handed-out, distinct pages (the general path then decides)."""
        p = self.page_size
        grid = slots.reshape(-1, p)
        heads = grid[:, 0]
        if heads.min() < 0 or heads.max() >= self.size or (heads % p).any():
            return False
        if not (grid == heads[:, None] + self._page_offsets).all():
            return False
        pages = heads // p
        if not (self._page_count[pages] == p).all():
            return False
        if len(pages) > 1:
            ordered = np.sort(pages)
            if (ordered[1:] == ordered[:-1]).any():
                return False
        self._owned[slots] = False
        self._handed_out -= len(slots)
        self._page_count[pages] = 0
        self._give(pages)
        return True

    def free_group_begin(self) -> None:
        """Start deferring frees; ``free_group_end`` returns them all in one call."""
        if self._group is not None:
            raise RuntimeError("free_group_begin: a free group is already open")
        self._group = []

    def free_group_end(self) -> None:
        """Free everything deferred since ``free_group_begin`` (validated as one call)."""
        group, self._group = self._group, None
        if group is None:
            raise RuntimeError("free_group_end: no free group is open")
        if group:
            self._free(np.concatenate(group))

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """``with allocator.free_group(): ...`` batches every free inside into one."""
        self.free_group_begin()
        try:
            yield
        finally:
            self.free_group_end()

    def check(self) -> None:
        """Recompute the allocator's invariants; raises ``AssertionError``."""
        p = self.page_size
        counts = self._owned.reshape(self.num_pages, p).sum(axis=1) if self.num_pages else []
        assert np.array_equal(counts, self._page_count), "page counts disagree with slots"
        assert int(self._owned.sum()) == self._handed_out, "handed-out count is off"
        out = self._pages.out_mask()  # pages off the free stack
        assert int(out.sum()) == self._pages_out, "the count of pages handed out is off"
        assert not self._page_count[~out].any(), "a free page has handed-out slots"
        assert self._page_count[out].all(), "an empty page is lost (not on the free stack)"
        self._pages.check()


class KVPool:
    """Per-layer K and V tensors indexed by slot: ``[size, num_kv_heads, head_dim]``.

    Args:
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        size: slots (match the allocator's ``size``).
        dtype, device: storage of the tensors.
        window_layers: layers whose KV lives in a slot space of its own, of
            ``window_size`` slots (sliding-window layers whose out-of-window KV is freed:
            `radixkv.kvcache.window.slots`); a layer is read and written by the slots of its
            space.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        window_layers: tuple[int, ...] = (),
        window_size: int = 0,
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("size", size),
        ):
            if _check_count(v, name) == 0:
                raise ValueError(f"{name} must be > 0")
        window_layers = tuple(sorted(set(window_layers)))
        if any(not 0 <= i < num_layers for i in window_layers):
            raise ValueError(f"window_layers must lie in [0, {num_layers}), got {window_layers}")
        if window_layers and _check_count(window_size, "window_size") == 0:
            raise ValueError("window_size must be > 0 when there are window_layers")
        self.num_layers, self.size = num_layers, size
        self.window_layers, self.window_size = window_layers, window_size if window_layers else 0
        sizes = [window_size if i in window_layers else size for i in range(num_layers)]
        self.k = [torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device)
                  for n in sizes]  # fmt: skip
        self.v = [torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device)
                  for n in sizes]  # fmt: skip

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def token_shape(self) -> tuple[int, int]:
        """One token's K (or V) of one layer: ``(kv heads, head dim)``."""
        return (self.k[0].shape[1], self.k[0].shape[2])

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def _layer_bytes(self) -> int:
        t = self.k[0]
        return 2 * t.shape[1] * t.shape[2] * t.element_size()

    def bytes_per_token(self) -> int:
        """KV bytes one token's full slot occupies, across the layers of that space (all
        layers but ``window_layers``)."""
        return (self.num_layers - len(self.window_layers)) * self._layer_bytes()

    def window_bytes_per_token(self) -> int:
        """KV bytes one window slot occupies, across ``window_layers``."""
        return len(self.window_layers) * self._layer_bytes()

    def nbytes(self) -> int:
        """Bytes of every K and V tensor."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[n, heads, dim]``) of layer ``layer`` at ``slots``."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``layer`` at ``slots`` (gathered copies)."""
        return self.k[layer][slots], self.v[layer][slots]
