"""A hybrid model's prefix cache (full-attention KV + recurrent-state checkpoints),
radixkv against SGLang 0.5.23's production `UnifiedRadixCache` (Rust tree core, FULL +
MAMBA components) and vLLM 0.33's `HybridKVCacheCoordinator` (a FullAttentionSpec group
and a MambaSpec group in ``align`` mode), driven with the same requests in the same run.

    python benchmarks/bench_hybrid.py [--repeats 3]

Per request, as each scheduler does it for a Mamba / Gated DeltaNet model: match the
prompt (the state hit, and the branch point where the full-attention match goes past
the last state), cache the branch point's state that the prefill saved there, then cache
the prompt's KV with its state at the end. SGLang's side runs in the SGLang peer's venv
(``benchmarks/peers/setup.sh sglang``), vLLM's in vLLM's (``... vllm``); a missing peer
is skipped with a note. Page 1: without its ping-pong extra buffer SGLang's
MambaComponent requires page size 1. vLLM runs with 16-token blocks, the finest grid its
align mode allows a state on (a real Qwen3.5-4B gets 528), driven as its scheduler does:
a step per prefill chunk (``new_step_starts``), the first chunk ending on the block grid
(where align mode keeps the state), then the rest; the finished request is freed (its
blocks stay cached).
Reported: µs per request (match + inserts, median of the repeats, GC on; the requests'
token lists are frozen out of the collector's walks, and each run starts after a
collection, the same for every side), cached tokens
(state hits, which must be equal: tests/differential/test_sglang_hybrid_diff.py checks the same
semantics operation by operation) and checkpoints held at the end; the last column is
the same requests through radixkv's cache without components (a full-attention model's
match + insert), for the cost of the state component.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PEERS = Path.home() / ".cache" / "radixkv-peers"
PEER = PEERS / "sglang" / "bin" / "python"
VLLM = PEERS / "vllm" / "bin" / "python"
VLLM_BLOCK = 16
WORKLOADS = ("a", "b")


def requests(workload: str) -> list[list[int]]:
    from workloads import multi_turn_chat, shared_system_prompt

    return shared_system_prompt() if workload == "a" else multi_turn_chat()


def run_radixkv(reqs: list[list[int]]) -> tuple[float, int, int]:
    import numpy as np

    from radixkv import RadixCache, RadixKey
    from radixkv.kvcache.recurrent.component import StateCheckpoints
    from radixkv.tree.node import bytes_to_tensor

    class Slots:
        def free(self, slots) -> None:
            pass

    state = StateCheckpoints(1 << 30, Slots())
    cache = RadixCache(1, components=(state,))
    keys = [RadixKey(np.asarray(r, dtype=np.int64)) for r in reqs]
    hits, slot = 0, 0
    t0 = time.perf_counter()
    for key in keys:
        parts, last, hit, full = cache.match_parts(key)  # the state hit and the branch point
        bytes_to_tensor(parts)  # the indices, as SGLang's match and match_prefix return them
        if hit:
            state.used(last)  # the hit copies this state
        hits += hit
        for pos, _kind in state.plan(len(key), full, hit):
            state.add(cache.insert_node(key[:pos]).last_node, slot)
            slot += 1
    dt = time.perf_counter() - t0
    return dt, hits, len(state.held)


def run_sglang(reqs: list[list[int]]) -> tuple[float, int, int]:
    from array import array

    import torch
    from sglang.srt import runtime_context
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
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

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 1
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
        mamba_size=2 * len(reqs) + 8,
        mamba_spec_state_size=0,
        max_context_len=1 << 16,
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
            page_size=1,
            eviction_policy="lru",
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            tree_core_backend="rust",
        )
    )
    assert type(cache.tree_core).__name__ == "RustUnifiedTreeCore"
    keys = [array("q", r) for r in reqs]
    values = [torch.arange(len(r)) for r in reqs]
    alloc, free = pool.mamba_allocator.alloc, pool.mamba_allocator.free
    hits = held = 0
    t0 = time.perf_counter()
    for toks, value in zip(keys, values, strict=True):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
        hits += m.device_prefix_len
        b = m.mamba_branching_seqlen
        for n in (b, len(toks)) if b is not None and b < len(toks) else (len(toks),):
            s = alloc(1)
            res = cache.insert(InsertParams(key=RadixKey(toks[:n]), value=value[:n], mamba_value=s))
            if res.mamba_exist:
                free(s)
            else:
                held += 1
    dt = time.perf_counter() - t0
    return dt, hits, held


def run_full_only(reqs: list[list[int]]) -> tuple[float, int, int]:
    """The same requests through radixkv's cache without components (a full-attention
    model): match + insert."""
    import numpy as np

    from radixkv import RadixCache, RadixKey

    cache = RadixCache(1)
    keys = [RadixKey(np.asarray(r, dtype=np.int64)) for r in reqs]
    hits = 0
    t0 = time.perf_counter()
    for key in keys:
        hits += cache.match_prefix(key).prefix_len
        cache.insert(key)
    return time.perf_counter() - t0, hits, 0


def run_vllm(reqs: list[list[int]]) -> tuple[float, int, int]:
    t0 = time.perf_counter()  # hashing is part of vLLM's request path: it is timed
    hits = vllm_hits(reqs, VLLM_BLOCK)
    return time.perf_counter() - t0, sum(hits), 0


def vllm_hits(reqs: list[list[int]], b: int) -> list[int]:
    """Each request's cached tokens in vLLM's align mode with ``b``-token blocks, the
    requests one after another (each freed when done: its blocks stay cached)."""
    import torch
    import vllm.utils.hashing as hashing
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request

    hash_fn = hashing.sha256  # vLLM's default prefix-caching hash
    kv_cache_utils.init_none_hash(hash_fn)
    full = FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=64, dtype=torch.float16)
    state = MambaSpec(block_size=b, shapes=((4, 8), (2, 8, 8)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")  # fmt: skip
    groups = [KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["gdn"], state)]
    cfg = KVCacheConfig(num_blocks=1 << 20, kv_cache_tensors=[], kv_cache_groups=groups)
    mgr = KVCacheManager(cfg, max_model_len=1 << 14, scheduler_block_size=b,
                         hash_block_size=b, enable_caching=True)  # fmt: skip
    assert type(mgr.coordinator).__name__ == "HybridKVCacheCoordinator"
    hasher = kv_cache_utils.get_request_block_hasher(b, hash_fn)
    params = SamplingParams(max_tokens=1)
    hits = []
    for i, toks in enumerate(reqs):
        req = Request(str(i), toks, params, None, block_hasher=hasher)
        mgr.new_step_starts()
        blocks, hit, *_ = mgr.get_computed_blocks(req)
        hits.append(hit)
        aligned = len(toks) - len(toks) % b
        chunks = [(aligned - hit, hit, blocks)] if aligned > hit else []
        if len(toks) > max(aligned, hit):
            rest = len(toks) - max(aligned, hit)
            chunks.append((rest,) if chunks else (rest, hit, blocks))
        for j, chunk in enumerate(chunks):
            if j:
                mgr.new_step_starts()
            if mgr.allocate_slots(req, *chunk) is None:
                raise RuntimeError(f"vLLM refused request {i}'s chunk {j}")
            req.num_computed_tokens += chunk[0] + (chunk[1] if len(chunk) > 1 else 0)
        mgr.free(req)
    return hits


def measure(impl: str, repeats: int) -> list[dict]:
    run = {"radixkv": run_radixkv, "full": run_full_only, "sglang": run_sglang,
           "vllm": run_vllm}[impl]  # fmt: skip
    rows = []
    for w in WORKLOADS:
        reqs = requests(w)
        # the requests' token lists (up to 2.6M references) are the harness's: frozen, so
        # a full collection during a timed run walks only what the cache under test made
        gc.collect()
        gc.freeze()
        times, out = [], None
        for _ in range(repeats):
            gc.collect()  # the previous run's tree goes now, not during the next run
            dt, hits, held = run(reqs)
            times.append(dt / len(reqs) * 1e6)
            out = (hits, held)
        gc.unfreeze()
        rows.append(dict(workload=w, us=statistics.median(times), hits=out[0], held=out[1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impl", choices=("radixkv", "sglang", "vllm"), help=argparse.SUPPRESS)
    # vLLM's cached tokens per request for the requests in a JSON file (bench_hybrid_engine)
    p.add_argument("--vllm-hits", nargs=2, metavar=("FILE", "BLOCK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_hits:
        reqs = json.loads(Path(args.vllm_hits[0]).read_text())
        print(json.dumps(vllm_hits(reqs, int(args.vllm_hits[1]))))
        return
    if args.impl:  # one side, in its own venv: print JSON
        print(json.dumps(measure(args.impl, args.repeats)))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ours = measure("radixkv", args.repeats)
    full = measure("full", args.repeats)
    peers = {}
    for name, python, env in (("sglang", PEER, {"SGLANG_PEER_UNIFIED": "1"}), ("vllm", VLLM, {})):
        if not python.exists():
            console.print(f"[yellow]skipping {name}:[/yellow] no interpreter at {python}")
            continue
        env = {**os.environ, **env, "PYTHONWARNINGS": "ignore"}
        cmd = [str(python), __file__, "--impl", name, "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode:
            raise SystemExit(f"{name} side failed:\n{proc.stderr[-2000:]}")
        peers[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs, vllm = peers.get("sglang"), peers.get("vllm")
    table = Table(title="hybrid prefix cache (FULL + recurrent state), page 1, µs per request")
    cols = ("workload", "radixkv µs", "SGLang Rust µs", "ratio", "cached tokens", "states")
    for col in (*cols, "vLLM µs", "ratio", "vLLM cached", "radixkv full-only µs"):
        table.add_column(col, justify="right")
    names = {"a": "(a) 2,000 × shared 1,024-token prompt", "b": "(b) 200 chats × 8 turns"}
    for i, r in enumerate(ours):
        t = theirs[i] if theirs else None
        table.add_row(
            names[r["workload"]],
            f"{r['us']:.1f}",
            f"{t['us']:.1f}" if t else "-",
            f"{t['us'] / r['us']:.1f}×" if t else "-",
            f"{r['hits']:,}" + (f" / {t['hits']:,}" if t else ""),
            f"{r['held']:,}" + (f" / {t['held']:,}" if t else ""),
            f"{vllm[i]['us']:.1f}" if vllm else "-",
            f"{vllm[i]['us'] / r['us']:.1f}×" if vllm else "-",
            f"{vllm[i]['hits']:,}" if vllm else "-",
            f"{full[i]['us']:.1f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
