"""How far can an online session order go on agent traffic? The session order
(`radixkv.sim.sessions`, ``--policy session``) beside orders told parts of the future
that no server knows, on the same replays: the share of the LRU -> Belady gap each
closes shows what each piece of knowledge is worth.

- ``session``: the shipped order (a session's stop reasons and gaps so far);
- ``+ends``: the same, told when each running answer will end (a server knows only that
  it is running);
- ``+tool gaps``: the same, told exactly when each agent waiting on a tool call comes
  back (the one piece a server would have to predict from the tool itself);
- ``oracle``: every session's next arrival (Belady at the session's grain);
- ``blind``: the order told *less* than a server usually knows: no answer's stop
  reason (a client that offers no tools and ends every answer at ``max_tokens``, as
  kv-cache-tester's replay client does), only each session's gaps.

Each row also gives Belady's and the orders' ratio to LRU (issue 61's live target asks
1.15x LRU).

Also the online features a server has for a tool call's gap, against the gap itself
(Spearman's rank correlation over every ``tool_use`` answer of the files).

    python benchmarks/bench_session_bounds.py ../shared/data/agentic/traces
        [--sessions 40] [--seeds 1,2,3] [--capacities 256k,512k,1M]

Measurement only: the told orders read the trace's future and ship nowhere.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from radixkv.sim import replay, sessions
from radixkv.sim.agentic import load_agentic, trace_files
from radixkv.sim.sweep import parse_capacity

INF = float("inf")


class _Told(sessions.SessionOrder):
    """The session order, told the trace's future (``know``: ``ends``, ``tools`` or
    ``all``)."""

    def __init__(self, trace: Any, know: str) -> None:
        super().__init__()
        self.know = know
        self.next_of: dict[int, float] = {}  # a request -> its session's next arrival
        last: dict[Any, Any] = {}
        for r in trace.requests:
            if r.session in last:
                self.next_of[id(last[r.session])] = r.timestamp
            last[r.session] = r
        self.nxt: dict[Any, float] = {}
        self.end: dict[Any, tuple[float, str]] = {}

    def arrive(self, req: Any) -> None:
        super().arrive(req)
        if req.session is not None:
            self.nxt[req.session] = self.next_of.get(id(req), INF)
            self.end[req.session] = (req.timestamp + req.duration_ms, req.stop)

    def predicted(self, session: Any) -> float:
        end, stop = self.end[session]
        running = self.now < end
        if self.know == "all" or (self.know == "tools" and not running and stop == "tool_use"):
            return self.nxt[session]
        if self.know == "ends" and running:
            return end + self.clock.typical(session, "tool_use") * 1000.0
        return super().predicted(session)


class _Blind(sessions.SessionOrder):
    """The session order, never told how an answer stopped."""

    def __init__(self) -> None:
        super().__init__()
        told = self.clock.stopped
        self.clock.stopped = lambda s, now, stop, node=None: told(s, now, "", node)  # type: ignore[method-assign]


ORDERS = {"session": None, "+ends": "ends", "+tool gaps": "tools", "oracle": "all",
          "blind": "blind"}  # fmt: skip


def _cell(args: tuple[str, int, int, str, str]) -> float:
    folder, n, seed, cap, order = args
    trace = load_agentic(folder, n, seed, 3600.0)
    units = parse_capacity(cap, trace.block_size)
    if order in ("lru", "belady"):
        return replay.simulate(trace, units, order).token_hit_rate
    know = ORDERS[order]
    original = sessions.SessionOrder
    if know == "blind":
        sessions.SessionOrder = _Blind  # type: ignore[misc]
    elif know is not None:
        sessions.SessionOrder = lambda: _Told(trace, know)  # type: ignore[assignment,misc]
    try:
        return replay.simulate(trace, units, "session").token_hit_rate
    finally:
        sessions.SessionOrder = original  # type: ignore[misc]


def _ranks(v: list[float]) -> list[float]:
    order = sorted(range(len(v)), key=v.__getitem__)
    out = [0.0] * len(v)
    for k, i in enumerate(order):
        out[i] = float(k)
    return out


def features(folder: str) -> dict[str, float]:
    """Spearman's rho of each online feature of a ``tool_use`` answer with the gap
    before the session's next call."""
    rows: list[dict[str, float]] = []

    def walk(reqs: list[dict]) -> None:
        calls = []
        for r in reqs:
            if r.get("type") == "subagent":
                walk(r["requests"])
            else:
                calls.append(r)
        prev = None
        for a, b in itertools.pairwise(calls):
            if a.get("stop") != "tool_use":
                continue
            gap = b.get("think_time", 0.0)
            rows.append({"gap": gap, "answer's API time": a.get("api_time", 0.0),
                         "prompt tokens": a["in"], "output tokens": a.get("out", 0),
                         "previous gap": -1.0 if prev is None else prev})  # fmt: skip
            prev = gap

    for f in trace_files(folder):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            walk(json.load(fh)["requests"])
    out = {}
    for k in ("answer's API time", "prompt tokens", "output tokens", "previous gap"):
        kept = [r for r in rows if r[k] >= 0]
        out[k] = statistics.correlation(_ranks([r[k] for r in kept]),
                                        _ranks([r["gap"] for r in kept]))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--sessions", type=int, default=40)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--capacities", default="256k,512k,1M")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    caps = a.capacities.split(",")
    names = ["lru", "belady", *ORDERS]
    jobs = [(a.folder, a.sessions, s, c, o) for s in seeds for c in caps for o in names]
    with ProcessPoolExecutor() as ex:
        got = dict(zip(jobs, ex.map(_cell, jobs), strict=True))
    print("| seed | capacity | lru | belady | " + " | ".join(ORDERS) + " | ÷ lru: belady, "
          "session, blind |")  # fmt: skip
    print("|---" * (5 + len(ORDERS)) + "|")
    for s in seeds:
        for c in caps:
            lru, bel = (got[(a.folder, a.sessions, s, c, o)] for o in ("lru", "belady"))
            cells = []
            for o in ORDERS:
                v = got[(a.folder, a.sessions, s, c, o)]
                cells.append(f"{v:.3f} ({(v - lru) / (bel - lru):+.0%})")
            ses, blind = (got[(a.folder, a.sessions, s, c, o)] for o in ("session", "blind"))
            ratios = f"{bel / lru:.2f} / {ses / lru:.2f} / {blind / lru:.2f}"
            print(f"| {s} | {c} | {lru:.3f} | {bel:.3f} | " + " | ".join(cells)
                  + f" | {ratios} |")  # fmt: skip
    print()
    print("| a tool call's online feature | Spearman's rho with the gap after it |")
    print("|---|---|")
    for k, v in features(a.folder).items():
        print(f"| {k} | {v:.3f} |")


if __name__ == "__main__":
    main()
