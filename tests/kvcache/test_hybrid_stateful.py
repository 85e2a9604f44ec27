"""Stateful property test of the hybrid cache: a radix tree with recurrent-state
checkpoints (`StateCheckpoints`) and sliding-window KV (`WindowKV`), driven by random
inserts, matches, locks, evictions of every kind (the tree's, each component's, a
chosen leaf's, `HybridBudget`'s) and allocator faults (a ``free`` that raises midway).

After every step: ``check_integrity()`` (the tree's invariants and each component's),
and slot conservation in each of the three pools: every slot ever handed out is held
by the tree, pending a retried free, or freed, exactly one of them (nothing leaks,
nothing is freed twice). Every match is checked against brute force: it ends at a
checkpoint, and every one of its last ``window`` units has window KV in the tree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.recurrent.component import StateCheckpoints
from radixkv.kvcache.window.component import WindowKV

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=16)


class Pool:
    """A slot pool that checks every free, and can be armed to fail the next one."""

    def __init__(self, name: str, base: int) -> None:
        self.name, self.next = name, base
        self.issued: set[int] = set()
        self.freed: set[int] = set()
        self.fail_next = False
        self.failures = 0

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        self.issued.update(out.tolist())
        return out

    def free(self, slots: torch.Tensor) -> None:
        if self.fail_next:
            self.fail_next = False
            self.failures += 1
            raise RuntimeError(f"{self.name}: injected free failure")
        got = slots.tolist()
        assert len(set(got)) == len(got), f"{self.name}: a slot twice in one free"
        for s in got:
            assert s in self.issued, f"{self.name}: slot {s} never handed out"
            assert s not in self.freed, f"{self.name}: slot {s} freed twice"
        self.freed.update(got)


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2]),
        window=st.integers(1, 6),
        retain=st.sampled_from(["ends", "all"]),
        policy=st.sampled_from(["lru", "utility"]),
        max_states=st.integers(1, 6),
        mode=st.sampled_from(["leaf", "precise", "merge"]),
        with_window=st.booleans(),
        with_state=st.booleans(),
    )
    def setup(self, page, window, retain, policy, max_states, mode, with_window, with_state):
        self.page = page
        self.full, self.win, self.st = Pool("full", 0), Pool("window", 10**6), Pool("state", 10**9)
        self.state = StateCheckpoints(max_states, self.st, policy) if with_state else None
        self.window = WindowKV(window, self.win, retain) if with_window else None
        comps = tuple(c for c in (self.state, self.window) if c is not None)
        self.cache = RadixCache(page, allocator=self.full, eviction_mode=mode, components=comps)
        self.budget = HybridBudget(
            self.cache, self.state, self.window, token_bytes=10, window_bytes=30
        )
        self.caller_freed = {"full": set(), "window": set(), "state": set()}
        self.matched: list = []  # locked nodes

    # --- helpers ------------------------------------------------------------------------
    def key(self, toks: list[int]) -> RadixKey:
        n = len(toks) - len(toks) % self.page
        return RadixKey(np.asarray(toks[:n], dtype=np.int64))

    def give_back(self, pool: Pool, slots) -> None:
        """The caller frees what the tree did not take (straight to the pool)."""
        slots = [int(s) for s in slots]
        if slots:
            pool.freed.update(slots)

    def tree_slots(self) -> tuple[set, set, set]:
        full, win = set(), set()
        for n in self.cache.iter_nodes():
            full.update(n.value.tolist())
            if self.window is not None:
                win.update(self.window.slots(n).tolist())
        st_ = set(self.state.held) if self.state is not None else set()
        return full, win, st_

    def pending(self, comp) -> set:
        if comp is None:
            return set()
        return {s for t in getattr(comp, "pending", []) for s in t.tolist()}

    # --- rules --------------------------------------------------------------------------
    @rule(toks=tokens, cut=st.integers(0, 16), fail=st.sampled_from([None, "window", "state"]))
    def insert(self, toks, cut, fail):
        key = self.key(toks)
        n = len(key)
        if n == 0:
            return
        if fail == "window":
            self.win.fail_next = True
        if fail == "state":
            self.st.fail_next = True
        points = sorted({min(n, cut - cut % self.page) or n, n})
        for pos in points:
            sub = key[:pos]
            value = torch.from_numpy(self.full.take(pos))
            extras = None
            wslots = None
            if self.window is not None:
                wslots = self.win.take(pos)
                extras = {"window": wslots}
            res = self.cache.insert_node(sub, value, extras=extras)
            self.give_back(self.full, value[: res.prefix_len].tolist())
            if self.window is not None:
                self.give_back(self.win, wslots[~self.window.taken])
            if self.state is not None and res.last_node is not self.cache.root:
                slot = int(self.st.take(1)[0])
                if not self.state.add(res.last_node, slot):
                    self.give_back(self.st, [slot])
        self.win.fail_next = self.st.fail_next = False

    @rule(toks=tokens, lock=st.booleans(), one_walk=st.booleans())
    def match(self, toks, lock, one_walk):
        key = self.key(toks)
        full = self.cache.match_len(key, full=True)
        got = self.cache.match_len(key)
        if one_walk:  # both lengths from one walk, as a hybrid admission asks
            _, last, hit, both_full = self.cache.match_parts(key)
            assert hit == got and both_full == full
        else:
            m = self.cache.match_prefix(key)
            last, hit = m.last_node, m.prefix_len
        assert hit == got <= full
        if got:
            node = last
            if self.state is not None:  # a match ends exactly at a checkpoint
                assert self.state.at(node) is not None, "match ended off a checkpoint"
                self.state.used(node)
            if self.window is not None:  # the last `window` units have window KV
                path = self.cache.path_to_root(node, "t")[::-1]
                covered = []
                for x in path:
                    k = self.window.covered(x)
                    covered += [False] * (len(x) - k) + [True] * k
                span = self.window.span
                assert all(covered[max(0, got - span) : got]), "window KV missing"
            if lock:
                self.cache.inc_lock_ref(node)
                self.matched.append(node)

    @precondition(lambda self: self.matched)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node = self.matched.pop(i % len(self.matched))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 20), fail=st.booleans())
    def evict(self, n, fail):
        self.full.fail_next = fail
        try:
            self.cache.evict(n)
        except RuntimeError:
            assert fail
        self.full.fail_next = False

    @rule(i=st.integers(0, 100), part=st.booleans())
    def evict_leaf(self, i, part):
        leaves = [x for x in self.cache.iter_nodes() if not x.children and not x.lock_ref]
        if not leaves:
            return
        node = leaves[i % len(leaves)]
        units = self.page if part and len(node) > self.page else None
        self.cache.evict_leaf(node, units)

    @precondition(lambda self: self.state is not None)
    @rule(n=st.integers(1, 3), fail=st.booleans())
    def evict_states(self, n, fail):
        self.st.fail_next = fail
        self.state.evict(n)
        self.st.fail_next = False

    @precondition(lambda self: self.window is not None)
    @rule(n=st.integers(1, 10), fail=st.booleans())
    def evict_window(self, n, fail):
        self.win.fail_next = fail
        self.window.evict(n)
        self.win.fail_next = False

    @rule(cap=st.integers(0, 2000))
    def budget_fit(self, cap):
        self.budget.fit(cap)
        assert self.budget.total() <= cap or not self._any_evictable()

    def _any_evictable(self) -> bool:
        return any(not x.children and not x.lock_ref for x in self.cache.iter_nodes())

    @rule()
    def flush(self):
        for c in (self.state, self.window):
            if c is not None:
                assert c.flush() == 0

    # --- invariants ---------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.cache.check_integrity()

    @invariant()
    def conservation(self):
        full, win, st_ = self.tree_slots()
        for pool, held, pend in (
            (self.full, full, set()),
            (self.win, win, self.pending(self.window)),
            (self.st, st_, self.pending(self.state)),
        ):
            parts = [held, pend, pool.freed]
            assert sum(map(len, parts)) == len(set().union(*parts)), f"{pool.name}: overlap"
            assert set().union(*parts) == pool.issued, f"{pool.name}: slots leaked"


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("retain", ["ends", "all"])
def test_window_bytes_follow_the_useful_ends(retain):
    """With ``retain="ends"`` a long cached prompt keeps window KV for its last
    ``window`` units only; with ``all``, for every unit."""
    pool = Pool("window", 0)
    window = WindowKV(8, pool, retain)
    cache = RadixCache(1, components=(window,))
    key = RadixKey(np.arange(100, dtype=np.int64))
    slots = pool.take(100)
    cache.insert_node(key, extras={"window": slots})
    assert window.held_units() == (8 if retain == "ends" else 100)
    assert cache.match_prefix(key).prefix_len == 100
    cache.check_integrity()


@settings(max_examples=200, deadline=None)
@given(
    page=st.sampled_from([1, 2]),
    prompts=st.lists(st.tuples(tokens, st.integers(0, 16)), min_size=1, max_size=6),
    queries=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 16), tokens), max_size=8),
)
def test_one_walk_gives_the_hit_and_the_branch_point(page, prompts, queries):
    """`match_parts` returns the state-limited hit and the full-attention match (a hybrid
    admission's start and branch point) from one walk; both equal the two walks
    (`match_len` without and with ``full``), on queries that follow a cached prompt for
    a while and then leave it (between checkpoints, inside a node)."""
    state = StateCheckpoints(64, Pool("state", 0))
    cache = RadixCache(page, components=(state,))
    slot = 0
    for toks, cut in prompts:  # checkpoints at a cut and at the end
        key = RadixKey(np.asarray(toks[: len(toks) - len(toks) % page], dtype=np.int64))
        for pos in sorted({min(len(key), cut - cut % page) or len(key), len(key)}):
            node = cache.insert_node(key[:pos]).last_node
            if node is not cache.root and state.add(node, slot):
                slot += 1
    for near, keep, tail in queries:
        toks = list(prompts[near % len(prompts)][0][:keep]) + tail
        key = RadixKey(np.asarray(toks, dtype=np.int64))
        full, hit = cache.match_len(key, full=True), cache.match_len(key)
        _, last, got, got_full = cache.match_parts(key)
        assert (got, got_full) == (hit, full)
        assert got == 0 or state.at(last) is not None  # the hit ends at a checkpoint
        cache.check_integrity()
