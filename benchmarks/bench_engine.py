"""Engine throughput with and without the prefix cache on a generated shared-prefix
workload (tiny random model, so it measures the engine and the cache, not a big model).

    python benchmarks/bench_engine.py [--groups 8 --per-group 16 --shared 512 ...]
"""

from __future__ import annotations

import argparse
import random

from radixkv.engine.engine import Engine
from radixkv.engine.models.llama import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--shared", type=int, default=512)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.groups):
        stem = [rng.randrange(256) for _ in range(args.shared)]
        prompts += [
            stem + [rng.randrange(256) for _ in range(args.question)] for _ in range(args.per_group)
        ]
    rng.shuffle(prompts)
    cfg = ModelConfig()  # the tiny random Llama the tests use
    results = {}
    for cache in (False, True):
        engine = Engine(
            cfg,
            prefix_cache=cache,
            kv_tokens=65536,
            max_running=32,
            chunk_size=2048,
            max_context_len=1024,
        )
        results[cache] = engine.generate(prompts, max_new_tokens=args.output, ignore_eos=True)
    off, on = results[False].stats, results[True].stats
    best = args.groups * (args.per_group - 1) * args.shared / on.prompt_tokens
    same = [o.token_ids for o in results[False].outputs] == [
        o.token_ids for o in results[True].outputs
    ]
    print(f"requests {on.requests}, prompt tokens {on.prompt_tokens:,}")
    print(
        f"no cache: {off.prefill_tokens:,} prefill tokens, {off.wall_s:.2f} s, "
        f"{off.throughput:,.0f} tok/s, TTFT p50 {off.ttft_p50_s:.2f} s"
    )
    print(
        f"cache:    {on.prefill_tokens:,} prefill tokens, {on.wall_s:.2f} s, "
        f"{on.throughput:,.0f} tok/s, TTFT p50 {on.ttft_p50_s:.2f} s"
    )
    print(f"throughput cache / no cache: {on.throughput / off.throughput:.2f}x")
    print(
        f"hit rate {on.hit_rate:.4f} of a best possible {best:.4f} "
        f"({on.hit_rate / best:.1%}); identical outputs: {same}"
    )


if __name__ == "__main__":
    main()
