"""Random traces for the simulator's tests."""

from __future__ import annotations

import random

from radixkv.sim.traces import (
    Interner,
    SimRequest,
    Trace,
)


def random_trace(seed: int, requests: int = 120) -> Trace:
    """Prefix-closed unit sequences drawn from a small random tree of prompts."""
    rng = random.Random(seed)
    interner = Interner()
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(5)]
    trace = Trace(f"random{seed}", 1)
    for _ in range(requests):
        toks = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        units = interner.units(toks, 1)
        trace.requests.append(SimRequest(units, len(units), len(toks)))
    return trace
