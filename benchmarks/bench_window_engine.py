"""Sliding-window KV in the engine, at equal KV bytes: a tiny random Gemma-3-like model
(5 sliding layers : 1 global, written by transformers' own ``save_pretrained``) serving
multi-turn chats that share system prompts, two ways in the same run:

* **whole**: every layer's KV in one pool (``window_tokens=0``, what the engine did
  before), ``K`` tokens of six layers;
* **split**: the sliding layers' KV in a pool of its own (`radixkv.kvcache.window.slots`), sized
  so that both pools together take the same bytes: ``F`` full-attention tokens and
  ``F / 4`` window tokens, ``F × 1 + F / 4 × 5 = K × 6`` layers' worth.

Each round sends every conversation's next turn at once (its history, the engine's own
previous answer, and a new user message). Reported per budget: the token hit rate, the
cache's KV bytes per cached token at the end (full-attention KV plus the windows it
holds, against six layers for every token), the wall time, and whether both ways gave
the same tokens.

    python benchmarks/bench_window_engine.py [--kv-tokens 3072,6144,24576] [--chats 24]

Then the cost of the window component's pressure calls on a large tree (``--nodes``:
prompts of 64 tokens behind 200 shared 32-token stems, page 16, window 64, windows kept
as the engine keeps them, ``retain="all"``), against the full cache's own ``evict`` in
the same run: ms per call, the first call and the next.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from workloads import engine_chats

DIMS = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, max_position_embeddings=8192)  # fmt: skip


def write_model(root: Path, window: int) -> Path:
    import transformers

    torch.manual_seed(0)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    conf = transformers.Gemma3TextConfig(**DIMS, sliding_window=window, layer_types=types)
    transformers.Gemma3ForCausalLM(conf).save_pretrained(root / "gemma3")
    return root / "gemma3"


def run(folder: Path, kv_tokens: int, window_tokens: int, args: argparse.Namespace) -> dict:
    from radixkv.engine.engine import Engine

    engine = Engine(str(folder), page_size=16, chunk_size=512, max_running=16,
                    kv_tokens=kv_tokens, window_tokens=window_tokens,
                    max_context_len=4096)  # fmt: skip
    t0 = time.perf_counter()
    prompt, cached, outputs = engine_chats(engine, args.chats, args.turns, args.system,
                                           args.user, args.new)  # fmt: skip
    wall = time.perf_counter() - t0
    kv, cache = engine.kv, engine.cache
    held = cache.total_size() * kv.bytes_per_token()
    if engine.window is not None:
        held += engine.window.component.held_units() * kv.window_bytes_per_token()
    every_layer = kv.num_layers * kv._layer_bytes()  # a token's KV in all six layers
    return {
        "hit": cached / prompt,
        "bytes_per_token": held / max(cache.total_size(), 1) / every_layer,
        "pool_bytes": kv.nbytes(),
        "wall": wall,
        "outputs": outputs,
        "preemptions": engine.scheduler.preemptions,
    }


def pressure_calls(prompts: int) -> dict[str, tuple[float, float]]:
    """ms of the first and second call of each pressure operation on a windowed tree of
    ``prompts`` prompts (see the module docstring)."""
    import random
    from array import array

    from radixkv.key import RadixKey
    from radixkv.kvcache.memory import TokenToKVPoolAllocator
    from radixkv.kvcache.window.component import WindowKV
    from radixkv.tree import RadixCache

    alloc, walloc = (TokenToKVPoolAllocator(prompts * 64 + 64, 16) for _ in range(2))
    win = WindowKV(64, walloc, retain="all")
    cache = RadixCache(16, "lru", alloc, eviction_mode="precise", components=(win,))
    rng = random.Random(0)
    stems = [[rng.randrange(1000) for _ in range(32)] for _ in range(200)]
    for i in range(prompts):
        key = RadixKey(array("q", stems[i % 200] + [rng.randrange(1000) for _ in range(32)]))
        cache.insert_node(key, alloc.alloc(64), extras={"window": walloc.alloc(64)})
    calls = {
        "WindowKV.evictable_units (until 64)": lambda: win.evictable_units(64),
        "WindowKV.evict_spare(16)": lambda: win.evict_spare(16),
        "WindowKV.evict(16)": lambda: win.evict(16),
        "RadixCache.evict(16) (full KV, the peer)": lambda: cache.evict(16),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = (times[0], times[1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-tokens", default="3072,6144,24576",
                   help="the whole pool's tokens (K), one run per value")  # fmt: skip
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--chats", type=int, default=24)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system", type=int, default=256)
    p.add_argument("--user", type=int, default=48)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--nodes", type=int, default=20000, help="prompts in the pressure tree")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp), args.window)
        print(f"Gemma-3-like, 5 sliding (window {args.window}) : 1 global; {args.chats} chats "
              f"x {args.turns} turns, 4 system prompts of {args.system} tokens, "
              f"+{args.user} user and {args.new} output tokens a turn")  # fmt: skip
        print(
            "| KV pools | way | tokens | hit rate | cache bytes per cached token "
            "(x six layers) | wall s | preemptions | same tokens |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for k in (int(x) for x in args.kv_tokens.split(",")):
            full = k * 6 * 4 // 9 // 16 * 16  # F + 5F/4 = 6K
            whole = run(folder, k, 0, args)
            split = run(folder, full, full // 4, args)
            same = whole["outputs"] == split["outputs"]
            for name, r, pools in (("whole", whole, f"{k:,}"),
                                   ("split", split, f"{full:,} + {full // 4:,}")):  # fmt: skip
                mib = r["pool_bytes"] / 2**20
                print(f"| {mib:.2f} MiB | {name} | {pools} | {r['hit']:.3f} | "
                      f"{r['bytes_per_token']:.2f} | {r['wall']:.1f} | {r['preemptions']} | "
                      f"{'yes' if same else 'NO'} |")  # fmt: skip
    print(f"\nPressure calls on a windowed tree of {args.nodes:,} prompts (ms, first / next):")
    for name, (first, then) in pressure_calls(args.nodes).items():
        print(f"  {name:42s} {first:8.2f} / {then:6.2f}")


if __name__ == "__main__":
    main()
