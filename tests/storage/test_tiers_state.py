"""The host pool and the store as a state machine: requests promote pages from the lower
tiers, evictions demote them, write policies send them to an in-memory store, and after
every step each page's KV is checked where the bookkeeping says it lives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import content
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv import RadixCache, RadixKey
from radixkv.engine.engine import Engine
from radixkv.kvcache.lifecycle import CacheManager
from radixkv.kvcache.memory import KVPool, TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.storage import MemoryStore
from radixkv.storage.tier import WRITE_POLICIES, KVTiers


def value_of(prefix: tuple) -> float:
    """The KV a token "computes": a function of its whole prefix."""
    return float(hash(prefix) % 100_003)


STEMS = [[], [7, 7, 8, 8, 9, 9, 1, 1], [3, 1, 4, 1, 5, 9, 2, 6]]
prompts = st.builds(
    lambda stem, tail: STEMS[stem] + tail,
    st.integers(0, 2),
    st.lists(st.integers(0, 3), min_size=1, max_size=10),
)


class TiersMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 4]),
        device_pages=st.integers(4, 10),
        host_pages=st.integers(0, 6),
        policy=st.sampled_from(WRITE_POLICIES),
        with_store=st.booleans(),
    )
    def setup(self, page, device_pages, host_pages, policy, with_store):
        size = page * device_pages
        self.alloc = TokenToKVPoolAllocator(size, page)
        self.cache = RadixCache(page, allocator=self.alloc)
        self.kv = KVPool(1, 1, 1, size)
        self.store = MemoryStore() if with_store else None
        self.tiers = KVTiers(self.kv, self.cache, b"f" * 16, self.store, host_pages, policy)
        self.mgr = CacheManager(self.cache, self.alloc, ReqToTokenPool(2, 64))
        self.page = page
        self.expected: dict[bytes, list[float]] = {}  # key -> the page's values

    def alloc_fn(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.cache.evict(n - self.alloc.available_size())
            slots = self.alloc.alloc(n)
        return slots

    @rule(prompt=prompts)
    def request(self, prompt):
        p = self.page
        usable = len(prompt) - 1
        self.tiers.load(prompt, None, usable, self.alloc_fn)
        key = RadixKey(prompt)
        hit = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(hit.last_node)
        n = len(prompt) - len(prompt) % p
        need = n - hit.prefix_len
        slots = self.alloc_fn(need) if need > 0 else torch.empty(0, dtype=torch.int64)
        self.cache.dec_lock_ref(hit.last_node)
        if slots is None:
            return  # the pool cannot hold it: nothing computed
        for j, slot in enumerate(slots.tolist()):  # "compute" the uncached tokens
            self.kv.k[0][slot] = value_of(tuple(prompt[: hit.prefix_len + j + 1]))
            self.kv.v[0][slot] = -value_of(tuple(prompt[: hit.prefix_len + j + 1]))
        all_slots = torch.cat((hit.indices, slots))
        self.cache.insert(key[:n], all_slots)
        hashes = self.tiers.page_hashes(prompt, None, n // p)
        for i, h in enumerate(hashes):
            self.expected[self.tiers._key(h)] = [
                value_of(tuple(prompt[: i * p + t + 1])) for t in range(p)
            ]
        self.tiers.save(prompt[:n], None, self.cache.match_prefix(key[:n]).indices)
        self.tiers.flush()

    @rule(prompt=prompts)
    def load_without_room(self, prompt):
        """A load whose slots cannot be had (an engine loading ahead that may not evict
        what returns sooner): nothing moves; the host pool keeps its pages."""
        before = self.tiers.host_keys()
        assert self.tiers.load(prompt, None, len(prompt) - 1, lambda n: None) == 0
        assert self.tiers.host_keys() == before

    @rule(n=st.integers(1, 12))
    def evict(self, n):
        self.cache.evict(n)
        self.tiers.flush()

    @invariant()
    def every_page_holds_its_kv(self):
        if not hasattr(self, "tiers"):
            return
        self.tiers.flush()  # the writer thread is done with the store
        self.tiers.check()
        self.cache.check_integrity()
        self.alloc.check()
        for (_, pages), slots in content(self.cache).items():  # device
            tokens = tuple(t for pg in pages for t in pg)
            got = self.kv.k[0][torch.tensor(slots)].reshape(-1).tolist()
            want = [value_of(tokens[: len(tokens) - self.page + t + 1]) for t in range(self.page)]
            assert got == want, "a device page holds another prefix's KV"
        for key, page in self.tiers.host_keys().items():  # host
            got = self.tiers.host[page, 0, 0].reshape(-1).tolist()
            assert got == self.expected[key], "a host page holds another prefix's KV"
        if self.store is not None:  # store
            for key, value in self.store.data.items():
                payload = self.tiers.codec.decode(key[16:], value)
                assert payload is not None
                pages = self.tiers._as_pages(np.frombuffer(payload, np.uint8).copy().reshape(1, -1))
                assert pages[0, 0, 0].reshape(-1).tolist() == self.expected[key]
        owned = len(self.cache.all_values()) + self.alloc.available_size()
        assert owned + self.alloc.reserved_tail_size() == self.alloc.size


TiersMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestTiersMachine = pytest.mark.slow(TiersMachine.TestCase)


def test_a_host_tier_brings_back_what_the_device_evicted():
    prompts = [[g] * 40 + [q] for g in range(6) for q in range(3)]  # 6 prefixes, 240 tokens
    cold = Engine("random", page_size=4, kv_tokens=96, max_context_len=64)
    want = cold.generate(prompts, max_new_tokens=4, ignore_eos=True)
    tiered = Engine("random", page_size=4, kv_tokens=96, max_context_len=64, host_tokens=512,
                    check_memory=True)  # fmt: skip
    got = tiered.generate(prompts, max_new_tokens=4, ignore_eos=True)
    again = tiered.generate(prompts, max_new_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in want.outputs]
    st_ = tiered.tier.stats
    assert st_.demoted_pages > 0 and st_.host_hit_tokens > 0
    assert again.stats.cached_tokens > got.stats.cached_tokens  # the host tier paid off
    tiered.tier.check()


class _GatedStore(MemoryStore):
    """A memory store whose writes wait at a gate once they are done, so a test can run
    the engine's side between a write landing and the writer thread's bookkeeping."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.landed, self.gate = threading.Event(), threading.Event()

    def set(self, keys, values):
        n = super().set(keys, values)
        self.landed.set()
        assert self.gate.wait(10)
        return n


def test_a_bad_page_found_while_a_write_lands_is_still_rewritten():
    """The writer thread and the engine thread share the pages to rewrite. A write that
    landed before a read found its page bad (someone overwrote it meanwhile) must not
    unmark it: the old code dropped the mark after every write, so the bad page was
    never written again (the store said it had it)."""
    page = 2
    alloc = TokenToKVPoolAllocator(32, page)
    cache = RadixCache(page, allocator=alloc)
    kv = KVPool(1, 1, 1, 32)
    store = _GatedStore()
    tiers = KVTiers(kv, cache, b"f" * 16, store, 0, "write_through")
    prompt = [5, 6, 7, 8, 9]
    slots = alloc.alloc(4)
    kv.k[0][slots] = torch.arange(1.0, 5.0).view(4, 1, 1)
    cache.insert(RadixKey(prompt[:4]), slots)
    tiers.save(prompt[:4], None, slots)  # the writer takes it and writes both pages
    assert store.landed.wait(10)
    keys = [tiers._key(h) for h in tiers.page_hashes(prompt, None, 2)]
    store.data[keys[1]] = b"not a page"  # overwritten after the write landed
    cache.evict(cache.evictable_size())
    assert tiers.load(prompt, None, 4, alloc.alloc) == page  # page 2 is refused: bad
    store.gate.set()  # the writer finishes its bookkeeping now
    tiers.flush()
    slots = alloc.alloc(2)  # the page is computed again and saved: it must be rewritten
    kv.k[0][slots] = torch.tensor([3.0, 4.0]).view(2, 1, 1)
    got = cache.match_prefix(RadixKey(prompt[:2])).indices
    cache.insert(RadixKey(prompt[:4]), torch.cat((got, slots)))
    tiers.save(prompt[:4], None, torch.cat((got, slots)))
    tiers.flush()
    assert store.data[keys[1]] != b"not a page"
    tiers.codec.decode(tiers.page_hashes(prompt, None, 2)[1], store.data[keys[1]])  # valid
