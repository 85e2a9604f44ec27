"""A shared store never serves the wrong KV, and repairs itself: two checkpoints one
weight apart, pages lost or corrupted in a real Redis, a file store that cannot be
written or created."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import redis
import torch
from support.models import middle_tensor, save_checkpoint
from support.stores import PROMPTS, REDIS_URL, OwnRedis, engine, run

from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.weights import random_model
from radixkv.tree import HASH_BYTES
from radixkv.web.process import ServerProcess


def pages_written(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith("radixkv:storage_pages_written_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_two_servers_two_checkpoints_one_middle_weight_apart(tmp_path, monkeypatch):
    from openai import OpenAI

    monkeypatch.setenv("RADIXKV_CACHE", str(tmp_path / "radixkv-cache"))  # the servers'
    model = random_model(ModelConfig(), seed=5)
    save_checkpoint(model, tmp_path / "a")
    _, t = middle_tensor(model)
    with torch.no_grad():
        t.view(-1)[t.numel() // 2] += 1e-3  # one weight element, in the middle
    save_checkpoint(model, tmp_path / "b")
    store = f"file://{tmp_path}/pages"
    cached = {}
    for run_name, folder in (("a", "a"), ("a again", "a"), ("b", "b")):
        args = ["--model", str(tmp_path / folder), "--page-size", "4", "--kv-tokens", "4096",
                "--storage", store]  # fmt: skip
        with ServerProcess(*args, timeout=60) as srv:
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
            r = client.completions.create(model=folder, prompt=PROMPTS[0], max_tokens=2,
                                          temperature=0)  # fmt: skip
            cached[run_name] = r.usage.prompt_tokens_details.cached_tokens
            deadline = time.monotonic() + 30  # bounded: the write-through is asynchronous
            while run_name == "a" and pages_written(srv.url) == 0:
                assert time.monotonic() < deadline, "no page was written"
                time.sleep(0.05)
    assert cached["a"] == 0
    assert cached["a again"] > 100  # the same checkpoint in a new process: served
    assert cached["b"] == 0  # one middle weight apart: nothing served


@pytest.fixture
def db15():
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    client.flushdb()
    yield client
    client.flushdb()


def test_store_keys_are_128_bit_and_events_keep_64_bit_ints(db15):
    e = engine(REDIS_URL)
    run(e)
    keys = db15.keys("*")
    assert keys and all(len(k) == 16 + HASH_BYTES == 32 for k in keys)
    from radixkv.events import EventCollector

    c = engine(None)
    collector = EventCollector()
    c.cache.set_event_sink(collector)
    run(c)
    batch = collector.drain()
    hashes = [h for ev in batch.events for h in getattr(ev, "block_hashes", [])]
    assert hashes and all(0 <= h < 2**64 for h in hashes)


def test_pages_a_restarted_redis_lost_are_written_again():
    own = OwnRedis()
    port = own.port
    try:
        e = engine(own.url)
        e.tier.store.retry_s = 0.0  # do not sit out the restart window
        want = run(e)
        fresh = engine(own.url)
        assert run(fresh) == want
        served = fresh.tier.hit_tokens
        assert served > 150
        own.kill()  # no persistence: a restart comes back empty
        own = OwnRedis(port=port)  # the same address
        assert redis.Redis.from_url(own.url).keys("*") == []
        e.flush_cache()  # the prompts are looked for in the store, missed, recomputed
        assert run(e) == want
        again = engine(own.url)  # served as before the restart: the pages were rewritten
        assert run(again) == want and again.tier.hit_tokens == served
        e.mgr.check_memory()
    finally:
        own.kill()


def test_corrupted_pages_are_counted_misses_and_rewritten_once_recomputed(db15):
    want = run(engine(REDIS_URL))
    for key in db15.keys("*"):
        value = bytearray(db15.get(key))
        value[-1] ^= 0xFF
        db15.set(key, bytes(value))
    second = engine(REDIS_URL)
    assert run(second) == want
    assert second.tier.stats.corrupt >= 1 and second.tier.hit_tokens == 0
    third = engine(REDIS_URL)  # the second engine rewrote what it recomputed
    assert run(third) == want
    assert third.tier.stats.corrupt == 0 and third.tier.hit_tokens > 150


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path):
    """A full disk, for real: the writer process may not grow a file past 1 KB."""
    script = f"""
import resource, signal, sys
from pathlib import Path
from radixkv.storage import FileStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
store = FileStore({str(tmp_path / "pages")!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
n = store.set([b"k" * 32, b"j" * 32], [b"x" * 100, b"y" * 4096])
print(n, store.stats.errors)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    assert out.stdout.split() == ["1", "1"]
    files = sorted(p.name for p in (tmp_path / "pages").rglob("*") if p.is_file())
    assert files == [(b"k" * 32).hex()]  # the written page, and no .tmp- file


def test_a_file_store_that_cannot_be_created_is_soft(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = f"file://{blocker}/pages"
    with caplog.at_level("WARNING", logger="radixkv.storage"):
        e = engine(bad)
    assert str(blocker / "pages") in caplog.text  # the message names the path
    assert run(e) == run(engine(None))
    assert e.tier.errors >= 1 and e.tier.hit_tokens == 0


def test_serve_starts_with_a_file_store_it_cannot_create(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = ["--model", "random", "--storage", f"file://{blocker}/pages"]
    with ServerProcess(*args, timeout=60) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "random", "prompt": "hi",
                                                           "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200
    assert str(blocker / "pages") in srv.stderr()  # the warning names the path


def test_a_storage_secret_refuses_pages_written_without_it(tmp_path):
    url = f"file://{tmp_path}/pages"
    want = run(engine(url))  # no secret: unsigned pages
    signed = engine(url, storage_secret="fleet secret")
    assert run(signed) == want
    assert signed.tier.stats.unauthenticated >= 1 and signed.tier.hit_tokens == 0
    reader = engine(url, storage_secret="fleet secret")  # signed pages were rewritten
    assert run(reader) == want and reader.tier.hit_tokens > 150
    wrong = engine(url, storage_secret="another secret")
    assert run(wrong) == want and wrong.tier.hit_tokens == 0
    assert wrong.tier.stats.unauthenticated >= 1


def test_the_secret_comes_from_the_environment(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/pages"
    monkeypatch.setenv("RADIXKV_STORAGE_SECRET", "from env")
    want = run(engine(url))
    assert run(engine(url, storage_secret="from env")) == want
    same = engine(url, storage_secret="from env")
    run(same)
    assert same.tier.hit_tokens > 150 and same.tier.stats.unauthenticated == 0
