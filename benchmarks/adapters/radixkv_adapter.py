"""radixkv on the shared workloads. Run by ``benchmarks/run.py`` (or alone):

python benchmarks/adapters/radixkv_adapter.py --workloads a,b,c,d,e,f --page-sizes 1,16
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

from radixkv import RadixCache, RadixKey
from radixkv.events import EventCollector
from radixkv.kvcache.lifecycle import CacheManager, Req
from radixkv.kvcache.memory import TokenToKVPoolAllocator
from radixkv.kvcache.req_table import ReqToTokenPool
from radixkv.units import div_ceil

# Set by ``bench_tree.py --events``: caches report KV events to a sink that keeps them
# (what a publisher would encode), to measure what the hooks cost.
EVENTS = False


class _Sink:
    def __init__(self) -> None:
        self.n = 0

    def stored(self, block_hashes, parent_hash, token_ids, block_size, extra_key) -> None:
        self.n += len(block_hashes)

    def removed(self, block_hashes) -> None:
        self.n += len(block_hashes)

    def cleared(self) -> None:
        self.n += 1


# The engine's configuration: LRU with chain merging and precise eviction, both opt-in
# (the default cache keeps SGLang's node contract and whole-leaf eviction).
OPT_INS = {"merge_chains": True, "precise": True}


def _cache(page_size: int = 1, sink=None, **kw) -> RadixCache:  # type: ignore[no-untyped-def]
    sink = sink if sink is not None else (_Sink() if EVENTS else None)
    return RadixCache(page_size=page_size, event_sink=sink, **OPT_INS, **kw)


def _keys(seqs: list[list[int]]) -> list[RadixKey]:
    return [RadixKey(array("q", s)) for s in seqs]


def _values(seqs: list[list[int]]) -> list[torch.Tensor]:
    out, nxt = [], 0
    for s in seqs:
        out.append(torch.arange(nxt, nxt + len(s), dtype=torch.int64))
        nxt += len(s)
    return out


def match_insert(seqs: list[list[int]], page: int, events: bool = False) -> tuple[float, dict]:
    """(a)/(b): per request, match then insert (keys and values built beforehand). With
    ``events``: the engine's sink as serve sets it up (`EventCollector` keeping token ids
    as arrays, which the publisher's thread encodes), drained into a batch per request."""
    keys, values = _keys(seqs), _values(seqs)
    sink = EventCollector(arrays=True) if events else None
    cache = _cache(page, sink)
    hit = 0
    t0 = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        hit += cache.match_prefix(key).prefix_len
        cache.insert(key, value)
        if sink is not None:
            sink.drain()
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def evict_calls(page: int) -> tuple[float, dict]:
    """(c): evict(1000) with ~5,000 leaves, refilling ~1,024 tokens between calls."""
    initial, batches = workloads.eviction_leaves()
    cache = _cache(page)
    for key in _keys(initial):
        cache.insert(key)
    refills = [_keys(b) for b in batches]
    total = 0.0
    for batch in refills:
        for key in batch:
            cache.insert(key)
        t0 = time.perf_counter()
        cache.evict(1000)
        total += time.perf_counter() - t0
    return total / len(refills) * 1e6, {"nodes": cache.num_nodes()}


def chain_match(page: int, matches: int = 1000) -> tuple[float, dict]:
    """(d): match a 32k-token prompt stored as a 256-node chain."""
    chain = workloads.deep_chain()
    cache = _cache(page)
    for key in _keys(chain):
        cache.insert(key)
    query = _keys(chain[-1:])[0]
    t0 = time.perf_counter()
    for _ in range(matches):
        cache.match_prefix(query)
    return (time.perf_counter() - t0) / matches * 1e6, {"nodes": cache.num_nodes()}


def request_path(page: int, tight: bool, alive: int = 16) -> tuple[float, dict]:
    """(e): per request: lookup, allocate the rest, insert (as after prefill), and when
    more than ``alive`` are running, finish the oldest (free). Tight: 1,024 pages."""
    seqs = workloads.request_path()
    size = 1024 * page if tight else 1 << 21
    alloc = TokenToKVPoolAllocator(size, page)
    mgr = CacheManager(
        _cache(page, allocator=alloc),
        alloc,
        ReqToTokenPool(alive + 1, max(map(len, seqs)) + page),
    )
    reqs = [Req(i, array("q", s)) for i, s in enumerate(seqs)]  # keys built before timing
    for r in reqs:
        r.token_array()
    window: deque[Req] = deque()
    hit = 0
    t0 = time.perf_counter()
    for r in reqs:
        mgr.admit(r)
        if mgr.allocate(r, len(r.input_ids) - r.kv_len) is None:
            raise RuntimeError("pool too small for the window")
        mgr.cache_unfinished_req(r)
        hit += r.cached_len
        window.append(r)
        if len(window) > alive:
            mgr.cache_finished_req(window.popleft())
    while window:
        mgr.cache_finished_req(window.popleft())
    dt = time.perf_counter() - t0
    mgr.check_memory()
    return dt / len(reqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def scheduler_step(page: int, events: bool = False) -> tuple[float, dict]:
    """(g): µs per scheduler step of 64 requests (``workloads.scheduler_steps``): admit
    the arrivals; one allocation for every chunk and decode of the step; after the
    forward, cache the chunks in one call and the finished requests in another."""
    prompts, outputs = workloads.scheduler_steps()
    alloc = TokenToKVPoolAllocator(1 << 21, page)
    rows = workloads.STEP_PHASES * workloads.STEP_ADMITS + 1
    longest = max(map(len, prompts)) + len(outputs[0]) + page
    sink = EventCollector(arrays=True) if events else None
    mgr = CacheManager(_cache(page, sink, allocator=alloc), alloc, ReqToTokenPool(rows, longest))
    reqs = [Req(i, s) for i, s in enumerate(prompts)]
    for r in reqs:
        r.token_array()
    hit, total, timed = 0, 0.0, 0
    gc.collect()  # the setup's garbage is not the steps' (else a full collection, ~0.1 s
    # in a process that imported torch, lands in the timed steps or not by chance)
    for steady, new, second, decode, finish in workloads.step_batches(reqs):
        t0 = time.perf_counter()
        for r in new:
            mgr.admit(r)
            hit += r.cached_len
        batch = new + second + decode
        counts = [div_ceil(len(r.input_ids) - r.kv_len, 2) for r in new]
        counts += [len(r.input_ids) - r.kv_len for r in second] + [1] * len(decode)
        if mgr.allocate_batch(batch, counts) is None:
            raise RuntimeError("pool too small")
        # (the forward pass runs here) then the sampled tokens come back
        for r in second + decode:
            r.output_ids.append(outputs[r.rid][len(r.output_ids)])
        mgr.cache_unfinished_batch(new + second)
        mgr.cache_finished_batch(finish)
        if sink is not None:
            sink.drain()  # the step's events, one batch (what the engine publishes)
        if steady:
            total += time.perf_counter() - t0
            timed += 1
    mgr.check_memory()
    return total / timed * 1e6, {"hit_rate": hit / sum(map(len, prompts))}


def memory_per_token() -> dict:
    """(f): RSS growth per cached token, 1M tokens in 10k leaves."""
    leaves = workloads.memory_leaves()
    first = next(leaves)  # builds the shared prefixes before the baseline
    gc.collect()
    base = rss_bytes()
    cache = _cache()
    nxt = 0
    for seq in itertools.chain([first], leaves):
        cache.insert(RadixKey(array("q", seq)), torch.arange(nxt, nxt + len(seq)))
        nxt += len(seq)
    gc.collect()
    grown = rss_bytes() - base
    assert cache.total_size() == workloads.CACHED_TOKENS_F
    return {"bytes_per_token": grown / cache.total_size(), "nodes": cache.num_nodes()}


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    a, b = workloads.shared_system_prompt(), workloads.multi_turn_chat()
    per_page = {
        "a": lambda p: match_insert(a, p),
        "b": lambda p: match_insert(b, p),
        "c": evict_calls,
        "d": chain_match,
        "g": scheduler_step,
    }
    with_events = {  # KV events on, as a routed fleet runs
        "a": lambda p: match_insert(a, p, events=True),
        "b": lambda p: match_insert(b, p, events=True),
        "g": lambda p: scheduler_step(p, events=True),
    }
    return run_suite(wl, pages, repeats, per_page, request_path, memory_per_token, with_events)


if __name__ == "__main__":
    adapter_main("radixkv", run)
