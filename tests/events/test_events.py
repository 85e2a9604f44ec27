"""KV events: the tree reports every page it gains and loses, the wire reads both vLLM
encodings (and real vLLM's bytes), and an index fed by the events knows exactly what each
worker holds, also over ZeroMQ with replay."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import content
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import RadixCache, RadixKey
from radixkv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventCollector,
    KVEventBatch,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    salt_tag,
)
from radixkv.router.index import KvIndex
from radixkv.router.subscriber import EventSubscriber
from radixkv.web.process import free_port_pair

DATA = Path(__file__).parent / "data"


def index_pages(index: KvIndex, worker) -> set:
    """The index's pages of ``worker`` as (namespace, pages of the prefix) keys."""
    by_id = {pid: key for key, pid in index._ids.items()}
    out = set()
    for pid in index._blocks.get(worker, {}).values():
        pages, ns, x = [], None, pid
        while x:
            parent, key_ns, page = by_id[x]
            pages.append(page)
            if parent == 0:
                ns = key_ns[0] if key_ns else None
            x = parent
        out.add((ns, tuple(reversed(pages))))
    return out


def tree_pages(cache: RadixCache, key: bytes | None = None) -> set:
    """The tree's pages, namespaces as the wire tags them."""
    return {(None if ns is None else salt_tag(ns, key), pages) for ns, pages in content(cache)}


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
            st.sampled_from([None, "salt-a"]),
        ),
        st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=14), st.none()),
        st.tuples(st.just("evict"), st.integers(0, 12), st.none()),
        st.tuples(st.just("reset"), st.none(), st.none()),
    ),
    max_size=40,
)


@given(
    page=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["lru", "fifo", "lfu"]),
    seq=ops,
    tokens=st.booleans(),
)
@settings(max_examples=300)
def test_events_replayed_into_an_index_reproduce_the_trees_pages(page, policy, seq, tokens):
    """With token ids (namespaces as keyed tags) the index rebuilds the tree's pages; with
    hashes only it still finds every cached prefix, from the request's tokens and salt."""
    key = b"fleet events key"
    sink = EventCollector(key, tokens)
    cache = RadixCache(page, policy, event_sink=sink)
    index = KvIndex(page)
    slot = 0
    for op, arg, ns in seq:
        if op == "insert":
            cache.insert(RadixKey(arg, ns), torch.arange(slot, slot + len(arg)))
            slot += len(arg)
        elif op == "match":
            cache.match_prefix(RadixKey(arg))
        elif op == "evict":
            cache.evict(arg)
        else:
            cache.reset()
        batch = sink.drain()
        if batch is not None:
            batch = decode_batch(encode_batch(batch))  # through the wire
            index.apply("w", batch)
        cache.check_integrity()
        index.check()
        if tokens:
            assert index_pages(index, "w") == tree_pages(cache, key)
        else:
            assert index.num_blocks("w") == len(content(cache))
        for (ns_, pages), _ in list(content(cache).items())[:3]:  # overlap agrees
            ids = [t for p in pages for t in p]
            tag = None if ns_ is None else salt_tag(ns_, key)
            assert index.overlap(ids, tag, ns_)["w"] == len(pages)


def test_two_workers_and_removal():
    index = KvIndex(2)
    index.apply("a", KVEventBatch(0, [BlockStored([11, 12], None, [1, 2, 3, 4], 2)]))
    index.apply("b", KVEventBatch(0, [BlockStored([99], None, [1, 2], 2)]))
    assert index.overlap([1, 2, 3, 4, 5]) == {"a": 2, "b": 1}
    assert index.overlap([1, 2], "tenant") == {}  # another namespace shares nothing
    index.apply("a", KVEventBatch(0, [BlockRemoved([12])]))
    assert index.overlap([1, 2, 3, 4]) == {"a": 1, "b": 1}
    index.remove_worker("b")
    assert index.overlap([1, 2, 3, 4]) == {"a": 1}
    index.apply("a", KVEventBatch(0, [AllBlocksCleared()]))
    assert index.overlap([1, 2, 3, 4]) == {}
    index.check()
    with pytest.raises(ValueError, match="block size"):
        index.validate("c", KVEventBatch(0, [BlockStored([1], None, [1, 2, 3], 3)]))


def test_a_recurrent_workers_checkpoint_blocks_stand_alone():
    """A recurrent worker's events store one block per checkpoint, its parent never told
    (`radixkv.kvcache.recurrent`): its overlap is the deepest page of the request whose
    hash it holds. A full-attention worker's is the run from the root: the same block
    with an unknown parent is skipped."""
    from radixkv.hashing.fast import event_hashes

    index = KvIndex(2)
    index.sparse.add("r")
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    h = event_hashes(ids, None, 2, 4)
    index.apply("r", KVEventBatch(0, [BlockStored([h[2]], h[1], [5, 6], 2)]))
    index.apply("p", KVEventBatch(0, [BlockStored([h[0]], None, [1, 2], 2),
                                      BlockStored([h[2]], h[1], [5, 6], 2)]))  # fmt: skip
    assert index.overlap([*ids, 9]) == {"r": 3, "p": 1}
    assert index.overlap([1, 2, 3, 4, 5, 0]) == {"p": 1}  # page 3 differs: no checkpoint
    assert index.overlap(ids, salt_tag("t"), "t") == {}  # another namespace
    index.apply("r", KVEventBatch(0, [BlockRemoved([h[2]])]))
    assert index.overlap(ids) == {"p": 1}
    index.check()


def test_a_run_whose_parent_is_unknown_is_skipped_and_counted():
    index = KvIndex(2)
    index.apply("a", KVEventBatch(0, [BlockStored([5], 4, [1, 2], 2)]))
    assert index.unknown_parents == 1 and index.overlap([1, 2]) == {}


# --- the wire ------------------------------------------------------------------------------
hashes = st.lists(
    st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32)), max_size=4
)
events = st.one_of(
    st.builds(
        lambda h, parent, size: BlockStored(h, parent, [7] * size * len(h), size),
        hashes,
        st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        st.integers(1, 4),
    ),
    st.builds(BlockRemoved, hashes),
    st.just(AllBlocksCleared()),
)


@given(st.floats(0, 2e9), st.lists(events, max_size=6), st.one_of(st.none(), st.integers(0, 8)))
def test_wire_round_trip(ts, evs, rank):
    batch = KVEventBatch(ts, evs, rank)
    assert decode_batch(encode_batch(batch)) == batch


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _LegacyStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _LegacyRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _LegacyCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_LegacyStored | _LegacyRemoved | _LegacyCleared]
    data_parallel_rank: int | None = None


def test_the_legacy_tagged_array_encoding_decodes():
    """vLLM's encoding before mid-2026: events as arrays whose first item is the tag."""
    old = _LegacyBatch(
        5.0,
        [_LegacyStored([3, 4], 2, [1, 2, 3, 4], 2, None, "GPU"), _LegacyRemoved([3], "GPU"),
         _LegacyCleared()],
    )  # fmt: skip
    payload = msgspec.msgpack.encode(old)
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really tagged arrays
    got = decode_batch(payload)
    assert got.ts == 5.0 and got.events == [
        BlockStored([3, 4], 2, [1, 2, 3, 4], 2, medium="GPU"),
        BlockRemoved([3], "GPU"),
        AllBlocksCleared(),
    ]


def test_real_vllm_bytes_decode():
    """Encoded by vLLM 0.33's own classes (``vllm.distributed.kv_events``), with fields
    radixkv does not know (group_idx); and vLLM's typed decoder reads ours (checked when
    the file was made, in vLLM's own environment)."""
    got = decode_batch((DATA / "vllm_0_33_event_batch.msgpack").read_bytes())
    assert got.data_parallel_rank == 1 and got.events[0] == BlockStored(
        [7, 8], 6, [1, 2, 3, 4], 2, extra_keys=[("s",), ("s",)]
    )
    assert isinstance(got.events[2], AllBlocksCleared)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode([1.0, [["Nope"]]]),
                                     msgspec.msgpack.encode({"x": 1})])  # fmt: skip
def test_garbage_is_a_value_error(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


# --- over ZeroMQ -----------------------------------------------------------------------------
def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def published(pub, n: int) -> None:
    """Wait until the publisher's thread has sent ``n`` batches in all."""
    assert wait_for(lambda: pub.published >= n), f"{pub.published} of {n} batches sent"


def publish_until_heard(pub, publish_one, heard, timeout: float = 60.0) -> int:
    """Publish one new batch at a time until the subscriber has applied one live; returns
    its sequence number. A SUB socket misses whatever went out before its subscription
    reached the publisher (ZeroMQ's slow joiner), however long one sleeps first, so the
    tests wait on this event instead. ``heard(seq)``: whether batch ``seq`` was heard."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the subscriber never heard a live batch"
        before = pub.published
        publish_one()
        published(pub, before + 1)
        seq = pub.published - 1
        if wait_for(lambda seq=seq: heard(seq), 0.25):
            return seq


def test_publisher_and_subscriber_with_replay_for_a_late_joiner():
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 100)
    index = KvIndex(2)
    sub = None
    try:
        sink = EventCollector()
        cache = RadixCache(2, event_sink=sink)
        for i in range(5):  # published before anyone listens: only the replay has them
            cache.insert(RadixKey([i, i, 9, 9]))
            pub.publish(sink.drain())
        published(pub, 5)
        sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, index.apply)
        cache.evict(2)
        more = iter(range(7, 10_000))

        def one() -> None:
            cache.insert(RadixKey([next(more)] * 2))
            pub.publish(sink.drain())

        heard = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        assert sub.replayed == heard >= 5 and sub.lost == 0  # all before it, replayed
        assert index_pages(index, "w") == tree_pages(cache)
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_a_batch_that_does_not_encode_is_dropped_and_the_stream_goes_on(caplog):
    """The publisher's thread encodes: a bad batch costs a logged error, not the thread,
    and takes no sequence number (subscribers see no gap)."""
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 100)
    index = KvIndex(2)
    sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, index.apply)
    try:
        sink = EventCollector(arrays=True)
        cache = RadixCache(2, event_sink=sink)
        bad = BlockStored([1], None, [1, 2], 2, extra_keys=[(object(),)])  # not msgpack
        pub.publish(KVEventBatch(0.0, [bad]))
        assert wait_for(lambda: "does not encode" in caplog.text)
        assert pub.published == 0  # dropped: it took no sequence number
        more = iter(range(5, 10_000))

        def one() -> None:
            cache.insert(RadixKey([next(more)] * 4))
            pub.publish(sink.drain())

        heard = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        assert sub.replayed == heard and sub.lost == 0  # no gap where the bad one was
        assert index_pages(index, "w") == tree_pages(cache)
    finally:
        sub.close()
        pub.close()


def test_a_late_joiner_replays_all_of_a_buffer_larger_than_one_answer(monkeypatch):
    """One replay answer holds at most REPLAY_MAX_BYTES from the oldest batch on; a late
    joiner that stopped at the first answer kept a busy worker's oldest pages and never
    heard they were evicted (a restarted router then routed to pages long gone)."""
    from radixkv import events as ev

    monkeypatch.setattr(ev, "REPLAY_MAX_BYTES", 4_000)
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 1000)
    index = KvIndex(4)
    sub = None
    try:
        sink = EventCollector()
        cache = RadixCache(4, event_sink=sink)
        for i in range(40):  # ~40 KB of stores, then every page evicted
            cache.insert(RadixKey([1000 + i] * 64))
            pub.publish(sink.drain())
        cache.evict(cache.evictable_size())
        pub.publish(sink.drain())
        published(pub, 41)
        sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, index.apply)
        more = iter(range(7, 10_000))

        def one() -> None:
            cache.insert(RadixKey([next(more)] * 8))
            pub.publish(sink.drain())

        heard = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        assert sub.lost == 0 and sub.replayed == heard >= 41
        assert index_pages(index, "w") == tree_pages(cache)  # the live pages, nothing stale
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_a_worker_is_untrusted_while_its_replay_runs():
    """A late joiner's index passes through the worker's past (pages stored long ago,
    then their removals): a router routing on it mid-replay sent requests to pages long
    gone, so the worker is marked untrusted until the replay is applied."""
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 100)
    seen: list = []
    sub = None
    try:
        for i in range(5):
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))
        published(pub, 5)

        def apply(worker, batch):
            seen.append(("batch", batch.events[0].block_hashes[0]))

        sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, apply,
                              lambda worker, stale: seen.append(("stale", stale)))  # fmt: skip
        more = iter(range(9, 10_000))

        def one() -> None:
            i = next(more)
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))

        heard = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        replayed = [("batch", i) for i in (*range(5), *range(9, 9 + heard - 5))]
        live = ("batch", 9 + heard - 5)  # the first heard live, after the replay
        assert seen == [("stale", True), *replayed, ("stale", False), live]
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_batches_beyond_the_replay_buffer_are_counted_lost():
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 2)
    index = KvIndex(1)
    sub = None
    try:
        for i in range(6):
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))
        published(pub, 6)
        sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, index.apply)
        more = iter(range(6, 10_000))

        def one() -> None:
            i = next(more)
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))

        heard = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        # the buffer holds the last two batches: what came before them is lost, counted
        assert sub.replayed + sub.lost == heard and sub.replayed <= 1 and sub.lost >= 5
        assert index.overlap([heard]) == {"w": 1} and index.overlap([4]) == {}
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_an_engine_publishes_what_its_cache_holds():
    from radixkv.engine.engine import Engine

    batches = []
    engine = Engine("random", page_size=4, kv_tokens=256)
    engine.publish_kv_events(batches.append)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10]] * 3,
                    max_new_tokens=4, ignore_eos=True)  # fmt: skip
    engine.flush_cache()
    engine.generate([list(range(40, 60))], max_new_tokens=2, ignore_eos=True)
    index = KvIndex(4)
    for b in batches:
        index.apply("e", b)
    assert index_pages(index, "e") == tree_pages(engine.cache)
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)


def test_replays_are_rate_limited_so_silent_peers_cannot_pile_up():
    """Many peers asking for replays: at most REPLAYS_PER_S are answered a second (a
    fake clock that never moves), each with at most the buffer's batches; the rest are
    dropped and counted, not queued."""
    import zmq

    from radixkv.events import REPLAYS_PER_S

    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}",
                            buffer_steps=3, clock=lambda: 100.0)  # fmt: skip
    peers = []
    try:
        for i in range(5):
            pub.publish(KVEventBatch(float(i), [AllBlocksCleared()]))
        deadline = time.monotonic() + 20  # bounded waits: for the thread, then the answers
        while pub.published < 5:  # all sent (and buffered) before anyone asks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        poller = zmq.Poller()
        for _ in range(REPLAYS_PER_S + 4):
            peer = zmq.Context.instance().socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(pub.replay_endpoint)
            peer.send_multipart((b"", (0).to_bytes(8, "big")))
            poller.register(peer, zmq.POLLIN)
            peers.append(peer)
        answered, batches = set(), 0
        while len(answered) < REPLAYS_PER_S:
            assert time.monotonic() < deadline, f"only {len(answered)} replays answered"
            for peer, _ in poller.poll(100):
                _, _, seq, _ = peer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) < 0:
                    answered.add(peer)
                else:
                    batches += 1
        assert batches == 3 * REPLAYS_PER_S  # the last 3 batches each time, not all 5
        while pub.replays_dropped < 4:  # the other 4 were dropped, not queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pub.replays_dropped == 4 and not poller.poll(200)  # and nothing else came
    finally:
        for peer in peers:
            peer.close()
        pub.close()


def test_the_index_shrinks_with_what_the_workers_hold():
    """A soak: 3,000 distinct prompts through a worker whose cache holds ~500 pages.
    The index interns only what is held (it used to keep every page ever stored)."""
    import random

    rng = random.Random(0)
    sink = EventCollector()
    cache = RadixCache(4, event_sink=sink)
    index = KvIndex(4)
    for i in range(3000):
        prompt = [i % 7] * 8 + [rng.randrange(50_000) for _ in range(20)]
        cache.insert(RadixKey(prompt), torch.arange(i * 28, i * 28 + 28))
        if cache.total_size() > 2000:
            cache.evict(cache.total_size() - 2000)
        index.apply("w", decode_batch(encode_batch(sink.drain())))
    index.check()
    held = len(content(cache))
    assert held <= 2000 // 4 + 7 and len(index._ids) == index.num_blocks("w") == held


def test_a_restarted_worker_is_noticed_even_when_its_first_batches_were_missed():
    """A restarted publisher numbers from 0 again; the subscriber may reconnect only after
    a few batches went out. Any sequence number at or below the last one means a restart:
    the index drops what the old process held and replays the new one's batches."""
    port = free_port_pair()
    ends = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    pub = ZmqEventPublisher(*ends, 100)
    index = KvIndex(1)
    sub = EventSubscriber("w", pub.endpoint, pub.replay_endpoint, index.apply)
    try:
        first = iter(range(10_000))

        def one() -> None:
            i = next(first)
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))

        old = publish_until_heard(pub, one, lambda seq: sub.last_seq == seq)
        while old < 4:  # five in all, heard in order
            one()
            old += 1
            assert wait_for(lambda old=old: sub.last_seq == old)
        pub.close()
        deadline = time.monotonic() + 10
        while True:  # the worker again, empty, once its old sockets let go of the ports
            try:
                pub = ZmqEventPublisher(*ends, 100)
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        for i in range(3):  # before the subscriber is back: missed live, kept for replay
            pub.publish(KVEventBatch(0, [BlockStored([50 + i], None, [50 + i], 1)]))
        published(pub, 3)
        again = iter(range(60, 10_000))

        def new_one() -> None:  # seq 3, 4, ...: at or below the last seen (4) at first
            i = next(again)
            pub.publish(KVEventBatch(0, [BlockStored([i], None, [i], 1)]))

        heard = publish_until_heard(
            pub, new_one, lambda seq: sub.restarts == 1 and sub.last_seq == seq
        )
        assert index.overlap([0]) == {} and index.overlap([4]) == {}  # the old process's
        assert index.overlap([50]) == {"w": 1} and index.overlap([60 + heard - 3]) == {"w": 1}
    finally:
        sub.close()
        pub.close()
