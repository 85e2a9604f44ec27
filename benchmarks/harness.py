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


def run_suite(
    workloads: list[str],
    pages: list[int],
    repeats: int,
    per_page: dict[str, Callable[[int], tuple[float, dict]]],
    request_path: Callable[[int, bool], tuple[float, dict]] | None = None,
    memory: Callable[[], dict] | None = None,
    with_events: dict[str, Callable[[int], tuple[float, dict]]] | None = None,
) -> list[Result]:
    """Run the requested workloads: (f) first, in a fresh heap (memory freed by other
    workloads would hide growth); (a)-(d) per page size; (e) at page 16, ample then tight.
    ``with_events``: the same workloads with KV events on (rows with variant "events")."""
    rows: list[Result] = []
    if "f" in workloads and memory is not None:
        rows.append({"workload": "f", "page_size": 1, **memory()})
    for page in pages:
        for w in workloads:
            if w in per_page:
                on, off, extra = measure(lambda w=w, p=page: per_page[w](p), repeats)
                rows.append(
                    {"workload": w, "page_size": page, "us_gc_on": on, "us_gc_off": off, **extra}
                )
            if w in (with_events or {}):
                fn = with_events[w]  # type: ignore[index]
                on, off, extra = measure(lambda fn=fn, p=page: fn(p), repeats)
                rows.append({"workload": w, "variant": "events", "page_size": page,
                             "us_gc_on": on, "us_gc_off": off, **extra})  # fmt: skip
    if "e" in workloads and request_path is not None:
        for tight in (False, True):
            on, off, extra = measure(lambda t=tight: request_path(16, t), repeats)
            rows.append(
                {
                    "workload": "e",
                    "variant": "tight" if tight else "ample",
                    "page_size": 16,
                    "us_gc_on": on,
                    "us_gc_off": off,
                    **extra,
                }
            )
    return rows


def adapter_main(impl: str, run: Callable[[list[str], list[int], int], list[Result]]) -> None:
    """The command line every adapter shares; prints the JSON the runner reads."""
    import argparse

    p = argparse.ArgumentParser(description=f"{impl} on the shared benchmark workloads")
    p.add_argument("--workloads", default="a,b,c,d,e,f,g")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    emit(
        impl,
        run(args.workloads.split(","), [int(x) for x in args.page_sizes.split(",")], args.repeats),
    )
