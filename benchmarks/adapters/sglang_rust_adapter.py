"""SGLang 0.5.23's production prefix cache, ``UnifiedRadixCache`` with its Rust tree core
(``tree_core_backend="rust"``), on the shared workloads (a)-(d) and (f). Runs in SGLang's
own virtual environment (``../shared/peers/setup.sh sglang``); imports nothing from
radixkv.

    SGLANG_PEER_UNIFIED=1 ~/.cache/radixkv-peers/sglang/bin/python \
        benchmarks/adapters/sglang_rust_adapter.py

(``SGLANG_PEER_UNIFIED=1`` must be in the environment: the peer's shim loads at
interpreter start and would otherwise stub the module this cache imports.)

Its ``match_prefix`` returns lengths and node ids but no indices tensor; (d) adds
``path_device_indices`` so it does what radixkv's match does. Its ``insert`` frees the
duplicated prefix of the value itself (into a null allocator here). (e) is not run: the
production scheduler's request path around this cache is not reproduced.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import time
from array import array
from pathlib import Path

if os.environ.get("SGLANG_PEER_UNIFIED") != "1":
    sys.exit("run with SGLANG_PEER_UNIFIED=1 in the environment (see the docstring)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import workloads
from harness import adapter_main, rss_bytes, run_suite
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


class NullAllocator:
    device = torch.device("cpu")

    def free(self, t):  # type: ignore[no-untyped-def]
        pass

    def free_segment(self, t, start_pos=0):  # type: ignore[no-untyped-def]
        pass


def new_cache(page: int) -> UnifiedRadixCache:
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=NullAllocator(),
            page_size=page,
            eviction_policy="lru",
            tree_components=(ComponentType.FULL,),
            tree_core_backend="rust",
        )
    )
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore", "not the Rust core"
    return cache


def _keys(seqs):  # type: ignore[no-untyped-def]
    return [RadixKey(array("q", s)) for s in seqs]


def _values(seqs):  # type: ignore[no-untyped-def]
    out, nxt = [], 0
    for s in seqs:
        out.append(torch.arange(nxt, nxt + len(s), dtype=torch.int64))
        nxt += len(s)
    return out


def match_insert(seqs, page):  # type: ignore[no-untyped-def]
    keys, values = _keys(seqs), _values(seqs)
    cache = new_cache(page)
    hit = 0
    t0 = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        hit += cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len
        cache.insert(InsertParams(key=key, value=value))
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def evict_calls(page):  # type: ignore[no-untyped-def]
    initial, batches = workloads.eviction_leaves()
    cache = new_cache(page)
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


def chain_match(page, matches=1000):  # type: ignore[no-untyped-def]
    chain = workloads.deep_chain()
    cache = new_cache(page)
    for key, value in zip(_keys(chain), _values(chain), strict=True):
        cache.insert(InsertParams(key=key, value=value))
    query = _keys(chain[-1:])[0]
    t0 = time.perf_counter()
    for _ in range(matches):
        r = cache.match_prefix(MatchPrefixParams(key=query))
        cache.path_device_indices(r.last_device_node)  # the indices radixkv's match builds
    return (time.perf_counter() - t0) / matches * 1e6, {}


def memory_per_token():  # type: ignore[no-untyped-def]
    leaves = workloads.memory_leaves()
    first = next(leaves)
    gc.collect()
    base = rss_bytes()
    cache = new_cache(1)
    nxt = 0
    for seq in itertools.chain([first], leaves):
        cache.insert(
            InsertParams(key=RadixKey(array("q", seq)), value=torch.arange(nxt, nxt + len(seq)))
        )
        nxt += len(seq)
    gc.collect()
    grown = rss_bytes() - base
    size = cache.total_size()
    return {"bytes_per_token": grown / (size[0] if isinstance(size, tuple) else size)}


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    a, b = workloads.shared_system_prompt(), workloads.multi_turn_chat()
    per_page = {
        "a": lambda p: match_insert(a, p),
        "b": lambda p: match_insert(b, p),
        "c": evict_calls,
        "d": chain_match,
    }
    return run_suite([w for w in wl if w != "e"], pages, repeats, per_page, None, memory_per_token)


if __name__ == "__main__":
    adapter_main("sglang_rust", run)
