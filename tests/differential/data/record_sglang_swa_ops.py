"""Record random operation sequences on SGLang 0.5.23's production `UnifiedRadixCache`
(Rust tree core) with the FULL and SWA components, for
tests/differential/test_sglang_hybrid_diff.py.

Run in the SGLang peer's venv (benchmarks/peers/setup.sh sglang), with the unified
import chain on:

    SGLANG_PEER_UNIFIED=1 ~/.cache/radixkv-peers/sglang/bin/python \
        tests/differential/data/record_sglang_swa_ops.py \
        tests/differential/data/sglang_swa_ops.json.gz

The SWA component runs on this CPU machine as it does in SGLang's scheduler: a
`SWAKVPool` (one window layer, one full layer) behind a `SWATokenToKVPoolAllocator`,
whose full-to-window index mapping gives each node its window slots.

Each sequence: inserts of a prompt's KV (fresh slots from the allocator, as a finished
request caches them), matches (the servable prefix, the full-attention hit and the
branch point), and evictions of window KV (``swa_num_tokens``) or of full KV
(``num_tokens``). After each operation that changed it, the recorder writes down what
SGLang then holds for every prompt inserted so far, through its own queries: the
full-attention prefix (``match_full_device_prefix``) and the window tombstones along it
(``swa_tombstone_ranges``).
"""

from __future__ import annotations

import random
import sys
from array import array

import torch
from recorder_common import random_prompt, write_fixture
from sglang.srt import runtime_context
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs

SIZE = 16384  # slots per pool: more than a sequence allocates, so nothing is refused


def build(page: int, window: int):
    runtime_context._CONTEXT.set_server_args(ServerArgs(model_path="dummy", page_size=page))
    kv = SWAKVPool(
        size=SIZE,
        size_swa=SIZE,
        page_size=page,
        dtype=torch.float32,
        head_num=1,
        head_dim=2,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device="cpu",
    )
    alloc = SWATokenToKVPoolAllocator(SIZE, SIZE, page, torch.float32, "cpu", kv, need_sort=False)
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=alloc,
            page_size=page,
            eviction_policy="lru",
            sliding_window_size=window,
            tree_components=(ComponentType.FULL, ComponentType.SWA),
            tree_core_backend="rust",
        )
    )
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore"
    return cache, alloc


def fresh_slots(alloc, n: int, page: int) -> torch.Tensor:
    """Full-attention slots for ``n`` new tokens (window slots mapped to them), as the
    scheduler allocates a request's prefill."""
    if page == 1:
        return alloc.alloc(n)
    zero, total = torch.tensor([0]), torch.tensor([n])
    return alloc.alloc_extend(zero, zero, total, total, torch.tensor([-1]), n)


def key(toks: list[int]) -> RadixKey:
    return RadixKey(array("q", toks))


def observe(cache, prompts: list[list[int]]) -> list:
    """For each prompt: [full-attention prefix, [[start, end] of window tombstones]]."""
    out = []
    for toks in prompts:
        full = cache.tree_core.match_full_device_prefix(key(toks))[0]
        tombs = cache.tree_core.swa_tombstone_ranges(key(toks), 0, full) if full else []
        out.append([full, [list(t) for t in tombs]])
    return out


def record(seed: int, page: int, window: int, n_ops: int) -> dict:
    rng = random.Random(seed)
    cache, alloc = build(page, window)
    prompts: list[list[int]] = []

    def prompt() -> list[int]:
        return random_prompt(rng, prompts, page, 16, 32)

    ops: list[dict] = []
    last_obs: list = []
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.45:
            toks = prompt()
            if not toks:
                continue
            slots = fresh_slots(alloc, len(toks), page)
            res = cache.insert(InsertParams(key=key(toks), value=slots))
            if toks not in prompts:
                prompts.append(toks)
            op = dict(op="insert", toks=toks, prefix_len=res.prefix_len)
        elif r < 0.8:
            toks = prompt()
            res = cache.match_prefix(MatchPrefixParams(key=key(toks)))
            op = dict(
                op="match",
                toks=toks,
                prefix_len=res.device_prefix_len,
                full=res.full_kv_hit_length,
                branch=res.swa_branching_seqlen,
            )
        else:
            n = rng.randint(1, 4) * page
            window_kv = rng.random() < 0.7
            params = EvictParams(num_tokens=0, swa_num_tokens=n) if window_kv else EvictParams(n)
            res = cache.evict(params)
            op = dict(
                op="evict_window" if window_kv else "evict_full",
                n=n,
                full_evicted=res.num_tokens_evicted,
                window_evicted=res.swa_num_tokens_evicted,
            )
        obs = observe(cache, prompts)
        if obs != last_obs:
            op["obs"] = last_obs = obs
        ops.append(op)
    return dict(seed=seed, page=page, window=window, ops=ops)


def main(out: str) -> None:
    seqs = [record(seed, 1, 2 + seed % 4, 150) for seed in range(60)]  # windows 2 to 5
    seqs += [record(seed, 2, 3 + seed % 4, 150) for seed in range(60, 80)]  # 3: not a page
    write_fixture(out, "UnifiedRadixCache(FULL, SWA), rust core", seqs)


if __name__ == "__main__":
    main(sys.argv[1])
