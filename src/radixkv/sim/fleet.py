"""Routing over replicas in time: a fleet of engines, each running its requests
concurrently on a clock, a router choosing for each request, and clients that send a
conversation's next turn when its answer is back. What the replica simulator
(`radixkv.sim.replicas`) leaves out is here: KV held while a request runs, eviction on the
replica's own demand, KV events that reach the router after a lag, and arrivals that
follow the answers.

One idea: every replica is radixkv's own engine (`radixkv.engine.Engine`: its scheduler,
memory, prefix cache and KV events, with the model's forward pass replaced by the
answers the model gave, as `radixkv.sim.serve_replay` does), so what a replica caches,
evicts and reports is what ``radixkv serve`` would; only time is modelled: a step takes
`StepCost` (a fixed part, a part per prompt token computed, a part per sequence decoding).

Routers (`ROUTERS`): every policy of `radixkv.router.policies`, through the same
`RoutingCore` ``radixkv route`` runs (its clock the simulator's, its index fed by the
replicas' events after ``event_lag_s``), and ``cache_aware``: SGLang's router (0.3.2) as
its source decides (`CacheAware`).

Clients (`Conversation`s): ``concurrency`` requests in flight at most, as bench-serve
sends a multi-turn workload: each conversation's turns in order, a turn ready when the
previous one's answer is back, ready turns sent first come first served. Or open loop
(``arrivals``): every turn sent at its own time, as a trace's timestamps say
(`trace_turns`). Between the router and a replica, each way, ``wire_s``; when an answer
ends, the router hears of it before the freed slot's next request, or after it
(``release_race``).

Measured against live runs (`benchmarks/bench_route.py` sets the simulated median of 5
seeds beside every live median): within 0.03 in 19 of 20 cells (four policies, chats
under pressure at three pool sizes and behind a shared system prompt at two), with the
router hearing of an answer's end after the client's next request 70% of the time
(``release_race``); not SGLang's router when it live places chats unevenly
(docs/performance.md).

Owns: the clock, the clients, the replicas' timing and the measurements. Must not
touch: how the engine schedules or caches (its own code runs), how a policy chooses.

Complexity: one engine step per replica step; each costs what the engine's step costs
without the model (about 0.1-0.3 ms here), so 288 chat turns of 16 tokens over three
replicas replay in about a second.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.model_runner import ModelRunner
from radixkv.engine.request import SamplingParams
from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.router.core import RoutingCore
from radixkv.sim.replicas import quantile
from radixkv.sim.serve_replay import ReplayRunner
from radixkv.sim.traces import Trace
from radixkv.tree import RadixCache

ROUTERS = (*policies.POLICIES, "cache_aware")
# SGLang router 0.3.2's defaults (``launch_router --help``)
SGLANG_CACHE_THRESHOLD = 0.3
SGLANG_BALANCE_ABS = 64
SGLANG_BALANCE_REL = 1.5
SGLANG_EVICTION_INTERVAL_S = 60.0
SGLANG_MAX_TREE_SIZE = 1 << 26  # characters per worker's tree


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: ``base_s`` + ``prefill_s`` per prompt token it
    computes + ``decode_s`` per sequence it decodes."""

    base_s: float = 0.004
    prefill_s: float = 2.0e-5
    decode_s: float = 3.0e-4
    jitter: float = 0.0  # each step's cost times a uniform draw in [1 - jitter, 1 + jitter]

    def of(self, prefill_tokens: int, decodes: int, draw: float = 0.0) -> float:
        """``draw`` in [-1, 1]: where in its jitter this step's cost falls."""
        s = self.base_s + self.prefill_s * prefill_tokens + self.decode_s * decodes
        return s * (1.0 + self.jitter * draw)


class Turn(NamedTuple):
    """One request of a conversation, as the server and the routers see it."""

    prompt: list[int]  # token ids: the messages as the server's chat template renders them
    output: list[int]  # the answer the model gave (its token ids)
    text: str  # what SGLang's router routes on: the messages' contents joined by spaces


@dataclass
class Conversation:
    """The user messages of one conversation, in order; ``system``: messages before them."""

    messages: list[str]
    system: list[dict] = field(default_factory=list)


def routing_text(messages: Sequence[dict]) -> str:
    """SGLang's router's text of a chat request: every message's content, joined by a
    space (an empty assistant message left out)."""
    return " ".join(m["content"].strip() if m["role"] == "assistant" else m["content"]
                    for m in messages if m["content"] or m["role"] != "assistant")  # fmt: skip


def chat_turns(
    conversations: Sequence[Conversation], max_tokens: int, model: str = "random", seed: int = 0
) -> list[list[Turn]]:
    """Every conversation's turns as a client sends them to ``radixkv serve --model
    MODEL``: each turn's history carries the answers the model gave before (greedy, the
    model run here once, turn by turn, for all conversations at once), so the token ids
    are the ones a live run sends."""
    engine = Engine(model, EngineConfig(max_context_len=1 << 16, seed=seed, kv_tokens=1 << 16))
    histories = [list(c.system) for c in conversations]
    out: list[list[Turn]] = [[] for _ in conversations]
    for t in range(max((len(c.messages) for c in conversations), default=0)):
        live = [i for i, c in enumerate(conversations) if t < len(c.messages)]
        prompts = {}
        for i in live:
            histories[i].append({"role": "user", "content": conversations[i].messages[t]})
            ids = list(engine.encode(histories[i]))
            prompts[engine.add_request(ids, SamplingParams(max_tokens, ignore_eos=True))] = (
                i, ids)  # fmt: skip
        answers: dict[Any, list[int]] = {rid: [] for rid in prompts}
        while engine.has_unfinished():
            for o in engine.step():
                answers[o.rid] += o.token_ids
        for rid, (i, ids) in prompts.items():
            text = routing_text(histories[i])
            out[i].append(Turn(ids, answers[rid], text))
            histories[i].append(
                {"role": "assistant", "content": engine.tokenizer.decode(answers[rid])}
            )
    return out


# --- the replicas ------------------------------------------------------------------------
class _TimedRunner(ReplayRunner):
    """The serve replay's runner (each request's known answer in place of the model),
    counting each step's work for its cost: one token a step, as a model decodes (a
    run of them in one step would cost one decode)."""

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base, {}, runs=False)
        self.prefill_tokens = self.decodes = 0

    def forward(self, plan: list, table: Any, inputs: Any = None) -> torch.Tensor:
        for r, n in plan:
            if r.output_ids:
                self.decodes += 1
            else:
                self.prefill_tokens += n
        return super().forward(plan, table, inputs)

    def take_cost(self, cost: StepCost, draw: float = 0.0) -> float:
        s = cost.of(self.prefill_tokens, self.decodes, draw)
        self.prefill_tokens = self.decodes = 0
        return s


class _Replica:
    """One replica: an engine, its answers, and what it is doing now."""

    def __init__(self, name: int, config: EngineConfig, model: str) -> None:
        self.name = name
        self.engine = Engine(model, config)
        self.runner = _TimedRunner(self.engine.runner)
        self.engine.runner = self.runner
        self.stepping = False
        self.served = 0
        self.batches: list[Any] = []  # KV events of the step running now


# --- SGLang's router ---------------------------------------------------------------------
class _Charge:
    """A `CacheAware` request's load on its worker (the core's `Ticket`, for its peer)."""

    def __init__(self, loads: list[int], worker: int) -> None:
        self.loads, self.worker_name, self.released = loads, worker, False

    def started(self) -> None:
        pass

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.loads[self.worker_name] -= 1


class CacheAware:
    """SGLang router 0.3.2's ``cache_aware`` policy, as its code (``smg``'s
    ``policies/cache_aware.rs``, ``tree.rs``) decides, on the request's text:

    - imbalanced (``max - min > balance_abs`` and ``max > min x balance_rel``, in
      requests in flight it counts itself): the least loaded worker;
    - else the worker whose tree holds the longest prefix of the text, when that is
      more than ``threshold`` of the text's characters; else the least loaded worker
      (0.3.2 no longer takes the smallest tree: measured live, 24 new prompts sent one
      at a time all go to one worker);
    - ties go to the first worker in ``order``: the router's list, in the order the
      workers registered (concurrent jobs: it differs from one router process to the
      next);
    - the text goes into the chosen worker's tree either way; every
      ``eviction_interval_s`` the trees are cut to ``max_tree_size`` characters each,
      least recently used first. It never hears of a worker's evictions.
    """

    def __init__(
        self, workers: int, clock: Callable[[], float],
        threshold: float = SGLANG_CACHE_THRESHOLD, balance_abs: int = SGLANG_BALANCE_ABS,
        balance_rel: float = SGLANG_BALANCE_REL,
        eviction_interval_s: float = SGLANG_EVICTION_INTERVAL_S,
        max_tree_size: int = SGLANG_MAX_TREE_SIZE, order: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        self.order = list(range(workers)) if order is None else list(order)
        if sorted(self.order) != list(range(workers)):
            raise ValueError(f"order must list the workers 0..{workers - 1} once, got {order!r}")
        self.trees = [RadixCache(page_size=1) for _ in range(workers)]
        self.loads = [0] * workers
        self.clock, self.threshold = clock, threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.every, self.max_size = eviction_interval_s, max_tree_size
        self.next_eviction = clock() + eviction_interval_s

    def choose(self, text: str) -> _Charge:
        now = self.clock()
        while now >= self.next_eviction:
            for tree in self.trees:
                tree.evict(max(0, tree.total_size() - self.max_size))
            self.next_eviction += self.every
        key = RadixKey([ord(c) for c in text])
        hi, lo = max(self.loads), min(self.loads)
        least = min(self.order, key=self.loads.__getitem__)  # (the first of equals)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            w = least
        else:
            matched = [t.match_len(key) for t in self.trees]
            best = max(self.order, key=matched.__getitem__)
            w = best if text and matched[best] / len(text) > self.threshold else least
        if text:
            self.trees[w].insert(key)
        self.loads[w] += 1
        return _Charge(self.loads, w)


# --- the run -----------------------------------------------------------------------------
@dataclass
class FleetResult:
    router: str
    replicas: int
    kv_tokens: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    token_hit_rate: float
    fleet_available_rate: float  # the longest prefix any replica held when it was routed
    routing_captured_rate: float  # what the chosen replica held then
    ttft_p50_s: float
    ttft_p90_s: float
    imbalance: float  # the busiest replica's requests over the mean
    per_replica: list[int]
    duration_s: float
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Run:
    """One simulated run: the event queue, the clients, the router and the replicas."""

    def __init__(
        self, turns: list[list[Turn]], replicas: int, config: EngineConfig, router: str,
        concurrency: int, cost: StepCost, event_lag_s: float, model: str,
        kv_weight: float, wire_s: float, seed: int, arrivals: list[list[float]] | None,
        release_race: float = 0.0,
    ) -> None:  # fmt: skip
        self.turns, self.cost, self.lag, self.concurrency = turns, cost, event_lag_s, concurrency
        self.wire = wire_s
        self.rng = random.Random(seed)  # the steps' jitter
        self.release_race = release_race
        self.race_rng = random.Random(f"release race {seed}")  # apart: jitter draws unchanged
        self.now = 0.0
        self.queue: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.reps = [_Replica(i, config, model) for i in range(replicas)]
        self.router = router
        if router == "cache_aware":
            # the order its workers registered in, a router process's own
            order = random.Random(f"worker order {seed}").sample(range(replicas), replicas)
            self.core: Any = CacheAware(replicas, lambda: self.now, order=order)
        else:
            self.core = RoutingCore(router, kv_weight, clock=lambda: self.now)
            self.core.index.block_size = config.page_size  # as the workers' cards say
            for r in self.reps:
                self.core.add(r.name)
                # as its card says (radixkv.router.fleet): the most pages its pool holds
                self.core.index.max_blocks[r.name] = r.engine.mgr.allocator.size // config.page_size
                r.engine.publish_kv_events(r.batches.append)
        self.open_loop = arrivals is not None
        self.ready = (
            deque() if self.open_loop else deque((c, 0) for c in range(len(turns)) if turns[c])
        )
        for c, times in enumerate(arrivals or ()):
            for t, when in enumerate(times):
                self._at(when, "send", (c, t))
        self.in_flight = 0
        self.sent: dict[Any, tuple[float, Any, Turn]] = {}  # rid: (when, charge, turn)
        self.ttfts: list[float] = []
        self.cached = self.prompt = self.available = self.captured = 0

    def _at(self, when: float, kind: str, data: Any) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), kind, data))

    def run(self) -> None:
        self._send_ready()
        handlers = {"events": getattr(self.core, "apply", None), "arrive": self._arrive,
                    "step": self._step_done, "answer": self._answered,
                    "send": self._send}  # fmt: skip
        while self.queue:
            self.now, _, kind, data = heapq.heappop(self.queue)
            handlers[kind](*data)

    # --- clients and routing ------------------------------------------------------------
    def _send_ready(self) -> None:
        while self.ready and self.in_flight < self.concurrency:
            c, t = self.ready.popleft()
            self._send(c, t)

    def _send(self, c: int, t: int) -> None:
        turn = self.turns[c][t]
        key = RadixKey(turn.prompt)
        held = [r.engine.cache.match_len(key) for r in self.reps]
        if self.router == "cache_aware":
            charge = self.core.choose(turn.text)
            name = charge.worker_name
        else:
            charge = self.core.choose(turn.prompt, None, len(turn.output))
            name = charge.worker.name
        rep = self.reps[name]
        rep.served += 1
        self.available += max(held)
        self.captured += held[name]
        self.in_flight += 1
        self.sent[(c, t)] = (self.now, charge, turn)
        self._at(self.now + self.wire, "arrive", (rep, (c, t), turn))

    def _arrive(self, rep: _Replica, rid: tuple[int, int], turn: Turn) -> None:
        rep.runner.outputs[rid] = turn.output
        try:
            rep.engine.add_request(turn.prompt, SamplingParams(len(turn.output), ignore_eos=True),
                                   rid=rid)  # fmt: skip
        except ValueError as e:  # a token the model lacks, a turn longer than the context
            raise ValueError(f"conversation {rid[0]}, turn {rid[1]}: {e}") from None
        if not rep.stepping:
            self._step(rep)

    # --- the replicas -------------------------------------------------------------------
    def _step(self, rep: _Replica) -> None:
        rep.stepping = True
        outs = rep.engine.step()
        took = rep.runner.take_cost(self.cost, self.rng.uniform(-1.0, 1.0))
        for batch in rep.batches:  # the step's KV events reach the router after it ends
            self._at(self.now + took + self.lag, "events", (rep.name, batch))
        rep.batches.clear()
        self._at(self.now + took, "step", (rep, outs))

    def _step_done(self, rep: _Replica, outs: list) -> None:
        for o in outs:
            when, charge, _turn = self.sent[o.rid]
            if o.output_tokens == len(o.token_ids) and o.token_ids:  # its first token
                self.ttfts.append(self.now + self.wire - when)
                charge.started()
            if o.finish_reason is not None:
                self.cached += o.cached_tokens
                self.prompt += o.prompt_tokens
                self._at(self.now + self.wire, "answer", (o.rid,))
        if rep.engine.has_unfinished():
            self._step(rep)
        else:
            rep.stepping = False

    def _answered(self, rid: tuple[int, int]) -> None:
        """The answer is back at its client: the router's charge ends, the conversation's
        next turn is ready, and the client sends what it may."""
        c, t = rid
        charge = self.sent[rid][1]
        late = self.release_race > 0 and self.race_rng.random() < self.release_race
        if not late:
            charge.release()
        self.in_flight -= 1
        if not self.open_loop and t + 1 < len(self.turns[c]):
            self.ready.append((c, t + 1))
        self._send_ready()
        if late:  # the router heard of the end only after the client's next request
            charge.release()


def trace_turns(trace: Trace) -> TraceTurns:
    """A token trace's requests (`radixkv.sim.traces`: with ``prompt_ids``) as one-turn
    conversations sent at their timestamps (`simulate_fleet`'s ``arrivals``): an answer
    the trace does not list is its count of token 0; SGLang's router's text is the
    prompt's ids joined by spaces, as it routes a request given as token ids.

    Raises:
        ValueError: a trace without token ids (Mooncake's hash ids)."""
    turns, arrivals = [], []
    for i, r in enumerate(trace.requests):
        if r.prompt_ids is None:
            raise ValueError(f"trace request {i}: the fleet simulator needs token ids")
        ids = list(r.prompt_ids)
        out = list(r.output_ids) if r.output_ids is not None else [0] * r.output_tokens
        turns.append([Turn(ids, out or [0], " ".join(map(str, ids)))])
        arrivals.append([r.timestamp / 1000.0])  # trace timestamps are milliseconds
    return TraceTurns(turns, arrivals)


class TraceTurns(NamedTuple):
    """`trace_turns`: the requests as one-turn conversations, and when each is sent."""

    turns: list[list[Turn]]
    arrivals: list[list[float]]


def simulate_fleet(
    turns: list[list[Turn]], replicas: int = 3, kv_tokens: int = 20480, router: str = "kv",
    concurrency: int = 16, cost: StepCost | None = None, event_lag_s: float = 0.0,
    config: EngineConfig | None = None, model: str = "random",
    kv_weight: float = policies.KV_OVERLAP_WEIGHT, wire_s: float = 0.0, seed: int = 0,
    arrivals: list[list[float]] | None = None, release_race: float = 0.0,
) -> FleetResult:  # fmt: skip
    """Run ``turns`` (`chat_turns`) through ``replicas`` engines of ``kv_tokens`` each
    behind ``router``, ``concurrency`` requests in flight at most. ``config``: the
    engines' other knobs (``bench_route.py``'s workers' by default: page 16, 16 running,
    chunks of 2,048). ``event_lag_s``: how long a step's KV events take to reach the
    router after the step ends. ``wire_s``: how long a request takes from the router's
    choice to its replica, and an answer's first token and end from the replica to its
    client (HTTP, the router's own time). ``seed``: the steps' jitter (`StepCost.jitter`):
    under pressure which turn a pool still holds turns on the order of a few
    milliseconds, so a live run varies from run to run, and so does this one with
    jitter; compare medians over seeds with medians over live runs (for ``cache_aware``
    the seed also draws the order its workers registered in). ``arrivals``: when
    each turn is sent (seconds, one list per conversation, as ``turns``): requests arrive
    at those times whatever the answers (open loop; ``concurrency`` is not used), as a
    trace's timestamps say (`trace_turns`). ``release_race``: the chance that the router
    hears an answer's end only after the client's next request (live, both come a few
    hundred microseconds after the last chunk, and either may win): that request is
    routed while the finished one still counts as load on its replica."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    for name, v in (("replicas", replicas), ("kv_tokens", kv_tokens),
                    ("concurrency", concurrency)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name, v in (("event_lag_s", event_lag_s), ("wire_s", wire_s)):
        if isinstance(v, bool) or not (isinstance(v, int | float) and 0 <= v < math.inf):
            raise ValueError(f"{name} must be a number of seconds >= 0, got {v!r}")
    if isinstance(release_race, bool) or not (
        isinstance(release_race, int | float) and 0 <= release_race <= 1
    ):
        raise ValueError(f"release_race must be a probability in [0, 1], got {release_race!r}")
    _check_arrivals(turns, arrivals)
    base = config or EngineConfig(page_size=16, max_running=16, chunk_size=2048,
                                  max_context_len=8192)  # fmt: skip
    cfg = dataclasses.replace(base, kv_tokens=kv_tokens)
    run = _Run(turns, replicas, cfg, router, concurrency, cost or StepCost(), event_lag_s,
               model, kv_weight, wire_s, seed, arrivals, release_race)  # fmt: skip
    run.run()
    served = [r.served for r in run.reps]
    mean = sum(served) / len(served)
    p = max(run.prompt, 1)
    return FleetResult(
        router=router, replicas=replicas, kv_tokens=kv_tokens, requests=sum(served),
        prompt_tokens=run.prompt, cached_tokens=run.cached,
        token_hit_rate=run.cached / p, fleet_available_rate=run.available / p,
        routing_captured_rate=run.captured / p,
        ttft_p50_s=quantile(run.ttfts, 0.5), ttft_p90_s=quantile(run.ttfts, 0.9),
        imbalance=max(served) / mean if mean else 1.0, per_replica=served,
        duration_s=run.now, preemptions=sum(r.engine.scheduler.preemptions for r in run.reps),
    )  # fmt: skip


def _check_arrivals(turns: list[list[Turn]], arrivals: list[list[float]] | None) -> None:
    if arrivals is None:
        return
    if len(arrivals) != len(turns) or any(
        len(a) != len(t) for a, t in zip(arrivals, turns, strict=True)
    ):
        raise ValueError("arrivals must give one time per turn, as turns lists them")
    for times in arrivals:
        for v in times:
            if isinstance(v, bool) or not (isinstance(v, int | float) and 0 <= v < math.inf):
                raise ValueError(f"arrivals must be seconds >= 0, got {v!r}")


__all__ = ["ROUTERS", "CacheAware", "Conversation", "FleetResult", "StepCost", "TraceTurns",
           "Turn", "chat_turns", "routing_text", "simulate_fleet", "trace_turns"]  # fmt: skip
