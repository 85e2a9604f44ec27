"""SGLang 0.5.23's RadixCache on the shared workloads. Runs in SGLang's own virtual
environment (built by ``benchmarks/peers/setup.sh sglang``); imports nothing from radixkv.

    ~/.cache/radixkv-peers/sglang/bin/python benchmarks/adapters/sglang_adapter.py
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from array import array
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import workloads
from harness import adapter_main, rss_bytes, run_suite
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey


class NullAllocator:
    """What the tree frees goes nowhere (workloads a-d, f): 0.5.23's evict() calls
    free_segment()."""

    device = torch.device("cpu")

    def free(self, t):  # type: ignore[no-untyped-def]
        pass

    def free_segment(self, t, start_pos=0):  # type: ignore[no-untyped-def]
        pass


def init_params(page: int, allocator=None, **extra) -> CacheInitParams:  # type: ignore[no-untyped-def]
    """An LRU cache's parameters, as both SGLang caches take them."""
    return CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator or NullAllocator(),
        page_size=page,
        eviction_policy="lru",
        **extra,
    )


def new_cache(page: int, allocator=None) -> RadixCache:  # type: ignore[no-untyped-def]
    return RadixCache(init_params(page, allocator))


def _keys(seqs):  # type: ignore[no-untyped-def]
    return [RadixKey(array("q", s)) for s in seqs]


def _values(seqs):  # type: ignore[no-untyped-def]
    out, nxt = [], 0
    for s in seqs:
        out.append(torch.arange(nxt, nxt + len(s), dtype=torch.int64))
        nxt += len(s)
    return out


def match_insert(seqs, page, make=new_cache):  # type: ignore[no-untyped-def]
    keys, values = _keys(seqs), _values(seqs)
    cache = make(page)
    hit = 0
    t0 = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        # 0.5.23's match returns the length and node only (radixkv's also builds the indices)
        hit += cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
        cache.insert(InsertParams(key=key, value=value))
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def evict_calls(page, make=new_cache):  # type: ignore[no-untyped-def]
    initial, batches = workloads.eviction_leaves()
    cache = make(page)
    for key in _keys(initial):
        cache.insert(InsertParams(key=key, value=torch.tensor(list(key.token_ids))))
    refills = [_keys(b) for b in batches]
    total = 0.0
    for batch in refills:
        for key in batch:
            cache.insert(InsertParams(key=key, value=torch.tensor(list(key.token_ids))))
        t0 = time.perf_counter()
        cache.evict(EvictParams(num_tokens=1000))
        total += time.perf_counter() - t0
    return total / len(refills) * 1e6, {}


def chain_match(page, matches=1000, make=new_cache, indices=False):  # type: ignore[no-untyped-def]
    """``indices``: also build the indices tensor (for a match that returns none)."""
    chain = workloads.deep_chain()
    cache = make(page)
    for key, value in zip(_keys(chain), _values(chain), strict=True):
        cache.insert(InsertParams(key=key, value=value))
    query = _keys(chain[-1:])[0]
    t0 = time.perf_counter()
    for _ in range(matches):
        r = cache.match_prefix(MatchPrefixParams(key=query))
        if indices:
            cache.path_device_indices(r.last_device_node)
    return (time.perf_counter() - t0) / matches * 1e6, {}


def request_path(page, tight, alive=16):  # type: ignore[no-untyped-def]
    """(e) as SGLang's scheduler does it: match (all but the last token), lock, allocate
    whole pages (evicting when short), insert the computed pages (cache_unfinished_req),
    re-match and move the lock; on finish unlock and free the unaligned tail."""
    seqs = workloads.request_path()
    size = 1024 * page if tight else 1 << 21
    alloc = (
        PagedTokenToKVPoolAllocator(size, page, torch.int64, "cpu", None, False)
        if page > 1
        else TokenToKVPoolAllocator(size, torch.int64, "cpu", None, False)
    )
    cache = new_cache(page, alloc)
    keys = _keys(seqs)
    window: deque = deque()
    hit = 0
    t0 = time.perf_counter()
    for key in keys:
        n = len(key)
        m = cache.match_prefix(MatchPrefixParams(key=key[: n - 1]))
        node = m.last_device_node
        prefix = (
            cache.path_device_indices(node)
            if m.device_prefix_len
            else torch.empty(0, dtype=torch.int64)
        )
        cache.inc_lock_ref(node)
        need = -(-(n - len(prefix)) // page) * page
        own = alloc.alloc(need)
        if own is None:
            cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
            own = alloc.alloc(need)
            if own is None:
                raise RuntimeError("pool too small for the window")
        hit += len(prefix)
        slots = torch.cat([prefix, own])
        aligned = n // page * page
        res = cache.insert(InsertParams(key=key[:aligned], value=slots[:aligned]))
        if res.prefix_len > len(prefix):
            alloc.free(slots[len(prefix) : res.prefix_len])
        m2 = cache.match_prefix(MatchPrefixParams(key=key[:aligned]))
        cache.inc_lock_ref(m2.last_device_node)
        cache.dec_lock_ref(node)
        window.append((m2.last_device_node, slots[aligned:]))
        if len(window) > alive:
            last, tail = window.popleft()
            cache.dec_lock_ref(last)
            if len(tail):
                alloc.free(tail)
    while window:
        last, tail = window.popleft()
        cache.dec_lock_ref(last)
        if len(tail):
            alloc.free(tail)
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def memory_per_token(make=new_cache):  # type: ignore[no-untyped-def]
    leaves = workloads.memory_leaves()
    first = next(leaves)
    gc.collect()
    base = rss_bytes()
    cache = make(1)
    nxt = 0
    for seq in itertools.chain([first], leaves):
        cache.insert(
            InsertParams(key=RadixKey(array("q", seq)), value=torch.arange(nxt, nxt + len(seq)))
        )
        nxt += len(seq)
    gc.collect()
    grown = rss_bytes() - base
    size = cache.total_size()  # the unified cache returns (device, host)
    return {"bytes_per_token": grown / (size[0] if isinstance(size, tuple) else size)}


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    a, b = workloads.shared_system_prompt(), workloads.multi_turn_chat()
    per_page = {
        "a": lambda p: match_insert(a, p),
        "b": lambda p: match_insert(b, p),
        "c": evict_calls,
        "d": chain_match,
    }
    return run_suite(wl, pages, repeats, per_page, request_path, memory_per_token)


if __name__ == "__main__":
    adapter_main("sglang", run)
