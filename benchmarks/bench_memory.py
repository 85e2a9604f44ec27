"""Slot allocator throughput: alloc + free, slots per second.

    python benchmarks/bench_memory.py [--repeats 3]

Each round allocates a batch of requests' worth of slots (random sizes, 16 alive at a
time) and frees the oldest, so the free stack is always churning.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from radixkv.kvcache.memory import TokenToKVPoolAllocator


def run(page_size: int, rounds: int = 20_000, seed: int = 0) -> float:
    rng = random.Random(seed)
    alloc = TokenToKVPoolAllocator(1 << 20, page_size)
    sizes = [rng.randint(16, 512) for _ in range(rounds)]
    alive = []
    slots = 0
    t0 = time.perf_counter()
    for n in sizes:
        got = alloc.alloc(n)
        alive.append(got)
        slots += n
        if len(alive) > 16:
            alloc.free(alive.pop(0))
    for got in alive:
        alloc.free(got)
    return slots / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for page in (1, 16):
        rate = statistics.median(run(page) for _ in range(args.repeats))
        print(
            f"page_size={page:>2}: {rate / 1e6:6.1f} M slots/s alloc+free "
            f"({1e6 * 264 / rate:5.1f} µs per 264-slot request)"
        )


if __name__ == "__main__":
    main()
