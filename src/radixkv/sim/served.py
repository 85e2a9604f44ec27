"""A server's own log replayed: what ``radixkv serve --served-log FILE`` wrote
(`radixkv.engine.served_log`: its cache knobs, then each request with the engine step it
arrived at) run again through the same engine without the model, each request entering
at its step. With the server's knobs and its arrival steps, the engine decides what it
decided live, at any concurrency: each request's cached prompt tokens are the server's
(``ServedReplay.agree`` counts them), the check a user runs against a server.

Owns: reading a served log and driving the engine by its steps. Must not touch: the
engine's internals (`radixkv.sim.serve_replay` builds and feeds it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.request import CacheSpec
from radixkv.engine.served_log import VERSION, knobs_from
from radixkv.sim import traces
from radixkv.sim.serve_replay import ServeReplay, add_replayed, finish_replay, replay_engine
from radixkv.sim.traces import Trace, TraceError, json_int, json_ints

FIELDS = ("order", "step", "token_ids", "output_ids", "boundaries", "extra_key", "group",
          "cache_limit", "cache_read", "retain", "finish", "left_step", "cached")  # fmt: skip


@dataclass(frozen=True)
class Arrival:
    """When and how a logged request entered the engine (and left it, if early)."""

    step: int
    left_step: int | None
    group: str | int | None
    cache: CacheSpec | None


@dataclass
class ServedTrace:
    """A served log: the requests (a token trace, in arrival order), how each arrived,
    what the server cached of each, and the server's knobs (`EngineConfig` fields)."""

    trace: Trace
    arrivals: list[Arrival]
    server_cached: list[int]
    knobs: dict[str, Any]

    def config(self) -> EngineConfig:
        """The server's `EngineConfig` (device: the CPU).

        Raises:
            ValueError: a knob the engine refuses.
        """
        return EngineConfig(**knobs_from(self.knobs))


@dataclass
class ServedReplay(ServeReplay):
    """A replay of a served log: `ServeReplay`'s totals and each request's agreement."""

    server_cached: list[int] = field(default_factory=list)

    @property
    def agree(self) -> int:
        """Requests whose cached prompt tokens equal the server's."""
        return sum(a == b for a, b in zip(self.cached, self.server_cached, strict=True))


def is_served_log(path: str | Path) -> bool:
    """Whether the file's first line is a served log's header."""
    with open(path, encoding="utf-8") as f:
        first = f.readline(4096)
    return '"radixkv_served_log"' in first


def _opt_int(rec: dict, key: str) -> int | None:
    v = rec[key]
    return None if v is None else json_int(v, key)


def _namespace(rec: dict, key: str) -> str | int | None:
    v = rec[key]
    if v is not None and (isinstance(v, bool) or not isinstance(v, (str, int))):
        raise ValueError(f"{key} must be a string, an integer or null, got {json.dumps(v)[:40]}")
    return v


def _cache(rec: dict, prompt: int) -> CacheSpec | None:
    read = rec["cache_read"]
    if not isinstance(read, bool):
        raise ValueError(f"cache_read must be true or false, got {json.dumps(read)[:40]}")
    limit = _opt_int(rec, "cache_limit")
    retain = rec["retain"]
    if not isinstance(retain, list) or not all(isinstance(x, list) and len(x) == 2 for x in retain):
        raise ValueError("retain must be a list of [position, seconds] pairs")
    pairs = []
    for pos, ttl in retain:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
            raise ValueError(f"retain: seconds must be a finite number, got {json.dumps(ttl)[:40]}")
        pairs.append((json_int(pos, "retain position", 1, prompt + 1), float(ttl)))
    if read and limit is None and not pairs:
        return None
    return CacheSpec(retain=tuple(pairs), limit=limit, read=read)


def load_served(path: str | Path) -> ServedTrace:
    """Read a served log (`radixkv.engine.served_log`), each line bounded as a trace's.

    Raises:
        TraceError: ``FILE:LINE: what is wrong``: no header, an unknown or missing field,
            a bad value, an order twice. (Requests are logged as they finish; they are
            replayed in arrival order, by step and order.)
    """
    from radixkv.checkpoint.files import regular_file

    regular_file(Path(path))  # a FIFO would block the open; a device never ends
    header: dict | None = None
    rows: list[tuple[int, int, list[int], dict, Arrival, int]] = []
    tally, orders = traces.Tally(), set()
    for n, rec in traces.read_records(path):
        try:
            if header is None:
                if rec.get("radixkv_served_log") != VERSION or not isinstance(
                    rec.get("config"), dict
                ):
                    raise ValueError(f"not a served log (its first line must be the header "
                                     f'{{"radixkv_served_log": {VERSION}, "config": {{...}}}})')
                header = rec
                continue
            if "radixkv_served_log" in rec:  # the server restarted onto the same file
                raise ValueError("a second header: one served log per server run")
            unknown = sorted(set(rec) - set(FIELDS))
            missing = [f for f in FIELDS if f not in rec]
            if unknown or missing:
                what = f"unknown field {unknown[0]!r:.40}" if unknown else f"missing {missing[0]!r}"
                raise ValueError(what)
            prompt = json_ints(rec["token_ids"], "token_ids")
            output = json_ints(rec["output_ids"], "output_ids")
            marks = json_ints(rec["boundaries"], "boundaries")
            if not prompt or any(not 0 < b <= len(prompt) for b in marks):
                raise ValueError("token_ids must not be empty; boundaries lie within them")
            tally.add(len(prompt) + len(output))
            order, step = json_int(rec["order"], "order"), json_int(rec["step"], "step")
            left = _opt_int(rec, "left_step")
            if order in orders or (left is not None and left < step):
                raise ValueError(f"order {order} twice, or a request leaving before it arrived")
            orders.add(order)
            if not isinstance(rec["finish"], str):
                raise ValueError("finish must be a string")
            arrival = Arrival(step, left, _namespace(rec, "group"), _cache(rec, len(prompt)))
            cached = json_int(rec["cached"], "cached", 0, len(prompt) + 1)
            ns = _namespace(rec, "extra_key")
            out = {"output_ids": output, "boundaries": marks, "extra_key": ns}
            rows.append((step, order, prompt, out, arrival, cached))
        except ValueError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
    if header is None or not rows:
        raise TraceError(f"{path}: a served log with no requests")
    try:
        knobs = knobs_from(header["config"])
        page = EngineConfig(**knobs).page_size  # (validates every knob)
    except (TypeError, ValueError) as e:
        text = str(e) if str(e).startswith("config") else f"config: {e}"
        raise TraceError(f"{path}:1: {text}") from None
    rows.sort(key=lambda x: x[:2])  # logged as they finished; replayed as they arrived
    trace = traces.from_tokens(Path(path).stem, [(x[2], x[3]) for x in rows], page)
    return ServedTrace(trace, [x[4] for x in rows], [x[5] for x in rows], dict(header["config"]))


def replay_served(log: ServedTrace, model: str | Path | torch.nn.Module) -> ServedReplay:
    """Replay ``log`` through an engine serving ``model`` (never run) with the server's
    knobs, each request queued before the engine's step count passes its arrival step
    (and aborted where it left early; one that failed leaves after its last step). Its
    ``mean_bytes``: per step.

    Raises:
        ValueError: a knob or a request the engine refuses (``trace request I: ...``).
    """
    cfg = log.config()
    # one token a step: the server's steps time the arrivals
    engine, outputs = replay_engine(log.trace, model, cfg, runs=False)
    capacity = int(cfg.cache_bytes) if isinstance(cfg.cache_bytes, int) else 0
    result = ServedReplay(capacity, cfg.max_running, server_cached=list(log.server_cached))
    sums = dict.fromkeys(("full", "window", "states"), 0.0)
    reqs = log.trace.requests
    leaving = sorted((a.left_step, i) for i, a in enumerate(log.arrivals)
                     if a.left_step is not None)  # fmt: skip
    done, nxt, gone, steps = [], 0, 0, 0
    while nxt < len(reqs) or engine.has_unfinished():
        now = engine.counters.steps
        idle = not engine.has_unfinished()
        while nxt < len(reqs) and (log.arrivals[nxt].step <= now or idle):
            a = log.arrivals[nxt]
            add_replayed(engine, outputs, nxt, reqs[nxt], a.cache, a.group)
            done.append(engine.requests[nxt])
            nxt, idle = nxt + 1, False
        while gone < len(leaving) and leaving[gone][0] <= now and leaving[gone][1] < nxt:
            engine.abort(leaving[gone][1])
            gone += 1
        engine.step()
        steps += 1
        for k, v in engine.cache_bytes_held().items():
            sums[k] += v
    for r in done:
        result.cached.append(max(r.prompt_cached, 0))
        result.prompt_tokens += len(r.input_ids)
    return finish_replay(engine, result, sums, steps)  # type: ignore[return-value]
