"""The request-to-token table: one row of slot indices per running request (SGLang's
``ReqToTokenPool``), in host memory as numpy.

Owns: request rows and the slots written in them. Must not touch: the allocator's
slots (`radixkv.kvcache.memory`), the tree.
"""

from __future__ import annotations

import numpy as np
import torch

from radixkv.key import as_count
from radixkv.kvcache.memory import index_device, runs, usable_device

_SLICE_WRITE = 32  # write_batch copies runs longer than this slice by slice


class ReqToTokenPool:
    """One row of slot indices per running request: ``[max_reqs, max_context_len]``.

    The table lives in host memory as numpy (an element write costs ~1 µs there against
    ~8 µs through torch indexing); ``table`` is a torch view of the same memory, and
    ``read`` returns torch views of it, moved to ``device`` when that is not the CPU.
    """

    def __init__(
        self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"
    ) -> None:
        if (
            as_count(max_reqs, "max_reqs") == 0
            or as_count(max_context_len, "max_context_len") == 0
        ):
            raise ValueError("max_reqs and max_context_len must be > 0")
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        self.device = index_device(usable_device(device))
        # the table's host memory, as numpy and as torch (one buffer): read them; the
        # pool's methods write them
        self.array = np.zeros((max_reqs, max_context_len), dtype=np.int64)
        self.table = torch.from_numpy(self.array)
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or ``None`` when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Return ``row``. Raises ``ValueError`` if it is not in use."""
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
            raise TypeError(f"free: row must be an int, got {type(row).__name__}")
        row = int(row)
        if not 0 <= row < self.max_reqs or row in self._free_rows:
            raise ValueError(f"free: row {row} is not in use")
        self._free_rows.append(row)

    def rows_in_use(self) -> list[int]:
        """Rows handed out and not freed, ascending."""
        free = set(self._free_rows)
        return [r for r in range(self.max_reqs) if r not in free]

    def check(self) -> None:
        """The free list holds distinct valid rows; raises ``AssertionError``."""
        rows = self._free_rows
        assert len(set(rows)) == len(rows), "a row is on the free list twice"
        assert all(type(r) is int and 0 <= r < self.max_reqs for r in rows), "a bad free row"

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set ``table[row, start:start + len(slots)] = slots``."""
        end = start + len(slots)
        if end > self.max_context_len:
            raise ValueError(
                f"request needs {end} tokens, more than max_context_len={self.max_context_len}"
            )
        self.array[row, start:end] = (
            slots.numpy(force=True) if isinstance(slots, torch.Tensor) else slots
        )

    def write_parts(self, row: int, parts: list[bytes]) -> None:
        """Set the start of ``row`` to packed int64 chunks, in order (a prefix match)."""
        end = sum(len(x) for x in parts) >> 3
        if end > self.max_context_len:
            raise ValueError(
                f"request needs {end} tokens, more than max_context_len={self.max_context_len}"
            )
        at, out = 0, self.array[row]
        for part in parts:
            k = len(part) >> 3
            out[at : at + k] = np.frombuffer(part, dtype=np.int64)
            at += k

    def write_batch(
        self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, slots: torch.Tensor
    ) -> None:
        """`write` for a batch: ``table[rows[i], starts[i]:starts[i] + counts[i]]`` gets
        the next ``counts[i]`` of ``slots`` (concatenated in order). Long runs (prefill
        chunks) are a slice copy each, the short ones (decodes) one scatter together."""
        ends = starts + counts
        if len(ends) and ends.max() > self.max_context_len:
            raise ValueError(
                f"request needs {int(ends.max())} tokens, more than "
                f"max_context_len={self.max_context_len}"
            )
        src = slots.numpy(force=True)
        if len(src) == len(rows) and (counts == 1).all():  # decodes: one scatter
            self.array[rows, starts] = src
            return
        offsets = np.cumsum(counts) - counts
        long = counts > _SLICE_WRITE
        for row, start, n, off in zip(  # long runs: a slice copy each
            rows[long].tolist(), starts[long].tolist(), counts[long].tolist(),
            offsets[long].tolist(), strict=True,
        ):  # fmt: skip
            self.array[row, start : start + n] = src[off : off + n]
        if not long.all():  # short runs (decodes): one scatter for all of them
            short = ~long
            c = counts[short]
            cols, at = runs(starts[short], c), runs(offsets[short], c)
            self.array[np.repeat(rows[short], c), cols] = src[at]

    def slot_at(self, row: int, i: int) -> int:
        """The slot of token ``i`` of ``row``."""
        return int(self.array[row, i])

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """``table[row, start:end]``: a view on the CPU (copy it before the row changes
        if you keep it), a copy on another device."""
        view = torch.from_numpy(self.array[row, start:end])
        return view if self.device.type == "cpu" else view.to(self.device)
