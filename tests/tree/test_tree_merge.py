"""Chain merging (``merge_chains``): a differential state machine runs the same operations
on a merging and a non-merging LRU cache and checks that everything a caller can observe
through the API agrees: every match (length and slot indices), every evict (tokens and
the exact slots freed, in order), the sizes and the cached content. Unit tests pin down
the structure (a chain is one node), events, undo and the argument checks."""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingAllocator, content
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import RadixCache, RadixKey

# few distinct tokens and short keys: shared prefixes, extensions and branches are common
tokens = st.lists(st.integers(0, 2), max_size=12)
namespaces = st.sampled_from([None, "a"])


class MergeDifferential(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2]), eagle=st.booleans())
    def setup(self, page: int, eagle: bool) -> None:
        self.allocs = (RecordingAllocator(), RecordingAllocator())
        self.caches = tuple(
            RadixCache(page, "lru", a, is_eagle=eagle, merge_chains=m, precise=True)
            for a, m in zip(self.allocs, (True, False), strict=True)
        )
        self.locked: list[tuple] = []  # (merged cache's node, plain cache's node)
        self.next_slot = 1000

    @rule(toks=tokens, ns=namespaces, own_slots=st.booleans())
    def insert(self, toks, ns, own_slots):
        value = None
        if own_slots:
            value = torch.arange(self.next_slot, self.next_slot + len(toks))
            self.next_slot += len(toks)
        a, b = (c.insert(RadixKey(toks, ns), value) for c in self.caches)
        assert a == b

    @rule(toks=tokens, ns=namespaces, split=st.booleans())
    def match(self, toks, ns, split):
        a, b = (c.match_prefix(RadixKey(toks, ns), split=split) for c in self.caches)
        assert a.prefix_len == b.prefix_len and torch.equal(a.indices, b.indices)

    @rule(toks=tokens, ns=namespaces)
    def match_and_lock(self, toks, ns):
        a, b = (c.match_prefix(RadixKey(toks, ns)) for c in self.caches)
        da, db = (c.inc_lock_ref(r.last_node) for c, r in zip(self.caches, (a, b), strict=True))
        assert da == db
        self.locked.append((a.last_node, b.last_node))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        pair = data.draw(st.sampled_from(self.locked))
        self.locked.remove(pair)
        da, db = (c.dec_lock_ref(n) for c, n in zip(self.caches, pair, strict=True))
        assert da == db

    @rule(num=st.integers(0, 12))
    def evict(self, num):
        before = [len(a.freed) for a in self.allocs]
        a, b = (c.evict(num) for c in self.caches)
        assert a == b
        freed = [al.freed[n:] for al, n in zip(self.allocs, before, strict=True)]
        assert sorted(freed[0]) == sorted(freed[1]), "LRU evicted different slots"

    @invariant()
    def agree(self):
        if not hasattr(self, "caches"):
            return
        m, plain = self.caches
        m.check_integrity()
        plain.check_integrity()
        assert m.num_nodes() <= plain.num_nodes()
        assert content(m) == content(plain)
        assert (m.evictable_size(), m.protected_size()) == (
            plain.evictable_size(),
            plain.protected_size(),
        )


MergeDifferential.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMergeDifferential = pytest.mark.slow(MergeDifferential.TestCase)


# --- structure --------------------------------------------------------------------------------
def test_a_chain_inserted_without_locks_is_one_node():
    cache = RadixCache(page_size=4, merge_chains=True)
    tokens = list(range(4096))
    for end in range(64, 4097, 64):
        cache.insert(RadixKey(tokens[:end]), torch.arange(end) + 10)
    assert cache.num_nodes() == 1 and cache.total_size() == 4096
    hit = cache.match_prefix(RadixKey(tokens))
    assert hit.prefix_len == 4096 and torch.equal(hit.indices, torch.arange(4096) + 10)
    cache.check_integrity()


def test_a_locked_leaf_is_not_merged_and_a_stale_reference_fails_loudly():
    cache = RadixCache(merge_chains=True)
    first = cache.insert_node(RadixKey([1, 2, 3])).last_node
    cache.inc_lock_ref(first)
    cache.insert(RadixKey([1, 2, 3, 4, 5]))  # extends a locked leaf: a child
    assert cache.num_nodes() == 2
    cache.dec_lock_ref(first)
    below = cache.match_prefix(RadixKey([1, 2, 3, 4, 5])).last_node
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6]))  # extends the unlocked leaf: merged
    assert cache.num_nodes() == 2 and below.evicted
    try:
        cache.inc_lock_ref(below)
    except ValueError as e:
        assert "not in this cache" in str(e)
    else:
        raise AssertionError("locking a merged-away node must fail")
    cache.check_integrity()


def test_merging_reports_the_same_events_as_a_chain():
    class Sink:
        def __init__(self):
            self.log = []

        def stored(self, block_hashes, parent_hash, token_ids, block_size, extra_key):
            self.log.append(("stored", block_hashes, parent_hash, token_ids))

        def removed(self, block_hashes):
            self.log.append(("removed", sorted(block_hashes)))

        def cleared(self):
            self.log.append(("cleared",))

    sinks = Sink(), Sink()
    caches = [
        RadixCache(2, event_sink=s, merge_chains=m, precise=True)
        for s, m in zip(sinks, (True, False), strict=True)
    ]
    for c in caches:
        for end in (4, 8, 12):
            c.insert(RadixKey(list(range(end)), "ns"))
        c.evict(6)
        c.check_integrity()
    assert caches[0].num_nodes() == 1 and caches[1].num_nodes() == 2
    assert sinks[0].log == sinks[1].log


def test_detach_leaf_takes_back_only_what_an_insert_added():
    cache = RadixCache(page_size=2, merge_chains=True)
    cache.insert(RadixKey([1, 2, 3, 4]), torch.tensor([10, 11, 12, 13]))
    last = cache.insert_node(RadixKey([1, 2, 3, 4, 5, 6]), torch.tensor([0, 0, 0, 0, 14, 15]))
    assert cache.num_nodes() == 1  # merged
    assert cache.detach_leaf(last.last_node, 2).tolist() == [14, 15]
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).indices.tolist() == [10, 11, 12, 13]
    cache.check_integrity()
    node = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    for bad in (0, 3, 6):
        try:
            cache.detach_leaf(node, bad)
        except ValueError as e:
            assert "units" in str(e)
        else:
            raise AssertionError(f"detach_leaf(units={bad}) must fail")
    assert cache.total_size() == 4


def test_merge_chains_is_lru_only():
    assert not RadixCache().merge_chains and not RadixCache().precise  # SGLang's
    merged = RadixCache(merge_chains=True)
    assert merged.merge_chains and merged.precise  # merging implies precise eviction
    assert RadixCache(precise=True).precise
    for bad, err in ((dict(eviction_policy="fifo", merge_chains=True), ValueError),
                     (dict(merge_chains=True, precise=False), ValueError),
                     (dict(merge_chains="yes"), TypeError)):  # fmt: skip
        try:
            RadixCache(**bad)
        except err as e:
            assert "merge_chains" in str(e)
        else:
            raise AssertionError(f"RadixCache({bad}) must fail")


def test_the_default_keeps_an_unlocked_node_valid_across_inserts():
    """SGLang's contract: a node from a match stays lockable until evict removes it, even
    when an insert extends it meanwhile (what merging would break)."""
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    held = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    cache.insert(RadixKey([1, 2, 3, 4, 5]))  # extends the held leaf
    assert cache.inc_lock_ref(held) == -3  # still the node of [1, 2, 3], no more
    assert cache.path_values(held).tolist() == [1, 2, 3]
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.dec_lock_ref(held)
    cache.check_integrity()
