"""KV events from a cache with sliding-window KV tell only servable blocks
(`radixkv.kvcache.window.servable`): after any sequence of inserts, evictions of full KV, window
evictions (whole, spare only, one node), locks and marks, the blocks the sink holds as
told are exactly the pages a match may end at (checked page by page with `match_len`),
and the stream is well formed (a block is stored once before it is removed, never
removed unless told).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.events import servable_blocks

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.window.component import WindowKV


class Slots:
    """Window slots: numbered as taken, freed ones counted."""

    def __init__(self) -> None:
        self.next, self.freed = 0, 0

    def take(self, n: int) -> np.ndarray:
        self.next += n
        return np.arange(self.next - n, self.next, dtype=np.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.freed += len(slots)


class Told:
    """A sink that keeps the blocks it was told, and checks the stream's form."""

    def __init__(self, strong: bool = False) -> None:
        self.strong_hashes = strong
        self.blocks: dict[int, tuple] = {}  # hash -> (parent, tokens)
        self.flush = None

    def attach(self, flush) -> None:
        self.flush = flush

    def stored(self, hashes, parent, tokens, size, extra_key) -> None:
        tokens = list(tokens)
        assert len(tokens) == len(hashes) * size
        for i, h in enumerate(hashes):
            assert h not in self.blocks, f"block {h} stored twice"
            before = parent if i == 0 else hashes[i - 1]
            self.blocks[h] = (before, tokens[i * size : (i + 1) * size])

    def removed(self, hashes) -> None:
        for h in hashes:
            assert h in self.blocks, f"block {h} removed but never told"
            del self.blocks[h]

    def cleared(self) -> None:
        self.blocks.clear()


STEMS = [list(range(10, 26)), list(range(10, 18)) + [40, 41, 42, 43], list(range(60, 70))]
keys = st.builds(
    lambda stem, cut, tail: STEMS[stem][:cut] + tail,
    st.integers(0, len(STEMS) - 1),
    st.integers(0, 16),
    st.lists(st.integers(0, 3), max_size=12),
)


class ServableMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 9),
        retain=st.sampled_from(["ends", "all"]),
        mode=st.sampled_from(["precise", "leaf", "merge"]),
        strong=st.booleans(),
    )
    def setup(self, page, window, retain, mode, strong):
        self.slots = Slots()
        self.win = WindowKV(window, self.slots, retain)
        self.cache = RadixCache(page, "lru", eviction_mode=mode, components=(self.win,))
        self.sink = Told(strong)
        self.cache.set_event_sink(self.sink)
        self.strong = strong
        self.locked: list = []

    def _nodes(self):
        return list(self.cache.iter_nodes())

    @rule(toks=keys, keep=st.integers(0, 20), ns=st.sampled_from([None, "t"]))
    def insert(self, toks, keep, ns):
        """An insert whose caller has window slots for its last ``keep`` units only."""
        p = self.cache.page_size
        toks = toks[: len(toks) // p * p]
        if not toks:
            return
        given = np.full(len(toks), -1, dtype=np.int64)
        if keep:
            given[-keep:] = self.slots.take(min(keep, len(toks)))
        self.cache.insert_node(RadixKey(toks, ns), extras={"window": given})

    @rule(n=st.integers(1, 12))
    def evict(self, n):
        self.cache.evict(n)

    @rule(n=st.integers(1, 12), spare=st.booleans())
    def evict_window(self, n, spare):
        (self.win.evict_spare if spare else self.win.evict)(n)

    @precondition(lambda self: self.cache.num_nodes())
    @rule(data=st.data())
    def drop(self, data):
        node = data.draw(st.sampled_from(self._nodes()))
        if not node.lock_ref:
            self.win.drop(node)

    @precondition(lambda self: self.cache.num_nodes())
    @rule(data=st.data(), mark=st.booleans())
    def lock_or_mark(self, data, mark):
        node = data.draw(st.sampled_from(self._nodes()))
        if mark:
            self.win.mark(node)
        else:
            self.cache.inc_lock_ref(node)
            self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule()
    def unlock(self):
        self.cache.dec_lock_ref(self.locked.pop(0))

    @invariant()
    def told_is_servable(self):
        if not hasattr(self, "cache"):
            return
        self.cache.flush_events()
        assert set(self.sink.blocks) == servable_blocks(self.cache, self.strong)
        self.cache.check_integrity()


ServableMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestServableMachine = ServableMachine.TestCase


def test_a_window_evicted_while_its_full_kv_stays_is_withdrawn_and_told_again():
    slots = Slots()
    win = WindowKV(4, slots, "all")
    cache = RadixCache(2, components=(win,))
    sink = Told()
    cache.set_event_sink(sink)
    toks = list(range(10, 22))  # 6 pages
    cache.insert_node(RadixKey(toks), extras={"window": slots.take(12)})
    cache.flush_events()
    assert len(sink.blocks) == 6  # every page: its window is there
    node = next(cache.iter_nodes())
    win.drop(node)  # the window goes, the full KV stays
    cache.flush_events()
    assert sink.blocks == {} and cache.match_len(RadixKey(toks), full=True) == 12
    # a request computes the last window again: the pages past it are servable again
    given = np.full(12, -1, dtype=np.int64)
    given[-6:] = slots.take(6)
    cache.insert_node(RadixKey(toks), extras={"window": given})
    cache.flush_events()
    ends = sorted(len(b[1]) for b in sink.blocks.values())
    assert len(sink.blocks) == 2 and ends == [2, 2]  # positions 10 and 12 (window 4)
    assert servable_blocks(cache, False) == set(sink.blocks)


def test_without_a_sink_windows_are_not_watched():
    win = WindowKV(4, Slots(), "all")
    cache = RadixCache(1, components=(win,))
    cache.set_event_sink(Told())
    gate = cache.component("servable")
    assert gate is not None and gate.gated is win
    toks = np.arange(8, dtype=np.int64)
    cache.insert_node(RadixKey(toks), extras={"window": np.arange(8, dtype=np.int64)})
    assert gate.touched  # the gate hears of the window's new slots (`RadixCache.changed`)
    cache.set_event_sink(None)
    assert cache.component("servable") is None  # nobody hears of windows any more
    with pytest.raises(ValueError, match="EAGLE"):
        c = RadixCache(1, is_eagle=True, components=(WindowKV(4, Slots()),))
        c.set_event_sink(Told())
