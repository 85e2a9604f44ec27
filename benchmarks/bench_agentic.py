"""Agentic traces (kv-cache-tester's Claude Code sessions) through the simulator.

1. **The reader against the published statistics.** kv-cache-tester's README gives, over
   its 739 traces, the requests per trace and each conversation's cache hit rate "from
   hash_id overlap between consecutive requests within each conversation" (and with 75%
   of the tool + system prefix warm on the first request). The same statistics are
   recomputed here over the files given, twice: straight from the JSON (consecutive
   overlap, this script's own arithmetic) and through `radixkv.sim.agentic` (each
   conversation replayed alone with an unbounded cache, which hits any earlier request,
   so it is at least the consecutive overlap).
2. **Policies at bounded capacities**: ``--sessions`` conversations drawn within an hour,
   for each seed, at each capacity (tokens of KV): every policy beside Belady's offline
   optimum, and the share of the LRU -> Belady gap each closes.

    python benchmarks/bench_agentic.py ../shared/data/agentic/traces [--sessions 40]
        [--seeds 1,2,3] [--capacities 256k,512k,1M] [--policies lru,slru,lfu,session]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

from radixkv.sim import sweep
from radixkv.sim.agentic import load_agentic, trace_files

PUBLISHED = {  # kv-cache-tester's README, 739 traces
    "requests per trace": (3, 19, 48, 101, 1178, 80),
    "hit rate, conversation only": (0.61, 0.92, 0.96, 0.97, 1.00, 0.93),
    "hit rate, 75% warm prefix": (0.67, 0.93, 0.96, 0.97, 1.00, 0.94),
}


def _calls(reqs: list) -> list[list[dict]]:
    """A conversation's sessions: its own calls, then each sub-agent's."""
    own, subs = [], []
    for r in reqs:
        if r.get("type") == "subagent":
            subs += _calls(r["requests"])
        else:
            own.append(r)
    return [own, *subs]


def consecutive_overlap(doc: dict, warm: float) -> float:
    """Tokens hit over tokens sent, a hit being the leading hash ids a call shares with
    the call before it in its session (the first call: ``warm`` of the tool + system
    prefix)."""
    block, hit, sent = doc["block_size"], 0, 0
    prefix = int(warm * (doc["tool_tokens"] + doc["system_tokens"])) // block * block
    for session in _calls(doc["requests"]):
        prev: list = []
        for c in session:
            common = 0
            for a, b in zip(prev, c["hash_ids"], strict=False):
                if a != b:
                    break
                common += 1
            hit += min(c["in"], common * block if prev else prefix)
            sent += c["in"]
            prev = c["hash_ids"]
    return hit / sent


def five(xs: list[float]) -> tuple[float, ...]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (min(xs), q[0], statistics.median(xs), q[2], max(xs), statistics.fmean(xs))


def published_statistics(folder: str) -> None:
    files = trace_files(folder)
    docs = []
    for f in files:
        if f.name.endswith(".gz"):
            with gzip.open(f) as g:
                docs.append(json.loads(g.read()))
        else:
            docs.append(json.loads(f.read_bytes()))
    reqs = [len([c for s in _calls(d["requests"]) for c in s]) for d in docs]
    own = {name: [] for name in PUBLISHED}
    own["requests per trace"] = reqs
    for d in docs:
        own["hit rate, conversation only"].append(consecutive_overlap(d, 0.0))
        own["hit rate, 75% warm prefix"].append(consecutive_overlap(d, 0.75))
    via = []  # the reader, each conversation alone, unbounded
    for f in files:
        t = load_agentic(f)
        run = sweep.run_sweep(t, [None], ["lru"])
        via.append(run.results[0].token_hit_rate)
    print(f"\n{len(files)} traces: min / P25 / median / P75 / max / mean\n")
    print("| statistic | kv-cache-tester (739 traces) | these traces, from the JSON | "
          "through the reader (unbounded) |")  # fmt: skip
    print("|---|---|---|---|")
    fmt = lambda xs, r: " / ".join(f"{x:.{r}f}" for x in xs)  # noqa: E731
    counted = [len(load_agentic(f).requests) for f in files]
    print(f"| requests per trace | {fmt(PUBLISHED['requests per trace'], 0)} | "
          f"{fmt(five(reqs), 0)} | {fmt(five(counted), 0)} |")
    for name in ("hit rate, conversation only", "hit rate, 75% warm prefix"):
        reader = fmt(five(via), 3) if name.endswith("only") else "-"
        print(f"| {name} | {fmt(PUBLISHED[name], 2)} | {fmt(five(own[name]), 3)} | {reader} |")


def policies(folder: str, sessions: int, seeds: list[int], caps: list[str],
             names: list[str]) -> None:  # fmt: skip
    print(f"\n{sessions} sessions within an hour; token hit rate, and the share of the "
          "LRU -> Belady gap closed\n")
    print("| seed | capacity | ceiling | " + " | ".join(names) + " | belady |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for seed in seeds:
        trace = load_agentic(folder, sessions, seed, 3600.0)
        units = [sweep.parse_capacity(c, trace.block_size, 0) for c in caps]
        run = sweep.run_sweep(trace, units, [*names, "belady"])
        rate = {(r.policy, r.capacity_tokens): r.token_hit_rate for r in run.results}
        for cap, u in zip(caps, units, strict=True):
            tokens = u * trace.block_size
            lru, best = rate[("lru", tokens)], rate[("belady", tokens)]
            cells = []
            for p in names:
                x = rate[(p, tokens)]
                closed = (x - lru) / (best - lru) if best > lru else 0.0
                cells.append(f"{x:.3f}" + ("" if p == "lru" else f" ({closed:+.0%})"))
            print(f"| {seed} | {cap} | {run.ceiling:.3f} | " + " | ".join(cells) +
                  f" | {best:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces")
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--capacities", default="256k,512k,1M")
    ap.add_argument("--policies", default="lru,slru,lfu,session")
    args = ap.parse_args()
    assert Path(args.traces).exists(), args.traces
    published_statistics(args.traces)
    policies(args.traces, args.sessions, [int(s) for s in args.seeds.split(",")],
             args.capacities.split(","), args.policies.split(","))  # fmt: skip


if __name__ == "__main__":
    main()
