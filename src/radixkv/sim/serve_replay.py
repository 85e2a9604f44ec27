"""What `radixkv serve` caches, replayed without the model: the engine's own scheduler,
request lifecycle and memory (`radixkv.engine`, `radixkv.kvcache`: one arena on a
hybrid model) run a token trace, each request's recorded output standing in for the
model's sampling.

Why it is exact: nothing the cache decides (what a request matches, when it is admitted,
allocated, preempted, inserted, checkpointed, evicted) reads a KV value or a logit; it
reads token ids, positions and sizes. So a replay that feeds the engine the tokens it
produced, with the same configuration and the same arrivals, makes the same decisions
and caches the same tokens per request. The model is built from ``config.json`` without
its weights (never run); the memory is the engine's own, index-only (KV on the ``meta``
device: shapes, no bytes), so any capacity replays in the memory of its indices.

The budget simulator (`radixkv.sim.hybrid`, policy ``radixkv``) models the same order of
eviction in the tree alone, one request at a time, fitting the budget after each
request; this replay also holds what a running request holds (its new pages, its window,
its chunk, pending checkpoints) and evicts as the engine does, on demand. docs/hybrid.md
compares the two (``benchmarks/bench_fidelity.py``).

A hash-id trace (Mooncake's, an agentic one: no token ids) replays in its units
(`in_units`): each unit one token, at page 1, through the engine of the spec scaled to
a unit (`unit_spec`), the budget simulator's grain; with room to spare it caches what
the token trace would at a page of one unit, request for request.

Arrivals: requests with the same timestamp arrive together (one wave, as one
``Engine.generate`` call); the next wave arrives when the previous one has finished.
``concurrency`` is the engine's ``max_running``.

Owns: driving an `Engine` through a trace. Must not touch: the engine's internals (it
replaces only its model runner, through `ReplayRunner`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.request import CacheSpec, MarkedIds, SamplingParams, SessionTag
from radixkv.engine.scheduler import DoesNotFit
from radixkv.sim.hybrid import HybridResult, ModelSpec
from radixkv.sim.spec_model import DTYPE as SPEC_DTYPE
from radixkv.sim.spec_model import SpecModel
from radixkv.sim.traces import SimRequest, Trace
from radixkv.units import div_ceil

REPLAY_TOKEN = 0  # an output the trace does not list is replayed as this token
FIRST_UNIT = 258  # a unit replay's first token id: past the byte tokenizer's BOS and EOS
# (a spec model's; a session's answer ends on EOS, so no unit may be it)


class ReplayRunner(ModelRunner):
    """The model runner with the trace in place of the model: a request whose prompt is
    done samples its recorded next output token (`REPLAY_TOKEN` past the record's end).
    Nothing is computed or written; the logits are one finite column a row, whatever
    the vocabulary."""

    def __init__(self, base: ModelRunner, outputs: dict[Any, list[int]], runs: bool) -> None:
        super().__init__(base.model, base.kv, base.device)
        self.outputs, self.knows_ahead = outputs, runs

    def forward(self, plan: list, table: Any, inputs: Any = None) -> torch.Tensor:
        return torch.zeros(len(plan), 1)

    def ahead(self, r: Any, k: int) -> list[int]:
        out, at = self.outputs[r.rid], len(r.output_ids)
        return [out[i] if i < len(out) else REPLAY_TOKEN for i in range(at, at + k)]

    def sample(self, r: Any, logits: torch.Tensor) -> int:  # type: ignore[override]
        out, k = self.outputs[r.rid], len(r.output_ids)
        return out[k] if k < len(out) else REPLAY_TOKEN


class _EndsOn:
    """A replayed answer of ``n`` tokens ending on ``last``: the recorded ones before it,
    `REPLAY_TOKEN` between (never materialized: a huge answer costs no memory)."""

    def __init__(self, recorded: list[int], n: int, last: int) -> None:
        self.recorded, self.n, self.last = recorded[: n - 1], n, last

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> int:
        if k == self.n - 1:
            return self.last
        return self.recorded[k] if k < len(self.recorded) else REPLAY_TOKEN


class TraceClock:
    """The engine's session clock in a replay (`radixkv.engine.engine.Engine`'s ``clock``):
    the trace's time in seconds, set to each wave's arrival. The replay computes a wave's
    answers at its arrival, so the session order sees what a server whose answers are
    fast sees of the trace: each answer stops as it starts, and the next call comes its
    ``api_time`` + think time later (the trace's arrivals carry the recorded answer's
    time). A server whose answers took that long is not replayed: dating each stop at
    the answer's end in the trace needs the answer's path held (locked) meanwhile,
    which a replay of one call at a time cannot (the ways tried and what they measure:
    docs/performance.md, "Agent sessions through the engine")."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ServeReplay:
    """One replay: each request's cached prompt tokens (trace order) and the totals."""

    capacity_bytes: int
    concurrency: int
    cached: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    preemptions: int = 0
    mean_bytes: dict[str, float] = field(default_factory=dict)  # full, window, states
    checkpoints: int = 0
    refused: int = 0  # requests the engine refused (prompt + output over its pool alone)
    steps: int = 0  # engine steps the replay took

    @property
    def hit_tokens(self) -> int:
        return sum(self.cached)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def empty_model(folder: str | Path) -> torch.nn.Module:
    """The model of ``folder``'s ``config.json`` with no weights (its weight files, if
    any, are not read): built on the meta device, then each parameter and buffer one
    zero broadcast to its shape, so a model of any size takes no memory and still counts
    its parameters (the budget's FLOPs). What the engine sizes its memory from; it is
    never run.

    Raises:
        ValueError (UnsupportedModel, FolderError): an architecture or config field
            radixkv does not serve, a bad config.
    """
    from radixkv.checkpoint.files import read_json
    from radixkv.engine.models import architecture_of, config_from_dict, family

    raw = read_json(Path(folder) / "config.json")
    fam, cfg = family(architecture_of(raw)), config_from_dict(raw)
    with torch.device("meta"):
        model = fam.MODEL_CLASS(cfg)
    for module in model.modules():
        for name, t in module.named_parameters(recurse=False):
            zero = torch.zeros((), dtype=t.dtype).expand(t.shape)
            setattr(module, name, torch.nn.Parameter(zero, requires_grad=False))
        for name, t in module.named_buffers(recurse=False):
            setattr(module, name, torch.zeros((), dtype=t.dtype).expand(t.shape))  # a buffer still
    return model


def replay_serve(
    trace: Trace, model: str | Path | torch.nn.Module, capacity_bytes: int,
    config: EngineConfig | None = None, *, concurrency: int = 1, cache_outputs: bool = True,
    runs: bool = True, limits: Sequence[int] | None = None,
) -> ServeReplay:  # fmt: skip
    """Replay ``trace`` (a token trace: its requests carry ``prompt_ids``) through an
    engine serving ``model`` (a folder, or a model) from one budget of
    ``capacity_bytes``, at most ``concurrency`` requests at once; the trace's block size
    is the engine's page. ``config``: the engine's other knobs (serve's defaults
    otherwise). ``cache_outputs=False``: each request caches its prompt only. A request
    that can never fit the pool alone is refused, as ``radixkv serve`` refuses it (400),
    and counted in ``refused``, its prompt a miss. ``runs``: decode the runs of tokens
    and compute the runs of a prompt's chunks that decide nothing in one step each
    (`Scheduler.steady_run`, `Scheduler.prefill_run`); False: one token and one chunk a
    step, as a model computes (the same cache, more steps). ``limits``: request ``i``
    caches its first ``limits[i]`` tokens (`in_units`), in place of ``cache_outputs``.

    Raises:
        ValueError: a trace without token ids, a token the model's vocabulary lacks, a
            capacity the engine refuses (naming its minimum), bad knobs.
    """
    base = config or EngineConfig()
    cfg = dataclasses.replace(base, page_size=trace.block_size, cache_bytes=capacity_bytes,
                              max_running=concurrency)  # fmt: skip
    clock = TraceClock()
    engine, outputs = replay_engine(trace, model, cfg, runs, clock)
    result = ServeReplay(capacity_bytes, concurrency)
    sums = dict.fromkeys(("full", "window", "states"), 0.0)
    waves = itertools.groupby(enumerate(trace.requests), key=lambda x: x[1].timestamp)
    for at, wave in waves:
        clock.now = max(clock.now, at / 1000.0)  # (ms; a wave's answers end at its arrival)
        reqs = []
        for i, req in wave:
            limit = limits[i] if limits else None if cache_outputs else len(req.prompt_ids)
            spec = None if limit is None else CacheSpec(limit=limit)
            rid = add_replayed(engine, outputs, i, req, spec, refuse=True)
            reqs.append((req, None if rid is None else engine.requests[rid]))
            result.refused += rid is None
        while engine.has_unfinished():
            engine.step()
        for req, r in reqs:
            result.cached.append(0 if r is None else max(r.prompt_cached, 0))
            result.prompt_tokens += len(req.prompt_ids)
            for k, v in engine.cache_bytes_held().items():
                sums[k] += v
    return finish_replay(engine, result, sums, len(trace.requests))


def replay_engine(
    trace: Trace, model: str | Path | torch.nn.Module, cfg: EngineConfig, runs: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Any, dict[Any, list[int]]]:  # fmt: skip
    """An engine serving ``model`` (a folder or a model, never run) with ``cfg``, its
    context long enough for every request of ``trace``, its runner replaying each
    request's recorded outputs (the dict: request id -> output ids, filled by
    `add_replayed`); ``runs``: it computes runs of tokens and chunks that decide nothing
    in one step (`replay_serve`), else one token and one chunk a step. Index-only: its
    KV and states live on the ``meta`` device (shapes, no bytes;
    `radixkv.kvcache.memory.index_device`), so a budget of any size is replayed in the
    memory of its indices alone. ``clock``: the engine's session clock (`TraceClock`)."""
    if any(r.prompt_ids is None for r in trace.requests):
        raise ValueError("trace: the serve replay needs token ids (a token or Marconi trace "
                         "that lists them, not Mooncake's hash ids)")  # fmt: skip
    net = model if isinstance(model, torch.nn.Module) else empty_model(model)
    longest = max([cfg.max_context_len, *(_length(r) for r in trace.requests)])
    cfg = dataclasses.replace(cfg, max_context_len=longest, device="meta")
    from radixkv.engine.engine import Engine

    engine = Engine(net, cfg, clock=clock)
    outputs: dict[Any, list[int]] = {}
    engine.runner = ReplayRunner(engine.runner, outputs, runs)
    return engine, outputs


def add_replayed(
    engine: Any, outputs: dict[Any, list[int]], i: int, req: SimRequest,
    cache: CacheSpec | None = None, group: Any = None, refuse: bool = False,
) -> Any:  # fmt: skip
    """Queue trace request ``i`` (id ``i``), to generate its recorded outputs; its id,
    or with ``refuse`` None for one that can never fit the engine's pool (not queued).

    Raises:
        ValueError: ``trace request I: ...`` (a token the model lacks, too long).
    """
    n, out = max(1, req.output_tokens), list(req.output_ids or ())
    session, eos = None, engine.tokenizer.eos_token_id
    if engine.sessions is not None and req.session is not None:  # (an agentic trace's)
        tool = req.stop == "tool_use"
        session = SessionTag(repr(req.session), lambda text, ids: tool)
    stops = session is not None and bool(req.stop) and eos is not None
    # it stops as the trace says, on EOS (the last token: sampled, no KV)
    outputs[i] = _EndsOn(out, n, eos) if stops else out
    sampling = SamplingParams(n, ignore_eos=not stops)
    prompt = MarkedIds(req.prompt_ids, req.token_boundaries)
    try:
        return engine.add_request(prompt, sampling, rid=i, chat=False, extra_key=req.extra_key,
                                  group=group, cache=cache, session=session)  # fmt: skip
    except DoesNotFit as e:
        if refuse and e.prompt_tokens + e.max_new_tokens <= engine.engine_config.max_context_len:
            del outputs[i]
            return None
        raise ValueError(f"trace request {i}: {e}") from None
    except ValueError as e:
        raise ValueError(f"trace request {i}: {e}") from None


def finish_replay(engine: Any, result: ServeReplay, sums: dict[str, float], n: int) -> ServeReplay:
    """``result`` with the engine's totals: preemptions, mean bytes, checkpoints."""
    result.preemptions, result.steps = engine.scheduler.preemptions, engine.counters.steps
    result.mean_bytes = {k: v / max(n, 1) for k, v in sums.items()}
    result.checkpoints = getattr(engine.cache.component("state"), "added", 0)  # (taken)
    return result


def tightest_budget(
    trace: Trace, model: str | Path | torch.nn.Module, hi: int = 16 << 20, within: int = 512
) -> int:
    """The least ``capacity_bytes`` (within ``within`` bytes, at most ``hi``) at which the
    trace's longest prompt runs alone in `replay_serve`: the tightest budget that serves
    the trace, found by bisection (each try builds an engine: O(log(hi / within))).

    Raises:
        ValueError: ``hi`` does not serve it either.
    """
    longest = max(trace.requests, key=lambda r: len(r.prompt_ids or ()))
    alone = Trace("alone", trace.block_size, [longest])
    if replay_serve(alone, model, hi).refused:  # (or raises: a budget the engine refuses)
        raise ValueError(f"capacity: {hi:,} bytes do not serve the trace's longest request")
    lo = 0
    while hi - lo > within:
        mid = (lo + hi) // 2
        try:
            served = not replay_serve(alone, model, mid).refused
        except ValueError:
            served = False
        lo, hi = (lo, mid) if served else (mid, hi)
    return hi


def serve_result(
    trace: Trace, folder: str | Path | None, spec: ModelSpec, capacity_bytes: int,
    concurrency: int = 1, cache_outputs: bool = True, chunk_size: int = 512,
    schedule: str = "lpm", split: str = "one", checkpoint_every: int = 0,
    eviction: str = "lru",
) -> HybridResult:  # fmt: skip
    """`replay_serve` as a row of the hybrid simulator's table, with ``radixkv serve``'s
    other defaults: policy ``serve`` (one arena), or ``serve-sglang`` with ``split=
    "sglang"`` (the engine with SGLang's fixed split of the same bytes, ``serve
    --cache-split sglang``), or ``serve-session`` with ``eviction="session"`` (``serve
    --eviction-policy session``: each request of an agentic trace tagged with its
    session, its answer stopping as the trace says, on the trace's clock);
    ``checkpoint_every`` as ``serve --checkpoint-every``.
    ``folder`` None: the engine of ``spec`` alone (`radixkv.sim.spec_model`: its
    bytes, no model). A hash-id trace (no token ids) replays in its units (`in_units`)
    through the engine of ``spec`` scaled to a unit (`unit_spec`; a folder's spec),
    ``chunk_size`` and ``checkpoint_every`` in whole units; its hits count in tokens as
    the budget simulator's do (`Trace.hit_tokens`)."""
    u, limits, replayed = 1, None, trace
    if any(r.prompt_ids is None for r in trace.requests):
        u, folder = trace.block_size, None
        if checkpoint_every % u:
            raise ValueError(f"checkpoint_every must be a multiple of the trace's block size "
                             f"({u}), got {checkpoint_every}")  # fmt: skip
        replayed, limits = in_units(trace, cache_outputs)
    cfg = EngineConfig(chunk_size=max(1, chunk_size // u), schedule_policy=schedule,
                       cache_bytes=capacity_bytes, cache_split=split,
                       checkpoint_every=checkpoint_every // u,
                       eviction_policy=eviction)  # fmt: skip
    model: Any = folder
    if folder is None:
        model, cfg.dtype = SpecModel(unit_spec(spec, u), _vocab(replayed)), SPEC_DTYPE
    rep = replay_serve(replayed, model, capacity_bytes, cfg, concurrency=concurrency,
                       cache_outputs=cache_outputs, limits=limits)  # fmt: skip
    if limits is not None:  # units to tokens
        pairs = zip(trace.requests, rep.cached, strict=True)
        rep.cached = [trace.hit_tokens(r, c) for r, c in pairs]
        rep.prompt_tokens = sum(r.prompt_tokens for r in trace.requests)
    saved = sum(spec.flops(c) for c in rep.cached)
    total = sum(spec.flops(r.prompt_tokens) for r in trace.requests)
    return HybridResult(
        trace=trace.name, model=spec.name, capacity_bytes=capacity_bytes,
        policy="serve-session" if eviction == "session" else
        "serve" if split == "one" else f"serve-{split}",
        requests=len(trace.requests), prompt_tokens=rep.prompt_tokens,
        hit_tokens=rep.hit_tokens, token_hit_rate=rep.token_hit_rate,
        flops_saved=saved / total if total else 0.0, mean_bytes=rep.mean_bytes,
        checkpoints=rep.checkpoints, block_tokens=trace.block_size, cached=list(rep.cached),
        refused=rep.refused,
    )  # fmt: skip


def in_units(trace: Trace, cache_outputs: bool = True) -> tuple[Trace, list[int]]:
    """A hash-id trace (Mooncake's, an agentic one: unit ids, no token ids) as the token
    trace of its units, each unit one token, to replay at page 1 through the engine of
    the spec scaled to a unit (`unit_spec`); and each request's cache limit in units.

    Request by request, in units of ``u = trace.block_size`` tokens: its prompt is the
    units that cover its tokens (``ceil(prompt_tokens / u)``; the trace's ids, a fresh
    one for a tail it does not list), so a match ends at most one unit before the one its
    last token lies in, as a paged engine's at page ``u``; it generates units until it
    has computed the whole units of ``prompt + output - 1`` tokens (the trace's ids where
    it lists them, `REPLAY_TOKEN` past them, never materialized: a huge answer costs the
    replay steps, not memory), so its states lie where a paged engine's do; it caches what
    `Trace.cached_units` says an engine leaves cached, in whole units of the tokens it
    computed (the units a later prompt can name: an unlisted output is never cached, so
    no two requests share one). Boundaries, namespace, arrival, session and stop stay.
    Unit ids become dense token ids from `FIRST_UNIT`; a prompt's unlisted tail gets fresh
    ones after them. O(listed units + prompt units).

    Exact with room to spare (the same hits as the token trace replayed at page ``u``,
    request for request); under pressure a running request holds one unit less than a
    paged engine where its output ends inside a page (that partial page is not a unit)."""
    dense: dict[Any, int] = {}
    for r in trace.requests:
        for x in r.units:
            dense.setdefault(x, len(dense) + FIRST_UNIT)
    fresh = itertools.count(len(dense) + FIRST_UNIT)
    out, limits, u = Trace(trace.name, 1), [], trace.block_size
    for r in trace.requests:
        prompt_u = max(1, div_ceil(r.prompt_tokens, u))
        end_u = max(prompt_u, (r.prompt_tokens + max(r.output_tokens, 1) - 1) // u)
        ids = [dense[x] for x in r.units[:end_u]]
        ids += [next(fresh) for _ in range(prompt_u - len(ids))]  # (a prompt tail unlisted)
        out.requests.append(SimRequest(
            ids, prompt_u, prompt_u, r.timestamp, end_u + 1 - prompt_u, r.boundaries,
            prompt_ids=array("q", ids[:prompt_u]), output_ids=array("q", ids[prompt_u:]),
            token_boundaries=r.boundaries, extra_key=r.extra_key, session=r.session,
            stop=r.stop, duration_ms=r.duration_ms,
        ))  # fmt: skip
        computed = r.prompt_tokens + (max(r.output_tokens - 1, 0) if cache_outputs else 0)
        limits.append(min(trace.cached_units(r, cache_outputs), computed // u))
    return out, limits


def unit_spec(spec: ModelSpec, unit: int) -> ModelSpec:
    """``spec`` with a unit of ``unit`` tokens as its token: KV bytes a unit, the window
    in whole units (as the budget simulator counts it), states unchanged."""
    return dataclasses.replace(spec, kv_bytes=spec.kv_bytes * unit,
                               window=div_ceil(spec.window, unit))  # (0 stays 0)


def _vocab(trace: Trace) -> int:
    """Token ids the trace's prompts and outputs use, at least the byte tokenizer's 258
    (the engine's for a model without one): a spec model's vocabulary."""
    top = 257
    for r in trace.requests:
        for ids in (r.prompt_ids, r.output_ids):
            if ids:
                top = max(top, max(ids))
    return top + 1


def _length(r: SimRequest) -> int:
    return len(r.prompt_ids or ()) + max(1, r.output_tokens)


__all__ = [
    "ReplayRunner",
    "ServeReplay",
    "empty_model",
    "in_units",
    "replay_serve",
    "serve_result",
    "unit_spec",
]
