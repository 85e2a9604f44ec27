"""The hybrid simulator's ``vllm`` row against vLLM's own code: the same trace through
vLLM 0.33's `KVCacheManager` (its `HybridKVCacheCoordinator`: one full-attention group
and the recurrent layers' groups in ``--mamba-cache-mode align``) at the same byte
budget.

    python benchmarks/peer_vllm_hybrid.py [--trace chat120_seed7.jsonl.gz] \\
        [--model-spec marconi-7b-hybrid.json] [--sizes 0.5,1,2,5] [--requests N]

vLLM's memory, as it sizes a hybrid model's: layers in groups of equal size (the
smaller layer count: one full-attention group, the recurrent layers in as many groups of
that size), one page per layer a block, a page the attention block's KV (the block
grown until a page holds one layer's state, `ModelSpec.vllm_block`), so a block id
costs ``page x group size`` bytes and the pool holds ``budget // that`` of them. Each
request runs as its scheduler runs it: the prompt in a chunk to the block grid and the
rest, then one decode step a token for every output token but the last, then it is
freed (its full blocks and the states on the grid stay cached). A request longer than
the pool can hold is counted as refused (vLLM would not start with that budget); the
simulator's row (`radixkv.sim.vllm_pool`) must refuse the same sizes.

vLLM's side runs in the vLLM peer's venv (``../shared/peers/setup.sh vllm`` or
``benchmarks/peers/setup.sh vllm``); this script starts it (``--peer``) and prints both
rows. Exit status 1 when a cell where vLLM served every request differs by more than
0.01.
"""

from __future__ import annotations

import sys

from peer_replay import PEERS, TOLERANCE, begin, inputs, run_peer

PEER = PEERS / "vllm" / "bin" / "python"


def pool(spec, cap: int) -> dict[str, int]:
    """vLLM's layer groups and block pool for ``cap`` bytes of ``spec``."""
    group = min(spec.full_layers, spec.recurrent_layers)
    page = max(spec.vllm_block() * spec.kv_bytes, spec.state_bytes)
    return {"blocks": cap // (page * group), "block": spec.vllm_block(),
            "state_groups": spec.recurrent_layers // group}  # fmt: skip


# --- vLLM's side (its venv) ---------------------------------------------------------------
def peer(job: dict) -> dict:
    """Each size's hit rate through vLLM's manager, or None where a request was refused."""
    return {"rates": [replay_vllm(job["requests"], **size) for size in job["sizes"]]}


def replay_vllm(reqs: list[dict], blocks: int, block: int, state_groups: int) -> float | None:
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

    b, hash_fn = block, hashing.sha256  # vLLM's default prefix-caching hash
    kv_cache_utils.init_none_hash(hash_fn)
    full = FullAttentionSpec(block_size=b, num_kv_heads=1, head_size=64, dtype=torch.float16)
    state = MambaSpec(block_size=b, shapes=((4, 8), (2, 8, 8)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")  # fmt: skip
    groups = [KVCacheGroupSpec(["attn"], full)]
    groups += [KVCacheGroupSpec([f"state{i}"], state) for i in range(state_groups)]
    cfg = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    mgr = KVCacheManager(cfg, max_model_len=1 << 17, scheduler_block_size=b,
                         hash_block_size=b, enable_caching=True)  # fmt: skip
    hasher = kv_cache_utils.get_request_block_hasher(b, hash_fn)
    hit_tokens = prompt_tokens = 0
    for i, r in enumerate(reqs):
        toks, outs = r["prompt"], r["output"]
        req = Request(str(i), toks, SamplingParams(max_tokens=max(1, len(outs))), None,
                      block_hasher=hasher)  # fmt: skip
        mgr.new_step_starts()
        cached, hit, *_ = mgr.get_computed_blocks(req)
        hit_tokens += hit
        prompt_tokens += len(toks)
        aligned = len(toks) - len(toks) % b  # the first chunk ends on the grid
        chunks = [(aligned - hit, hit, cached)] if aligned > hit else []
        if len(toks) > max(aligned, hit):
            rest = len(toks) - max(aligned, hit)
            chunks.append((rest,) if chunks else (rest, hit, cached))
        steps = [*chunks, *[(1,)] * max(len(outs) - 1, 0)]  # decode: all outputs but the last
        for j, step in enumerate(steps):
            if j:
                mgr.new_step_starts()
            if j >= len(chunks):
                req.append_output_token_ids(outs[j - len(chunks)])
            if mgr.allocate_slots(req, *step) is None:
                return None  # longer than the pool holds: refused
            req.num_computed_tokens += step[0] + (step[1] if len(step) > 1 else 0)
        mgr.free(req)
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


# --- the driver (radixkv's venv) ------------------------------------------------------------
def main() -> int:
    args = begin(__doc__, peer, PEER, "vLLM")
    if isinstance(args, int):
        return args
    from radixkv.sim.hybrid import simulate_hybrid

    trace, spec, outputs, caps = inputs(args)
    if not spec.recurrent_layers:
        print(f"{spec.name} has no recurrent layers: this compares the align mode", file=sys.stderr)
        return 2
    reqs = [{"prompt": list(r.units[: r.num_prompt_units]),
             "output": list(r.units[r.num_prompt_units :]) if outputs else []}
            for r in trace.requests]  # fmt: skip
    job = {"requests": reqs, "sizes": [pool(spec, c) for c in caps]}
    try:
        theirs, peer_s = run_peer(PEER, __file__, job, {})
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    ours = [simulate_hybrid(trace, spec, c, "vllm", outputs) for c in caps]
    print(f"{len(trace.requests)} requests, {spec.name}, vLLM block {spec.vllm_block()}, "
          f"outputs {'cached' if outputs else 'not cached'}")  # fmt: skip
    print(f"{'GB':>6}{'blocks':>8}{'vLLM':>9}{'simulator':>11}{'diff':>8}")
    worst, agree = 0.0, True
    for c, size, a, row in zip(caps, job["sizes"], theirs, ours, strict=True):
        b = row.token_hit_rate
        if a is None or row.refused:  # both must refuse: vLLM would not start
            agree &= a is None and row.refused > 0
            mine = f"refused {row.refused}" if row.refused else f"{b:.3f}"
            print(f"{c / 1e9:>6g}{size['blocks']:>8,}{'refused' if a is None else f'{a:.3f}':>9}"
                  f"{mine:>11}")  # fmt: skip
            continue
        worst = max(worst, abs(a - b))
        print(f"{c / 1e9:>6g}{size['blocks']:>8,}{a:>9.3f}{b:>11.3f}{b - a:>+8.3f}")
    refusals = "both refuse the same sizes" if agree else "they refuse different sizes"
    print(f"largest |simulator - vLLM| where vLLM served all: {worst:.4f} (tolerance "
          f"{TOLERANCE}); {refusals}; vLLM {peer_s:.1f} s")  # fmt: skip
    return 1 if worst > TOLERANCE or not agree else 0


if __name__ == "__main__":
    sys.exit(main())
