"""Timing and memory helpers shared by every adapter (stdlib only: adapters run in the
peers' own virtual environments)."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
from collections.abc import Callable

Result = dict


def measure(fn: Callable[[], tuple[float, dict]], repeats: int) -> tuple[float, float, dict]:
    """Median µs/op of ``fn`` with the garbage collector on (as engines run) and off.
    ``fn`` builds its own state, times only the operations, and returns (µs/op, extras)."""
    on, off, extra = [], [], {}
    for gc_on in (True, False):
        for _ in range(repeats):
            gc.collect()
            if not gc_on:
                gc.disable()
            try:
                us, extra = fn()
            finally:
                gc.enable()
            (on if gc_on else off).append(us)
    return statistics.median(on), statistics.median(off), extra


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (torch storage included)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def emit(impl: str, rows: list[Result]) -> None:
    """Print the adapter's results as one JSON document on stdout."""
    json.dump({"impl": impl, "python": sys.version.split()[0], "rows": rows}, sys.stdout)
    sys.stdout.write("\n")
