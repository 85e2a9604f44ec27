"""The state pool (`radixkv.kvcache.recurrent.pool`): spare rows handed out and back once,
copies that never share, and a row's bytes that load back into another row."""

from __future__ import annotations

import pytest
import torch

from radixkv.kvcache.recurrent.pool import StatePool
from radixkv.kvcache.spec import RecurrentSpec

SPEC = RecurrentSpec(2, ((3, 2), (2, 2, 2)))


def test_rows_are_handed_out_once_and_checked():
    pool = StatePool(SPEC, first=2, spare=3)
    assert [t.shape for t in pool.tensors] == [(2, 5, 3, 2), (2, 5, 2, 2, 2)]
    rows = [pool.take(), pool.take(), pool.take()]
    assert rows == [2, 3, 4] and pool.take() is None
    pool.check(rows)
    with pytest.raises(AssertionError, match="lost or held twice"):
        pool.check(rows[:2])  # one row neither free nor in use
    pool.give([rows[1]])
    pool.check([rows[0], rows[2]])
    with pytest.raises(AssertionError):
        pool.check([rows[0], rows[1], rows[2]])  # a row free and in use


def test_copies_and_bytes_round_trip():
    pool = StatePool(SPEC, first=1, spare=2)
    for t in pool.tensors:
        t[:, 0] = torch.randn_like(t[:, 0])
    pool.copy(0, 1)
    pool.tensors[0][:, 0] += 1  # the copy is its own, not a view
    assert not torch.equal(pool.tensors[0][:, 0], pool.tensors[0][:, 1])
    data = pool.row_bytes(1)
    assert len(data) == pool.row_size == SPEC.state_bytes == 2 * (6 + 8) * 4
    pool.load_row(2, data)
    assert all(torch.equal(t[:, 1], t[:, 2]) for t in pool.tensors)
    with pytest.raises(ValueError, match="a state row is 112 bytes, got 3"):
        pool.load_row(2, b"abc")
    with pytest.raises(ValueError, match="rows must be >= 0"):
        StatePool(SPEC, first=-1, spare=1)
