"""The sliding-window lifecycle's state machine and its helpers (the arena's and
the managers' machines subclass it)."""

from __future__ import annotations

import torch
from helpers import step_plan
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import RadixCache
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.kvcache.window.component import WindowKV
from radixkv.kvcache.window.slots import WindowSlots
from support.faults import InjectedFault, inject_fault


def make(window=4, size=256, wsize=64, page=1, max_reqs=4, max_len=96, policy="lru",
         mode="merge", retain="ends"):  # fmt: skip
    alloc = TokenToKVPoolAllocator(size, page)
    walloc = TokenToKVPoolAllocator(wsize, page)
    comp = WindowKV(window, walloc, retain)
    cache = RadixCache(page, policy, alloc, eviction_mode=mode, components=(comp,))
    slots = WindowSlots(comp, walloc, max_reqs, max_len, window)
    return CacheManager(cache, alloc, ReqToTokenPool(max_reqs, max_len), slots)


def serve(m: CacheManager, ids: list[int], chunk: int = 8, out: int = 0, **kw) -> Req:
    req = Req(object(), list(ids), **kw)
    assert m.admit(req)
    while req.kv_len < len(req.input_ids):
        assert m.allocate(req, min(chunk, len(req.input_ids) - req.kv_len)) is not None
        m.cache_unfinished_req(req)
        m.check_memory()
    for t in range(out):
        req.output_ids.append(t)
        assert m.allocate(req, 1) is not None
        m.check_memory()
    m.cache_finished_req(req)
    m.check_memory()
    return req


def seq(start, n):
    return list(range(start, start + n))


# --- the fuzzer --------------------------------------------------------------------------------
STEMS = [[], seq(5, 12), seq(5, 6) + seq(40, 10)]


prompts = st.builds(
    lambda stem, suffix: STEMS[stem] + suffix,
    st.integers(0, len(STEMS) - 1),
    st.lists(st.integers(0, 2), max_size=14),
).filter(len)


SITES = ["alloc_extend", "alloc_extend_batch", "free", "match_parts", "insert_node"]


class WindowLifecycleMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 7),
        pages=st.integers(6, 16),
        wpages=st.integers(5, 12),
        mode=st.sampled_from(["merge", "precise", "leaf"]),
        retain=st.sampled_from(["ends", "all"]),
    )
    def setup(self, page, window, pages, wpages, mode, retain="ends"):
        self.m = self.manager(page, window, pages, wpages, mode, retain)
        self.full: dict[int, tuple] = {}  # slot -> fingerprint of the KV it holds
        self.win: dict[int, tuple] = {}
        self.reqs: list[Req] = []
        self.rid = 0

    def manager(self, page, window, pages, wpages, mode, retain) -> CacheManager:
        """The memory under test: two slot spaces of their own."""
        wsize = max(wpages * page, 4 * (window + 3 * page) + 8)  # every request's peak fits
        return make(window, pages * page * 4, wsize, page, 4, 64, "lru", mode, retain)

    def fp(self, req: Req, i: int) -> tuple:
        return tuple(req.all_ids[: i + 1])

    def check_req(self, req: Req) -> None:
        row = self.m.req_pool.read(req.row, 0, req.kv_len).tolist()
        for i, slot in enumerate(row):
            assert self.full.get(slot) == self.fp(req, i), f"full slot {slot} at {i}"
        w = self.m.manager("window")
        for i in range(max(0, req.kv_len - w.window + 1), req.kv_len):
            slot = int(w.table[req.row, i])
            assert self.win.get(slot) == self.fp(req, i), f"window slot {slot} at {i}"

    def compute(self, req: Req, slots: torch.Tensor) -> None:
        start = req.kv_len - len(slots)
        wrow = self.m.manager("window").table[req.row]
        for j, slot in enumerate(slots.tolist()):
            self.full[slot] = self.win[int(wrow[start + j])] = self.fp(req, start + j)

    @rule(prompt=prompts, marks=st.lists(st.integers(1, 20), max_size=2))
    def arrive(self, prompt, marks):
        self.rid += 1
        req = Req(self.rid, list(prompt), boundaries=tuple(marks))
        if self.m.admit(req):
            self.check_req(req)
            self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(chunk=st.integers(1, 9), data=st.data())
    def step_all(self, chunk, data):
        draw = lambda: data.draw(st.integers(0, 2))  # noqa: E731
        batch, counts = step_plan(self.reqs, chunk, draw, 44)
        slots = self.m.allocate_batch(batch, counts)
        if slots is None:  # short: preempt the newest
            self.m.abort(self.reqs.pop())
            return
        self.run(list(zip(batch, counts, strict=True)), slots)
        self.m.cache_unfinished_batch(batch)

    def run(self, plan: list[tuple[Req, int]], slots: torch.Tensor) -> None:
        """The model's step: KV for each planned request's new tokens."""
        for (req, _), part in zip(plan, torch.split(slots, [n for _, n in plan]), strict=True):
            self.compute(req, part)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step_one(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        if req.kv_len < len(req.input_ids):
            n = min(5, len(req.input_ids) - req.kv_len)
        elif req.num_tokens < 44:
            req.output_ids.append(data.draw(st.integers(0, 2)))
            n = 1
        else:
            return
        slots = self.m.allocate(req, n)
        if slots is None:
            self.m.abort(req)
            self.reqs.remove(req)
            return
        self.run([(req, n)], slots)
        self.m.cache_unfinished_req(req)

    @precondition(lambda self: self.reqs)
    @rule()
    def finish_all(self):
        done = [r for r in self.reqs if r.kv_len >= len(r.input_ids) and r.kv_len == r.num_tokens]
        for r in done:  # each has its last token (a recurrent manager snapshots its end)
            self.m.finishing(r)
        self.m.cache_finished_batch(done)
        self.reqs = [r for r in self.reqs if r.admitted]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        self.m.abort(req)
        self.reqs.remove(req)

    @rule(n=st.integers(1, 30), window=st.booleans())
    def evict(self, n, window):
        if window:
            self.m.manager("window").component.evict(n)
        else:
            self.m.cache.evict(n)

    @rule(
        data=st.data(),
        site=st.sampled_from(SITES),
        space=st.sampled_from(["full", "window", "states"]),
        op=st.sampled_from(["arrive", "step_all", "step_one", "finish_all", "abort"]),
        after=st.integers(0, 2),
    )
    def fault(self, data, site, space, op, after):
        """An operation while a call it makes raises midway: nothing leaks, and every
        request still reads its own KV."""
        with inject_fault(*self.target(site, space), after):
            try:
                if op == "arrive":
                    self.arrive(data.draw(prompts), [])
                elif op == "finish_all":
                    self.finish_all()
                elif op == "step_all" and self.reqs:
                    self.step_all(3, data)
                elif self.reqs:
                    getattr(self, op)(data)
            except InjectedFault:
                pass
        self.reqs = [r for r in self.reqs if r.admitted]
        self.m.manager("window").component.flush()  # a failed window free is retried

    def target(self, site: str, space: str) -> tuple[object, str]:
        """What a fault strikes: the tree's call, or the allocator of a space (a space
        this memory lacks: the window's)."""
        if site in ("match_parts", "insert_node"):
            return self.m.cache, site
        return (self.m.allocator if space == "full" else self.m.manager("window").allocator), site

    @invariant()
    def exact(self):
        if hasattr(self, "m"):
            self.m.check_memory()
            self.m.cache.check_integrity()
            for r in self.reqs:
                self.check_req(r)
