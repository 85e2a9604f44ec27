"""`WindowKV`'s short walks against the walks from the root they replace: where a match
may end (`match_limit`, walked back from the match's end), whether a node's end is
servable (walked up a window), and which nodes an insert refits (`_to_fit`: those whose
reach changed and those the caller's slots reach). A reference component does each the
long way (every node from the root, as before); random inserts (slots with holes),
locks, marks, splits, merges and evictions run on two trees, one with each; after every
step the two hold the same window slots, reaches and marks on every node, and answer
every match and every ``servable`` alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import RadixCache, RadixKey
from radixkv.kvcache.window.component import WindowKV


class Freed:
    def __init__(self) -> None:
        self.slots: list[int] = []

    def free(self, t: torch.Tensor) -> None:
        self.slots += t.tolist()


class FromTheRoot(WindowKV):
    """The walks as they were: from the root, every node."""

    def servable(self, node):  # type: ignore[no-untyped-def]
        path = self.cache.path_to_root(node, "WindowKV.servable")[::-1]
        return self.match_limit(path, None, 0) == sum(len(n) for n in path)

    def match_limit(self, path, partial, units):  # type: ignore[no-untyped-def]
        span, run, end, best = self.span, 0, 0, 0
        for node in path:
            end += len(node)
            k = self.covered(node)
            if k < len(node):
                run = end - k
            if end - run >= span or run == 0:
                best = end
        if partial is not None:
            k = self.covered(partial)
            first, pos = end + len(partial) - k, end + units
            if pos > first:
                run = first if first > end else run
                if pos - run >= span or run == 0:
                    best = pos
        return best

    def _to_fit(self, path, top, given, seen):  # type: ignore[no-untyped-def]
        out, end = [], 0
        for node in path:
            end += len(node)
            out.append((node, end))
        assert end == top
        return out


def tree(kind: type, window: int, page: int, retain: str, mode: str) -> tuple[RadixCache, Any]:
    comp = kind(window, Freed(), retain)
    return RadixCache(page, "lru", eviction_mode=mode, components=(comp,)), comp


def state(cache: RadixCache, comp: WindowKV) -> dict:
    out = {}
    for n in cache.iter_nodes():
        w = comp._w(n)
        out[n.id] = (n.key_bytes, n.parent.id if n.parent else None, n.lock_ref,
                     w.slots, w.reach, w.mark, comp.servable(n))  # fmt: skip
    return out


words = st.lists(st.integers(0, 2), min_size=1, max_size=10)
# which of an insert's window slots are holes (-1): none, all, a run of them, or any
spans = st.tuples(st.integers(0, 24), st.integers(0, 24))
holes = st.one_of(
    st.just([]), st.just([True] * 24),
    spans.map(lambda r: [r[0] <= i < r[1] for i in range(24)]),
    spans.map(lambda r: [not r[0] <= i < r[1] for i in range(24)]),
    st.lists(st.booleans(), max_size=24),
)  # fmt: skip
steps = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3), words, holes, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("mark"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.sampled_from(["tree", "window", "spare"]),
                  st.integers(1, 12)),
        st.tuples(st.just("match"), st.integers(0, 3), words),
    ),
    max_size=40,
)
STEMS = [[], [7] * 9, [7] * 5 + [8] * 6, [9, 8, 7, 6, 5, 4]]


@settings(max_examples=1000, deadline=None)
@given(window=st.integers(1, 9), page=st.sampled_from([1, 2, 4]),
       retain=st.sampled_from(["ends", "all"]), mode=st.sampled_from(["precise", "merge"]),
       ops=steps)  # fmt: skip
def test_the_short_walks_answer_and_refit_as_the_walks_from_the_root(window, page, retain, mode,
                                                                    ops):  # fmt: skip
    trees = [tree(k, window, page, retain, mode) for k in (WindowKV, FromTheRoot)]
    locked: list[list] = [[], []]
    slot = 0
    for op in ops:
        for t, ((cache, comp), held) in enumerate(zip(trees, locked, strict=True)):
            if op[0] == "insert":
                _, stem, word, _, lock = op
                key = STEMS[stem] + word
                extra = np.arange(slot, slot + len(key), dtype=np.int64)
                for i, hole in enumerate(op[3][: len(key)]):
                    if hole:
                        extra[i] = -1
                node = cache.insert_node(RadixKey(np.asarray(key, dtype=np.int64)),
                                         extras={"window": extra}).last_node  # fmt: skip
                if lock and node is not cache.root:
                    cache.inc_lock_ref(node)
                    held.append(node)
            elif op[0] == "unlock" and held:
                cache.dec_lock_ref(held.pop(op[1] % len(held)))
            elif op[0] == "mark":
                nodes = sorted(cache.iter_nodes(), key=lambda n: n.id)
                if nodes:
                    comp.mark(nodes[op[1] % len(nodes)])
            elif op[0] == "evict":
                _, what, n = op
                if what == "tree":
                    cache.evict(n)
                elif what == "window":
                    comp.evict(n)
                else:
                    comp.evict_spare(n)
            elif op[0] == "match":
                ids = STEMS[op[1]] + op[2]  # every prefix: matches ending inside nodes
                keys = [RadixKey(np.asarray(ids[:i], dtype=np.int64)) for i in range(len(ids))]
                got = [cache.match_len(k, full=full) for k in keys for full in (False, True)]
                if t == 0:
                    first = got
                else:
                    assert got == first, op
        slot += 64
        a, b = (state(c, w) for c, w in trees)
        assert a == b, op
        assert trees[0][1].held == trees[1][1].held
        assert trees[0][1].allocator.slots == trees[1][1].allocator.slots
        for cache, _ in trees:
            cache.check_integrity()


def both(window: int, retain: str, mode: str = "precise") -> list[tuple[RadixCache, Any]]:
    return [tree(k, window, 1, retain, mode) for k in (WindowKV, FromTheRoot)]


def put(cache: RadixCache, ids: list[int], slots: list[int]) -> Any:
    key = RadixKey(np.asarray(ids, dtype=np.int64))
    return cache.insert_node(key, extras={"window": np.asarray(slots, dtype=np.int64)}).last_node


def test_a_match_inside_a_node_ends_a_window_past_its_covered_tails_first_unit():
    """The edges the random walk seldom reaches: a match ending inside a node exactly a
    window past where its covered tail starts, or joining the covered run before it."""
    for cache, _ in both(2, "all"):
        put(cache, [1, 2, 3, 4, 5, 6], [-1, -1, 10, 11, 12, 13])  # covered from unit 2
        assert cache.match_len(RadixKey(np.asarray([1, 2, 3, 4, 9]))) == 4
    for cache, _ in both(3, "all"):
        put(cache, [1, 2, 3], [-1, 10, 11])  # 2 of 3 covered
        put(cache, [1, 2, 3, 4, 5, 6], [-1, -1, -1, 20, 21, 22])
        assert cache.match_len(RadixKey(np.asarray([1, 2, 3, 4, 9]))) == 4
    for cache, _ in both(3, "all"):  # a run short at the middle node: the end before it
        put(cache, [1, 2], [10, 11])  # wholly covered, from the root
        put(cache, [1, 2, 3, 4], [-1, -1, -1, 21])  # 1 of 2 covered
        put(cache, [1, 2, 3, 4, 5], [-1, -1, -1, -1, 31])  # 1 of 1
        assert cache.match_len(RadixKey(np.asarray([1, 2, 3, 4, 5]))) == 2


def test_an_insert_refits_a_node_whose_reach_fell_though_it_takes_no_slot():
    """A leaf extended past its end no longer needs a window there: it frees it, though
    the insert hands slots only for the new units."""
    for cache, comp in both(3, "ends"):
        leaf = put(cache, [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
        assert comp.covered(leaf) == 3
        put(cache, [1, 2, 3, 4, 5, 6, 7, 8], [-1] * 6 + [30, 31])
        assert comp.covered(leaf) == 1  # the new leaf's window reaches 1 unit into it
        cache.check_integrity()
