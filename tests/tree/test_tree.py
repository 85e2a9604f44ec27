"""RadixCache behaviour, case by case: matching, insertion, locks, eviction, namespaces,
bigram keys, bad inputs, deep trees, and the integrity checker's own ability to fail."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import RecordingAllocator, content, snapshot

from radixkv import POLICIES, RadixCache, RadixKey


def toks(text: str) -> list[int]:
    """A word-level stand-in tokenizer, stable across runs."""
    return [sum(ord(c) * 31**i for i, c in enumerate(w)) % 50000 for w in text.split()]


# --- the seed's example -------------------------------------------------------------------
def test_capital_of_france_then_italy_shares_the_prefix():
    cache = RadixCache()
    france = toks("What is the capital of France ?")
    italy = toks("What is the capital of Italy ?")
    slots_france = torch.arange(100, 100 + len(france))
    assert cache.match_prefix(RadixKey(france)).prefix_len == 0
    assert cache.insert(RadixKey(france), slots_france) == 0
    hit = cache.match_prefix(RadixKey(italy))
    assert hit.prefix_len == 5  # "What is the capital of"
    assert hit.indices.tolist() == slots_france[:5].tolist()  # the very same slots
    assert cache.insert(RadixKey(italy), torch.arange(200, 207)) == 5
    assert cache.total_size() == 9
    cache.check_integrity()


# --- match and insert ---------------------------------------------------------------------
def test_match_splits_so_last_node_is_exact_and_insert_reports_prefix():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3, 4, 5]), torch.tensor([10, 11, 12, 13, 14]))
    r = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert (r.prefix_len, r.indices.tolist(), len(r.last_node)) == (3, [10, 11, 12], 3)
    assert r.last_node.key.tolist() == [1, 2, 3] and len(r.last_node.children) == 1
    assert r.indices.dtype == torch.int64
    assert cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), torch.arange(6)) == 5
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).indices.tolist() == [
        10,
        11,
        12,
        13,
        14,
        5,
    ]
    cache.check_integrity()


def test_value_defaults_to_token_ids_and_accepts_many_types():
    cache = RadixCache()
    cache.insert([7, 8, 9])
    assert cache.match_prefix([7, 8, 9]).indices.tolist() == [7, 8, 9]
    from array import array

    import numpy as np

    for i, value in enumerate(
        [[1, 2], np.array([1, 2]), array("q", [1, 2]), torch.tensor([1, 2], dtype=torch.int32)]
    ):
        c = RadixCache()
        c.insert(RadixKey([i, i]), value)
        assert c.match_prefix(RadixKey([i, i])).indices.tolist() == [1, 2]


def test_pages_truncate_keys_and_split_on_page_boundaries():
    cache = RadixCache(page_size=4)
    assert cache.insert(RadixKey(list(range(10))), torch.arange(10)) == 0
    assert cache.total_size() == 8  # two whole pages
    r = cache.match_prefix(RadixKey([0, 1, 2, 3, 4, 5, 99, 99]))
    assert r.prefix_len == 4 and len(r.last_node) == 4
    assert cache.match_prefix(RadixKey([0, 1, 2])).prefix_len == 0
    cache.check_integrity()


def test_read_only_lookup_changes_nothing():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3, 4]))
    before = snapshot(cache)
    r = cache.match_prefix(RadixKey([1, 2, 9]), split=False)
    assert r.prefix_len == 2 and r.indices.tolist() == [1, 2] and r.last_node is cache.root
    assert cache.match_len(RadixKey([1, 2, 3, 4, 5])) == 4
    assert snapshot(cache) == before


def test_match_refreshes_recency_along_the_path():
    cache = RadixCache(eviction_policy="lru")
    cache.insert(RadixKey([1, 1]))
    cache.insert(RadixKey([2, 2]))
    cache.match_prefix(RadixKey([1, 1]))  # [1,1] is now the most recent
    assert cache.evict(1) == 2  # a whole leaf, as SGLang evicts
    assert cache.match_len(RadixKey([2, 2])) == 0 and cache.match_len(RadixKey([1, 1])) == 2


# --- locks --------------------------------------------------------------------------------
def test_locks_protect_paths_and_keep_the_size_identity():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3, 4]))
    cache.insert(RadixKey([1, 2, 5, 6]))
    node = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    assert cache.inc_lock_ref(node) == -4  # [1,2] and [3,4]
    assert cache.inc_lock_ref(node) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (2, 4, 6)
    assert cache.evict(100) == 2
    assert cache.match_len(RadixKey([1, 2, 3, 4])) == 4
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    assert cache.evict(100) == 4 and cache.total_size() == 0
    cache.check_integrity()


def test_unlocking_an_unlocked_node_fails_and_changes_nothing():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    node = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    before = snapshot(cache)
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)
    assert snapshot(cache) == before


def test_locking_an_evicted_or_foreign_node_fails():
    cache, other = RadixCache(), RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    node = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    other.insert(RadixKey([1, 2, 3]))
    with pytest.raises(ValueError, match="not in this cache"):
        other.inc_lock_ref(node)
    cache.evict(3)
    assert node.evicted
    with pytest.raises(ValueError, match="not in this cache"):
        cache.inc_lock_ref(node)
    with pytest.raises(TypeError, match="TreeNode"):
        cache.inc_lock_ref("node")


def test_root_locks_are_no_ops():
    cache = RadixCache()
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0


# --- eviction -----------------------------------------------------------------------------
def test_evict_frees_through_the_allocator_in_one_call():
    alloc = RecordingAllocator()
    cache = RadixCache(allocator=alloc)
    cache.insert(RadixKey([1, 2]), torch.tensor([50, 51]))
    cache.insert(RadixKey([3, 4]), torch.tensor([60, 61]))
    assert cache.evict(4) == 4
    assert sorted(alloc.freed) == [50, 51, 60, 61] and alloc.calls == 1
    assert cache.evict(4) == 0 and alloc.calls == 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_evict_is_page_precise(page_size):
    alloc = RecordingAllocator()
    cache = RadixCache(page_size=page_size, allocator=alloc, precise=True)
    cache.insert(RadixKey(list(range(96))), torch.arange(1000, 1096))
    k = cache.evict(1)
    assert k == page_size  # not the whole 96-token leaf
    assert alloc.freed == list(range(1096 - page_size, 1096))  # the tail goes first
    assert cache.match_len(RadixKey(list(range(96)))) == 96 - page_size
    for need in (5, 17, 33):
        before = cache.evictable_size()
        k = cache.evict(need)
        assert min(need, before) <= k < min(need, before) + page_size
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_drops_whole_leaves_by_default(page_size):
    alloc = RecordingAllocator()
    cache = RadixCache(page_size=page_size, allocator=alloc)
    cache.insert(RadixKey(list(range(96))), torch.arange(1000, 1096))
    cache.insert(RadixKey([7] * 8), torch.arange(8))
    assert cache.evict(1) == 96  # the least recent leaf, whole (SGLang's semantics)
    assert alloc.freed == list(range(1000, 1096)) and cache.total_size() == 8
    cache.check_integrity()


def test_evict_more_than_cached_empties_the_unlocked_part():
    cache = RadixCache(page_size=4)
    cache.insert(RadixKey(list(range(8))))
    cache.insert(RadixKey([9] * 8))
    node = cache.match_prefix(RadixKey([9] * 8)).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(10**6) == 8
    assert cache.total_size() == cache.protected_size() == 8
    cache.check_integrity()


def test_parent_becomes_evictable_after_its_children_go():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    cache.insert(RadixKey([1, 2, 4]))
    assert cache.evict(4) == 4 and cache.total_size() == 0


def test_no_allocator_means_evicted_indices_are_dropped():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    assert cache.evict(3) == 3


# --- policies -----------------------------------------------------------------------------
def victims(cache: RadixCache, n: int) -> list[int]:
    """First units of the leaves evicted one at a time."""
    out = []
    for _ in range(n):
        before = content(cache)
        cache.evict(1)
        (gone,) = [k for k in before if k not in content(cache)]
        out.append(gone[1][0][0])  # (namespace, (first page, ...)) -> first unit
    return out


def three_leaves(policy: str) -> RadixCache:
    cache = RadixCache(eviction_policy=policy)
    cache.insert(RadixKey([1]), priority=5)
    cache.insert(RadixKey([2]), priority=1)
    cache.insert(RadixKey([3]), priority=3)
    cache.match_prefix(RadixKey([1]))
    cache.match_prefix(RadixKey([1]))
    cache.match_prefix(RadixKey([3]))
    return cache


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("lru", [2, 1, 3]),
        ("mru", [3, 1, 2]),
        ("fifo", [1, 2, 3]),
        ("filo", [3, 2, 1]),
        ("lfu", [2, 3, 1]),
        ("priority", [2, 3, 1]),
        ("slru", [2, 3, 1]),
    ],
)
def test_each_policy_orders_evictions_as_documented(policy, order):
    assert victims(three_leaves(policy), 3) == order


def test_slru_protects_nodes_hit_twice_even_if_older():
    cache = RadixCache(eviction_policy="slru")
    cache.insert(RadixKey([1]))
    cache.match_prefix(RadixKey([1]))
    cache.match_prefix(RadixKey([1]))  # hit twice: protected segment
    cache.insert(RadixKey([2]))
    cache.match_prefix(RadixKey([2]))  # hit once, more recent than [1]
    assert victims(cache, 2) == [2, 1]


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="lru, lfu, fifo, mru, filo, priority, slru, session"):
        RadixCache(eviction_policy="random")
    assert set(POLICIES) == {"lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "session"}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_same_operations_give_the_same_tree_and_eviction_order(policy):
    def run() -> tuple:
        alloc = RecordingAllocator()
        cache = RadixCache(eviction_policy=policy, allocator=alloc)
        for i in range(60):
            cache.insert(RadixKey([i % 7, i % 5, i % 3, i]), priority=i % 4)
            cache.match_prefix(RadixKey([i % 5, i % 3]))
        cache.evict(50)
        return cache.format_tree(), alloc.freed

    assert run() == run()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_peek_names_the_leaf_evict_takes_next(policy):
    """`EvictionOrder.peek`: the next victim and its key, nothing taken; locked leaves
    and entries gone stale are passed over, as `evict` passes them."""
    cache = RadixCache(eviction_policy=policy)
    for i in range(40):
        cache.insert(RadixKey([i % 7, i % 5, i % 3, i]), priority=i % 4)
        cache.match_prefix(RadixKey([i % 5, i % 3]))
    locked = cache.match_prefix(RadixKey([0, 0, 0, 0])).last_node
    cache.inc_lock_ref(locked)
    while (first := cache.order.peek()) is not None:
        key, node = first
        assert node is not locked and not node.children and node.lock_ref == 0
        assert key == cache.order.policy_key(node)
        assert cache.order.peek() == first  # nothing was taken
        ids = {n.id for n in cache.iter_nodes()}
        cache.evict(1)  # a whole leaf: this one
        assert node.id in ids and node.id not in {n.id for n in cache.iter_nodes()}
    cache.dec_lock_ref(locked)
    assert cache.order.peek()[1] is locked
    cache.check_integrity()


@pytest.mark.parametrize("precise", [False, True])
def test_evict_below_a_floor_takes_only_what_ranks_below_it(precise):
    """`EvictionOrder.below`: within it, `evict` (asked for everything) takes exactly the
    leaves whose priority is below the floor, a parent its children's going uncovers
    included when its own is; all of them once the block ends."""
    cache = RadixCache(eviction_policy="priority", precise=precise)
    for i in range(60):
        cache.insert(RadixKey([i % 3, i % 5, i % 7, i]), priority=i % 6)
    for floor in (2, 4):
        with cache.order.below(floor):
            cache.evict(cache.evictable_size())
            assert cache.order.floor == floor
        left = list(cache.iter_nodes())
        assert left and min(n.priority for n in left if not n.children) >= floor
        # (nodes keep the greatest priority on their path: what stays had one at or above)
        assert all(n.priority >= floor for n in left if n is not cache.root)
        cache.check_integrity()
    assert cache.order.floor is None
    cache.evict(cache.evictable_size())
    assert cache.total_size() == 0
    for j in range(3):  # parents ranking above every child of theirs, nothing else
        cache.insert(RadixKey([100 + j, 7, 7]), priority=1)
        cache.insert(RadixKey([100 + j, 8]), priority=0)
        cache.insert(RadixKey([100 + j]), priority=5)  # (never a leaf: no entry of its own)
    with cache.order.below(2):
        cache.evict(cache.evictable_size())
    assert cache.total_size() == 3 and all(cache.match_len(RadixKey([100 + j])) for j in range(3))


@pytest.mark.parametrize("seed", range(4))
def test_size_below_never_counts_more_than_an_eviction_under_the_floor_takes(seed):
    """`EvictionOrder.size_below`: what a load ahead may count on. A chain inserted chunk
    by chunk counts whole; on random trees (shared prefixes, locks) it is never more
    than `evict` under `below` the same floor frees."""
    rng = random.Random(seed)
    chain = RadixCache(eviction_policy="priority")
    for n in range(8, 72, 8):  # one prompt, 8 tokens a chunk: a chain of 8 nodes
        chain.insert(RadixKey(list(range(n))), priority=3)
    assert chain.order.size_below(4, 10**9) == 64 and chain.order.size_below(3, 10**9) == 0
    for _ in range(5):
        cache = RadixCache(eviction_policy="priority")
        for _ in range(40):
            key = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            cache.insert(RadixKey(key + [rng.randrange(100) for _ in range(rng.randrange(4))]),
                         priority=rng.randrange(6))  # fmt: skip
        for _ in range(3):
            cache.inc_lock_ref(cache.match_prefix(RadixKey([rng.randrange(3)] * 3)).last_node)
        floor = rng.randrange(1, 7)
        counted = cache.order.size_below(floor, 10**9)
        with cache.order.below(floor):
            freed = cache.evict(cache.evictable_size())
        assert counted <= freed, (counted, freed)
        assert cache.order.size_below(floor, 10**9) == 0
        cache.check_integrity()


# --- namespaces and bigram keys -----------------------------------------------------------
def test_extra_key_namespaces_never_share_nodes():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3], extra_key="lora-a"))
    assert cache.match_len(RadixKey([1, 2, 3])) == 0
    assert cache.match_len(RadixKey([1, 2, 3], extra_key="lora-b")) == 0
    assert cache.match_len(RadixKey([1, 2, 3], extra_key="lora-a")) == 3
    assert cache.insert(RadixKey([1, 2, 3])) == 0
    assert len(cache.root.children) == 2
    cache.check_integrity()


def test_eagle_uses_bigram_keys_without_mutating_the_callers_key():
    cache = RadixCache(is_eagle=True)
    key = RadixKey([1, 2, 3, 4])
    assert cache.insert(key, torch.tensor([10, 11, 12, 13])) == 0
    assert not key.is_bigram
    assert cache.total_size() == 3  # three pairs; the value is truncated to 3
    r = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert r.prefix_len == 2 and r.indices.tolist() == [10, 11]
    assert list(r.last_node.key) == [(1, 2), (2, 3)]
    cache.check_integrity()


def test_bigram_key_in_a_plain_cache_is_rejected():
    with pytest.raises(ValueError, match="is_eagle"):
        RadixCache().insert(RadixKey([1, 2, 3], is_bigram=True))


# --- bad input leaves the cache unchanged -------------------------------------------------
@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c: c.insert(RadixKey([1, 2, 3]), torch.tensor([1, 2])), ValueError, "len"),
        (lambda c: c.insert(RadixKey([1, 2]), torch.tensor([1.0, 2.0])), TypeError, "value"),
        (lambda c: c.insert(RadixKey([1, 2]), [[1, 2]]), TypeError, "value"),
        (lambda c: c.insert(RadixKey([1, 2]), priority=1.5), TypeError, "priority"),
        (lambda c: c.insert([1.5, 2.0]), TypeError, "token_ids"),
        (lambda c: c.insert("abc"), TypeError, "key"),
        (lambda c: c.match_prefix(12), TypeError, "key"),
        (lambda c: c.evict(-1), ValueError, "num_tokens"),
        (lambda c: c.evict(2.0), TypeError, "num_tokens"),
        (lambda c: c.evict(True), TypeError, "num_tokens"),
    ],
)
def test_bad_input_raises_a_clear_error_and_changes_nothing(call, error, match):
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3, 4]))
    cache.match_prefix(RadixKey([1, 2]))
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        call(cache)
    assert snapshot(cache) == before
    cache.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"page_size": 0}, ValueError),
        ({"page_size": 1.0}, TypeError),
        ({"allocator": object()}, TypeError),
        ({"eviction_policy": 3}, TypeError),
    ],
)
def test_bad_constructor_arguments(kwargs, error):
    with pytest.raises(error):
        RadixCache(**kwargs)


def test_disabled_cache_never_stores():
    cache = RadixCache(disable=True)
    assert cache.insert(RadixKey([1, 2, 3])) == 0
    r = cache.match_prefix(RadixKey([1, 2, 3]))
    assert r.prefix_len == 0 and r.last_node is cache.root and cache.evict(5) == 0
    with pytest.raises(ValueError):
        cache.insert(RadixKey([1, 2, 3]), [1])


def test_reset_empties_the_cache():
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    cache.reset()
    assert cache.total_size() == 0 and cache.match_len(RadixKey([1, 2, 3])) == 0
    cache.check_integrity()


# --- deep trees: nothing recurses ---------------------------------------------------------
@pytest.mark.slow
def test_a_5000_node_chain_needs_no_recursion():
    cache = RadixCache(merge_chains=False)  # merging would store the chain as one node
    tokens = list(range(10_000))
    for end in range(2, 10_001, 2):
        cache.insert(RadixKey(tokens[:end]))
    assert cache.num_nodes() == 5000
    assert cache.match_prefix(RadixKey(tokens)).prefix_len == 10_000
    assert cache.all_values().tolist() == tokens
    assert len(cache.format_tree().splitlines()) == 5001
    cache.check_integrity()
    assert cache.evict(10_000) == 10_000
    cache.check_integrity()


def test_pretty_print_writes_the_tree(capsys):
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3], extra_key="t"))
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "total=3" in out and "ns='t'" in out and "[1, 2, 3]" in out


# --- the integrity checker can fail -------------------------------------------------------
def corrupt_cases():
    def sizes(c, leaf):
        c._evictable += 1

    def parent(c, leaf):
        leaf.parent = c.root

    def lock(c, leaf):
        leaf.parent.lock_ref = 0  # below its locked child's count

    def stale_heap(c, leaf):
        c.order.clear()

    def heap_key(c, leaf):  # live entries whose keys are not their nodes' any more
        c.order.policy_key = lambda node: (-1, node.id)

    def page(c, leaf):
        c.page_size = 2

    def count(c, leaf):
        c._num_nodes += 1

    return [sizes, parent, lock, stale_heap, heap_key, page, count]


@pytest.mark.parametrize("corrupt", corrupt_cases())
def test_check_integrity_detects_corruption(corrupt):
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    cache.insert(RadixKey([1, 2, 4, 5]))
    leaf = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    cache.inc_lock_ref(leaf)
    cache.check_integrity()
    corrupt(cache, leaf)
    with pytest.raises(AssertionError, match="integrity"):
        cache.check_integrity()


def test_check_locks_names_a_lock_no_holder_accounts_for():
    """Two holders on one path: the ledger holds; a lock taken behind its back (a leak)
    or a holder whose lock was released are each named with the node; a holder that
    was evicted is named too."""
    cache = RadixCache()
    cache.insert(RadixKey([1, 2, 3]))
    cache.insert(RadixKey([1, 2, 4, 5]))
    a = cache.match_prefix(RadixKey([1, 2, 3])).last_node
    b = cache.match_prefix(RadixKey([1, 2, 4, 5])).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    cache.check_locks([a, b])
    cache.inc_lock_ref(a)  # (leaked)
    shared = a.parent  # (the first node on the path: checked parents first)
    with pytest.raises(AssertionError, match=f"node {shared.id}: lock_ref 3, but its "
                       "holders account for 2 .a lock leaked"):  # fmt: skip
        cache.check_locks([a, b])
    cache.dec_lock_ref(a)
    cache.dec_lock_ref(b)
    with pytest.raises(AssertionError, match=f"node {shared.id}: lock_ref 1, but its "
                       "holders account for 2"):  # fmt: skip
        cache.check_locks([a, b])
    cache.check_locks([a])
    cache.dec_lock_ref(a)
    cache.evict(cache.evictable_size())
    with pytest.raises(AssertionError, match=f"holder's node {a.id} is not in the tree"):
        cache.check_locks([a])
    cache.check_locks([])


def test_extends_leaf_tells_a_next_turn_from_a_divergence_and_changes_nothing():
    c = RadixCache(page_size=2)
    c.insert(RadixKey([1, 2, 3, 4]))
    (leaf,) = c.root.children.values()
    before = (c.total_size(), leaf.last_access, leaf.hit_count)
    assert c.extends_leaf(RadixKey([1, 2, 3, 4, 5, 6]))  # a next turn
    assert c.extends_leaf(RadixKey([1, 2, 3, 4]))  # the same prompt again
    assert not c.extends_leaf(RadixKey([1, 2, 9, 9]))  # diverges inside the leaf
    assert not c.extends_leaf(RadixKey([5, 5]))
    assert (c.total_size(), leaf.last_access, leaf.hit_count) == before  # read-only
    c.insert(RadixKey([1, 2, 7, 7]))  # [1, 2] is now a branch point, not a leaf
    assert not c.extends_leaf(RadixKey([1, 2, 8, 8]))
    assert c.extends_leaf(RadixKey([1, 2, 7, 7, 8, 8]))
    assert not c.extends_leaf(RadixKey([1, 2, 3, 4], extra_key="other"))
    assert not RadixCache(page_size=2, disable=True).extends_leaf(RadixKey([1, 2]))
