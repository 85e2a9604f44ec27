"""vLLM 0.33's KVCacheManager on workload (e), the full request path. Runs in vLLM's own
virtual environment (``benchmarks/peers/setup.sh vllm``); imports nothing from radixkv.

    ~/.cache/radixkv-peers/vllm/bin/python benchmarks/adapters/vllm_adapter.py
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import vllm.utils.hashing as hashing
import workloads
from harness import adapter_main, run_suite
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

HASH = "sha256"  # vLLM's default prefix-caching hash


def request_path(block: int, tight: bool, hash_name: str, alive: int = 16):  # type: ignore[no-untyped-def]
    """Per request: hash its blocks and look up the hit, allocate the rest (touches hits,
    pops or evicts free blocks, registers the new full blocks), and when more than
    ``alive`` are running free the oldest (its blocks stay cached, evictable)."""
    seqs = workloads.request_path()
    hash_fn = getattr(hashing, hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    num_blocks = 1024 if tight else (1 << 21) // block
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    mgr = KVCacheManager(
        cfg,
        max_model_len=4096,
        scheduler_block_size=block,
        hash_block_size=block,
        enable_caching=True,
    )
    hasher = kv_cache_utils.get_request_block_hasher(block, hash_fn)
    params = SamplingParams(max_tokens=1)
    window: deque = deque()
    hit = 0
    t0 = time.perf_counter()  # hashing is part of vLLM's request path: it is timed
    for i, toks in enumerate(seqs):
        req = Request(str(i), toks, params, None, block_hasher=hasher)
        blocks, n_hit, *_ = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, len(toks) - n_hit, n_hit, blocks) is None:
            raise RuntimeError("pool too small for the window")
        req.num_computed_tokens = len(toks)
        hit += n_hit
        window.append(req)
        if len(window) > alive:
            mgr.free(window.popleft())
    while window:
        mgr.free(window.popleft())
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, {"hit_rate": hit / sum(len(s) for s in seqs)}


def run(wl: list[str], pages: list[int], repeats: int) -> list[dict]:
    """Only (e): hash-based blocks have no match/insert/evict API of their own."""
    rows = run_suite(wl, pages, repeats, {}, lambda b, t: request_path(b, t, HASH))
    return [{**r, "hash": HASH} for r in rows]


if __name__ == "__main__":
    adapter_main("vllm", run)
