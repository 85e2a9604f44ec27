"""The request lifecycle with sliding-window KV in a slot space of its own
(`radixkv.kvcache.window.slots`): a request keeps only its last window, the tree only the windows
a match can end at, and what a request reads is always what it computed.

The fuzzer fingerprints every computed full and window slot with the tokens its KV
depends on; after every operation (some with a call failing midway) each running
request's row and the window positions its next step reads must hold its own tokens'
fingerprints, and `check_memory` must find every slot of both spaces owned once.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from support.window_machine import WindowLifecycleMachine, make, seq, serve

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.window.component import WindowKV
from radixkv.kvcache.window.slots import WindowSlots


def test_a_request_keeps_its_last_window_and_the_tree_the_ends():
    m = make(window=4)
    win = m.manager("window")
    req = Req(1, seq(10, 60))
    assert m.admit(req)
    most = 0
    while req.kv_len < 60:
        assert m.allocate(req, min(8, 60 - req.kv_len)) is not None
        most = max(most, int(win.own[req.row].sum()))
        m.cache_unfinished_req(req)
        m.check_memory()
    for t in range(30):  # decode well past the window
        req.output_ids.append(t)
        assert m.allocate(req, 1) is not None
        most = max(most, int(win.own[req.row].sum()))
        m.check_memory()
    assert most <= win.peak(8)  # never the whole context
    m.cache_finished_req(req)
    m.check_memory()
    assert m.cache.total_size() == 90 and win.component.held_units() == 4  # one window
    assert win.allocator.available_size() == win.allocator.size - 4
    again = Req(2, seq(10, 60) + list(range(30)) + [7])
    assert m.admit(again) and again.cached_len == 90  # the leaf's end is servable
    m.abort(again)
    inside = Req(3, seq(10, 40) + [500])
    assert m.admit(inside) and inside.cached_len == 0  # no window inside: recomputed
    m.abort(inside)
    m.check_memory()


def test_the_second_sharer_supplies_the_branch_window_and_the_third_hits():
    m = make(window=4)
    serve(m, seq(0, 30) + seq(100, 10))
    second = serve(m, seq(0, 30) + seq(200, 10))
    assert second.cached_len == 0  # the branch point at 30 had no window yet
    third = serve(m, seq(0, 30) + seq(300, 10))
    assert third.cached_len == 30


def test_a_boundary_keeps_its_window_so_the_second_request_hits():
    m = make(window=4)
    serve(m, seq(0, 24) + seq(100, 20), boundaries=(24,))  # a system message's end
    second = serve(m, seq(0, 24) + seq(200, 20))
    assert second.cached_len == 24
    plain = make(window=4)
    serve(plain, seq(0, 24) + seq(100, 20))
    assert serve(plain, seq(0, 24) + seq(200, 20)).cached_len == 0


@pytest.mark.parametrize("page", [1, 4])
def test_window_pressure_tombstones_the_tree_not_the_running(page):
    """A small window pool: requests' allocations evict the tree's windows (its
    matches end earlier), never what a running request reads."""
    m = make(window=4, wsize=32, page=page)
    for i in range(7):
        serve(m, seq(1000 * i, 32))
    assert m.manager("window").component.held_units() <= 28
    a, b = Req("a", seq(0, 50)), Req("b", seq(7000, 50))
    assert m.admit(a) and m.admit(b)
    while a.kv_len < 50:
        for r in (a, b):
            assert m.allocate(r, min(4, 50 - r.kv_len)) is not None
            m.cache_unfinished_req(r)
            m.check_memory()
    assert m.manager("window").evicted > 0
    hits = [m.cache.match_len(RadixKey(seq(1000 * i, 32))) for i in range(7)]
    assert 0 in hits and 32 in hits  # the least recent lost their windows, not all


def test_the_engine_way_keeps_windows_while_there_is_room_and_frees_the_spare_first():
    """``retain="all"`` (what the engine runs): the second sharer already hits at the
    branch point; under pressure the windows no end needs go before any end's."""
    m = make(window=4, wsize=64, retain="all")
    serve(m, seq(0, 30) + seq(100, 10))
    assert serve(m, seq(0, 30) + seq(200, 10)).cached_len == 30  # "ends": only the third
    comp = m.manager("window").component
    held = comp.held_units()
    assert comp.evict_spare(10**6) == held - 3 * 4  # the two leaves' and the branch's windows
    for tail in (100, 200, 300):  # every end still serves
        assert m.cache.match_len(RadixKey(seq(0, 30) + seq(tail, 10))) >= 30
    assert m.cache.match_len(RadixKey(seq(0, 30) + seq(100, 10))) == 40
    m.check_memory()


def test_bad_window_wiring_is_refused():
    alloc, walloc = TokenToKVPoolAllocator(32), TokenToKVPoolAllocator(16)
    comp = WindowKV(4, walloc)
    with pytest.raises(ValueError, match="window allocator"):
        WindowSlots(comp, alloc, 2, 16, 4)
    with pytest.raises(ValueError, match="longer"):
        WindowSlots(comp, walloc, 2, 16, 8)
    slots = WindowSlots(comp, walloc, 2, 16, 4)
    with pytest.raises(ValueError, match="not a component"):
        CacheManager(RadixCache(1, allocator=alloc), alloc, ReqToTokenPool(2, 16), slots)
    cache = RadixCache(1, allocator=alloc, components=(comp,))
    with pytest.raises(ValueError, match="shape"):
        CacheManager(cache, alloc, ReqToTokenPool(3, 16), slots)


WindowLifecycleMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestWindowLifecycleMachine = pytest.mark.slow(WindowLifecycleMachine.TestCase)


def test_the_fingerprint_check_catches_a_stale_window_read():
    """The machine's read check is not vacuous: a row pointing at a slot another
    request computed fails it."""
    machine = WindowLifecycleMachine()
    machine.setup(page=1, window=4, pages=8, wpages=8, mode="merge", retain="ends")
    machine.arrive(seq(5, 12), [])
    machine.step_all(12, None)
    req = machine.reqs[0]
    w = machine.m.manager("window")
    w.table[req.row, req.kv_len - 1] = np.int64(next(iter(set(machine.win) - {
        int(w.table[req.row, req.kv_len - 1])}), 0))  # fmt: skip
    with pytest.raises(AssertionError):
        machine.check_req(req)
