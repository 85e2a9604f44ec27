"""radixkv's RadixCache alone on the core workloads (a)-(d): a quick look without peers.

    python benchmarks/bench_tree.py [--page-sizes 1,16] [--repeats 3]

For the side-by-side comparison with SGLang and vLLM use ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "adapters"))

import radixkv_adapter
from radixkv_adapter import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--events",
        action="store_true",
        help="caches report KV events to a "
        "sink that only counts them (the (a)/(b) events rows use the engine's)",
    )
    args = parser.parse_args()
    radixkv_adapter.EVENTS = args.events
    rows = run(["a", "b", "c", "d"], [int(p) for p in args.page_sizes.split(",")], args.repeats)
    print(f"{'workload':<10}{'page':>6}{'µs GC on':>12}{'µs GC off':>12}{'hit rate':>10}")
    for r in rows:
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else ""
        name = f"({r['workload']}) {r.get('variant', '')}"
        print(
            f"{name:<10}{r['page_size']:>6}{r['us_gc_on']:>12.1f}{r['us_gc_off']:>12.1f}{hit:>10}"
        )


if __name__ == "__main__":
    main()
