"""Record random operation sequences on SGLang 0.5.23's production `UnifiedRadixCache`
(Rust tree core) with the FULL and MAMBA components, for
tests/differential/test_sglang_hybrid_diff.py.

Run in the SGLang peer's venv (benchmarks/peers/setup.sh sglang), with the unified
import chain on:

    SGLANG_PEER_UNIFIED=1 ~/.cache/radixkv-peers/sglang/bin/python \
        tests/differential/data/record_sglang_hybrid_ops.py \
        tests/differential/data/sglang_hybrid_ops.json.gz

Each sequence: inserts of a prompt's full KV with a state checkpoint at its end (as the
scheduler caches a finished request), matches (the state hit, the full-attention hit
and the branch point where the next prefill saves its state), inserts of a branch
point's state, and evictions of states (from the start, or
only in the second half so that more full-attention results are comparable). Page 1: without the
ping-pong extra buffer SGLang's MambaComponent requires page_size 1.
"""

from __future__ import annotations

import random
import sys
from array import array

import torch
from recorder_common import random_prompt, write_fixture
from sglang.srt import runtime_context
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs


class NullAllocator:
    device = torch.device("cpu")

    def free(self, t):
        pass

    def free_segment(self, t, start_pos=0):
        pass


def build(page: int):
    args = ServerArgs(model_path="dummy", page_size=page)
    args._mamba_cache_chunk_size = page  # the state grid: one page
    runtime_context._CONTEXT.set_server_args(args)
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=4,
        conv_kernel=4,
    )
    pool = HybridReqToTokenPool(
        size=8,
        mamba_size=4096,
        mamba_spec_state_size=0,
        max_context_len=512,
        device="cpu",
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
        mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False,
    )
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=NullAllocator(),
            page_size=page,
            eviction_policy="lru",
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            tree_core_backend="rust",
        )
    )
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore"
    return cache, pool


def record(seed: int, page: int, n_ops: int, late: bool) -> dict:
    rng = random.Random(seed)
    cache, pool = build(page)
    prompts: list[list[int]] = []

    def prompt() -> list[int]:
        return random_prompt(rng, prompts, page, 12, 24)

    ops = []
    slot = 0
    for i in range(n_ops):
        r = rng.random() * (0.9 if late and i < n_ops // 2 else 1)  # late: evict in the 2nd half
        if r < 0.45:
            toks = prompt()
            if not toks:
                continue
            state = pool.mamba_allocator.alloc(1)
            res = cache.insert(
                InsertParams(
                    key=RadixKey(array("q", toks)),
                    value=torch.arange(slot, slot + len(toks)),
                    mamba_value=state,
                )
            )
            slot += len(toks)
            if res.mamba_exist:
                pool.mamba_allocator.free(state)
            prompts.append(toks)
            ops.append(
                dict(
                    op="insert", toks=toks, prefix_len=res.prefix_len, exists=bool(res.mamba_exist)
                )
            )
        elif r < 0.9:
            toks = prompt()
            res = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks))))
            ops.append(
                dict(
                    op="match",
                    toks=toks,
                    prefix_len=res.device_prefix_len,
                    branch=res.mamba_branching_seqlen,
                )
            )
            if res.mamba_branching_seqlen is not None and rng.random() < 0.5:
                # the next prefill saved the branch point's state: cache it
                b = res.mamba_branching_seqlen
                state = pool.mamba_allocator.alloc(1)
                ins = cache.insert(
                    InsertParams(
                        key=RadixKey(array("q", toks[:b])),
                        value=torch.arange(slot, slot + b),
                        mamba_value=state,
                    )
                )
                slot += b
                if ins.mamba_exist:
                    pool.mamba_allocator.free(state)
                ops.append(
                    dict(
                        op="insert",
                        toks=toks[:b],
                        prefix_len=ins.prefix_len,
                        exists=bool(ins.mamba_exist),
                    )
                )
        else:
            n = rng.randint(1, 3)
            res = cache.evict(EvictParams(num_tokens=0, mamba_num=n))
            ops.append(dict(op="evict_states", n=n, evicted=res.mamba_num_evicted))
    return dict(seed=seed, page=page, ops=ops)


def main(out: str) -> None:
    seqs = [record(seed, 1, 120, late=seed % 2 == 0) for seed in range(60)]
    write_fixture(out, "UnifiedRadixCache(FULL, MAMBA), rust core", seqs)


if __name__ == "__main__":
    main(sys.argv[1])
