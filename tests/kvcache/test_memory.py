"""Slot allocator, KV pool and request-to-token table: semantics and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.kvcache.memory import KVPool, TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool


def state(a: TokenToKVPoolAllocator):
    return (
        a._owned.copy().tolist(),
        a._page_count.tolist(),
        a._pages.count(),
        a._pages.peek(a._pages.count()).tolist(),
        a._handed_out,
    )


def test_alloc_hands_out_distinct_slots_and_never_a_partial_result():
    a = TokenToKVPoolAllocator(10)
    x = a.alloc(6)
    assert x.dtype == torch.int64 and len(set(x.tolist())) == 6
    assert a.alloc(5) is None and a.available_size() == 4
    y = a.alloc(4)
    assert set(x.tolist()) | set(y.tolist()) == set(range(10))
    a.free(x)
    assert a.available_size() == 6
    a.check()


def test_paged_alloc_takes_whole_pages_and_extend_fills_the_last_one():
    a = TokenToKVPoolAllocator(64, page_size=16)
    x = a.alloc(5)
    assert x.tolist() == [0, 1, 2, 3, 4] and a.available_size() == 48
    assert a.reserved_tail_size() == 11
    y = a.alloc_extend(4, 14)  # 11 slots left in page 0, then a fresh page
    assert y.tolist() == list(range(5, 16)) + [16, 17, 18]
    assert a.available_size() == 32 and a.reserved_tail_size() == 13
    z = a.alloc_extend(-1, 16)  # a sequence ending on a page boundary opens a new page
    assert z.tolist() == list(range(32, 48))
    a.free(torch.cat([x, y[:11]]))  # page 0 empties and comes back
    assert a.available_size() == 32
    a.check()


def test_extend_refuses_a_slot_it_does_not_know_or_a_page_extended_twice():
    a = TokenToKVPoolAllocator(64, page_size=16)
    a.alloc(5)
    a.alloc_extend(4, 2)
    before = state(a)
    with pytest.raises(ValueError, match="already extended"):
        a.alloc_extend(4, 2)
    with pytest.raises(ValueError, match="not handed out"):
        a.alloc_extend(40, 2)
    assert state(a) == before


def test_extend_returns_none_when_pages_are_short_and_changes_nothing():
    a = TokenToKVPoolAllocator(32, page_size=16)
    a.alloc(20)
    before = state(a)
    assert a.alloc_extend(19, 40) is None
    assert state(a) == before


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("double", ValueError, "not handed out"),
        ("never", ValueError, "not handed out"),
        ("range", ValueError, "out of range"),
        ("repeat", ValueError, "twice"),
        ("float", TypeError, "integers"),
        ("2d", ValueError, "1-D"),
    ],
)
def test_bad_frees_raise_and_leave_the_allocator_unchanged(bad, error, match):
    a = TokenToKVPoolAllocator(16, page_size=4)
    x = a.alloc(6)
    a.free(x[:2])
    before = state(a)
    arg = {
        "double": x[:3],
        "never": torch.tensor([12]),
        "range": torch.tensor([3, 99]),
        "repeat": torch.tensor([3, 3]),
        "float": torch.tensor([3.0]),
        "2d": torch.tensor([[3]]),
    }[bad]
    with pytest.raises(error, match=match):
        a.free(arg)
    assert state(a) == before


@pytest.mark.parametrize(("n", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_alloc_counts(n, error):
    a = TokenToKVPoolAllocator(8)
    before = state(a)
    with pytest.raises(error, match="n must"):
        a.alloc(n)
    assert state(a) == before


def test_free_group_batches_frees_into_one_validated_call():
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(8)
    with a.free_group():
        a.free(x[:3])
        a.free(x[3:5])
        assert a.available_size() == 8  # deferred
    assert a.available_size() == 13
    before = state(a)
    with pytest.raises(ValueError, match="twice"), a.free_group():
        a.free(x[5:7])
        a.free(x[6:8])
    assert state(a) == before  # the whole group was refused
    with pytest.raises(RuntimeError):
        a.free_group_end()


def test_random_alloc_free_keeps_the_invariants():
    rng = np.random.default_rng(0)
    for page in (1, 4, 16):
        a = TokenToKVPoolAllocator(256, page_size=page)
        held: list[torch.Tensor] = []
        for _ in range(300):
            if held and rng.random() < 0.5:
                a.free(held.pop(rng.integers(len(held))))
            else:
                got = a.alloc(int(rng.integers(0, 40)))
                if got is not None:
                    held.append(got)
            a.check()
            owned = sum(len(h) for h in held)
            assert a.available_size() + owned + a.reserved_tail_size() == a.size


def test_kv_pool_writes_and_reads_by_slot():
    pool = KVPool(num_layers=2, num_kv_heads=3, head_dim=4, size=10)
    k, v = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    slots = torch.tensor([7, 2])
    pool.write(1, slots, k, v)
    rk, rv = pool.read(1, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert not pool.k[0].any()
    assert pool.bytes_per_token() == 2 * 2 * 3 * 4 * 4
    with pytest.raises(ValueError):
        KVPool(0, 1, 1, 1)


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(max_reqs=2, max_context_len=8)
    r0, r1 = pool.alloc(), pool.alloc()
    assert {r0, r1} == {0, 1} and pool.alloc() is None
    pool.write(r0, 2, torch.tensor([5, 6]))
    assert pool.read(r0, 0, 4).tolist() == [0, 0, 5, 6]
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write(r0, 7, torch.tensor([1, 2]))
    pool.free(r0)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(r0)


def test_a_pool_smaller_than_one_page_has_nothing_to_hand_out():
    a = TokenToKVPoolAllocator(10, page_size=16)
    assert a.size == 0 and a.available_size() == 0
    assert a.alloc(1) is None and a.alloc(0).tolist() == []
    a.check()


@settings(max_examples=150, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    before=st.lists(st.integers(1, 40), max_size=6),
    batch=st.lists(st.tuples(st.integers(-1, 5), st.integers(0, 40)), max_size=8),
)
def test_alloc_extend_batch_equals_alloc_extend_request_by_request(page, before, batch):
    size = 24 * page + 160  # small enough that some batches do not fit
    a, b = TokenToKVPoolAllocator(size, page), TokenToKVPoolAllocator(size, page)
    ends = []
    for n in before:
        x, y = a.alloc(n), b.alloc(n)
        assert (x is None and y is None) or torch.equal(x, y)
        if x is not None:
            ends.append(int(x[-1]))
    # each request continues one of the earlier allocations (at most once) or starts fresh
    last = [ends[i] if 0 <= i < len(ends) else -1 for i, _ in batch]
    last = [s if s < 0 or last.index(s) == k else -1 for k, s in enumerate(last)]
    counts = [n for _, n in batch]
    unchanged = state(a)
    out = a.alloc_extend_batch(np.array(last, dtype=np.int64), np.array(counts, dtype=np.int64))
    ref = [b.alloc_extend(s, n) for s, n in zip(last, counts, strict=True)]
    if out is None:  # all or nothing: refused only when the whole batch does not fit
        assert any(r is None for r in ref)
        assert state(a) == unchanged
        return
    assert all(r is not None for r in ref)
    assert out.tolist() == [s for r in ref for s in r.tolist()]
    assert state(a) == state(b)
    a.check()


@settings(max_examples=150, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    before=st.lists(st.integers(1, 40), max_size=12),
    batch=st.lists(st.integers(-1, 11), min_size=1, max_size=12),
)
def test_a_decode_batch_takes_the_one_slot_path_with_the_same_result(page, before, batch):
    """One slot each (a decode step: `_alloc_decode`, SGLang's ``alloc_decode``): the
    same slots and bookkeeping as request by request, refused all or nothing."""
    test_alloc_extend_batch_equals_alloc_extend_request_by_request.hypothesis.inner_test(
        page, before, [(i, 1) for i in batch]
    )


def test_alloc_extend_batch_refuses_bad_batches_unchanged():
    a = TokenToKVPoolAllocator(64, 4)
    x = a.alloc(6)  # slots 0-5: page 1 has room after slot 5
    before = state(a)
    for last, counts in (
        ([5, 5], [1, 1]),  # two requests extend one page
        ([2], [1]),  # the rest of page 0 is handed out
        ([9], [1]),  # never handed out
        ([5], [-1]),
        ([5, -1], [1]),
    ):
        with pytest.raises(ValueError, match="alloc_extend_batch"):
            a.alloc_extend_batch(np.array(last), np.array(counts))
        assert state(a) == before
    assert a.alloc_extend_batch(np.array([5, -1]), np.array([40, 40])) is None
    assert state(a) == before
    out = a.alloc_extend_batch(np.array([5, -1]), np.array([3, 2]))
    assert out.tolist() == [6, 7, 8, 12, 13] and int(x[-1]) == 5
    a.check()


def test_freeing_whole_pages_takes_the_fast_path_and_still_refuses_bad_frees():
    a = TokenToKVPoolAllocator(64, 4)
    x = a.alloc(12)  # pages 0-2, whole
    y = a.alloc(6)  # page 3 whole, page 4 half
    before = state(a)
    for bad in (
        torch.cat([x[:4], x[:4]]),  # one page twice
        torch.cat([x[:4], y[4:6], y[4:6]]),  # not whole pages, and a slot twice
        torch.arange(20, 28),  # pages 5 and 6 were never handed out
    ):
        with pytest.raises(ValueError):
            a.free(bad)
        assert state(a) == before
    a.free(torch.cat([y[:4], x[4:8]]))  # pages 3 and 1, whole: the fast path
    assert a._pages.count() == 16 - 5 + 2
    a.free(x[[1, 0, 2, 3]])  # page 0 out of order: the general path
    a.free(y[4:])
    a.free(x[8:])
    assert a.available_size() == 64
    a.check()


def test_shortfall_is_what_alloc_extend_batch_lacks():
    """`shortfall` says how many slots to free before the same batch extension fits:
    the rest of a partial page costs nothing, each further page a page."""
    a = TokenToKVPoolAllocator(64, 16)
    first = a.alloc_extend_batch(np.array([-1, -1]), np.array([5, 16]))  # 1 + 1 pages
    last = np.array([int(first[4]), int(first[20])])  # a partial page; a full one
    taken = a.alloc(32)  # the last two free pages
    assert a.available_size() == 0
    assert a.shortfall(last, np.array([11, 0])) <= 0  # fills the partial page only
    assert a.shortfall(last, np.array([12, 1])) == 32  # one page each beyond
    assert a.alloc_extend_batch(last, np.array([12, 1])) is None
    a.free(taken)
    assert a.shortfall(last, np.array([12, 1])) == 0
    assert a.alloc_extend_batch(last, np.array([12, 1])) is not None
