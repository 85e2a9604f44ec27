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

import os
import sys
from pathlib import Path

if os.environ.get("SGLANG_PEER_UNIFIED") != "1":
    sys.exit("run with SGLANG_PEER_UNIFIED=1 in the environment (see the docstring)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workloads
from harness import adapter_main, run_suite
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang_adapter import NullAllocator, chain_match, evict_calls, match_insert, memory_per_token


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


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    a, b = workloads.shared_system_prompt(), workloads.multi_turn_chat()
    per_page = {
        "a": lambda p: match_insert(a, p, new_cache),
        "b": lambda p: match_insert(b, p, new_cache),
        "c": lambda p: evict_calls(p, new_cache),
        # its match builds no indices tensor: add it, to do what radixkv's match does
        "d": lambda p: chain_match(p, make=new_cache, indices=True),
    }
    wl = [w for w in wl if w != "e"]
    return run_suite(wl, pages, repeats, per_page, None, lambda: memory_per_token(new_cache))


if __name__ == "__main__":
    adapter_main("sglang_rust", run)
