"""The hybrid simulator's ``sglang`` row against SGLang's own code: the same trace through
SGLang 0.5.23's production `UnifiedRadixCache` (Rust tree core, FULL + MAMBA components)
at the same byte budget, split into the same two pools.

    python benchmarks/peer_sglang_hybrid.py [--trace chat120_seed7.jsonl.gz] \\
        [--model-spec marconi-7b-hybrid.json] [--sizes 0.5,1,2,5] [--requests N]

Both sides follow the simulator's ``sglang`` rules for what a request caches (each
prompt matched but its last token; its KV, with a state at the end of what it leaves
cached and at the branch point where the full-attention match went past the last state;
room for its KV made before it runs, its matched prefix locked meanwhile): what differs
is whose tree, matching and eviction decide. The pools: states ``mamba_full_memory_ratio``
(0.9) of the full KV's bytes, as SGLang splits a hybrid model's memory; the full pool
evicts least recently used leaves (``EvictParams(num_tokens=...)``), the state pool
evicts a state when a new one finds it full (``EvictParams(mamba_num=1)``).

SGLang's side runs in the SGLang peer's venv (``../shared/peers/setup.sh sglang`` or
``benchmarks/peers/setup.sh sglang``), with ``SGLANG_PEER_UNIFIED=1``; this script starts
it (``--peer``) and prints both rows and their difference. Page 1: SGLang's
MambaComponent needs page 1 without its ping-pong extra buffer. Exit status 1 when a
cell differs by more than 0.01.
"""

from __future__ import annotations

import sys
import time

from peer_replay import PEERS, TOLERANCE, begin, inputs, run_peer

PEER = PEERS / "sglang" / "bin" / "python"


def pools(spec, cap: int) -> dict[str, int]:
    """SGLang's split of ``cap`` bytes: full-attention KV tokens and state slots (as the
    simulator's ``sglang`` row splits them)."""
    from radixkv.kvcache.plan import SGLANG_STATE_RATIO  # (the simulator's too)

    full_share = cap / (1 + SGLANG_STATE_RATIO)
    return {"tokens": int(full_share // spec.full_kv),
            "states": max(1, int(cap - full_share) // spec.checkpoint)}  # fmt: skip


def requests(trace, outputs: bool) -> list[dict]:
    """What each request matches and leaves cached (page 1: a unit is a token)."""
    out = []
    for r in trace.requests:
        n = (
            r.prompt_tokens + r.output_tokens - 1
            if outputs and r.output_tokens
            else r.prompt_tokens
        )
        out.append({"units": list(r.units[: max(n, r.num_prompt_units)]),
                    "prompt": r.num_prompt_units, "n": max(n, r.num_prompt_units)})  # fmt: skip
    return out


# --- SGLang's side (its venv) -------------------------------------------------------------
def peer(job: dict) -> dict:
    """Replay ``job["requests"]`` through SGLang's unified cache at each pool size."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", page_size=1)
    args._mamba_cache_chunk_size = 1
    runtime_context._CONTEXT.set_server_args(args)
    return {"rates": [replay_sglang(job["requests"], size["tokens"], size["states"])
                      for size in job["sizes"]]}  # fmt: skip


def replay_sglang(reqs: list[dict], tokens: int, states: int) -> float:
    """The token hit rate of ``reqs`` through a `UnifiedRadixCache` whose full pool holds
    ``tokens`` and whose state pool holds ``states``."""
    from array import array

    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class NullAllocator:  # the pools' sizes are counted here; freed slots are not reused
        device = torch.device("cpu")

        def free(self, t):
            pass

        def free_segment(self, t, start_pos=0):
            pass

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1,
                                    num_heads=2, head_dim=4, state_size=4,
                                    conv_kernel=4)  # fmt: skip
    pool = HybridReqToTokenPool(
        size=4, mamba_size=states, mamba_spec_state_size=0, max_context_len=1 << 17,
        device="cpu", enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False,
    )  # fmt: skip
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=NullAllocator(),
        page_size=1, eviction_policy="lru",
        tree_components=(ComponentType.FULL, ComponentType.MAMBA), tree_core_backend="rust",
    ))  # fmt: skip
    slots = pool.mamba_allocator

    def fit(units: int = 0) -> None:  # the full pool: least recently used leaves go
        over = cache.full_evictable_size() + cache.full_protected_size() + units - tokens
        if over > 0:
            cache.evict(EvictParams(num_tokens=over))

    def state() -> torch.Tensor | None:  # the state pool: full, it evicts one
        if slots.available_size() == 0:
            cache.evict(EvictParams(mamba_num=1))
        return slots.alloc(1)

    slot, hit_tokens, prompt_tokens = 0, 0, 0
    for r in reqs:
        units, P, n = r["units"], r["prompt"], r["n"]
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", units[: P - 1]))))
        hit = m.device_prefix_len
        hit_tokens += hit
        prompt_tokens += P
        lock = cache.lock(m.last_device_node)
        fit(n - hit)  # room for its KV before it runs
        marks = {n}
        if m.mamba_branching_seqlen is not None and m.mamba_branching_seqlen > hit:
            marks.add(m.mamba_branching_seqlen)
        for pos in sorted(p for p in marks if hit < p <= n):
            s = state()
            if s is None:  # every state is locked (a pool of one or two): none cached
                continue
            res = cache.insert(InsertParams(key=RadixKey(array("q", units[:pos])),
                                            value=torch.arange(slot, slot + pos),
                                            mamba_value=s))  # fmt: skip
            slot += pos
            if res.mamba_exist:
                slots.free(s)
        cache.unlock(lock)
        fit()
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


# --- the driver (radixkv's venv) ------------------------------------------------------------
def main() -> int:
    args = begin(__doc__, peer, PEER, "SGLang")
    if isinstance(args, int):
        return args
    from radixkv.sim.hybrid import simulate_hybrid

    trace, spec, outputs, caps = inputs(args)
    job = {"requests": requests(trace, outputs), "sizes": [pools(spec, c) for c in caps]}
    try:
        theirs, peer_s = run_peer(PEER, __file__, job, {"SGLANG_PEER_UNIFIED": "1"})
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ours = [simulate_hybrid(trace, spec, c, "sglang", outputs).token_hit_rate for c in caps]
    sim_s = time.perf_counter() - t0
    print(f"{len(trace.requests)} requests, {spec.name}, page 1, outputs "
          f"{'cached' if outputs else 'not cached'}")  # fmt: skip
    print(f"{'GB':>6}{'tokens':>12}{'states':>8}{'SGLang':>9}{'simulator':>11}{'diff':>8}")
    worst = 0.0
    for c, size, a, b in zip(caps, job["sizes"], theirs, ours, strict=True):
        worst = max(worst, abs(a - b))
        print(f"{c / 1e9:>6g}{size['tokens']:>12,}{size['states']:>8,}{a:>9.3f}{b:>11.3f}"
              f"{b - a:>+8.3f}")  # fmt: skip
    print(f"largest |simulator - SGLang|: {worst:.4f} (tolerance {TOLERANCE}); "
          f"SGLang {peer_s:.1f} s, simulator {sim_s:.1f} s")  # fmt: skip
    return 1 if worst > TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
