"""Prompt-cache retention and explicit caching: `radixkv.retention.Retention` on a tree
(deadlines, quotas, pressure) and through the engine (`CacheSpec`: a retained prefix
survives a flood that evicts everything else, an explicit limit caches only up to it, a
request that does not read the cache finds nothing, and pins never keep a request from
running)."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import RadixCache, RadixKey
from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.request import CacheSpec, SamplingParams
from radixkv.retention import Retention

CFG = ModelConfig()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def K(toks, ns=None) -> RadixKey:
    return RadixKey(np.asarray(toks, dtype=np.int64), ns)


def tree(*prompts, ns=None) -> RadixCache:
    cache = RadixCache(1)
    for p in prompts:
        cache.insert(K(p, ns))
    return cache


def test_a_pin_holds_until_its_deadline_and_asking_again_extends_it():
    cache, clock = tree(list(range(10)), list(range(100, 110))), Clock()
    ret = Retention(cache, 100, 100, clock)
    assert ret.pin(K(range(6)), 10) == 6  # a prefix: the node is split there
    assert cache.evict(100) == 14  # all but the pinned prefix
    assert cache.match_len(K(range(10))) == 6
    clock.now = 5
    assert ret.pin(K(range(6)), 10) == 6 and ret.total == 6  # asked again: until 15
    clock.now = 12
    assert ret.expire() == 0 and cache.evictable_size() == 0
    clock.now = 15
    assert ret.expire() == 1 and ret.released["expired"] == 1
    assert cache.evictable_size() == 6 and ret.total == 0
    ret.check()
    cache.check_integrity()


def test_a_hit_that_uses_a_retained_prefix_whole_renews_it():
    cache, clock = tree(list(range(10))), Clock()
    ret = Retention(cache, 100, 100, clock)
    ret.pin(K(range(6)), 10)  # until 10
    clock.now = 8
    short = cache.match_prefix(K(range(4))).last_node  # uses only part of it
    assert ret.hit(short) == 0
    long = cache.match_prefix(K(range(9))).last_node  # runs through it: a use
    assert ret.hit(long) == 1  # until 18
    clock.now = 12
    assert ret.expire() == 0
    clock.now = 18
    assert ret.expire() == 1 and not ret.pins
    assert ret.hit(long) == 0  # nothing retained: nothing to renew
    ret.check()


def test_quotas_release_the_least_recently_asked_for_first():
    prompts = [[i] * 8 for i in range(1, 5)]
    cache, clock = RadixCache(1), Clock()
    for i, p in enumerate(prompts):
        cache.insert(K(p, "a" if i < 3 else "b"))
    ret = Retention(cache, max_tokens=16, max_total=24, clock=clock)
    for i, p in enumerate(prompts[:3]):
        clock.now = i
        assert ret.pin(K(p, "a"), 100) == 8
    # tenant a holds 16: its third pin released its oldest (the first)
    assert ret.used["a"] == 16 and ret.released["quota"] == 1
    assert cache.evictable_size() == 16  # the released one and tenant b's
    clock.now = 9
    assert ret.pin(K(prompts[3], "b"), 100) == 8 and ret.total == 24
    assert cache.evict(100) == 8 and cache.match_len(K(prompts[0], "a")) == 0
    assert ret.pin(K([9] * 30, "b"), 100) == 0  # not cached: nothing to retain
    cache.insert(K([7] * 30, "b"))
    assert ret.pin(K([7] * 30, "b"), 100) == 0  # over the quota alone: refused
    assert ret.refused == 2 and ret.total == 24
    ret.check()


def test_relieve_frees_pins_until_enough_is_evictable():
    cache = tree([1] * 8, [2] * 8, [3] * 8)
    ret = Retention(cache, 100, 100, Clock())
    for t in (1, 2, 3):
        ret.pin(K([t] * 8), 100)
    assert cache.evictable_size() == 0
    assert ret.relieve(10) == 16 and len(ret.pins) == 1  # two whole pins
    assert ret.released["pressure"] == 2
    with pytest.raises(ValueError, match="ttl"):
        ret.pin(K([3] * 8), 0)
    with pytest.raises(ValueError, match="max_tokens"):
        Retention(cache, -1, 10)


# --- through the engine -----------------------------------------------------------------
def run(engine: Engine, prompt, spec=None, max_new_tokens=2):
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rid = engine.add_request(prompt, sp, cache=spec)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.rid == rid and out.finished:
                last = out
    return last


def test_a_retained_prefix_survives_a_flood_that_evicts_everything_else():
    system = list(range(100, 164))
    for retained in (False, True):
        engine = Engine(CFG, kv_tokens=256, check_memory=True)
        spec = CacheSpec(retain=((64, 3600.0),)) if retained else None
        first = run(engine, system + [1, 2, 3], spec)
        assert first.cache_write_tokens == (64 if retained else None)
        for i in range(20):  # 20 x 60 tokens through a 256-token pool
            run(engine, [200 + i] * 58)
        again = run(engine, system + [4, 5, 6])
        assert again.cached_tokens == (64 if retained else 0)
        assert engine.retention.total == (64 if retained else 0)


def test_a_request_whose_hit_uses_a_retained_prefix_renews_it():
    engine = Engine(CFG, kv_tokens=256, check_memory=True)
    clock = Clock()
    engine.retention.clock = clock
    system = list(range(100, 164))
    run(engine, system + [1, 2, 3], CacheSpec(retain=((64, 100.0),)))  # until 100
    clock.now = 90
    assert run(engine, system + [4, 5, 6]).cached_tokens == 64  # a use: until 190
    clock.now = 150
    run(engine, [9] * 8)  # a step: expire() runs
    assert engine.retention.total == 64
    clock.now = 191
    run(engine, [9] * 8)
    assert engine.retention.total == 0 and engine.retention.released["expired"] == 1


def test_an_explicit_limit_caches_only_up_to_it_and_no_read_finds_nothing():
    engine = Engine(CFG, kv_tokens=512, page_size=4, check_memory=True)
    prompt = list(range(10, 50))
    run(engine, prompt, CacheSpec(limit=22))
    assert engine.cache.match_len(K(prompt)) == 20  # whole pages up to the limit
    out = run(engine, prompt, CacheSpec(read=False, limit=0))
    assert out.cached_tokens == 0 and engine.cache.match_len(K(prompt)) == 20
    assert run(engine, prompt).cached_tokens == 20


def test_retained_prefixes_never_keep_a_request_from_running():
    engine = Engine(CFG, kv_tokens=64, max_retained_tokens=32, check_memory=True)
    run(engine, list(range(1, 31)), CacheSpec(retain=((30, 3600.0),)))
    assert engine.retention.total == 30
    # needs 60 of the 64 slots: the pin goes (counted), the request runs
    out = run(engine, list(range(200, 250)), max_new_tokens=10)
    assert out.output_tokens == 10
    assert engine.retention.total == 0 and engine.retention.released["pressure"] == 1


def test_cache_spec_errors_name_the_argument():
    engine = Engine(CFG)
    sp = SamplingParams(max_new_tokens=1)
    for spec, match in (
        (CacheSpec(retain=((0, 5.0),)), "positions"),
        (CacheSpec(retain=((9, 5.0),)), "positions"),
        (CacheSpec(retain=((2, 0),)), "seconds"),
        (CacheSpec(limit=-1), "limit"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.add_request([1, 2, 3], sp, cache=spec)
    with pytest.raises(TypeError, match="CacheSpec"):
        engine.add_request([1, 2, 3], sp, cache={"limit": 1})
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_retained_tokens"):
        Engine(CFG, max_retained_tokens=-1)
