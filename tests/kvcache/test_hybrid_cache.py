"""The hybrid cache's components, case by case: recurrent-state checkpoints (where they
go, what a match may use, eviction by LRU and by utility, supersession), sliding-window
KV (what is kept, marks, tombstones recovered), `HybridBudget`'s order, and the errors
of their APIs. The random sequences are in ``test_hybrid_stateful.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.budget import HybridBudget
from radixkv.kvcache.recurrent.component import StateCheckpoints
from radixkv.kvcache.window.component import WindowKV


class Pool:
    def __init__(self) -> None:
        self.next, self.freed = 0, []

    def take(self, n: int) -> np.ndarray:
        self.next += n
        return np.arange(self.next - n, self.next, dtype=np.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def K(*toks: int) -> RadixKey:
    return RadixKey(np.asarray(toks, dtype=np.int64))


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def hybrid(max_states=8, policy="lru", page=1, **kw):
    pool = Pool()
    state = StateCheckpoints(max_states, pool, policy, **kw)
    cache = RadixCache(page, components=(state,))
    return cache, state, pool


def serve(cache, state, toks, slot, boundaries=(), prompt_end=True):
    """What an engine does for one prompt: match, plan, snapshot at each planned
    position; returns the hit."""
    key = K(*toks)
    full = cache.match_len(key, full=True)
    hit = cache.match_prefix(key).prefix_len
    for pos, kind in state.plan(len(key), full, hit, boundaries, prompt_end):
        node = cache.insert_node(key[:pos]).last_node
        state.add(node, slot, kind=kind)
        slot += 1
    cache.insert(key)
    return hit


# --- recurrent-state checkpoints ---------------------------------------------------------
def test_a_match_ends_at_the_deepest_checkpoint_it_passes():
    cache, state, _ = hybrid()
    node = cache.insert_node(K(*seq(0, 10))).last_node
    assert cache.match_prefix(K(*seq(0, 10))).prefix_len == 0  # no checkpoint: no hit
    assert cache.match_len(K(*seq(0, 10)), full=True) == 10
    state.add(node, 7, offset=4)
    m = cache.match_prefix(K(*seq(0, 10)))
    assert m.prefix_len == 4 and state.at(m.last_node) == 7 and state.used(m.last_node) == 7
    cache.check_integrity()
    # one walk gives both: where the request starts and where it leaves the cached path
    _, last, hit, full = cache.match_parts(K(*seq(0, 8), 99))
    assert (hit, full) == (4, 8) and state.at(last) == 7
    assert cache.match_parts(K(50, 51))[2:] == (0, 0)
    cache.check_integrity()


def test_the_third_sharer_hits_the_branch_point_and_the_second_already_hits_a_boundary():
    cache, state, _ = hybrid()
    system = seq(100, 12)
    assert serve(cache, state, system + [1, 2, 3], 0) == 0
    # the second request leaves the first's path after the system prompt: it snapshots
    # the branch point during its own prefill
    assert serve(cache, state, system + [4, 5, 6], 10) == 0
    assert serve(cache, state, system + [7, 8, 9], 20) == 12
    # with the boundary known up front, the second request hits
    cache2, state2, _ = hybrid()
    assert serve(cache2, state2, system + [1, 2, 3], 0, boundaries=(12,)) == 0
    assert serve(cache2, state2, system + [4, 5, 6], 10, boundaries=(12,)) == 12
    kinds = sorted(c.kind for c in state2.held.values())
    assert kinds == ["boundary", "end", "end"]


def test_plan_positions_and_kinds():
    _cache, state, _ = hybrid(page=4)
    state.every_pages = 2
    plan = state.plan(prompt_units=30, full_hit=13, state_hit=4, boundaries=(9, 22))
    # page-aligned: the end 28, the branch 12, boundaries 8 and 20, every 8 units from 4
    assert plan == [(8, "boundary"), (12, "branch"), (16, "interval"), (20, "boundary"),
                    (24, "interval"), (28, "end")]  # fmt: skip
    assert (28, "end") not in state.plan(30, 13, 4, (), prompt_end=False)
    assert state.plan(30, 4, 28) == []  # nothing past where the request starts


def test_a_chat_turn_supersedes_the_last_and_a_branch_point_never_is():
    cache, state, _ = hybrid()
    turn1 = seq(0, 8)
    serve(cache, state, turn1, 0)
    (c1,) = state.held.values()
    assert not state.superseded(c1)  # a leaf's end: the next turn starts there
    serve(cache, state, turn1 + seq(50, 4), 1)
    assert state.superseded(c1)  # the conversation went on, no branch there
    serve(cache, state, turn1 + seq(80, 4), 2)  # a regenerated turn 2: a branch
    assert not state.superseded(c1)


def test_a_checkpoint_a_running_request_will_pass_is_superseded_while_it_runs():
    """A turn's end that a running request resumed from (or computed a page past) is
    superseded while nothing is cached below it yet, and the budget's candidate sets
    follow (`HybridBudget.check`); when the request leaves it is a leaf's end again. A
    branch point never is; neither is a checkpoint a longer path has branched at."""
    cache, state, _ = hybrid()
    budget = HybridBudget(cache, state, token_bytes=1)
    serve(cache, state, seq(0, 8), 0)
    (c1,) = state.held.values()
    assert not state.superseded(c1)
    state.pass_through(c1, 1)
    assert state.superseded(c1)
    budget.check(set())
    state.pass_through(c1, 1)  # a second request resumed there too
    state.pass_through(c1, -1)
    assert state.superseded(c1) and c1.passing == 1
    state.pass_through(c1, -1)  # it left without caching past it
    assert not state.superseded(c1) and c1.passing == 0
    budget.check(set())
    node = c1.node
    state.add(node, 7, offset=4, kind="branch")
    branch = state.held[7]
    state.pass_through(branch, 1)
    assert not state.superseded(branch)  # a branch point: requests leave there
    state.pass_through(branch, -1)
    serve(cache, state, seq(0, 8) + seq(50, 4), 1)
    serve(cache, state, seq(0, 8) + seq(80, 4), 2)  # two turns 2: a branch at c1
    state.pass_through(c1, 1)
    assert not state.superseded(c1)
    state.drop([c1])
    state.pass_through(c1, -1)  # dropped meanwhile: nothing to count
    assert c1.passing == 1
    budget.check(set())


def test_lru_and_utility_eviction_choose_differently():
    """The oldest checkpoint sits after a long prefix: LRU drops it, utility (prefill
    FLOPs saved per byte, plus recency) drops a short one instead."""
    for policy, dropped in (("lru", 100), ("utility", 101)):
        pool = Pool()
        state = StateCheckpoints(3, pool, policy, prefill_flops=lambda n: float(n) ** 2)
        cache = RadixCache(1, components=(state,))
        for slot, toks in ((100, seq(0, 64)), (101, seq(1000, 2)), (102, seq(2000, 2))):
            state.add(cache.insert_node(K(*toks)).last_node, slot)
        state.add(cache.insert_node(K(*seq(3000, 2))).last_node, 103)  # one over: one goes
        assert pool.freed == [dropped] and state.evictions == 1
        assert sorted(state.held) == sorted({100, 101, 102, 103} - {dropped})
        cache.check_integrity()


def test_a_protected_checkpoint_is_never_evicted_until_unprotected_as_often():
    cache, state, _pool = hybrid(max_states=4)
    nodes = [cache.insert_node(K(*seq(10 * i, 8))).last_node for i in range(4)]
    for slot, node in enumerate(nodes):
        state.add(node, slot)
    (first,) = state.serving(nodes[0])
    state.protect(first)
    state.protect(first)
    state.protect(state.serving(nodes[1])[0])
    assert state.evict(4) == 2 and sorted(state.held) == [0, 1]  # the unprotected ones
    state.unprotect(first)
    assert state.evict(1) == 0  # still protected once
    state.unprotect(first)
    assert state.evict(1) == 1 and sorted(state.held) == [1]
    state.unprotect(first)  # gone: nothing to do
    with pytest.raises(ValueError, match="not held"):
        state.protect(first)
    cache.check_integrity()


def test_serving_names_the_checkpoints_a_hit_starts_from():
    """At the prefix's end (a request going on past it) and the deepest strictly before
    it (the prompt sent again), in the node itself or above it."""
    cache, state, _pool = hybrid(max_states=8, page=4)
    node = cache.insert_node(K(*seq(0, 16))).last_node
    state.add(node, 1, offset=8)
    assert [c.slot for c in state.serving(node)] == [1]  # nothing at the end
    state.add(node, 2)
    state.add(node, 3, offset=12)
    assert [c.slot for c in state.serving(node)] == [2, 3]
    child = cache.insert_node(K(*seq(0, 16), *seq(100, 8))).last_node
    assert [c.slot for c in state.serving(child)] == [2]  # none at its end: its parent's
    state.add(child, 4)
    assert [c.slot for c in state.serving(child)] == [4, 2]  # before it: its parent's end
    cache.check_integrity()


def test_checkpoints_follow_splits_merges_and_eviction():
    pool = Pool()
    state = StateCheckpoints(8, pool)
    cache = RadixCache(2, allocator=pool, eviction_mode="merge", components=(state,))
    node = cache.insert_node(K(*seq(0, 8)), torch.arange(8)).last_node
    state.add(node, 100, offset=4)
    state.add(node, 101)
    cache.insert_node(K(*seq(0, 4), 9, 9), torch.arange(20, 26))  # splits at 4
    cache.check_integrity()
    assert cache.match_prefix(K(*seq(0, 8))).prefix_len == 8
    assert cache.match_prefix(K(*seq(0, 6))).prefix_len == 4
    cache.evict(100)
    assert not state.held and sorted(pool.freed)[-2:] == [100, 101]
    cache.check_integrity()


def test_state_api_errors_name_the_argument():
    cache, state, _ = hybrid(page=2)
    node = cache.insert_node(K(*seq(0, 6))).last_node
    with pytest.raises(ValueError, match="page boundary"):
        state.add(node, 1, offset=3)
    with pytest.raises(ValueError, match="slot"):
        state.add(node, -1)
    state.add(node, 1)
    with pytest.raises(ValueError, match="holds a checkpoint"):
        state.add(node, 1, offset=2)
    with pytest.raises(ValueError, match="kind"):
        state.add(node, 2, offset=2, kind="whim")
    with pytest.raises(ValueError, match="max_states"):
        StateCheckpoints(0)
    with pytest.raises(ValueError, match="policy"):
        StateCheckpoints(2, policy="fifo")
    with pytest.raises(TypeError, match="allocator"):
        StateCheckpoints(2, allocator=object())
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="history"):
            StateCheckpoints(2, history=bad)
    other = RadixCache(2).insert_node(K(1, 2)).last_node
    with pytest.raises(ValueError, match="not in this cache"):
        state.add(other, 5)


# --- sliding-window KV -------------------------------------------------------------------
def window_cache(window=4, retain="ends"):
    pool = Pool()
    win = WindowKV(window, pool, retain)
    return RadixCache(1, components=(win,)), win, pool


def put(cache, win, pool, toks):
    key = K(*toks)
    slots = pool.take(len(key))
    res = cache.insert_node(key, extras={"window": slots})
    pool.free(torch.from_numpy(slots[~win.taken]))  # the caller frees what was not taken
    return res


def test_window_kv_is_kept_for_the_ends_a_match_can_use():
    cache, win, pool = window_cache(4)
    put(cache, win, pool, seq(0, 20))
    assert win.held_units() == 4  # the leaf's last window
    assert cache.match_prefix(K(*seq(0, 20))).prefix_len == 20
    # a position inside with no window KV is not servable: the match falls to the root
    assert cache.match_len(K(*seq(0, 12))) == 0
    assert cache.match_len(K(*seq(0, 12)), full=True) == 12
    # a second prompt branching at 12: the branch point needs a window, and the
    # inserting request supplies it (a tombstone recovered)
    put(cache, win, pool, seq(0, 12) + [99, 98])
    assert cache.match_len(K(*seq(0, 12), 7)) == 12
    assert win.held_units() == 4 + 2 + 4  # branch window, new leaf's 2 (+2 shared), old leaf
    cache.check_integrity()
    held = {s for n in cache.iter_nodes() for s in win.slots(n).tolist()}
    assert held.isdisjoint(pool.freed) and len(held) + len(pool.freed) == pool.next


def test_a_marked_boundary_keeps_its_window_for_the_next_sharer():
    cache, win, pool = window_cache(4)
    node = put(cache, win, pool, seq(0, 10)).last_node  # a system prompt's end
    win.mark(node)
    put(cache, win, pool, seq(0, 10) + seq(50, 10))
    assert win.servable(node) and cache.match_len(K(*seq(0, 10), 77)) == 10
    # unmarked, the same shape loses the boundary's window
    cache2, win2, pool2 = window_cache(4)
    put(cache2, win2, pool2, seq(0, 10))
    put(cache2, win2, pool2, seq(0, 10) + seq(50, 10))
    assert cache2.match_len(K(*seq(0, 10), 77)) == 0


def test_window_pressure_tombstones_least_recent_first():
    cache, win, pool = window_cache(4, retain="all")
    put(cache, win, pool, seq(0, 8))
    put(cache, win, pool, seq(100, 8))
    cache.match_prefix(K(*seq(100, 8)))  # the second is more recent
    assert win.evict(1) == 8
    assert cache.match_len(K(*seq(0, 8))) == 0 and cache.match_len(K(*seq(100, 8))) == 8
    cache.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_window_pressure_frees_in_the_order_a_sort_gives(seed):
    """`evict` and `evict_spare` keep their order in heaps (no scan a call): after random
    inserts, matches (which make nodes recent), locks and evictions, each frees exactly
    what sorting every node by (last_access, id) and taking them in turn frees."""
    import random

    rng = random.Random(seed)
    cache, win, pool = window_cache(4, retain="all")
    stems = [seq(1000 * i, rng.randrange(2, 12)) for i in range(5)]
    locked = []
    for step in range(120):
        toks = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        op = rng.random()
        if op < 0.45:
            put(cache, win, pool, toks)
        elif op < 0.7:
            res = cache.match_prefix(K(*toks))
            if rng.random() < 0.3:  # a running request: an old node or the match's end
                nodes = [n for n in cache.iter_nodes() if n is not cache.root]
                node = rng.choice(nodes) if rng.random() < 0.5 else res.last_node
                if node is not cache.root:
                    cache.inc_lock_ref(node)
                    locked.append(node)
        elif op < 0.8 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            spare = rng.random() < 0.5
            units = rng.randrange(1, 12)
            nodes = list(cache.iter_nodes())
            before = {n.id: win.covered(n) for n in nodes}
            cut = win._spare if spare else (lambda n: 0 if n.lock_ref else win.covered(n))
            want, freed = dict(before), 0
            for n in sorted(nodes, key=lambda n: (n.last_access, n.id)):
                if freed >= units:
                    break
                if cut(n):
                    freed += cut(n)
                    want[n.id] -= cut(n)
            got = win.evict_spare(units) if spare else win.evict(units)
            assert got == freed
            assert {n.id: win.covered(n) for n in nodes} == want, step
        cache.check_integrity()


def test_drop_tombstones_a_chosen_node_and_refuses_a_locked_one():
    cache, win, pool = window_cache(4, retain="all")
    put(cache, win, pool, seq(0, 8))
    mid = cache.insert_node(K(*seq(0, 4))).last_node  # split: [0, 4) and [4, 8)
    assert win.drop(mid) == 4 and win.drop(mid) == 0
    assert pool.freed == [0, 1, 2, 3]
    assert cache.match_len(K(*seq(0, 8))) == 8  # the last window is still there
    assert cache.match_len(K(*seq(0, 6))) == 0  # two units past a tombstone: too few
    leaf = cache.match_prefix(K(*seq(0, 8))).last_node
    cache.inc_lock_ref(leaf)
    with pytest.raises(ValueError, match="locked"):
        win.drop(leaf)
    cache.dec_lock_ref(leaf)
    other, _w, _p = window_cache(4)
    with pytest.raises(ValueError, match="not in this cache"):
        win.drop(put(other, _w, _p, seq(0, 4)).last_node)
    cache.check_integrity()


def test_extras_are_checked():
    cache, _win, _pool = window_cache(4)
    with pytest.raises(ValueError, match="no component takes"):
        cache.insert_node(K(1, 2), extras={"state": [1, 2]})
    with pytest.raises(ValueError, match="entries for"):
        cache.insert_node(K(1, 2, 3), extras={"window": [1]})
    assert cache.num_nodes() == 0
    with pytest.raises(ValueError, match="window"):
        WindowKV(0)
    with pytest.raises(ValueError, match="retain"):
        WindowKV(4, retain="some")


# --- the budget -----------------------------------------------------------------------
def test_budget_evicts_dead_kv_then_superseded_then_by_utility():
    cache, state, _pool = hybrid()
    budget = HybridBudget(cache, state, token_bytes=1, flops=lambda n: float(n))
    state.state_bytes = 10
    a = cache.insert_node(K(*seq(0, 10))).last_node
    state.add(a, 1, offset=6)  # units 7..10 are dead: nothing can start there
    turn2 = cache.insert_node(K(*seq(0, 6), *seq(50, 6))).last_node
    state.add(turn2, 2)
    state.add(cache.insert_node(K(*seq(200, 2))).last_node, 3)
    state.add(cache.insert_node(K(*seq(300, 40))).last_node, 4)
    assert budget.held() == {"full": 58, "window": 0, "states": 40}
    budget.fit(budget.total() - 1)  # 1. dead KV: the 4 units past the checkpoint at 6
    assert cache.total_size() == 54 and sorted(state.held) == [1, 2, 3, 4]
    # the conversation went on from the checkpoint at 6, no branch there any more
    assert state.superseded(state.held[1])
    budget.fit(budget.total() - 1)  # 2. superseded: the KV stays
    assert sorted(state.held) == [2, 3, 4] and cache.total_size() == 54
    # 3. by utility: the short prefix saves least per byte, though not the oldest
    budget.fit(budget.total() - 1)
    assert sorted(state.held) == [2, 4] and cache.match_len(K(*seq(200, 2))) == 0
    budget.fit(budget.total() - 1)  # its KV is dead now, and goes first
    assert cache.total_size() == 52 and sorted(state.held) == [2, 4]
    budget.fit(0)  # everything evictable goes
    assert budget.total() == 0 and not state.held
    cache.check_integrity()


@pytest.mark.parametrize("with_window", [False, True])
def test_budget_under_a_floor_evicts_only_what_ranks_below_it(with_window):
    """With the stamped order under a floor (`EvictionOrder.below`: a load ahead's room),
    the budget frees only leaves whose priority is below it, then stops; the rest go
    once the floor is lifted. Checkpoints (each leaf's end) or a window alike."""
    win = state = None
    if with_window:
        cache, win, pool = window_cache(4, retain="all")
        budget = HybridBudget(cache, None, win, token_bytes=1, window_bytes=1,
                              order="priority")  # fmt: skip
    else:
        cache, state, _pool = hybrid()
        budget = HybridBudget(cache, state, token_bytes=1, order="priority")
        state.state_bytes = 10
    leaves = {}
    for slot, prio in enumerate((1, 5, 3, 9, 4), 1):
        key = leaves[prio] = K(*seq(100 * slot, 8))
        extras = {"window": pool.take(8)} if win is not None else None
        node = cache.insert_node(key, extras=extras, priority=prio).last_node
        if state is not None:
            state.add(node, slot)
    with cache.order.below(4):
        budget.fit(0)
    held = {p for p, key in leaves.items() if cache.match_len(key) == 8}
    assert held == {4, 5, 9}, held
    budget.fit(0)
    assert not any(cache.match_len(key) for key in leaves.values())
    cache.check_integrity()


@pytest.mark.parametrize("frequency", [True, False])
def test_budget_weighs_what_a_segment_saves_by_the_hits_through_it(frequency):
    """Three prompts of one length (one saving per byte), used least recently first c,
    then a, then b; three hits resumed from a. A round that must drop two checkpoints
    takes c's either way; then, counting hits, the unused b's (GDSF's frequency x cost /
    size), and without them a's, the less recent."""
    cache, state, _pool = hybrid()
    budget = HybridBudget(cache, state, token_bytes=1, flops=float, frequency=frequency)
    state.state_bytes = 10
    slot = {"c": 1, "a": 2, "b": 3}
    for name, first in (("c", 100), ("a", 200), ("b", 300)):
        node = cache.insert_node(K(*seq(first, 8))).last_node
        state.add(node, slot[name])
        if name == "a":
            for _ in range(3):
                assert state.used(cache.match_prefix(K(*seq(200, 8))).last_node) == slot["a"]
    assert [state.held[s].uses for s in (1, 2, 3)] == [0, 3, 0]
    budget.fit(budget.total() - 2 * state.state_bytes + 1)  # one round: two checkpoints
    assert sorted(state.held) == [slot["a"] if frequency else slot["b"]]
    cache.check_integrity()


def test_greedy_dual_lets_a_segment_left_alone_go_once_the_clock_passes_it():
    """A saves the most per byte (a prefix's FLOPs grow as its square); B, then C, each
    saving less, go first, and each victim moves the clock to its score. D, taken after
    C went, starts from that clock and outscores A: A goes, however much it saves (with
    the clock ignored, D would go and A never)."""
    cache, state, _pool = hybrid()
    budget = HybridBudget(cache, state, token_bytes=1, flops=lambda n: float(n * n))
    state.state_bytes = 10

    def take(first: int, n: int, slot: int) -> None:
        state.add(cache.insert_node(K(*seq(first, n))).last_node, slot)

    def drop_one() -> int:
        held = set(state.held)
        while set(state.held) == held:  # (a round may free dead KV first)
            budget.fit(budget.total() - 1)
        (gone,) = held - set(state.held)
        return gone

    take(100, 16, 1)  # A: 256 / 26 = 9.8 per byte
    take(200, 8, 2)  # B: 64 / 18 = 3.6
    assert drop_one() == 2 and state.age == pytest.approx(64 / 18)
    take(300, 8, 3)  # C: 3.6 + 3.6 = 7.1
    assert drop_one() == 3 and state.age == pytest.approx(2 * 64 / 18)
    take(400, 8, 4)  # D: 7.1 + 3.6 = 10.7 > A's 9.8
    assert state.held[4].age == state.age and state.held[1].age == 0.0
    assert drop_one() == 1
    cache.check_integrity()


def test_budget_refuses_an_unknown_order():
    cache, state, _pool = hybrid()
    with pytest.raises(ValueError, match="order must be one of"):
        HybridBudget(cache, state, token_bytes=1, order="lfu")
    with pytest.raises(ValueError, match="alpha weighs the utility order only"):
        HybridBudget(cache, state, token_bytes=1, alpha=2.0)
    assert not cache.components or all(c.name != "budget" for c in cache.components)


def test_a_hit_counts_a_use_of_every_checkpoint_on_its_path_through_splits():
    """A hit at the end of a conversation counts for the system prompt's checkpoint
    before it too; a split of the node moves the checkpoints with their counts."""
    cache, state, _pool = hybrid()
    conv = cache.insert_node(K(*seq(0, 12))).last_node
    state.add(conv, 1, offset=4)  # the system prompt's end, inside the node
    state.add(conv, 2)  # the turn's end
    state.used(cache.match_prefix(K(*seq(0, 12))).last_node)
    assert [state.held[s].uses for s in (1, 2)] == [1, 1]
    other = cache.insert_node(K(*seq(0, 4), 99, 98)).last_node  # splits at 4
    assert state.held[1].node is not conv and state.held[1].uses == 1
    state.used(cache.match_prefix(K(*seq(0, 4))).last_node)
    assert [state.held[s].uses for s in (1, 2)] == [2, 1]
    assert other.parent is state.held[1].node
    cache.check_integrity()


def test_a_prefix_taken_again_after_its_checkpoint_was_dropped_starts_from_its_uses():
    """The use history: a dropped checkpoint leaves its count behind; one taken again at
    the same prefix, its KV evicted and computed again meanwhile, starts from it plus
    one. Another prefix, the same tokens in another namespace, a count the bounded
    history forgot, or one dropped as superseded start at 0."""
    cache, state, _pool = hybrid(history=2)
    a = cache.insert_node(K(*seq(0, 8))).last_node
    state.add(a, 1)
    for _ in range(2):
        state.used(cache.match_prefix(K(*seq(0, 8))).last_node)
    state.drop([state.held[1]])
    assert cache.evict(8) == 8 and cache.total_size() == 0  # its KV goes too
    state.add(cache.insert_node(K(*seq(0, 8))).last_node, 2)
    assert state.held[2].uses == 3
    state.add(cache.insert_node(K(*seq(100, 8))).last_node, 3)
    assert state.held[3].uses == 0
    state.drop([state.held[2]])
    tenant = RadixKey(np.asarray(seq(0, 8), dtype=np.int64), "tenant-b")
    state.add(cache.insert_node(tenant).last_node, 4)
    assert state.held[4].uses == 0  # another namespace's prefix
    for s in (3, 4):  # two more drops: the history (2) forgets the first
        state.drop([state.held[s]])
    state.add(cache.insert_node(K(*seq(0, 8))).last_node, 5)
    assert state.held[5].uses == 0
    state.add(cache.insert_node(K(*seq(100, 8))).last_node, 6)
    assert state.held[6].uses == 1
    state.drop_superseded([state.held[6]])  # not evicted for its worth
    state.add(cache.insert_node(K(*seq(100, 8))).last_node, 7)
    assert state.held[7].uses == 0
    cache.check_integrity()


@pytest.mark.parametrize("history", [4096, 0])
def test_the_budget_keeps_a_prefix_that_came_back_over_one_seen_once(history):
    """A was evicted and came back; B, as long, is newer and seen once. With the use
    history A's segment is worth two hits and B goes; without it they tie and A, the
    less recent, goes (the behaviour before the history)."""
    cache, state, _pool = hybrid(history=history)
    budget = HybridBudget(cache, state, token_bytes=1)
    state.state_bytes = 10

    def take(first: int, slot: int) -> None:
        state.add(cache.insert_node(K(*seq(first, 8))).last_node, slot)

    take(200, 1)
    budget.fit(0)  # A goes, checkpoint and KV
    assert budget.total() == 0
    take(200, 2)  # A again
    take(300, 3)  # B
    held = set(state.held)
    while set(state.held) == held:
        budget.fit(budget.total() - 1)
    assert set(state.held) == ({2} if history else {3})
    cache.check_integrity()


def test_a_superseded_checkpoint_requests_came_back_to_twice_hands_the_next_one_a_use():
    """A chat's earlier turn, dropped as superseded after requests went on from it
    twice or more, gives the checkpoint after it on the path one use (not its count);
    one in the same batch is passed over. A turn resumed once, or one with nothing
    after it, hands on nothing. The counts are not remembered."""
    cache, state, _pool = hybrid()

    def turn(n: int, slot: int, first: int = 0) -> None:
        state.add(cache.insert_node(K(*seq(first, 8 * n))).last_node, slot)

    def resume(n: int, first: int = 0) -> None:
        state.used(cache.match_prefix(K(*seq(first, 8 * n))).last_node)

    turn(1, 1)
    for _ in range(3):
        resume(1)
    turn(2, 2)
    assert state.superseded(state.held[1]) and state.held[2].uses == 0
    state.drop_superseded([state.held[1]])
    assert state.held[2].uses == 1
    resume(2)
    turn(3, 3)
    turn(4, 4)
    state.drop_superseded([state.held[2], state.held[3]])  # 3 is going too: 4 gets it
    assert state.held[4].uses == 1
    turn(1, 5, first=100)  # another conversation, resumed once
    resume(1, first=100)
    turn(2, 6, first=100)
    state.drop_superseded([state.held[5]])
    assert state.held[6].uses == 0
    for _ in range(2):
        resume(2, first=100)
    state.drop_superseded([state.held[6]])  # its last turn: nothing after it
    assert sorted(state.held) == [4] and not state._remembered
    cache.check_integrity()


def test_the_budget_keeps_a_conversation_requests_came_back_to_over_a_prompt_seen_once():
    """Requests went on twice from A's first turn, then A went on; B, as long, newer,
    was seen once. Squeezed, the budget drops A's superseded first turn, whose use
    passes to A's latest: its segment is worth two hits, and B goes (with equal worth
    the less recent, A, would)."""
    cache, state, _pool = hybrid()
    budget = HybridBudget(cache, state, token_bytes=1)
    state.state_bytes = 10
    state.add(cache.insert_node(K(*seq(0, 8))).last_node, 1)
    for _ in range(2):
        state.used(cache.match_prefix(K(*seq(0, 8))).last_node)
    state.add(cache.insert_node(K(*seq(0, 16))).last_node, 2)
    state.add(cache.insert_node(K(*seq(100, 16))).last_node, 3)
    budget.fit(budget.total() - 1)  # 2. the superseded first turn
    assert sorted(state.held) == [2, 3] and state.held[2].uses == 1
    budget.fit(budget.total() - 1)  # 3. by worth
    assert sorted(state.held) == [2]
    cache.check_integrity()


def test_evict_leaf_errors():
    cache = RadixCache(2)
    leaf = cache.insert_node(K(1, 2, 3, 4)).last_node
    cache.inc_lock_ref(leaf)
    with pytest.raises(ValueError, match="unlocked leaf"):
        cache.evict_leaf(leaf)
    cache.dec_lock_ref(leaf)
    with pytest.raises(ValueError, match="whole pages"):
        cache.evict_leaf(leaf, 3)
    assert cache.evict_leaf(leaf, 2) == 2 and cache.total_size() == 2
    assert cache.evict_leaf(leaf) == 2 and cache.total_size() == 0
    with pytest.raises(ValueError, match="not in this cache"):
        cache.evict_leaf(leaf)


def scanning_budget() -> type:
    """The brute-force model of the budget's order (benchmarks/bench_budget.py): every
    round scans the whole tree for its candidates."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_budget.py"
    spec = importlib.util.spec_from_file_location("bench_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ScanningBudget


@pytest.mark.parametrize("order", ["greedy-dual", "utility"])
@pytest.mark.parametrize("preset", ["qwen3.5-4b", "nemotron-h", "gemma-3"])
def test_budget_keeps_the_order_of_a_full_scan(preset, order, monkeypatch):
    """The incremental candidate sets evict exactly what scanning the whole tree every
    round evicts: the same hits, checkpoints and bytes, at tight and loose budgets."""
    from functools import partial

    import radixkv.sim.hybrid as sim
    from radixkv.sim.traces import gen_chat

    trace = gen_chat(conversations=24, turns=4, systems=2, system_len=256, message_len=64,
                     output_len=64)  # fmt: skip
    spec = sim.PRESETS[preset]
    every = sum(len(r.units) for r in trace.requests) * 16 * (spec.full_kv + spec.window_kv)
    ceiling = sim.simulate_hybrid(trace, spec, sim.UNBOUNDED, "radixkv").hit_tokens
    for frac in (0.02, 0.05, 0.1) if spec.window else (0.15, 0.3, 0.6):
        monkeypatch.setattr(sim, "HybridBudget", partial(HybridBudget, order=order))
        got = sim.simulate_hybrid(trace, spec, int(every * frac), "radixkv")
        monkeypatch.setattr(sim, "HybridBudget", partial(scanning_budget(), order=order))
        want = sim.simulate_hybrid(trace, spec, int(every * frac), "radixkv")
        monkeypatch.undo()
        assert 0 < got.hit_tokens < ceiling, frac  # it hit, and the budget bit
        assert (got.hit_tokens, got.checkpoints, got.mean_bytes) == (
            want.hit_tokens,
            want.checkpoints,
            want.mean_bytes,
        ), frac


@pytest.mark.parametrize("order", ["greedy-dual", "utility"])
def test_budget_keeps_the_order_of_a_full_scan_when_conversations_fork(order, monkeypatch):
    """Chats whose earlier turns are taken up again with another message (an edit, a
    retry): a checkpoint dropped as superseded is taken again where it was, which the
    use history must treat alike in both (the scan once remembered those drops and
    evicted differently at 0.3 and 0.6 of the KV)."""
    from functools import partial

    import radixkv.sim.hybrid as sim
    from radixkv.sim.traces import SimRequest, Trace, gen_chat

    base = gen_chat(conversations=24, turns=4, systems=2, system_len=256, message_len=64,
                    output_len=64)  # fmt: skip
    reqs, fresh = [], 1 << 40
    for i, r in enumerate(base.requests):
        reqs.append(r)
        if i >= 12 and i % 3 == 0:  # a fork of the turn 12 requests back: its history + 4
            old = base.requests[i - 12]
            units = [*old.units[: base.cached_units(old, True)], *range(fresh, fresh + 4)]
            fresh += 4
            reqs.append(SimRequest(units, len(units), len(units) * base.block_size))
    trace = Trace("forks", base.block_size, reqs)
    spec = sim.PRESETS["qwen3.5-4b"]
    every = sum(len(r.units) for r in reqs) * base.block_size * spec.full_kv
    for frac in (0.3, 0.6):
        monkeypatch.setattr(sim, "HybridBudget", partial(HybridBudget, order=order))
        got = sim.simulate_hybrid(trace, spec, int(every * frac), "radixkv")
        monkeypatch.setattr(sim, "HybridBudget", partial(scanning_budget(), order=order))
        want = sim.simulate_hybrid(trace, spec, int(every * frac), "radixkv")
        monkeypatch.undo()
        assert got.hit_tokens > 0, frac
        assert (got.hit_tokens, got.checkpoints, got.mean_bytes) == (
            want.hit_tokens,
            want.checkpoints,
            want.mean_bytes,
        ), frac
