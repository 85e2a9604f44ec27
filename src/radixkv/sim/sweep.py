"""Capacity sweeps: parse capacities, run many replays in parallel, report them.

Capacities are given in tokens (``1M``, ``512k``, ``inf``), blocks (``2000blocks``) or bytes
of KV (``8GiB``, ``8GB``, needing a model's bytes per token from `MODELS` or a custom value).

Owns: capacity parsing, sweeps and their output. Must not touch: a replay's logic.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing as mp
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from radixkv.sim.replay import (
    BLOCK_POLICIES,
    POLICY_NAMES,
    SESSION,
    SimResult,
    reuse_ceiling,
    simulate,
)
from radixkv.sim.traces import Trace
from radixkv.units import BYTE_UNITS


class SweepRun(NamedTuple):
    """`run_sweep`: the results in (policy, capacity) order, and the reuse ceiling."""

    results: list[SimResult]
    ceiling: float  # the unbounded hit rate


# KV bytes per token: 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16/fp16).
MODELS: dict[str, int] = {
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,
    "qwen2.5-72b": 2 * 80 * 8 * 128 * 2,
    "smollm2-135m": 2 * 30 * 3 * 64 * 2,
}

_TOKENS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTES = BYTE_UNITS
_BLOCKS = ("blocks", "block", "blk")
CAPACITY_FORMS = "tokens (65536, 512k, 1M), blocks (2000blocks), KV bytes (8GiB, 8GB) or inf"


def parse_capacity(text: str, block_size: int, bytes_per_token: int | None = None) -> int | None:
    """Capacity in units (blocks, rounded down), or ``None`` for ``inf``.

    Units are never guessed: a bare number or ``k``/``M``/``G`` counts tokens, ``blocks``
    counts blocks, and bytes are written ``B``, ``KiB``..``TiB`` or ``KB``..``TB``. A lone
    lowercase ``b`` (blocks or bytes?) is refused.

    Raises:
        ValueError: unreadable text, an ambiguous unit, a byte size without
            ``bytes_per_token``, or a non-zero capacity below one block.
    """
    raw = text.strip().replace("_", "")
    if raw.lower() in ("inf", "unbounded", "none"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([A-Za-z]*)", raw)
    if not m:
        raise ValueError(f"capacity {text!r}: expected {CAPACITY_FORMS}")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "b":
        raise ValueError(
            f"capacity {text!r} is ambiguous: write {m.group(1)}blocks for blocks or "
            f"{m.group(1)}B for bytes"
        )
    if unit.lower() in _BLOCKS:
        units = int(value)
    elif unit in _BYTES:
        if not bytes_per_token:
            raise ValueError(f"capacity {text!r} is in bytes: give --model or --bytes-per-token")
        units = int(value * _BYTES[unit] / bytes_per_token) // block_size
    elif unit.lower().removesuffix("tokens").removesuffix("tok") in _TOKENS:
        units = int(value * _TOKENS[unit.lower().removesuffix("tokens").removesuffix("tok")])
        units //= block_size
    else:
        raise ValueError(f"capacity {text!r}: unknown unit {unit!r}; expected {CAPACITY_FORMS}")
    if units == 0 and value > 0:
        raise ValueError(
            f"capacity {text!r} is less than one block ({block_size} tokens"
            + (f", {block_size * bytes_per_token:,} bytes)" if bytes_per_token else ")")
        )
    return units


_TRACE: Trace | None = None  # the trace, shared with forked workers


def _run(args: tuple[int | None, str, bool, float, str]) -> SimResult:
    assert _TRACE is not None
    cap, policy, outputs, warmup, scope = args
    return simulate(_TRACE, cap, policy, cache_outputs=outputs, warmup=warmup, scope=scope)


@contextmanager
def _pool(workers: int) -> Iterator[Any]:
    """Forked workers that stop with this process: a SIGINT to it alone (a supervisor's;
    a terminal's reaches only it too, as the workers ignore SIGINT) terminates them at
    once, where an executor's exit waited for every running replay. While they fork, a
    SIGINT is only noted, and raised once inside: raised then, in an at-fork handler, it
    was swallowed ("Exception ignored") and the run went on. (Killing the workers before
    the pool's exit deadlocks it: one may hold its task queue's lock.)"""
    noted: list[int] = []
    hold = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )  # (an inherited SIG_IGN stays as it is)
    if hold:
        signal.signal(signal.SIGINT, lambda *_: noted.append(1))
    try:
        pool = mp.get_context("fork").Pool(workers, initializer=_ignore_sigint)
    finally:
        if hold:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    with pool:  # its exit terminates them (SIGTERM: no traceback, nothing waited for)
        if noted:
            raise KeyboardInterrupt
        yield pool


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sweep(
    trace: Trace,
    capacities: Sequence[int | None],
    policies: Sequence[str],
    cache_outputs: bool = False,
    warmup: float = 0.0,
    workers: int | None = None,
    progress: Callable[[SimResult], None] | None = None,
    scope: str = "tree",
) -> list[SimResult]:
    """Every (policy, capacity) point, across processes when there are several cores.
    Results come back in (policy, capacity) order."""
    global _TRACE
    jobs = [(c, p, cache_outputs, warmup, scope) for p in policies for c in capacities]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    _TRACE = trace
    try:
        if workers <= 1 or "fork" not in mp.get_all_start_methods():
            out = []
            for job in jobs:
                out.append(_run(job))
                if progress:
                    progress(out[-1])
            return out
        with _pool(workers) as pool:
            out = []
            for result in pool.imap(_run, jobs):
                out.append(result)
                if progress:
                    progress(result)
            return out
    finally:
        _TRACE = None


def policy_list(text: str | None, scope: str) -> list[str]:
    """The policies ``--policy`` names (``None``: the scope's defaults; ``all``).

    Raises:
        ValueError: ``policy: ...`` naming an unknown one.
    """
    valid = POLICY_NAMES if scope == "tree" else BLOCK_POLICIES
    text = text or ("lru,lfu,belady" if scope == "tree" else "lru,fifo")
    names = list(valid) if text == "all" else text.split(",")
    named = (*valid, SESSION) if scope == "tree" else valid  # (session: named, not in all)
    for p in names:
        if p not in named:
            raise ValueError(f"policy: unknown {p!r} for --scope {scope}; valid: "
                             f"{', '.join(valid)}")  # fmt: skip
    return names


def capacities(text: str, block_size: int, bytes_per_token: int | None) -> dict[int | None, str]:
    """Comma-separated capacities as units, each with the text that gave it (in order,
    duplicates once).

    Raises:
        ValueError: a capacity `parse_capacity` refuses.
    """
    labels: dict[int | None, str] = {}
    for part in text.split(","):
        labels.setdefault(parse_capacity(part, block_size, bytes_per_token), part.strip())
    return labels


def bounded_caps(caps: Sequence[int | None]) -> list[int | None]:
    """The capacities to sweep policy by policy (`run_sweep` replays the unbounded one
    once, when there are others)."""
    return [c for c in caps if c is not None] if len(caps) > 1 and None in caps else list(caps)


def run_sweep(
    trace: Trace,
    caps: Sequence[int | None],
    policies: Sequence[str],
    cache_outputs: bool = False,
    warmup: float = 0.0,
    workers: int | None = None,
    progress: Callable[[SimResult], None] | None = None,
    scope: str = "tree",
) -> SweepRun:
    """`sweep`, with the unbounded point replayed once for every policy (it is the same
    for all), the results in (policy, capacity) order, and the reuse ceiling: the
    unbounded hit rate (with a warm-up, the measured one)."""
    bounded = bounded_caps(caps)
    results = sweep(trace, bounded, policies, cache_outputs, warmup, workers, progress, scope)
    if len(caps) > 1 and None in caps:
        unbounded = simulate(trace, None, "lru", cache_outputs, warmup, scope=scope)
        for p in policies:
            results.append(SimResult(**{**unbounded.to_dict(), "policy": p}))
        order = {c: i for i, c in enumerate(caps)}
        results.sort(key=lambda r: (policies.index(r.policy), order[r.capacity_units]))
    if not warmup:
        ceiling = reuse_ceiling(trace, cache_outputs)
    else:
        unbounded_rates = [r.token_hit_rate for r in results if r.capacity_units is None]
        ceiling = max(unbounded_rates, default=float("nan"))
    return SweepRun(results, ceiling)


def to_json(results: list[SimResult], ceiling: float) -> str:
    return json.dumps(
        {"reuse_ceiling": ceiling, "results": [r.to_dict() for r in results]}, indent=2
    )


def to_csv(results: list[SimResult]) -> str:
    buf = io.StringIO()
    rows = [r.to_dict() for r in results]
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["policy"])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def fmt_tokens(n: int | None) -> str:
    if n is None:
        return "inf"
    for div, suf in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= div:
            return f"{n / div:.4g}{suf}"
    return str(n)


def print_table(
    results: list[SimResult],
    ceiling: float,
    trace: Trace,
    console: Any,
    labels: dict[int | None, str] | None = None,
) -> None:
    """The results as a table; ``labels`` maps a capacity in units to the text the user
    gave (``1M``, ``8GiB``), shown next to the exact tokens it came to."""
    from rich.table import Table

    labels = labels or {}
    table = Table(
        title=f"{trace.name}: {len(trace.requests):,} requests, {trace.prompt_tokens():,} "
        f"prompt tokens, block {trace.block_size}; reuse ceiling {ceiling:.3f}"
    )
    for col in (
        "policy",
        "capacity",
        "tokens",
        "token hit rate",
        "request hit rate",
        "block hit rate",
        "prefill tokens saved",
        "evicted blocks",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right", overflow="fold")
    for r in results:
        table.add_row(
            r.policy,
            labels.get(r.capacity_units, fmt_tokens(r.capacity_tokens)),
            "inf" if r.capacity_tokens is None else f"{r.capacity_tokens:,}",
            f"{r.token_hit_rate:.4f}",
            f"{r.request_hit_rate:.4f}",
            f"{r.block_hit_rate:.4f}",
            fmt_tokens(r.hit_tokens),
            f"{r.evicted_units:,}",
        )
    console.print(table)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed).

    Raises:
        RuntimeError: matplotlib is not installed (the ``plot`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install 'radixkv[plot]'") from e
    return plt


def save_plot(plt: Any, fig: Any, ax: Any, path: str) -> None:
    """The common end of every plot: grid, legend, layout, the PNG, the figure closed."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: list[SimResult], ceiling: float, trace: Trace, path: str) -> None:
    """Hit rate against capacity, one curve per policy, the unbounded ceiling marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        pts = sorted(
            (r.capacity_tokens, r.token_hit_rate)
            for r in results
            if r.policy == policy and r.capacity_tokens is not None
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.axhline(ceiling, linestyle="--", color="gray", label=f"unbounded ({ceiling:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, min(1.0, max(ceiling, 0.05) * 1.15))
    ax.set_title(f"Prefix-cache hit rate: {trace.name}")
    save_plot(plt, fig, ax, path)


__all__ = [
    "MODELS",
    "parse_capacity",
    "plot",
    "print_table",
    "reuse_ceiling",
    "sweep",
    "to_csv",
    "to_json",
]
