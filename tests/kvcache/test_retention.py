"""Prompt-cache retention and explicit caching: `radixkv.kvcache.retention.Retention` on a tree
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
from radixkv.kvcache.retention import Retention

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
        engine = Engine(CFG, kv_tokens=256, max_retained_tokens=64, check_memory=True)
        spec = CacheSpec(retain=((64, 3600.0),)) if retained else None
        first = run(engine, system + [1, 2, 3], spec)
        assert first.cache_write_tokens == (64 if retained else None)
        for i in range(20):  # 20 x 60 tokens through a 256-token pool
            run(engine, [200 + i] * 58)
        again = run(engine, system + [4, 5, 6])
        assert again.cached_tokens == (64 if retained else 0)
        assert engine.retention.total == (64 if retained else 0)


def test_a_request_whose_hit_uses_a_retained_prefix_renews_it():
    engine = Engine(CFG, kv_tokens=256, max_retained_tokens=64, check_memory=True)
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


# --- the bookkeeping against a brute-force model ----------------------------------------
class RetentionModel:
    """`Retention`'s rules written plainly, O(pins) each (the module docstring): per
    namespace quotas release its own least recently asked-for pins; the shared caps
    are shared fairly; pressure takes from the namespace holding the most. Keys are
    independent, fully cached prefixes, so a pin holds exactly its key's tokens."""

    def __init__(self, qt, tt, qs, ts):
        self.qt, self.tt, self.qs, self.ts = qt, tt, qs, ts
        self.pins = {}  # name -> dict(ns, n, c, deadline, asked, ttl, seq)
        self.rank, self.seq, self.released, self.refused = {}, 0, {}, 0

    def held(self, ns, what):
        return sum(p[what] for p in self.pins.values() if p["ns"] == ns)

    def namespaces(self):
        return {p["ns"] for p in self.pins.values()}

    def oldest(self, ns):
        own = [(p["asked"], p["seq"], k) for k, p in self.pins.items() if p["ns"] == ns]
        return min(own)[2]

    def release(self, k, why):
        ns = self.pins.pop(k)["ns"]
        self.released[why] = self.released.get(why, 0) + 1
        if ns not in self.namespaces():
            del self.rank[ns]

    def pin(self, k, ns, n, c, ttl, now):
        if k in self.pins:
            p = self.pins[k]
            if p["asked"] != now:
                self.seq += 1
                p["asked"], p["seq"] = now, self.seq
            p["deadline"], p["ttl"] = max(p["deadline"], now + ttl), max(p["ttl"], ttl)
            return n
        if n > min(self.qt, self.tt) or c > min(self.qs, self.ts):
            self.refused += 1
            return 0
        while self.held(ns, "n") + n > self.qt or self.held(ns, "c") + c > self.qs:
            self.release(self.oldest(ns), "quota")
        for what, cap, more in (("n", self.tt, n), ("c", self.ts, c)):
            while sum(p[what] for p in self.pins.values()) + more > cap:
                names = self.namespaces()
                share = cap / (len(names) + (ns not in names))
                if self.held(ns, what) + more > share:
                    if ns not in names:
                        self.refused += 1
                        return 0
                    self.release(self.oldest(ns), "quota")
                    continue
                top = max(names, key=lambda x: (self.held(x, what), -self.rank[x]))
                if top == ns or self.held(top, what) <= share:
                    self.refused += 1
                    return 0
                self.release(self.oldest(top), "quota")
        self.seq += 1
        self.rank.setdefault(ns, self.seq)
        self.pins[k] = dict(ns=ns, n=n, c=c, deadline=now + ttl, asked=now, ttl=ttl,
                            seq=self.seq)  # fmt: skip
        return n

    def hit(self, k, now):
        p = self.pins.get(k)
        if p is not None:
            if p["asked"] != now:
                self.seq += 1
                p["asked"], p["seq"] = now, self.seq
            p["deadline"] = max(p["deadline"], now + p["ttl"])

    def expire(self, now):
        for k in [k for k, p in self.pins.items() if p["deadline"] <= now]:
            self.release(k, "expired")

    def relieve(self, tokens):
        gained = 0
        while self.pins and gained < tokens:
            names = self.namespaces()
            top = max(names, key=lambda x: (self.held(x, "n"), -self.rank[x]))
            k = self.oldest(top)
            gained += self.pins[k]["n"]
            self.release(k, "pressure")


@pytest.mark.parametrize("with_states", [False, True])
def test_retention_equals_a_brute_force_model(with_states):
    """Random pins from a few namespaces (quotas, fair shares, checkpoints), hits, time,
    expiry and pressure: the heaps' answers equal the plain rules', step by step."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from radixkv.kvcache.recurrent.component import StateCheckpoints

    class Slots:
        def free(self, slots):
            pass

    op = st.one_of(
        st.tuples(st.just("pin"), st.integers(0, 11), st.sampled_from([None, "a", "b", "c"]),
                  st.sampled_from([1.0, 5.0, 50.0])),
        st.tuples(st.just("hit"), st.integers(0, 11)),
        st.tuples(st.just("time"), st.sampled_from([0.0, 1.0, 4.0])),
        st.tuples(st.just("relieve"), st.integers(1, 40)),
    )  # fmt: skip

    @settings(max_examples=150)
    @given(st.lists(op, max_size=60), st.integers(8, 40), st.integers(8, 60))
    def run_ops(ops, quota, total):
        lengths = [4 + 3 * (i % 5) for i in range(12)]
        state = StateCheckpoints(128, Slots(), policy="lru") if with_states else None
        cache = RadixCache(1, components=(state,) if state else ())
        keys, slot = [], 0
        for i, n in enumerate(lengths):
            for ns in (None, "a", "b", "c"):
                key = K([1000 + i] + list(range(n - 1)), ns)
                node = cache.insert_node(key).last_node
                if state is not None:  # one checkpoint at the end; every other one before too
                    state.add(node, slot)
                    slot += 1
                    if i % 2 and n > 4:
                        state.add(node, slot, offset=n - 2)
                        slot += 1
            keys.append(n)
        clock = Clock()
        qs, ts = (3, 5) if with_states else (0, 0)
        ret = Retention(cache, quota, total, clock, state, qs, ts)
        model = RetentionModel(quota, total, qs, ts)
        for o in ops:
            if o[0] == "pin":
                i, ns, ttl = o[1:]
                key = K([1000 + i] + list(range(keys[i] - 1)), ns)
                c = (1 + (i % 2 and keys[i] > 4)) if with_states else 0
                got = ret.pin(key, ttl)
                assert got == model.pin((i, ns), ns, keys[i], c, ttl, clock.now)
            elif o[0] == "hit":
                for ns in (None, "a", "b", "c"):
                    key = K([1000 + o[1]] + list(range(keys[o[1]] - 1)), ns)
                    ret.hit(cache.match_prefix(key).last_node)
                    model.hit((o[1], ns), clock.now)
            elif o[0] == "time":
                clock.now += o[1]
                ret.expire()
                model.expire(clock.now)
            else:
                ret.relieve(o[1])
                model.relieve(o[1])
            assert ret.total == sum(p["n"] for p in model.pins.values())
            assert dict(ret.used) == {ns: model.held(ns, "n") for ns in model.namespaces()}
            assert ret.total_states == sum(p["c"] for p in model.pins.values())
            assert dict(ret.released) == model.released and ret.refused == model.refused
            assert len(ret.pins) == len(model.pins)
            ret.check()
            cache.check_integrity()

    run_ops()


@pytest.mark.parametrize("page", [4, 1])
def test_a_retained_prefix_keeps_the_windows_a_hit_needs(tmp_path, page):
    """Sliding layers keep only the windows a match can end at: the retained prefix's
    end (a request going on past it) and, now, a page before it (the same prompt sent
    again computes its last token, so its match ends there). It got 0 after a flood."""
    from support.models import folder

    layers = ["sliding_attention", "full_attention"]
    path = folder(tmp_path / "g", "Gemma3ForCausalLM", head_dim=16, query_pre_attn_scalar=16,
                  sliding_window=16, layer_types=layers)  # fmt: skip
    engine = Engine(str(path), kv_tokens=512, page_size=page, window_tokens=200, chunk_size=64,
                    max_context_len=256, check_memory=True)  # fmt: skip
    system = list(range(100, 164))
    assert run(engine, system, CacheSpec(retain=((64, 3600.0),))).cache_write_tokens == 64
    for i in range(20):  # 20 x 60 tokens through a 512-token pool and 200 window tokens
        run(engine, [200 + i] * 58)
    assert run(engine, system).cached_tokens == 64 - page
    assert run(engine, system + [1, 2, 3]).cached_tokens == 64


class NoScan(dict):
    """The pins by node, refusing to be scanned whole: every operation must reach what
    it needs through its heaps (releasing a pin cost a scan of all pins, twice)."""

    def values(self):
        raise AssertionError("scanned every pin")

    __iter__ = items = values

    def copy(self):
        return dict(super().items())


def test_no_operation_scans_every_pin():
    """8,192 small pins, then one that releases 3,000 of them, hits, expiry and
    pressure: none scans the pins (the old bookkeeping did, in each release: 13 s of one
    engine step through HTTP, 4.6 s in process)."""
    cache, clock = RadixCache(1), Clock()
    ret = Retention(cache, 16384, 32768, clock)
    ret.pins = NoScan()
    for i in range(8192):
        key = K([i % 250 + 3, i // 250 + 3], "t")
        cache.insert(key)
        assert ret.pin(key, 100.0 + i % 7) == 2
    big = K([(7 * i) % 250 + 3 for i in range(6000)], "t")
    cache.insert(big)
    assert ret.pin(big, 100.0) == 6000
    assert len(ret.pins) == 8192 - 3000 + 1 and ret.released["quota"] == 3000
    ret.hit(cache.match_prefix(big).last_node)
    clock.now = 105.5  # the small pins of ttl 100 to 105 expire
    assert ret.expire() > 0
    assert ret.relieve(100) >= 100
    ret.pins = dict(ret.pins.copy())  # a scan now, for the check
    ret.check()
