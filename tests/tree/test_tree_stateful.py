"""Stateful property test: random insert / match / lock / unlock / evict against a
brute-force reference model, with ``check_integrity()`` after every step.

The model is a dict from every cached prefix, in whole pages, ``(namespace, pages...)`` to
the slot indices of its last page: prefix matching is a loop over that dict, insertion
fills the missing pages, and eviction is checked by set difference (what left the tree
is exactly what the allocator was handed). The first victim of every eviction is checked against a
brute-force minimum of the policy's sort key over all evictable leaves.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from helpers import RecordingAllocator, content, removed_values, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixkv import POLICIES, RadixCache, RadixKey, TreeNode

tokens = st.lists(st.integers(0, 3), max_size=14)
namespaces = st.sampled_from([None, "a"])


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 4]),
        eagle=st.booleans(),
        policy=st.sampled_from(sorted(POLICIES)),
        precise=st.booleans(),
    )
    def setup(self, page: int, eagle: bool, policy: str, precise: bool) -> None:
        self.page, self.eagle, self.policy = page, eagle, policy
        self.alloc = RecordingAllocator()
        self.cache = RadixCache(page, policy, self.alloc, is_eagle=eagle, precise=precise)
        self.model: dict[tuple, int] = {}
        self.matched: list[TreeNode] = []
        self.locked: list[TreeNode] = []
        self.next_slot = 1000

    # --- the model ---------------------------------------------------------------------
    def pages(self, toks: list[int]) -> list[tuple]:
        units = [(a, b) for a, b in itertools.pairwise(toks)] if self.eagle else list(toks)
        p = self.page
        return [tuple(units[i : i + p]) for i in range(0, len(units) - p + 1, p)]

    def model_match(self, ns, pages: list[tuple]) -> int:
        """Cached pages of the prefix."""
        n = 0
        while n < len(pages) and (ns, tuple(pages[: n + 1])) in self.model:
            n += 1
        return n

    # --- rules -------------------------------------------------------------------------
    @rule(toks=tokens, ns=namespaces, default_value=st.booleans(), priority=st.integers(0, 3))
    def insert(self, toks, ns, default_value, priority):
        pages, p = self.pages(toks), self.page
        if default_value:
            value, slots = None, list(toks)
        else:
            slots = list(range(self.next_slot, self.next_slot + len(toks)))
            self.next_slot += len(toks)
            value = torch.tensor(slots, dtype=torch.int64)
        cached = self.model_match(ns, pages)
        assert self.cache.insert(RadixKey(toks, ns), value, priority) == cached * p
        for i in range(cached, len(pages)):
            self.model[(ns, tuple(pages[: i + 1]))] = tuple(slots[i * p : (i + 1) * p])

    @rule(toks=tokens, ns=namespaces, split=st.booleans())
    def match(self, toks, ns, split):
        pages = self.pages(toks)
        cached = self.model_match(ns, pages)
        expected = [v for i in range(cached) for v in self.model[(ns, tuple(pages[: i + 1]))]]
        n = cached * self.page
        before = snapshot(self.cache)
        assert self.cache.match_len(RadixKey(toks, ns)) == n
        result = self.cache.match_prefix(RadixKey(toks, ns), split=split)
        assert result.prefix_len == n and result.indices.tolist() == expected
        if split:
            depth, node = 0, result.last_node
            while node is not self.cache.root:
                depth, node = depth + len(node), node.parent
            assert depth == n, "last_node must end exactly at the match"
            self.matched.append(result.last_node)
        else:
            assert snapshot(self.cache) == before, "a read-only lookup changed the cache"

    @precondition(lambda self: self.matched)
    @rule(data=st.data())
    def lock(self, data):
        node = data.draw(st.sampled_from(self.matched))
        if node.evicted:
            before = snapshot(self.cache)
            try:
                self.cache.inc_lock_ref(node)
            except ValueError:
                assert snapshot(self.cache) == before
                return
            raise AssertionError("locking an evicted node must fail")
        path, x = [], node
        while x is not self.cache.root:
            path.append(x)
            x = x.parent
        expected = -sum(len(p) for p in path if p.lock_ref == 0)
        assert self.cache.inc_lock_ref(node) == expected
        self.locked.append(node)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        node = data.draw(st.sampled_from(self.locked))
        self.locked.remove(node)
        path, x = [], node
        while x is not self.cache.root:
            path.append(x)
            x = x.parent
        expected = sum(len(p) for p in path if p.lock_ref == 1)
        assert self.cache.dec_lock_ref(node) == expected

    @precondition(lambda self: self.matched)
    @rule(data=st.data())
    def unlock_unlocked_fails(self, data):
        node = data.draw(st.sampled_from(self.matched))
        if node.evicted or node.lock_ref > 0:
            return
        before = snapshot(self.cache)
        try:
            self.cache.dec_lock_ref(node)
        except ValueError:
            assert snapshot(self.cache) == before
            return
        raise AssertionError("unlocking an unlocked node must fail")

    @rule(num=st.integers(0, 30))
    def evict(self, num):
        cache = self.cache
        evictable = cache.evictable_size()
        sort_key = POLICIES[self.policy]
        leaves = [n for n in cache.iter_nodes() if not n.children and n.lock_ref == 0]
        first_victim = min(leaves, key=sort_key) if leaves else None
        victim_len = len(first_victim) if first_victim else 0
        before = content(cache)
        freed_before = len(self.alloc.freed)

        k = cache.evict(num)

        want = min(num, evictable)
        if cache.precise:  # the last victim trimmed: less than a page over
            assert want <= k < want + self.page, (num, evictable, k)
        else:  # whole leaves (SGLang): over by less than the last victim
            assert want <= k <= evictable and (k == 0) == (want == 0), (num, evictable, k)
        after = content(cache)
        assert removed_values(before, after) == Counter(self.alloc.freed[freed_before:])
        assert (len(before) - len(after)) * self.page == k
        if num > 0 and first_victim is not None:
            assert first_victim.evicted or len(first_victim) < victim_len, "wrong victim"
        assert all(not n.evicted for n in self.locked), "a locked node was evicted"
        self.model = after

    @rule(toks=tokens.filter(lambda t: len(t) > 1), ns=namespaces)
    def bad_insert_changes_nothing(self, toks, ns):
        before = snapshot(self.cache)
        try:
            self.cache.insert(RadixKey(toks, ns), torch.arange(len(toks) - 1))
        except ValueError:
            assert snapshot(self.cache) == before
            return
        raise AssertionError("a value of the wrong length must be rejected")

    # --- invariants --------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        self.cache.check_locks(self.locked)  # (each lock's holder is the test)
        assert content(self.cache) == self.model
        c = self.cache
        total = len(self.model) * self.page
        assert c.evictable_size() + c.protected_size() == c.total_size() == total


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=75,  # a maximum: hypothesis averages about 2/3 of it
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheMachine = pytest.mark.slow(CacheMachine.TestCase)
