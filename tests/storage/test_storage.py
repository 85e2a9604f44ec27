"""The shared KV tier against real stores: the Redis on 127.0.0.1:6379 (tests use db 15
and flush it), a redis-server of their own to kill or fill, and a folder."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis
import torch
from support.stores import PROMPTS, REDIS_URL, OwnRedis, engine, run

from radixkv.engine.engine import Engine
from radixkv.storage import FileStore, MemoryStore, PageCodec, RedisStore, open_store
from radixkv.storage.page import PageError
from radixkv.storage.resp import IOV_BATCH
from radixkv.web.process import free_port


@pytest.fixture
def shared_redis():
    """The machine's Redis (CI starts it): a test fails, not skips, if it is down."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    client.ping()
    client.flushdb()
    yield REDIS_URL
    client.flushdb()


# --- stores --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "file", "redis"])
def test_store_backends(kind, tmp_path, shared_redis):
    store = {"memory": MemoryStore, "file": lambda: FileStore(tmp_path),
             "redis": lambda: RedisStore(shared_redis)}[kind]()  # fmt: skip
    keys = [bytes([i]) * 24 for i in range(5)]
    assert store.exists_prefix(keys) == 0
    assert store.set(keys[:3], [b"a", b"bb", b"ccc"]) == 3
    assert store.exists_prefix(keys) == 3
    assert store.exists_prefix(keys[1:]) == 2
    assert store.get(keys[:4]) == [b"a", b"bb", b"ccc", None]
    assert store.exists([keys[4], keys[2], keys[3], keys[0]]) == [False, True, False, True]
    assert store.exists([]) == []


@pytest.mark.parametrize("kind", ["memory", "file", "redis"])
def test_get_into_reads_values_into_the_callers_buffers(kind, tmp_path, shared_redis):
    """Values of an accepted length land in the given buffers (Redis: from the socket,
    some larger than its read chunks); a missing key is None, a refused length False,
    and the replies after either still land where they belong."""
    store = {"memory": MemoryStore, "file": lambda: FileStore(tmp_path),
             "redis": lambda: RedisStore(shared_redis)}[kind]()  # fmt: skip
    rng = np.random.default_rng(0)
    big = [rng.integers(0, 256, 300_001, dtype=np.uint8).tobytes() for _ in range(3)]
    keys = [bytes([i]) * 24 for i in range(6)]
    store.set([keys[0], keys[1], keys[3], keys[4], keys[5]],
              [big[0], b"short", big[1], b"", big[2]])  # fmt: skip
    dest = np.zeros((6, 300_001 - 7), dtype=np.uint8)
    heads = [bytearray(7) for _ in keys]
    asked: list[tuple[int, int]] = []

    def parts(i: int, n: int):
        asked.append((i, n))
        if n != 300_001:
            return None
        return [memoryview(heads[i]), memoryview(dest[i])]

    got = store.get_into(keys, parts)
    assert got == [True, False, None, True, False, True]
    assert asked == [(0, 300_001), (1, 5), (3, 300_001), (4, 0), (5, 300_001)]
    for i, b in ((0, big[0]), (3, big[1]), (5, big[2])):
        assert bytes(heads[i]) + dest[i].tobytes() == b
    assert not dest[1].any() and not dest[2].any() and not dest[4].any()


def test_redis_writes_many_values_with_a_ttl_and_reads_them_back(shared_redis):
    """SETs go out as one scatter-gather send: more buffers than one sendmsg takes, an
    empty value, values larger than the socket's buffer, and the expiry on every key."""
    store = RedisStore(shared_redis, ttl_s=3600)
    n = IOV_BATCH // 3 + 7  # three buffers a SET: more than one sendmsg's worth
    keys = [b"key-%05d" % i for i in range(n)]
    values = [bytes([i % 251]) * (i % 5000) for i in range(n)]
    assert store.set(keys, values) == n
    assert store.get(keys) == values
    client = redis.Redis.from_url(shared_redis)
    assert all(0 < client.ttl(k) <= 3600 for k in keys[:: n // 7])
    big = [np.random.default_rng(i).bytes(3_000_001) for i in range(6)]  # partial sends
    assert store.set(keys[:6], big) == 6 and store.get(keys[:6]) == big


def test_a_tls_redis_reads_and_writes_through_the_same_code(tmp_path):
    """rediss://: the SETs are sent buffer by buffer (a TLS socket has no sendmsg) and
    the GETs read into the caller's buffers through TLS."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for a TLS redis-server")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    port = free_port()
    own = OwnRedis("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                   "--tls-key-file", str(key), "--tls-auth-clients", "no", port=port)  # fmt: skip
    try:
        store = RedisStore(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", timeout=5.0)
        values = [np.random.default_rng(i).bytes(1_500_001) for i in range(4)]
        keys = [b"tls-page-%d" % i for i in range(4)]
        assert store.set(keys, values) == 4 and store.stats.errors == 0
        dest = [bytearray(1_500_001) for _ in keys]
        got = store.get_into(keys + [b"missing"], lambda i, n: [memoryview(dest[i])])
        assert got == [True, True, True, True, None]
        assert [bytes(d) for d in dest] == values
    finally:
        own.kill()


def test_a_key_of_another_type_is_a_bad_page_not_a_store_failure(shared_redis):
    """A key of another type under a page's name used to fail the whole read, marking
    the store down for 5 s for every prompt; now it is that one page's miss (counted and
    rewritten by the tier), the replies after it still land, and the store stays up."""
    store = RedisStore(shared_redis)
    client = redis.Redis.from_url(shared_redis)
    keys = [b"page-a" * 4, b"a-list" * 4, b"page-b" * 4]
    store.set([keys[0], keys[2]], [b"x" * 1000, b"y" * 1000])
    client.delete(keys[1])
    client.rpush(keys[1], b"not a string")  # GET answers WRONGTYPE
    bufs = [bytearray(1000) for _ in keys]
    got = store.get_into(keys, lambda i, n: [memoryview(bufs[i])] if n == 1000 else None)
    assert got == [True, False, True] and bytes(bufs[2]) == b"y" * 1000
    assert store.get(keys) == [b"x" * 1000, b"", b"y" * 1000]
    assert store.stats.errors == 0 and store.exists_prefix(keys) == 3
    assert store.set([keys[1]], [b"z" * 1000]) == 1  # SET replaces a key of any type
    assert store.get([keys[1]]) == [b"z" * 1000]


def test_an_error_reply_mid_read_is_a_soft_failure_and_the_next_read_works(shared_redis):
    """Any other error reply (here: a script that raises, standing for a store that
    refuses) fails the call softly and drops the connection, which is never reused."""
    store = RedisStore(shared_redis, retry_s=0.0)
    client = redis.Redis.from_url(shared_redis)
    keys = [b"page-a" * 4, b"page-b" * 4]
    store.set(keys, [b"x" * 1000, b"y" * 1000])
    client.config_set("maxmemory", "1")  # a GET still works; a full store answers OOM
    try:
        assert store.set([b"new" * 8], [b"z" * 1000]) == 0 and store.stats.errors == 1
    finally:
        client.config_set("maxmemory", "0")
    bufs = [bytearray(1000) for _ in keys]
    got = store.get_into(keys, lambda i, n: [memoryview(bufs[i])] if n == 1000 else None)
    assert got == [True, True] and bytes(bufs[1]) == b"y" * 1000


def test_the_reply_reader_parses_what_redis_sends_and_refuses_what_it_would_not():
    """`RespReader` on a socket pair: many small replies in one read and one larger than
    a read, nil in RESP2 and RESP3, an error reply, a line with no end, a peer that
    hangs up mid-reply."""
    from radixkv.storage.resp import RespReader

    ours, theirs = socket.socketpair()
    big = bytes(range(256)) * 1000
    small = [b"v%03d" % i for i in range(500)]
    wire = b"".join(b"$4\r\n%s\r\n" % v for v in small)
    wire += b"$%d\r\n%s\r\n$-1\r\n_\r\n$3\r\nabc\r\n-WRONGTYPE no\r\n" % (len(big), big)
    threading.Thread(target=theirs.sendall, args=(wire,), daemon=True).start()
    reader = RespReader(ours)
    got = []
    for _ in small:
        buf = bytearray(4)
        assert reader.bulk_into(lambda n, b=buf: [memoryview(b)] if n == 4 else None)
        got.append(bytes(buf))
    assert got == small
    head, rest = bytearray(10), bytearray(len(big) - 10)
    assert reader.bulk_into(lambda n: [memoryview(head), memoryview(rest)]) is True
    assert bytes(head + rest) == big
    assert reader.bulk_into(lambda n: None) is None  # $-1
    assert reader.bulk_into(lambda n: None) is None  # RESP3 null
    assert reader.bulk_into(lambda n: None) is False  # a length nobody wants: skipped
    assert reader.bulk_into(lambda n: None) is False  # WRONGTYPE: not a page
    theirs.sendall(b"-ERR something else\r\n")
    with pytest.raises(redis.ResponseError, match="something else"):
        reader.bulk_into(lambda n: None)
    garbage = threading.Thread(target=theirs.sendall, args=(b"x" * 150_000,), daemon=True)
    garbage.start()  # no line end: not Redis
    with pytest.raises(ConnectionError, match="longer than"):
        RespReader(ours).bulk_into(lambda n: None)
    ours2, theirs2 = socket.socketpair()
    theirs2.sendall(b"$100\r\nonly-part")
    theirs2.close()
    with pytest.raises(ConnectionError, match="closed"):
        RespReader(ours2).bulk_into(lambda n: [memoryview(bytearray(n))])
    ours.close(), theirs.close(), ours2.close()


def test_open_store_urls(tmp_path):
    assert isinstance(open_store("memory://"), MemoryStore)
    assert isinstance(open_store(f"file://{tmp_path}/pages"), FileStore)
    assert isinstance(open_store("redis://127.0.0.1:6379/15"), RedisStore)
    for bad in ("s3://bucket", "file://", "nonsense"):
        with pytest.raises(ValueError, match="storage"):
            open_store(bad)


def test_the_page_header_catches_every_kind_of_bad_value():
    codec, other = PageCodec(b"f" * 16), PageCodec(b"g" * 16)
    kh = b"k" * 16
    value = codec.encode(kh, b"payload" * 10)
    assert codec.decode(kh, value) == b"payload" * 10
    flipped = bytearray(value)
    flipped[-3] ^= 1
    cases = {
        "truncated": value[:-5],
        "corrupted": bytes(flipped),
        "another key": codec.encode(b"j" * 16, b"payload"),
        "another model": other.encode(kh, b"payload"),
        "short": b"RKV2",
        "the old format": b"RKV1" + value[4:],
    }
    for case, bad in cases.items():
        with pytest.raises(PageError) as e:
            codec.decode(kh, bad)
        assert e.value.kind == "corrupt", case


def test_a_storage_secret_refuses_pages_without_its_mac():
    fp, kh = b"f" * 16, b"k" * 16
    signed, other = PageCodec(fp, b"fleet secret"), PageCodec(fp, b"another secret")
    value = signed.encode(kh, b"payload" * 10)
    assert signed.decode(kh, value) == b"payload" * 10
    # a writer without the secret (or with another), and a page edited in place with a
    # CRC recomputed to match: all refused, as unauthenticated
    import struct
    import zlib

    header = len(PageCodec(fp).encode(kh, b""))  # ends with the payload's CRC-32
    forged = bytearray(value)
    forged[-40] ^= 1  # a payload byte (the MAC is the last 32)
    forged[header - 4 : header] = struct.pack(">I", zlib.crc32(bytes(forged[header:-32])))
    for case, bad in {
        "unsigned": PageCodec(fp).encode(kh, b"payload" * 10),
        "another secret": other.encode(kh, b"payload" * 10),
        "edited, CRC fixed": bytes(forged),
    }.items():
        with pytest.raises(PageError) as e:
            signed.decode(kh, bad)
        assert e.value.kind == "unauthenticated", case
    with pytest.raises(ValueError, match="secret"):
        PageCodec(fp, b"")


# --- the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize(("page", "dtype"), [(1, torch.float32), (16, torch.float32),
                                            (16, torch.bfloat16), (16, torch.float16)])  # fmt: skip
def test_pages_loaded_from_a_store_give_the_same_tokens_as_recomputing(page, dtype, tmp_path):
    """In every KV dtype (numpy has no bfloat16: pages go to the store as bytes)."""
    url = f"file://{tmp_path}/pages"
    cold = run(engine(None, page, dtype=dtype))
    first = engine(url, page, dtype=dtype)
    assert run(first) == cold
    assert first.tier.stats.pages_written > 0
    second = engine(url, page, dtype=dtype)  # another engine: an empty device cache
    out = second.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in out.outputs] == cold
    assert second.tier.hit_tokens > 0 and out.outputs[0].cached_tokens > 100
    second.mgr.check_memory()
    second.cache.check_integrity()


def test_another_model_or_page_size_never_matches(tmp_path):
    url = f"file://{tmp_path}/pages"
    run(engine(url, 4))
    for other in (
        engine(url, 8),
        Engine("random", page_size=4, kv_tokens=4096, storage=url, seed=1),
    ):
        other.generate(PROMPTS[:1], max_new_tokens=2, ignore_eos=True)
        assert other.tier.hit_tokens == 0


@pytest.mark.slow
def test_two_engine_processes_share_a_system_prompt_through_redis(shared_redis):
    script = (
        "import json, sys\n"
        "from radixkv.engine.engine import Engine\n"
        f"e = Engine('random', page_size=4, kv_tokens=4096, storage={shared_redis!r})\n"
        f"out = e.generate({PROMPTS!r}, max_new_tokens=8, ignore_eos=True)\n"
        "e.tier.flush()\n"
        "print(json.dumps([[o.token_ids for o in out.outputs], e.tier.hit_tokens]))\n"
    )
    import json

    runs = [
        json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True,
                                  text=True, check=True).stdout)
        for _ in range(2)
    ]  # fmt: skip
    (tokens1, hits1), (tokens2, hits2) = runs
    assert tokens1 == tokens2 and hits1 == 0 and hits2 > 150


# --- faults -------------------------------------------------------------------------------
def test_a_store_down_at_start_costs_a_recompute_not_a_crash():
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    e = engine(dead)
    e.tier.store.clock = lambda: 0.0  # a clock that stands still: still inside retry_s
    assert run(e) == run(engine(None))
    # one call failed; every later one skipped the store instead of waiting on it
    assert e.tier.store.stats.errors == 1 and e.tier.hit_tokens == 0


def test_redis_killed_mid_run():
    own = OwnRedis()
    try:
        first = engine(own.url)
        want = run(first)
        own.kill()
        second = engine(own.url)
        second.tier.store.clock = lambda: 0.0  # stands still: inside the retry window
        assert run(second) == want  # recomputed, identical
        assert second.tier.store.stats.errors == 1  # one timeout, then the store skipped
        second.mgr.check_memory()
    finally:
        if own.proc.poll() is None:
            own.kill()


def test_a_full_store_fails_writes_softly():
    own = OwnRedis("--maxmemory-policy", "noeviction")
    try:
        client = redis.Redis.from_url(own.url)
        client.config_set("maxmemory", "1")  # full already: every write is refused (OOM)
        e = engine(own.url)
        assert run(e) == run(engine(None))
        assert e.tier.errors >= 1 and e.tier.stats.pages_written == 0
    finally:
        own.kill()


@pytest.mark.slow
def test_two_servers_share_through_redis(shared_redis):
    from openai import OpenAI

    from radixkv.web.process import ServerProcess

    args = ["--model", "random", "--page-size", "4", "--kv-tokens", "4096", "--storage",
            shared_redis]  # fmt: skip
    cached = []
    for _ in range(2):  # one after the other: the second starts with an empty device cache
        with ServerProcess(*args, timeout=60) as srv:
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            r = client.completions.create(model="random", prompt=PROMPTS[0], max_tokens=4,
                                          temperature=0)  # fmt: skip
            cached.append((r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text))
            import httpx

            deadline = time.monotonic() + 30  # until the write-through is done
            want = 150 // 4 if len(cached) == 1 else 0  # the first server's prompt pages
            while True:
                text = httpx.get(f"{srv.url}/metrics").text
                written = re.search(r"radixkv:storage_pages_written_total\{[^}]*\} (\S+)", text)
                if written and float(written.group(1)) >= want:
                    break
                assert time.monotonic() < deadline, "the pages were never written"
                time.sleep(0.05)
    (c1, t1), (c2, t2) = cached
    assert c1 == 0 and c2 > 150 and t1 == t2


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("tier", ["store", "host"])
def test_loaded_kv_is_bit_identical_to_recomputed_kv(page, tier, tmp_path):
    """Stronger than equal logits: the KV a prompt's pages bring back from the host pool or
    the store equals, bit for bit, the KV a cold engine computes for them."""
    import torch

    from radixkv import RadixKey

    prompt = PROMPTS[0]
    cold = engine(None, page)
    cold.generate([prompt], max_new_tokens=1, ignore_eos=True)
    if tier == "store":
        url = f"file://{tmp_path}/pages"
        run(engine(url, page))
        warm = engine(url, page)
    else:
        warm = Engine("random", page_size=page, kv_tokens=4096, host_tokens=4096)
        warm.generate([prompt], max_new_tokens=1, ignore_eos=True)
        warm.flush_cache()  # everything leaves the device: demoted to the host pool
        assert warm.cache.total_size() == 0 and warm.tier.stats.demoted_pages > 0
    out = warm.generate([prompt], max_new_tokens=1, ignore_eos=True)
    assert warm.tier.hit_tokens > 0 and out.outputs[0].cached_tokens > 100
    ids = cold.encode(prompt)  # generate wraps prompts in the chat template
    n = (len(ids) - 1) // page * page
    a = cold.cache.match_prefix(RadixKey(ids[:n])).indices
    b = warm.cache.match_prefix(RadixKey(ids[:n])).indices
    assert len(a) == len(b) == n
    for layer in range(cold.kv.num_layers):
        assert torch.equal(cold.kv.k[layer][a], warm.kv.k[layer][b])
        assert torch.equal(cold.kv.v[layer][a], warm.kv.v[layer][b])


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random

    while True:
        port = random.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def test_a_redis_cluster_works_through_the_same_code(tmp_path):
    ports = [cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            folder = tmp_path / str(port)
            folder.mkdir()
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
                cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        for port in ports:  # every node answers before the cluster is made
            deadline = time.monotonic() + 20
            while True:
                try:
                    redis.Redis(port=port, socket_timeout=1).ping()
                    break
                except redis.RedisError:
                    assert time.monotonic() < deadline, f"redis-server on {port} did not start"
                    time.sleep(0.1)
        made = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
             "--cluster-yes"], capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr
        url = f"redis://127.0.0.1:{ports[0]}?cluster=1"
        keys = [bytes([i]) * 24 for i in range(6)]
        deadline = time.monotonic() + 30
        while True:  # until the cluster has settled and takes writes
            try:
                store = RedisStore(url, timeout=2.0, retry_s=0.0)
                if store.set(keys, [b"v%d" % i for i in range(6)]) == 6:
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "the cluster did not settle"
            time.sleep(0.3)
        assert store.exists_prefix(keys) == 6 and store.get(keys[:2]) == [b"v0", b"v1"]
        first = engine(url)
        want = run(first)
        second = engine(url)
        assert run(second) == want and second.tier.hit_tokens > 150
    finally:
        for p in procs:
            p.kill()
            p.wait()


# --- the file store follows nothing it did not write -------------------------------------
def _page_path(store: FileStore, key: bytes):
    name = key.hex()
    return store.root / name[-2:] / name


def test_a_planted_folder_link_is_never_written_through_nor_read_back(tmp_path):
    """A symlink planted under a page subfolder's name used to be followed: pages were
    written into the folder it pointed at, and read back from there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    store = FileStore(tmp_path / "pages")
    key = bytes(range(24))
    sub = _page_path(store, key).parent
    sub.parent.mkdir(parents=True, exist_ok=True)
    sub.symlink_to(outside, target_is_directory=True)
    (outside / key.hex()).write_bytes(b"planted")
    assert store.get([key]) == [None]  # not read through the link
    assert store.set([key], [b"page"]) == 1
    assert list(outside.iterdir()) == [outside / key.hex()]  # nothing written there
    assert (outside / key.hex()).read_bytes() == b"planted"
    assert not sub.is_symlink() and store.get([key]) == [b"page"]  # a real folder now


def test_a_planted_page_link_fifo_or_device_is_a_bad_page_and_never_blocks(tmp_path):
    """A link to /dev/zero grew a server by 3 GB in 8 s; a FIFO hung the engine."""
    import os
    import threading

    store = FileStore(tmp_path / "pages")
    keys = [bytes([i]) * 24 for i in range(3)]
    store.set(keys, [b"x"] * 3)  # the subfolders exist
    for k in keys:
        _page_path(store, k).unlink()
    _page_path(store, keys[0]).symlink_to("/dev/zero")
    os.mkfifo(_page_path(store, keys[1]))
    _page_path(store, keys[2]).symlink_to(tmp_path / "elsewhere")
    got: list = []
    t = threading.Thread(target=lambda: got.append((store.get(keys), store.exists_prefix(keys))))
    t.start()
    t.join(20)
    assert not t.is_alive(), "a read blocked on a planted file"
    values, present = got[0]
    assert values == [b"", b"", b""] and present == 0  # not pages: refused, unread
    assert store.get_into(keys, lambda i, n: [memoryview(bytearray(n))]) == [False] * 3
    assert store.set(keys, [b"a", b"b", b"c"]) == 3  # written over, as pages
    assert store.get(keys) == [b"a", b"b", b"c"] and store.stats.errors == 0


def test_a_file_store_keeps_under_its_cap_by_recency(tmp_path):
    """100 distinct 4,000-token prompts wrote 25,000 files with no bound."""
    import os

    store = FileStore(tmp_path / "pages", max_bytes=10_000)
    keys = [i.to_bytes(24, "big") for i in range(40)]
    for i, k in enumerate(keys):
        store.set([k], [bytes(1000)])
        if i == 0:
            os.utime(_page_path(store, keys[0]), (0, 0))  # the oldest page...
        store.get([keys[0]])  # ...read all along: kept over newer unread ones
    held = sum(f.stat().st_size for f in (tmp_path / "pages").rglob("*") if f.is_file())
    assert held <= 10_000 and store.held_bytes == held
    assert store.stats.evicted_pages >= 30 and store.stats.evicted_bytes >= 30_000
    assert store.get([keys[0]]) == [bytes(1000)] and store.get([keys[1]]) == [None]
    assert store.get(keys[-3:]) == [bytes(1000)] * 3  # the newest stay
    again = FileStore(tmp_path / "pages", max_bytes=10_000)  # another process: scans it
    assert again.held_bytes == held


def test_a_file_store_is_capped_by_default_to_fit_its_disk_and_says_so(tmp_path):
    """Without --storage-max-bytes the folder had no cap (206 MB after 100 prompts and
    growing): now what it holds at start plus half the disk's free space, printed at
    start by radixkv serve."""
    from radixkv.storage.files import DISK_SHARE
    from radixkv.web.process import ServerProcess

    store = FileStore(tmp_path / "pages")
    store.set([b"k" * 24], [bytes(5000)])
    free = shutil.disk_usage(tmp_path).free
    again = FileStore(tmp_path / "pages")  # another start: what it holds counts
    assert again.held_bytes == 5000
    assert abs(again.max_bytes - (5000 + free * DISK_SHARE)) < 0.01 * free
    args = ["--model", "random", "--storage", f"file://{tmp_path}/pages"]
    with ServerProcess(*args, timeout=60) as srv:
        pass
    text = srv.stderr()
    assert f"file store {tmp_path}/pages: 0.0 MiB held, at most " in text
    assert "half its disk's free space; --storage-max-bytes sets it" in text


def test_serve_refuses_a_size_cap_on_a_store_that_sizes_itself(capsys):
    from radixkv.cli import main

    argv = ["serve", "--model", "random", "--storage", "redis://127.0.0.1:6379/0",
            "--storage-max-bytes", "1000", "--port", "0"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: --storage-max-bytes: only a file://")


def test_an_engine_rewrites_a_page_key_of_another_type_and_the_store_stays_up(shared_redis):
    """A key of another type under a page's name: before, each read of that prefix
    marked the whole store down for 5 s for every prompt, and the key was never
    repaired. Now the page is a counted bad page, later pages of other prompts still
    load at once, and the engine writes the page over it when it computes it."""
    client = redis.Redis.from_url(shared_redis)
    first = engine(shared_redis)
    cold = run(first)
    keys = sorted(k for k in client.scan_iter() if client.type(k) == b"string")
    victim = keys[len(keys) // 2]
    client.delete(victim)
    client.rpush(victim, b"not a page")
    second = engine(shared_redis)
    assert run(second) == cold
    st = second.tier
    assert st.stats.corrupt >= 1 and st.errors == 0  # a bad page, not a failed store
    assert st.hit_tokens > 0  # the other prompts' pages still came from the store
    assert client.type(victim) == b"string"  # written over as a page
    third = engine(shared_redis)
    assert run(third) == cold and third.tier.stats.corrupt == 0
