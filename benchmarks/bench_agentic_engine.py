"""Agentic traces through the engine itself: kv-cache-tester's Claude Code sessions
replayed in their 64-token blocks (`radixkv.sim.serve_replay.in_units`) through
``radixkv serve``'s scheduler, lifecycle and one byte budget, with its default eviction
order and with ``--eviction-policy session`` (the trace's sessions and stop reasons,
on the trace's clock), beside the budget simulator's rows for the same two orders
(``radixkv``, ``session``).

``--sessions`` conversations drawn within an hour per seed; capacities in tokens of the
spec's full KV (the spec's bytes a token times the count). A request longer than the
pool holds alone is refused by the engine (as ``radixkv serve`` answers 400) and
counted a miss; the simulator's rows serve it. Seconds: each row's replay.

    python benchmarks/bench_agentic_engine.py ../shared/data/agentic/traces
        [--sessions 40] [--seeds 1,2,3] [--capacities 256k,512k,1M]
        [--specs full,qwen3.5-4b] [--max-context 128k]
"""

from __future__ import annotations

import argparse
import time

from radixkv.sim.agentic import load_agentic
from radixkv.sim.hybrid import PRESETS, ModelSpec, simulate_hybrid
from radixkv.sim.serve_replay import serve_result
from radixkv.sim.sweep import parse_capacity

# full attention alone: 8 layers of 8 KV heads x 128 in bf16 (a Llama-8B-like layer's
# bytes, 8 of its 32 layers: the ratios are what matter)
SPECS = {"full": ModelSpec("full-attention", 8, 4096, params=8e9), **PRESETS}
ROWS = ("serve", "serve-session", "radixkv", "session")


def row(trace, spec: ModelSpec, cap: int, policy: str) -> tuple[float, int, float]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    if policy.startswith("serve"):
        eviction = "session" if policy == "serve-session" else "lru"
        r = serve_result(trace, None, spec, cap, schedule="fcfs", eviction=eviction)
    else:
        r = simulate_hybrid(trace, spec, cap, policy)
    return r.token_hit_rate, r.refused, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces")
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--capacities", default="256k,512k,1M")
    ap.add_argument("--specs", default="full,qwen3.5-4b")
    ap.add_argument("--max-context", default="128k",
                    help="each session ends before a call longer than this (tokens; "
                    "kv-cache-tester's --max-context), so the engine refuses none")  # fmt: skip
    args = ap.parse_args()
    for name in args.specs.split(","):
        spec = SPECS[name]
        print(f"{spec.name}: {spec.full_kv:,} bytes of full KV a token; {args.sessions} "
              f"sessions within an hour, calls up to {args.max_context} tokens")  # fmt: skip
        print("seed capacity  " + "  ".join(f"{p:>13}" for p in ROWS) + "   refused  seconds")
        for seed in (int(s) for s in args.seeds.split(",")):
            trace = load_agentic(args.traces, sessions=args.sessions, seed=seed,
                                 max_context=parse_capacity(args.max_context, 1))  # fmt: skip
            for text in args.capacities.split(","):
                cap = parse_capacity(text, 1) * spec.full_kv  # (tokens)
                got = [row(trace, spec, cap, p) for p in ROWS]
                rates = "  ".join(f"{h:13.3f}" for h, _, _ in got)
                secs = "/".join(f"{s:.0f}" for _, _, s in got)
                print(f"{seed:>4} {text:>8}  {rates}   {got[0][1]:>7}  {secs}", flush=True)


if __name__ == "__main__":
    main()
