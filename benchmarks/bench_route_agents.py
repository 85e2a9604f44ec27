"""Routing agents, live: kv-cache-tester's own client (``trace_replay_tester.py``, a peer
tool in its own venv: ``../shared/peers/setup.sh kvtester``) replays the recorded Claude
Code sessions through a router in front of three `radixkv serve` workers; `radixkv route
--policy kv` against SGLang's router (``cache_aware``, ``setup.sh router``), in
interleaved pairs, each run on fresh workers.

Per run: the workers' prefix-cache hit rate (their hits over their queries, summed), the
load imbalance (the busiest worker's computed prefill tokens + generated tokens over the
mean: its busy time, as the simulator's table counts it; and its requests over the
mean), requests served, the client's TTFT p50 / p90. The machine's limits: a tiny model
(``radixkv make-model qwen3 /tmp/kvm --context 65536``), ``--max-context`` tokens a
request, 8 users.

    python benchmarks/bench_route_agents.py --traces /tmp/traces --duration 300 --pairs 3

Needs: the shared traces gunzipped into ``--traces``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
from pathlib import Path

from bench_route import PEER, PeerRouter, worker_totals

from radixkv.web.process import ServerProcess, free_port_pair

KVTESTER = Path.home() / ".cache" / "radixkv-peers" / "kvtester"


def workers(model: str, kv_tokens: int, n: int) -> tuple[list[ServerProcess], list[str]]:
    ports = [free_port_pair() for _ in range(n)]
    flags = ["--model", model, "--max-context-len", "65536", "--kv-tokens", str(kv_tokens),
             "--served-model-name", "kvm", "--max-running", "8", "--page-size", "16"]  # fmt: skip
    procs = [ServerProcess(*flags, "--kv-events", f"tcp://127.0.0.1:{q}", timeout=120)
             for q in ports]  # fmt: skip
    return procs, [f"{w.url},tcp://127.0.0.1:{q}" for w, q in zip(procs, ports, strict=True)]


def client(url: str, args: argparse.Namespace, out: Path, seed: int) -> list[float]:
    """Run kv-cache-tester's client against ``url``; its TTFTs (seconds)."""
    cmd = [str(KVTESTER / "bin" / "python"), str(KVTESTER / "trace_replay_tester.py"),
           "--api-endpoint", url, "--trace-directory", args.traces, "--output-dir", str(out),
           "--tokenizer", args.model, "--max-context", str(args.max_context),
           "--max-users", str(args.users), "--start-users", str(args.users),
           "--test-duration", str(args.duration), "--seed", str(seed), "--skip-graphs",
           "--time-scale", str(args.time_scale), "--max-ttft", "1000", "--recycle"]  # fmt: skip
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return sorted(float(r["ttft"]) for f in glob.glob(f"{out}/**/detailed_results.csv",
                                                      recursive=True)
                  for r in csv.DictReader(open(f)) if r.get("ttft") and float(r["ttft"]) > 0)


def run(args: argparse.Namespace, router: str, seed: int) -> dict:
    procs, specs = workers(args.model, args.kv_tokens, 3)
    urls = [w.url for w in procs]
    front: object
    try:
        if router == "cache_aware":
            front = PeerRouter(PEER, urls)
        else:
            flags = [a for s in specs for a in ("--worker", s)]
            front = ServerProcess("--model", args.model, "--policy", router, *flags,
                                  command="route", timeout=120)  # fmt: skip
        try:
            out = Path(args.out) / f"client_{router}_{seed}"
            ttft = client(front.url, args, out, seed)  # type: ignore[attr-defined]
        finally:
            front.stop()  # type: ignore[attr-defined]
        totals = [worker_totals(u) for u in urls]
    finally:
        for w in procs:
            w.stop()
    work = [t.get("prefill_computed_tokens_total", 0) + t.get("generation_tokens_total", 0)
            for t in totals]  # fmt: skip
    reqs = [t.get("request_success_total", 0) for t in totals]
    hits = sum(t.get("prefix_cache_hits_total", 0) for t in totals)
    queries = sum(t.get("prefix_cache_queries_total", 0) for t in totals)
    return {
        "router": router, "seed": seed, "hit_rate": hits / queries if queries else 0.0,
        "work_imbalance": max(work) / statistics.mean(work) if sum(work) else 0.0,
        "request_imbalance": max(reqs) / statistics.mean(reqs) if sum(reqs) else 0.0,
        "requests": reqs, "work": work,
        "ttft_p50": statistics.median(ttft) if ttft else None,
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="/tmp/traces")
    p.add_argument("--model", default="/tmp/kvm")
    p.add_argument("--duration", type=int, default=300)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--kv-tokens", type=int, default=16384, help="each worker's pool")
    p.add_argument("--max-context", type=int, default=16384)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--routers", default="kv,approx",
                   help="radixkv route policies; cache_aware: SGLang's router (kv-cache-tester's "
                   "client cannot use it: it reads the model name from /v1/models, which "
                   "sglang-router 0.3.2 answers as text/plain, naming the model 'unknown')")
    p.add_argument("--out", default="/tmp/route_agents")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # three workers on a few cores: one each
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(1, args.pairs + 1):
        for router in args.routers.split(","):
            row = run(args, router, seed)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(Path(args.out) / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    for router in args.routers.split(","):
        mine = [r for r in rows if r["router"] == router]
        each = ", ".join(f"{r['hit_rate']:.4f}" for r in mine)
        print(f"{router}: hit {statistics.median(r['hit_rate'] for r in mine):.4f} (runs "
              f"{each}), work imbalance {statistics.median(r['work_imbalance'] for r in mine):.2f}")


if __name__ == "__main__":
    main()
