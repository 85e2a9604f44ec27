"""`radixkv route` on real processes: three `radixkv serve` replicas (tiny random model)
publishing KV events, the router in front, a multi-turn workload from bench-serve, once
per policy.

    python benchmarks/bench_route.py [--conversations 12 --turns 4 --json out.json]

Between policies every replica's cache is flushed (the router hears it as events) and a
new router starts, so each policy starts cold. Reported: the replicas' prefix-cache hit
rate and prompt tokens computed (from their /metrics), and time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

import httpx

from radixkv.server.bench_serve import BenchConfig, run_bench
from radixkv.server.process import ServerProcess, free_port_pair

RESULTS = Path(__file__).resolve().parent / "results"
WORKER = ["--model", "random", "--page-size", "16", "--kv-tokens", "65536", "--max-running", "16",
          "--max-context-len", "8192", "--chunk-size", "2048",
          "--admin-key", "bench-admin"]  # fmt: skip
ADMIN = {"Authorization": "Bearer bench-admin"}  # /flush_cache is an admin endpoint
POLICIES = ("round_robin", "least_load", "approx", "kv")


def worker_totals(urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            m = re.match(r"radixkv:(\w+_total)\{[^}]*\} ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


REUSE = (
    "prompt_tokens",
    "fleet_available_tokens",
    "routing_captured_tokens",
    "engine_delivered_tokens",
)  # the router's decomposed reuse counters


def router_totals(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        m = re.match(r"radixkv_router:(\w+)_total ([0-9.e+-]+)$", line)
        if m and m.group(1) in REUSE:
            out[m.group(1)] = float(m.group(2))
    return out


def start_router(specs: list[str], policy: str, weight: float) -> ServerProcess:
    args = [a for s in specs for a in ("--worker", s)]
    return ServerProcess("--model", "random", "--policy", policy, "--kv-weight", str(weight),
                         *args, command="route")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-words", type=int, default=150)
    p.add_argument("--message-words", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-weight", type=float, default=4.0, help="the kv router's weight [4]")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=str(RESULTS / "route.json"))
    args = p.parse_args()
    ports = [free_port_pair() for _ in range(args.replicas)]
    workers = [ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{q}") for q in ports]
    specs = [f"{w.url},tcp://127.0.0.1:{q}" for w, q in zip(workers, ports, strict=True)]
    urls = [w.url for w in workers]
    rows = []
    try:
        for policy in args.policies.split(","):
            for url in urls:
                httpx.post(f"{url}/flush_cache", headers=ADMIN).raise_for_status()
            router = start_router(specs, policy, args.kv_weight)
            rurl = router.url
            try:
                before = worker_totals(urls)
                cfg = BenchConfig(
                    url=rurl, workload="multi-turn", conversations=args.conversations,
                    turns=args.turns, first_words=args.first_words,
                    message_words=args.message_words, max_tokens=args.max_tokens,
                    num_prompts=args.conversations * args.turns,
                    max_concurrency=args.concurrency, time_limit=900,
                )  # fmt: skip
                reused = router_totals(rurl)
                rep = asyncio.run(run_bench(cfg))
                after = worker_totals(urls)
                reused = {k: v - reused.get(k, 0) for k, v in router_totals(rurl).items()}
            finally:
                router.stop()
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            row = {
                "policy": policy,
                "completed": rep["requests"]["completed"],
                "hit_rate": d["prefix_cache_hits_total"] / d["prefix_cache_queries_total"],
                "prefill_tokens": d["prefill_computed_tokens_total"],
                "prompt_tokens": d["prompt_tokens_total"],
                "ttft_p50_s": rep["ttft_s"]["p50"],
                "ttft_p90_s": rep["ttft_s"]["p90"],
                "duration_s": rep["duration_s"],
                # reuse decomposed (the router's tokens): available, captured, delivered
                **{
                    k.removesuffix("_tokens") + "_rate": reused.get(k, 0)
                    / max(reused.get("prompt_tokens", 0), 1)
                    for k in REUSE[1:]
                },
            }
            rows.append(row)
            print(
                f"{policy:<12} hit rate {row['hit_rate']:.3f}  prefill tokens "
                f"{row['prefill_tokens']:>9,.0f}  TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms  "
                f"p90 {row['ttft_p90_s'] * 1e3:7.1f} ms  reuse available / captured / "
                f"delivered {row['fleet_available_rate']:.3f} / "
                f"{row['routing_captured_rate']:.3f} / {row['engine_delivered_rate']:.3f}  "
                f"({row['completed']} requests, {row['duration_s']:.1f} s)",
                flush=True,
            )
    finally:
        for w in workers:
            w.stop()
    by = {r["policy"]: r for r in rows}
    if "kv" in by and "round_robin" in by:
        ratio = by["kv"]["hit_rate"] / by["round_robin"]["hit_rate"]
        print(f"kv hit rate / round_robin: {ratio:.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
