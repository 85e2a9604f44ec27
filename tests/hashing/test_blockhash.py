"""Event block hashes (`radixkv.hashing.fast`): the vectorized chain equals its scalar
definition, a cache emits exactly what a router computes, hash-only events keep
BLAKE2b, and the hashes are the same in another process."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import RadixCache, RadixKey
from radixkv.events import BlockStored, EventCollector, KVEventBatch, encode_batch
from radixkv.hashing import fast as blockhash
from radixkv.hashing.fast import _M, event_hashes, root_state
from radixkv.tree import chain_hashes

MASK = (1 << 64) - 1


def scalar(tokens: list[int], ns, page: int, n: int) -> list[int]:
    """The definition, one page at a time: c_i = c_{i-1} * M + sum(u_j * K_j) mod 2^64."""
    event_hashes(tokens, ns, page, n)  # grows the key table to this page size
    keys = [int(k) for k in blockhash._keys[:page]]  # the module's table, grown
    state, out = root_state(ns), []
    for i in range(n):
        digest = sum(
            (t & MASK) * k for t, k in zip(tokens[i * page : (i + 1) * page], keys, strict=True)
        )
        state = (state * _M + digest) & MASK
        out.append(state)
    return out


@settings(max_examples=60, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    pages=st.integers(0, 40),
    ns=st.sampled_from([None, "tenant-a", ("lora", 3)]),
    data=st.data(),
)
def test_the_vectorized_chain_is_its_definition(page, pages, ns, data):
    tokens = data.draw(st.lists(st.integers(0, (1 << 31) - 1), min_size=page * pages,
                                max_size=page * pages))  # fmt: skip
    assert event_hashes(tokens, ns, page, pages) == scalar(tokens, ns, page, pages)


def test_a_cache_emits_what_a_router_computes_and_one_token_changes_every_later_hash():
    sink = EventCollector()
    cache = RadixCache(4, event_sink=sink)
    prompt = list(range(100, 140))
    cache.insert(RadixKey(prompt))
    cache.insert(RadixKey(prompt[:20] + [7] + prompt[21:]))  # one token differs in page 5
    first, second = [e for e in sink.drain().events if isinstance(e, BlockStored)]
    assert first.block_hashes == event_hashes(prompt, None, 4, 10)
    assert second.parent_block_hash == first.block_hashes[4]  # shares 5 pages, then forks
    assert not set(second.block_hashes) & set(first.block_hashes)
    salted = event_hashes(prompt, "salt", 4, 10)
    assert not set(salted) & set(first.block_hashes)  # namespaces never collide
    cache.check_integrity()


def test_hash_only_events_keep_blake2b():
    """Hash-only events show nothing but the hashes: they must not give tokens away
    (the fast chain is linear), so such a sink gets BLAKE2b chains."""
    sink = EventCollector(tokens=False)
    cache = RadixCache(4, event_sink=sink)
    prompt = list(range(40))
    cache.insert(RadixKey(prompt))
    (event,) = sink.drain().events
    want = [int.from_bytes(h[:8], "big") for h in chain_hashes(prompt, None, 4, 10)]
    assert event.block_hashes == want and event.token_ids == []


def test_the_hashes_are_the_same_in_another_process():
    code = ("from radixkv.hashing.fast import event_hashes; "
            "print(event_hashes(list(range(64)), 'ns', 16, 4))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == str(event_hashes(list(range(64)), "ns", 16, 4))


class _EagerCollector(EventCollector):
    """The same sink without ``attach``: its cache reports each insert at once."""

    attach = None  # type: ignore[assignment]


_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.lists(st.integers(0, 2), min_size=1, max_size=20),
            st.sampled_from([None, "salt"]),
        ),
        st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=20), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 16), st.none()),
        st.tuples(st.just("detach"), st.integers(0, 50), st.none()),
        st.tuples(st.just("lock"), st.integers(0, 50), st.none()),
        st.tuples(st.just("drain"), st.none(), st.none()),
        st.tuples(st.just("reset"), st.none(), st.none()),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4]),
    eagle=st.booleans(),
    opt_ins=st.sampled_from([{}, {"precise": True}, {"merge_chains": True}]),
    steps=_steps,
)
def test_hashing_a_steps_inserts_at_the_drain_reports_what_hashing_each_at_once_does(
    page, eagle, opt_ins, steps
):
    """A collector's cache hashes the pages it stored only when the collector is
    drained, or when it needs the hashes sooner (a split, a child, an eviction): the
    stream of events must be the one a sink told of every insert at once gives. A
    collector that keeps token ids and hashes as arrays (what serve's publisher takes)
    must put the same bytes on the wire."""
    lazy, eager, arrays = EventCollector(), _EagerCollector(), EventCollector(arrays=True)
    sinks = (lazy, eager, arrays)
    caches = [RadixCache(page, is_eagle=eagle, event_sink=s, **opt_ins) for s in sinks]
    parts: list[tuple[list, list]] = []  # each drain: the lists' events, the arrays'
    locked: list = [[], [], []]
    for op, arg, ns in steps:
        for c, held in zip(caches, locked, strict=True):
            if op == "insert":
                c.insert(RadixKey(arg, ns, is_bigram=eagle))
            elif op == "match":
                c.match_prefix(RadixKey(arg, is_bigram=eagle))
            elif op == "evict":
                c.evict(arg)
            elif op in ("detach", "lock"):
                nodes = [n for n in c.iter_nodes() if n is not c.root]
                leaves = [n for n in nodes if not n.children and not n.lock_ref]
                if op == "detach" and leaves:
                    c.detach_leaf(leaves[arg % len(leaves)])
                elif op == "lock" and nodes:
                    held.append(nodes[arg % len(nodes)])
                    c.inc_lock_ref(held[-1])
                    if len(held) > 2:
                        c.dec_lock_ref(held.pop(0))
            elif op == "reset":
                c.reset()
                held.clear()
            c.check_integrity()
        if op == "drain":
            parts.append((_events(lazy.drain()), _events(arrays.drain())))
    parts.append((_events(lazy.drain()), _events(arrays.drain())))
    assert [e for listed, _ in parts for e in listed] == eager.events
    for listed, arrayed in parts:  # arrays: the same bytes on the wire
        assert encode_batch(KVEventBatch(0.0, arrayed)) == encode_batch(KVEventBatch(0.0, listed))


def _events(batch) -> list:
    return batch.events if batch is not None else []


def test_a_collectors_events_show_an_insert_at_once_though_hashing_waits():
    """Hashing waits for a flush, but what a collector shows does not: reading its
    events right after an insert (no drain) gives the insert's pages, as before."""
    sink = EventCollector()
    cache = RadixCache(4, event_sink=sink)
    cache.insert(RadixKey(list(range(8))))
    events = cache.component("event_hashes")
    assert events.pending  # the hashes wait ...
    (stored,) = sink.events  # ... until someone looks
    assert stored.block_hashes == event_hashes(list(range(8)), None, 4, 2)
    assert not events.pending and sink.drain().events == [stored]
    assert sink.drain() is None
