"""Micro-benchmark of radixkv's RadixCache on the core workloads (a)-(d).

    python benchmarks/bench_tree.py [--page-sizes 1,16] [--repeats 3] [--json out.json]

Prints µs per operation (median of ``--repeats`` runs) with the garbage collector on
(as engines run) and off. Workloads are seeded (see ``workloads.py``); keys and value
tensors are built before the clock starts, for every implementation alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

from radixkv import RadixCache, RadixKey


def _keys(seqs: list[list[int]]) -> list[RadixKey]:
    return [RadixKey(array("q", s)) for s in seqs]


def _values(seqs: list[list[int]]) -> list[torch.Tensor]:
    out, nxt = [], 0
    for s in seqs:
        out.append(torch.arange(nxt, nxt + len(s), dtype=torch.int64))
        nxt += len(s)
    return out


def bench_match_insert(seqs: list[list[int]], page: int) -> tuple[float, float]:
    """(a)/(b): per request, match then insert. Returns (µs per request, token hit rate)."""
    keys, values = _keys(seqs), _values(seqs)
    cache = RadixCache(page_size=page)
    hit = 0
    t0 = time.perf_counter()
    for key, value in zip(keys, values, strict=True):
        hit += cache.match_prefix(key).prefix_len
        cache.insert(key, value)
    dt = time.perf_counter() - t0
    return dt / len(seqs) * 1e6, hit / sum(len(s) for s in seqs)


def bench_evict(page: int) -> tuple[float, float]:
    """(c): evict(1000) with ~5,000 leaves, refilling between calls. µs per evict."""
    initial, batches = workloads.eviction_leaves()
    cache = RadixCache(page_size=page)
    for key in _keys(initial):
        cache.insert(key)
    refills = [_keys(b) for b in batches]
    total = 0.0
    for batch in refills:
        for key in batch:
            cache.insert(key)
        t0 = time.perf_counter()
        cache.evict(1000)
        total += time.perf_counter() - t0
    return total / len(refills) * 1e6, float(cache.num_nodes())


def bench_chain(page: int, matches: int = 1000) -> tuple[float, float]:
    """(d): match a 32k-token prompt stored as a 256-node chain. µs per match."""
    chain = workloads.deep_chain()
    cache = RadixCache(page_size=page)
    for key in _keys(chain):
        cache.insert(key)
    query = _keys(chain[-1:])[0]
    t0 = time.perf_counter()
    for _ in range(matches):
        r = cache.match_prefix(query)
    dt = time.perf_counter() - t0
    assert r.prefix_len == len(chain[-1]) // page * page
    return dt / matches * 1e6, float(cache.num_nodes())


def measure(
    fn: Callable[[], tuple[float, float]], repeats: int, gc_on: bool
) -> tuple[float, float]:
    times, extra = [], 0.0
    for _ in range(repeats):
        gc.collect()
        if not gc_on:
            gc.disable()
        try:
            t, extra = fn()
        finally:
            gc.enable()
        times.append(t)
    return statistics.median(times), extra


def run(page_sizes: list[int], repeats: int) -> list[dict]:
    a = workloads.shared_system_prompt()
    b = workloads.multi_turn_chat()
    cases: list[tuple[str, str, Callable[[int], Callable[[], tuple[float, float]]]]] = [
        (
            "a",
            "shared system prompt, match+insert /req",
            lambda p: lambda: bench_match_insert(a, p),
        ),
        ("b", "multi-turn chat, match+insert /turn", lambda p: lambda: bench_match_insert(b, p)),
        ("c", "evict(1000), ~5k leaves /call", lambda p: lambda: bench_evict(p)),
        ("d", "match 32k tokens in 256-node chain /match", lambda p: lambda: bench_chain(p)),
    ]
    rows = []
    for page in page_sizes:
        for wid, desc, make in cases:
            us_on, extra = measure(make(page), repeats, gc_on=True)
            us_off, _ = measure(make(page), repeats, gc_on=False)
            rows.append(
                {
                    "workload": wid,
                    "description": desc,
                    "page_size": page,
                    "us_gc_on": us_on,
                    "us_gc_off": us_off,
                    "hit_rate": extra if wid in "ab" else None,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = run([int(p) for p in args.page_sizes.split(",")], args.repeats)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"radixkv RadixCache, median of {args.repeats} (µs/op)")
    for col in ("workload", "page", "µs (GC on)", "µs (GC off)", "hit rate"):
        table.add_column(col, justify="right" if col != "workload" else "left")
    for r in rows:
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else ""
        table.add_row(
            f"({r['workload']}) {r['description']}",
            str(r["page_size"]),
            f"{r['us_gc_on']:.1f}",
            f"{r['us_gc_off']:.1f}",
            hit,
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
