"""`StatePool`: the recurrent layers' states of one engine, out of the model and out of
the events and tiers code: its tensors, which rows are free, and the copies between rows.

Rows ``0 .. first - 1`` are the running requests' (a request's row is its request-table
row); rows ``first ..`` hold checkpoints and pending snapshots and are handed out by
`take` and returned by `give`. A row is one sequence's state over every recurrent layer:
for each of the spec's shapes, a tensor ``[layers, rows, *shape]``. The model reads and
writes them in place (`RecurrentSpec` says what they are; the model names them).

Invariant (``check``): the free rows are distinct spare rows; with the rows in use, every
spare row is free or in use exactly once.

Owns: the state tensors and the spare rows. Must not touch: the tree, what a row holds
(the model's), which checkpoint a row is (`radixkv.kvcache.recurrent`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixkv.kvcache.spec import RecurrentSpec


class StatePool:
    """``first`` running rows and ``spare`` rows of states of ``spec`` on ``device``."""

    def __init__(
        self, spec: RecurrentSpec, first: int, spare: int, device: str | torch.device = "cpu"
    ) -> None:
        if first < 0 or spare < 0:
            raise ValueError(f"rows must be >= 0, got first={first}, spare={spare}")
        self.spec, self.first, self.spare = spec, first, spare
        rows = first + spare
        self.tensors = tuple(
            torch.zeros(spec.layers, rows, *shape, dtype=spec.dtype, device=device)
            for shape in spec.shapes
        )
        self._free = list(range(rows - 1, first - 1, -1))  # a stack: the lowest goes first

    @property
    def row_size(self) -> int:
        """Bytes of one row (one checkpoint)."""
        return self.spec.state_bytes

    def free_count(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free spare row, or ``None`` when none is left."""
        return self._free.pop() if self._free else None

    def give(self, rows: Iterable[int]) -> None:
        """Spare rows back (each taken once)."""
        self._free.extend(rows)

    def copy(self, src: int, dst: int) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (never shared: copy, not lend)."""
        for t in self.tensors:
            t[:, dst].copy_(t[:, src])

    def row_flat(self, row: int) -> torch.Tensor:
        """A row's states as one uint8 tensor (a copy): each tensor's layers in order."""
        return torch.cat([t[:, row].reshape(-1) for t in self.tensors]).view(torch.uint8)

    def load_flat(self, row: int, flat: torch.Tensor) -> None:
        """Row ``row`` from `row_flat` of the same spec."""
        values = flat.to(self.tensors[0].device).view(self.spec.dtype)
        at = 0
        for t in self.tensors:
            n = t[:, row].numel()
            t[:, row].copy_(values[at : at + n].view_as(t[:, row]))
            at += n

    def row_bytes(self, row: int) -> bytes:
        """A row's states as bytes: each tensor's layers in order."""
        return self.row_flat(row).cpu().numpy().tobytes()

    def load_row(self, row: int, data: bytes) -> None:
        """Row ``row`` from ``row_bytes`` of the same spec.

        Raises:
            ValueError: ``data`` is not one row's bytes.
        """
        if len(data) != self.row_size:
            raise ValueError(f"a state row is {self.row_size} bytes, got {len(data)}")
        self.load_flat(row, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def check(self, in_use: Iterable[int]) -> None:
        """Raises AssertionError unless every spare row is free or in use, once."""
        every = sorted([*self._free, *in_use])
        if every != list(range(self.first, self.first + self.spare)):
            raise AssertionError("state rows are lost or held twice")


__all__ = ["StatePool"]
