"""The request lifecycle: the seed's example, bad inputs, and a stateful fuzzer that
interleaves many requests with check_memory() and check_integrity() after every step.

The fuzzer also checks *what* the slots hold: each "computed" slot gets a fingerprint of
the tokens its KV depends on (the namespace and the sequence up to that token). Whenever a
request's row points at slots it did not compute (a cache hit, or a re-match after a
chunk), their fingerprints must be those of the request's own tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import content, step_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.faults import InjectedFault, inject_fault

from radixkv import RadixCache
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool


def make(size=64, page=1, eagle=False, max_reqs=4, max_len=64, policy="lru"):
    alloc = TokenToKVPoolAllocator(size, page)
    cache = RadixCache(page, policy, alloc, is_eagle=eagle)
    return CacheManager(cache, alloc, ReqToTokenPool(max_reqs, max_len))


def run_to_completion(m: CacheManager, req: Req, outputs: list[int]) -> None:
    assert m.admit(req)
    assert m.allocate(req, len(req.input_ids) - req.kv_len) is not None
    for tok in outputs:  # decode: each sampled token is fed back (gets a slot) next step
        req.output_ids.append(tok)
        assert m.allocate(req, 1) is not None
    m.cache_finished_req(req)


# --- the seed's example ----------------------------------------------------------------------
def test_capital_of_france_then_italy_reuses_the_very_same_slots():
    m = make()
    what = [11, 12, 13, 14, 15]  # "What is the capital of"
    france = Req("fr", [*what, 21, 99])  # + "France ?"
    italy = Req("it", [*what, 22, 99])  # + "Italy ?"
    assert m.admit(france) and france.cached_len == 0
    slots_fr = m.allocate(france, 7)
    m.cache_finished_req(france)
    m.check_memory()
    available = m.allocator.available_size()
    assert m.admit(italy)
    assert italy.cached_len == 5
    assert m.req_pool.read(italy.row, 0, 5).tolist() == slots_fr[:5].tolist()
    new = m.allocate(italy, 2)  # only the suffix is allocated
    assert len(new) == 2 and m.allocator.available_size() == available - 2
    assert not set(new.tolist()) & set(slots_fr.tolist())
    m.check_memory()
    m.cache_finished_req(italy)
    m.check_memory()
    assert m.cache.total_size() == 9


def test_a_prompt_is_never_matched_whole():
    m = make()
    run_to_completion(m, Req(1, [1, 2, 3, 4]), [])
    again = Req(2, [1, 2, 3, 4])
    assert m.admit(again) and again.cached_len == 3  # the last token makes the logits
    m.abort(again)
    m.check_memory()


def test_chunked_prefill_hands_whole_pages_to_the_tree_as_it_goes():
    m = make(size=64, page=4)
    req = Req(1, list(range(1, 15)))
    assert m.admit(req)
    m.allocate(req, 6)
    m.cache_unfinished_req(req)
    assert req.cache_protected_len == 4 and m.cache.protected_size() == 4
    m.check_memory()
    m.allocate(req, 8)
    m.cache_unfinished_req(req)
    assert req.cache_protected_len == 12
    m.check_memory()
    m.cache_finished_req(req)
    assert m.cache.total_size() == 12 and m.cache.protected_size() == 0
    m.check_memory()


@pytest.mark.parametrize("merge", [True, False])
def test_chunks_and_turns_of_one_chat_merge_into_one_node(merge):
    alloc = TokenToKVPoolAllocator(256, 4)
    cache = RadixCache(4, "lru", alloc, merge_chains=merge)
    m = CacheManager(cache, alloc, ReqToTokenPool(2, 128))
    history: list[int] = []
    for turn in range(3):  # each turn: the history + a new message, prefilled in 2 chunks
        history = history + [turn + 1] * 12
        req = Req(turn, list(history))
        assert m.admit(req)
        rest = len(history) - req.kv_len
        for n in (rest // 2, rest - rest // 2):
            assert m.allocate(req, n) is not None
            m.cache_unfinished_req(req)
            m.check_memory()
        req.output_ids.append(7)
        m.allocate(req, 1)
        m.cache_finished_req(req)
        history = req.all_ids
        m.check_memory()
        cache.check_integrity()
    # without merging: one node per chunk and per finish; merged: the whole chat
    assert (cache.num_nodes() == 1) == merge
    assert cache.match_len(history) == cache.total_size() == len(history) // 4 * 4


def test_identical_prompts_in_one_step_free_the_duplicates():
    m = make(page=1)
    a, b = Req("a", [1, 2, 3, 4, 5]), Req("b", [1, 2, 3, 4, 5])
    assert m.admit(a) and m.admit(b)
    m.allocate(a, 5)
    m.allocate(b, 5)
    m.cache_finished_req(a)
    m.cache_finished_req(b)  # its 5 slots duplicate a's: freed
    assert m.cache.total_size() == 5
    assert m.allocator.available_size() == 64 - 5
    m.check_memory()


def test_allocation_evicts_when_short_and_fails_cleanly_when_everything_is_locked():
    m = make(size=16, page=4)
    run_to_completion(m, Req(1, list(range(100, 112))), [])
    assert m.cache.total_size() == 12
    big = Req(2, list(range(200, 216)))
    assert m.admit(big)
    assert m.allocate(big, 16) is not None  # evicted the first request's 12 tokens
    assert m.cache.total_size() == 0
    m.check_memory()
    other = Req(3, [7, 7, 7, 7, 7])
    assert m.admit(other)
    assert m.allocate(other, 5) is None  # nothing free, nothing evictable
    m.check_memory()
    m.abort(big)
    m.abort(other)
    m.check_memory()
    assert m.allocator.available_size() == 16


def test_eagle_and_namespaces_flow_through():
    m = make(eagle=True)
    run_to_completion(m, Req(1, [1, 2, 3, 4, 5], extra_key="lora-a"), [6])
    assert m.cache.total_size() == 5  # 6 tokens with KV -> 5 bigram pairs
    other_ns = Req(2, [1, 2, 3, 4, 5], extra_key="lora-b")
    same_ns = Req(3, [1, 2, 3, 4, 9], extra_key="lora-a")
    assert m.admit(other_ns) and other_ns.cached_len == 0
    assert m.admit(same_ns) and same_ns.cached_len == 3  # pairs (1,2) (2,3) (3,4)
    m.check_memory()
    m.abort(other_ns)
    m.abort(same_ns)
    m.check_memory()


# --- bad inputs --------------------------------------------------------------------------------
def snapshot(m: CacheManager):
    a = m.allocator
    return (
        a._owned.tolist(),
        a._pages.count(),
        m.req_pool.available_size(),
        m.cache.format_tree(),
        m.cache.evictable_size(),
        dict(m.running),
    )


def test_a_request_longer_than_the_context_is_refused_unchanged():
    m = make(max_len=8)
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_context_len"):
        m.admit(Req(1, list(range(9))))
    assert snapshot(m) == before
    req = Req(2, list(range(8)))
    m.admit(req)
    req.output_ids.append(1)
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_context_len"):
        m.allocate(req, 9)
    assert snapshot(m) == before


@pytest.mark.parametrize("case", ["unadmitted", "twice", "negative", "beyond", "not_req", "empty"])
def test_lifecycle_bad_calls_raise_and_change_nothing(case):
    m = make()
    req = Req(1, [1, 2, 3])
    m.admit(req)
    before = snapshot(m)
    with pytest.raises((ValueError, TypeError)):
        {
            "unadmitted": lambda: m.cache_finished_req(Req(9, [1])),
            "twice": lambda: m.admit(req),
            "negative": lambda: m.allocate(req, -1),
            "beyond": lambda: m.allocate(req, 4),
            "not_req": lambda: m.abort("req"),
            "empty": lambda: m.admit(Req(2, [])),
        }[case]()
    assert snapshot(m) == before


def test_a_double_free_is_refused():
    m = make()
    run_to_completion(m, Req(1, [1, 2, 3]), [])
    tree_slots = m.cache.all_values()
    before = snapshot(m)
    with pytest.raises(ValueError, match="not handed out"):
        m.allocator.free(m.allocator.alloc(0).new_tensor([int(m.allocator.free_slots()[0])]))
    assert snapshot(m) == before
    m.allocator.free(tree_slots[:1])  # a real free of a tree slot breaks ownership...
    with pytest.raises(AssertionError, match="owned twice"):
        m.check_memory()  # ...and check_memory says so


def test_manager_refuses_a_cache_with_another_allocator():
    alloc = TokenToKVPoolAllocator(16)
    with pytest.raises(ValueError, match="allocator"):
        CacheManager(RadixCache(), alloc, ReqToTokenPool(1, 8))
    with pytest.raises(ValueError, match="page sizes"):
        CacheManager(RadixCache(4, allocator=alloc), alloc, ReqToTokenPool(1, 8))


# where a fault may strike: the allocator's and the tree's calls the manager makes
FAULT_SITES = {"alloc_extend", "alloc_extend_batch", "free", "match_parts", "insert_node"}


def test_a_failed_admit_returns_its_row():
    m = make(max_reqs=4)
    for i in range(6):  # an unhashable namespace is refused before a row is taken
        with pytest.raises(TypeError, match="extra_key"):
            m.admit(Req(i, [1, 2, 3], extra_key=["tenant"]))
    for i in range(6):  # a tree that fails mid-admit: the row comes back
        with inject_fault(m.cache, "match_parts", 0), pytest.raises(InjectedFault):
            m.admit(Req(i, [1, 2, 3]))
        m.check_memory()
    assert m.req_pool.available_size() == 4
    assert m.admit(Req(9, [1, 2, 3]))


def test_check_memory_notices_a_leaked_row():
    m = make(max_reqs=4)
    m.req_pool.alloc()  # taken by nobody
    with pytest.raises(AssertionError, match="row"):
        m.check_memory()


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_failing_free_in_cache_finished_req_leaks_nothing(fail_at):
    m = make(size=64, page=4)
    a, b = Req(1, list(range(10))), Req(2, list(range(14)))
    for r in (a, b):  # both compute the same 8 leading tokens: b's are duplicates
        assert m.admit(r)
        assert m.allocate(r, len(r.input_ids)) is not None
    m.cache_finished_req(a)
    before = m.allocator.available_size()
    with inject_fault(m.allocator, "free", fail_at), pytest.raises(InjectedFault):
        m.cache_finished_req(b)  # frees its tail (call 0), then its duplicates (call 1)
    m.check_memory()
    m.cache.check_integrity()
    m.abort(b)  # what it still owns goes back
    m.check_memory()
    assert m.allocator.available_size() > before


def test_evict_with_a_failing_allocator_changes_nothing():
    m = make(size=64, page=4)
    run_to_completion(m, Req(1, list(range(20))), [])
    before = snapshot(m)
    with inject_fault(m.allocator, "free", 0), pytest.raises(InjectedFault):
        m.cache.evict(9)
    assert snapshot(m) == before
    m.check_memory()
    assert m.cache.evict(9) == 20  # the request's whole leaf (whole-leaf eviction)


# --- the fuzzer --------------------------------------------------------------------------------
STEMS = [[], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]]
prompts = st.builds(
    lambda stem, suffix: STEMS[stem] + suffix,
    st.integers(0, len(STEMS) - 1),
    st.lists(st.integers(0, 2), max_size=12),
).filter(len)


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 4, 16]),
        pages=st.integers(3, 8),
        eagle=st.booleans(),
        policy=st.sampled_from(["lru", "lfu", "slru", "fifo"]),
    )
    def setup(self, page, pages, eagle, policy):
        self.m = make(
            size=page * pages, page=page, eagle=eagle, max_reqs=5, max_len=48, policy=policy
        )
        self.content: dict[int, tuple] = {}  # slot -> fingerprint of the KV it holds
        self.reqs: list[Req] = []
        self.rid = 0

    def fingerprint(self, req: Req, i: int) -> tuple:
        return (req.extra_key, tuple(req.all_ids[: i + 1]))

    def check_row(self, req: Req) -> None:
        row = self.m.req_pool.read(req.row, 0, req.kv_len).tolist()
        for i, slot in enumerate(row):
            assert self.content.get(slot) == self.fingerprint(req, i), (
                f"slot {slot} at position {i} of {req.rid} holds other KV"
            )

    def compute(self, req: Req, slots: torch.Tensor) -> None:
        start = req.kv_len - len(slots)
        for j, slot in enumerate(slots.tolist()):
            self.content[slot] = self.fingerprint(req, start + j)

    @rule(
        prompt=prompts,
        ns=st.sampled_from([None, "a"]),
        copies=st.integers(1, 2),
        limit=st.one_of(st.none(), st.integers(0, 24)),  # explicit prompt caching
        read=st.sampled_from([True, True, False]),  # False: it does not use the cache
    )
    def arrive(self, prompt, ns, copies, limit=None, read=True):
        for _ in range(copies):  # two copies: identical prompts in the same step
            self.rid += 1
            req = Req(self.rid, list(prompt), extra_key=ns, cache_limit=limit, cache_read=read)
            if self.m.admit(req):
                assert read or req.cached_len == 0
                self.check_row(req)
                self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 20))
    def step(self, data, chunk):
        req = data.draw(st.sampled_from(self.reqs))
        if req.kv_len < len(req.input_ids):  # prefill a chunk
            n = min(chunk, len(req.input_ids) - req.kv_len)
        elif len(req.all_ids) < 40:  # decode: feed back one sampled token
            req.output_ids.append(data.draw(st.integers(0, 2)))
            n = 1
        else:
            return
        slots = self.m.allocate(req, n)
        if slots is None:  # out of memory even after eviction: preempt it
            self.m.abort(req)
            self.reqs.remove(req)
            return
        self.compute(req, slots)
        self.m.cache_unfinished_req(req)
        self.check_row(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        if req.kv_len < len(req.input_ids):
            return
        self.m.cache_finished_req(req)
        self.reqs.remove(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 7))
    def step_all(self, data, chunk):
        """One engine step through the batched calls: every request prefills a chunk or
        decodes a token, all allocated at once, then cached at once."""
        draw = lambda: data.draw(st.integers(0, 2))  # noqa: E731
        batch, counts = step_plan(self.reqs, chunk, draw, 40)
        slots = self.m.allocate_batch(batch, counts)
        if slots is None:  # short for the whole batch: preempt the newest
            self.abort_req(self.reqs[-1])
            return
        for req, part in zip(batch, torch.split(slots, counts), strict=True):
            self.compute(req, part)
        self.m.cache_unfinished_batch(batch)
        for req in batch:
            self.check_row(req)

    @precondition(lambda self: self.reqs)
    @rule()
    def finish_all(self):
        done = [r for r in self.reqs if r.kv_len >= len(r.input_ids)]
        self.m.cache_finished_batch(done)
        self.reqs = [r for r in self.reqs if r.admitted]

    def abort_req(self, req):
        self.m.abort(req)
        self.reqs.remove(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        self.m.abort(req)
        self.reqs.remove(req)

    @rule(num=st.integers(0, 40))
    def evict(self, num):
        self.m.cache.evict(num)

    @rule()
    def double_free_is_refused(self):
        slots = self.m.cache.all_values()
        if not len(slots):
            return
        a = self.m.allocator
        owned_before = a._owned.copy()
        try:
            a.free(torch.cat([slots[:1], slots[:1]]))
        except ValueError:
            assert (a._owned == owned_before).all()
            return
        raise AssertionError("freeing a slot twice in one call must fail")

    @rule(
        data=st.data(),
        site=st.sampled_from(sorted(FAULT_SITES)),
        op=st.sampled_from(
            ["arrive", "step", "step_all", "finish", "finish_all", "abort", "evict"]
        ),
        after=st.integers(0, 2),
    )
    def fault(self, data, site, op, after):
        """Run an operation while a call it makes raises midway (fault injection); the
        invariant then proves nothing leaked, and the requests carry on."""
        target = self.m.cache if site in ("match_parts", "insert_node") else self.m.allocator
        with inject_fault(target, site, after):
            try:
                if op == "arrive":
                    self.arrive(data.draw(prompts), data.draw(st.sampled_from([None, "a"])), 1)
                elif op == "evict":
                    self.evict(data.draw(st.integers(1, 40)))
                elif op == "finish_all":
                    self.finish_all()
                elif self.reqs:
                    getattr(self, op)(data, 7) if op.startswith("step") else getattr(self, op)(data)
            except InjectedFault:
                pass
        self.reqs = [r for r in self.reqs if r.admitted]
        for r in self.reqs:
            self.check_row(r)

    @invariant()
    def memory_is_exact(self):
        if hasattr(self, "m"):
            self.m.check_memory()
            self.m.cache.check_integrity()


LifecycleMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=75,  # a maximum: hypothesis averages about 2/3 of it
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLifecycleMachine = pytest.mark.slow(LifecycleMachine.TestCase)


# --- the batched step API ----------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 4]),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=6),
    chunk=st.integers(1, 9),
    decodes=st.integers(0, 6),
)
def test_a_batched_step_does_what_the_per_request_calls_do(page, prompts, chunk, decodes):
    """The same steps run request by request and batched: identical slots, rows, tree and
    allocator, with the accounting identity after every step. (Frees are grouped alike
    on both sides: one free call returns pages to the stack in another order than
    several.)"""
    ms = [make(size=512, page=page, max_reqs=8, max_len=64) for _ in range(2)]
    reqs = [[Req(i, list(p)) for i, p in enumerate(prompts)] for _ in ms]
    for m, rs in zip(ms, reqs, strict=True):
        for r in rs:
            assert m.admit(r)
    for step in range(40):
        outs = []
        for batched, (m, rs) in enumerate(zip(ms, reqs, strict=True)):
            live = [r for r in rs if r.admitted]
            if not live:
                continue
            ns = [min(chunk, r.num_tokens - r.kv_len) for r in live]
            if batched:
                slots = m.allocate_batch(live, ns)
            else:
                slots = torch.cat([m.allocate(r, n) for r, n in zip(live, ns, strict=True)])
            outs.append(slots)
            done = [r for r in live if r.kv_len == r.num_tokens and len(r.output_ids) >= decodes]
            going = [r for r in live if r not in done]
            for r in going:
                if r.kv_len == r.num_tokens:
                    r.output_ids.append(step % 4)  # a sampled token, computed next step
            if batched:
                m.cache_unfinished_batch(going)
                m.cache_finished_batch(done)
            else:  # one free group each, as the batch calls use (same free order)
                with m.allocator.free_group():
                    for r in going:
                        m.cache_unfinished_req(r)
                with m.allocator.free_group():
                    for r in done:
                        m.cache_finished_req(r)
            m.check_memory()
        if len(outs) == 2:
            assert torch.equal(outs[0], outs[1])
        a, b = ms
        assert content(a.cache) == content(b.cache)
        assert np.array_equal(a.allocator._owned, b.allocator._owned)
        assert np.array_equal(a.req_pool.array, b.req_pool.array)


def test_allocate_batch_is_all_or_nothing_and_checks_every_request():
    m = make(size=32, page=4, max_reqs=4, max_len=64)
    a, b = Req("a", list(range(20))), Req("b", list(range(100, 120)))
    assert m.admit(a) and m.admit(b)
    before = m.allocator.available_size()
    for bad, err in (
        (([a, b], [4]), ValueError),  # lengths differ
        (([a, a], [1, 1]), ValueError),  # twice
        (([a, b], [1, -1]), ValueError),
        (([a, b], [1, 21]), ValueError),  # more than it has
        (([a, Req("x", [1])], [1, 1]), ValueError),  # not admitted
        (([a, b], [1, 1.0]), ValueError),
    ):
        with pytest.raises(err):
            m.allocate_batch(*bad)
        assert m.allocator.available_size() == before and a.kv_len == b.kv_len == 0
    assert m.allocate_batch([a, b], [20, 20]) is None  # 40 > 32: nothing handed out
    assert m.allocator.available_size() == before and a.kv_len == b.kv_len == 0
    m.check_memory()
    slots = m.allocate_batch([a, b], [13, 13])
    assert len(slots) == 26 and a.kv_len == b.kv_len == 13
    assert m.req_pool.read(b.row, 0, 13).tolist() == slots[13:].tolist()
    m.check_memory()
