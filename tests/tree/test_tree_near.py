"""``insert_node(..., near=node)``: the walk starts at a node whose path spells the
key's start (a request's locked end) and gives what the walk from the root gives. Two
trees take the same random inserts (namespaces, EAGLE's bigrams, pages, chain merging),
evictions and locks, one with a ``near`` drawn from anywhere (on the key's path, off
it, deeper than the key, another namespace's, the root, an evicted node), one without;
every insert returns the same, and the trees stay the same node for node."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import RadixCache, RadixKey

tokens = st.lists(st.integers(0, 2), max_size=14)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens, st.sampled_from([None, "a"]),
                  st.one_of(st.integers(0, 1), st.integers(0, 40))),
        st.tuples(st.just("evict"), st.integers(1, 6)),
        st.tuples(st.just("lock"), tokens, st.sampled_from([None, "a"])),
        st.tuples(st.just("unlock"), st.integers(0, 9)),
    ),
    max_size=30,
)


def shape(cache: RadixCache) -> list[tuple]:
    return sorted((n.id, n.parent.id if n.parent else None, n.key_bytes, n.value_bytes,
                   n.lock_ref, n.extra_key) for n in cache.iter_nodes())  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(page=st.sampled_from([1, 2]), eagle=st.booleans(), merge=st.booleans(), steps=ops)
def test_an_insert_near_a_node_is_the_insert_from_the_root(page, eagle, merge, steps):
    trees = [RadixCache(page, "lru", is_eagle=eagle, merge_chains=merge, precise=True)
             for _ in range(2)]  # fmt: skip
    locked: list[list] = [[], []]
    gone = [[], []]  # nodes evicted from each tree (a stale near)
    slot = 100
    for op in steps:
        if op[0] == "insert":
            _, toks, ns, pick = op
            key = RadixKey(toks, ns)
            value = torch.arange(slot, slot + len(toks))
            slot += len(toks)
            nodes = sorted(trees[0].iter_nodes(), key=lambda n: n.id)
            # where the same tokens end in either namespace (on the key's path, or a
            # twin of it under another namespace), then anywhere
            ends = [trees[0].match_prefix(RadixKey(toks, x), split=False).last_node
                    for x in (ns, None if ns else "a")]  # fmt: skip
            near = [*ends, trees[0].root, *nodes, *gone[0]]
            got = [trees[0].insert_node(key, value, near=near[pick % len(near)]),
                   trees[1].insert_node(key, value)]  # fmt: skip
            assert got[0].prefix_len == got[1].prefix_len
            assert got[0].last_node.id == got[1].last_node.id
        elif op[0] == "evict":
            before = [{n.id: n for n in t.iter_nodes()} for t in trees]
            assert trees[0].evict(op[1]) == trees[1].evict(op[1])
            for t, old, out in zip(trees, before, gone, strict=True):
                now = {n.id for n in t.iter_nodes()}
                out += [n for i, n in old.items() if i not in now]
        elif op[0] == "lock":
            for t, held in zip(trees, locked, strict=True):
                node = t.match_prefix(RadixKey(op[1], op[2])).last_node
                t.inc_lock_ref(node)
                held.append(node)
        elif op[0] == "unlock" and locked[0]:
            i = op[1] % len(locked[0])
            for t, held in zip(trees, locked, strict=True):
                t.dec_lock_ref(held.pop(i))
        assert shape(trees[0]) == shape(trees[1]), op
        for t in trees:
            t.check_integrity()


def test_a_near_node_under_another_namespace_or_evicted_is_not_walked_from():
    for eagle in (False, True):
        t = RadixCache(1, "lru", is_eagle=eagle, precise=True)
        t.insert_node(RadixKey([0, 1, 5], None), torch.arange(3))
        twin = t.insert_node(RadixKey([0, 1, 5], "a"), torch.arange(10, 13)).last_node
        got = t.insert_node(RadixKey([0, 1, 5, 2], None), torch.arange(20, 24), near=twin)
        assert got.last_node.parent is not twin and got.last_node.extra_key is None
        assert got.prefix_len == (2 if eagle else 3)  # (bigrams: one pair fewer)
        t.evict(100)
        assert t.insert_node(RadixKey([0, 1, 5], "a"), torch.arange(3), near=twin).prefix_len == 0
        t.check_integrity()


def test_near_must_be_a_node():
    t = RadixCache(1, "lru")
    for bad in (3, "root", [t.root]):
        with pytest.raises(TypeError, match="near must be a TreeNode"):
            t.insert_node(RadixKey([1, 2]), near=bad)
    assert t.total_size() == 0
