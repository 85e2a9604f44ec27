"""`Engine`: continuous batching over the prefix cache, with chunked prefill.

The online API: ``add_request`` queues a request and returns its id; each ``step``
schedules (`radixkv.engine.scheduler`), runs the model (`ModelRunner`) and processes the
sampled tokens (`radixkv.engine.output`: text, stop conditions, outputs), then caches
what was computed; ``abort`` drops a request at any stage and frees its KV. ``generate``
is the offline wrapper: add all, step until done. The model comes from
`radixkv.engine.loader`, the cache's memory from `radixkv.engine.cache_memory`.

Owns: the requests in flight and the step. Must not touch: how the parts are built
(the loader's, the cache memory's), text and stop decisions (the output processor's).

Threads: one thread drives an `Engine` (`AsyncEngine` owns it for asyncio callers): the
step, requests, the cache, the pools and the model are that thread's alone. Safe from
any thread, because they read only what never changes after construction: `encode` (the
tokenizer and the vocabulary size; Hugging Face's ``tokenizers`` encodes concurrently,
the chat template renders in a fresh sandbox each call), ``tokenizer`` itself,
``config`` and ``scheduler.max_tokens()`` (pool and context sizes). The server tokenizes
off its event loop through these, never through anything else.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from radixkv.engine.ahead import IDLE_CHUNKS, load_ahead
from radixkv.engine.cache_memory import CacheMemory, build_tiers
from radixkv.engine.config import SCHEDULE_POLICIES, EngineConfig
from radixkv.engine.faults import EngineFault, FaultWatch
from radixkv.engine.loader import load_model, load_tokenizer
from radixkv.engine.loader import model_identity as identity_of
from radixkv.engine.model_runner import ModelRunner, NonFiniteLogits
from radixkv.engine.models.llama import ModelConfig
from radixkv.engine.output import (
    EngineCounters,
    GenerateResult,
    OutputProcessor,
    RequestOutput,
    RunStats,
)
from radixkv.engine.request import (
    CacheSpec,
    EngineReq,
    MarkedIds,
    SamplingParams,
    SessionTag,
    StepOutput,
)
from radixkv.engine.scheduler import DoesNotFit, Scheduler, SchedulerHooks
from radixkv.engine.served_log import ServedLog
from radixkv.key import RadixKey, check_namespace
from radixkv.kvcache.layer_types import ENGINE_NAMES
from radixkv.kvcache.retention import Retention
from radixkv.kvcache.sessions import session_order
from radixkv.tokenizer import Tokenizer
from radixkv.units import align_down

log = logging.getLogger("radixkv.engine")

__all__ = [
    "SCHEDULE_POLICIES",
    "DoesNotFit",
    "Engine",
    "EngineConfig",
    "EngineFault",
    "GenerateResult",
    "RequestOutput",
    "RunStats",
    "SamplingParams",
    "StepOutput",
    "load_model",
    "load_tokenizer",
]


class Engine:
    """A small inference engine on the radix prefix cache.

    Args:
        model: see `radixkv.engine.loader.load_model`.
        config: an `EngineConfig`; keyword arguments override its fields
            (``Engine("random", kv_tokens=4096)``).
        tokenizer: the tokenizer to use instead of the model's own.
        clock: seconds for the agent sessions' order (a replay passes its trace's time).
    """

    def __init__(
        self,
        model: str | Path | ModelConfig | torch.nn.Module = "auto",
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        **overrides: Any,
    ) -> None:
        cfg = dataclasses.replace(config or EngineConfig(), **overrides)
        self.engine_config, self.clock = cfg, clock
        self.device = torch.device(cfg.device)
        net, own_tokenizer, self.model_name = load_model(model, cfg.seed)
        self.tokenizer: Tokenizer = tokenizer or own_tokenizer
        self.model = net.to(device=self.device, dtype=cfg.dtype)
        self.config: ModelConfig = self.model.config
        self.memory = memory = CacheMemory(cfg, self.model, self.device)
        self.cache, self.kv, self.mgr = memory.cache, memory.kv, memory.mgr
        self.arena = memory.arena
        for line in self.memory_summary():
            log.info("%s", line)
        retained = cfg.max_retained_tokens
        capacity = self.mgr.allocator.capacity
        retained = capacity // 8 if retained is None else retained
        # all namespaces together, shared fairly (salts are the client's to choose): by
        # default two namespaces at their quota fit, so one other tenant takes nothing
        total = max(2 * retained, capacity // 4)
        self.retention = Retention.over(self.cache, retained, total)
        self.sessions = session_order(cfg.eviction_policy, self.cache, memory.mgr.managers,
                                      memory.budget)  # fmt: skip
        self.runner = ModelRunner(self.model, self.kv, self.device)
        self.outputs = OutputProcessor(self.tokenizer)
        self.counters, self.faults = EngineCounters(), FaultWatch()
        self.requests: dict[Any, EngineReq] = {}  # unfinished requests by id
        self._order = itertools.count()
        self._aborted: list[EngineReq] = []  # aborted since the last step (reported once)
        self._events: Any = None  # (collector, publish) once KV events are on
        self._source_files = getattr(net, "source_files", None)
        self._identity: bytes | None = None
        self.served_log = ServedLog(cfg.served_log, cfg) if cfg.served_log else None
        self.tier: Any = None  # host pool and shared store (radixkv.storage), if any
        self.layer_tiers: list[Any] = []  # the other layer types' pages and checkpoints there
        if cfg.storage is not None or cfg.host_tokens:
            from radixkv.storage.layers import layer_tiers

            self.tier = build_tiers(cfg, memory, self.model_identity())
            host_states = (memory.plan.checkpoints or 0) if cfg.host_tokens else 0
            host_pages = cfg.host_tokens // cfg.page_size
            self.layer_tiers = layer_tiers(self.tier, self.mgr.managers, self.cache, host_pages,
                                           host_states)  # fmt: skip
        self.ahead = load_ahead(cfg, self.cache, self.mgr, self.sessions, self.tier,
                                self._load_below, self.layer_tiers)  # fmt: skip
        relieve = self.retention.relieve  # (a load ahead's hold goes first)
        relieve = self.ahead.relieving(relieve) if self.ahead is not None else relieve
        hooks = SchedulerHooks(self._prefetch if self.tier is not None else None,
                               self._admitted, relieve)  # fmt: skip
        self.scheduler = Scheduler(cfg, self.mgr, hooks)

    def __getattr__(self, name: str) -> Any:
        """A layer type's manager by its public name (``engine.window``,
        ``engine.recurrent``: `radixkv.kvcache.layer_types.ENGINE_NAMES`), or None when the
        model has no such layers."""
        kind = ENGINE_NAMES.get(name)
        memory = self.__dict__.get("memory")
        if kind is None or memory is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return memory.layer(kind)

    def memory_summary(self) -> list[str]:
        """The cache's memory as sized at start, one line each (what ``radixkv serve``
        prints; `radixkv.engine.cache_memory`), and a file store's cap."""
        lines = self.memory.summary()
        describe = getattr(getattr(getattr(self, "tier", None), "store", None), "describe", None)
        if describe is not None:  # a file store: its size cap
            lines.append(describe())
        return lines

    def cache_bytes_held(self) -> dict[str, int]:
        """Bytes held now per kind: ``full``, ``window``, ``states``."""
        return self.memory.held_bytes()

    def cache_bytes_evicted(self) -> dict[str, int]:
        """Bytes evicted to make room since the start, per kind."""
        return self.memory.evicted_bytes()

    def _admitted(self, r: EngineReq) -> None:
        """Admitted: a retained prefix its hit used lives on; a tagless session is found."""
        if r.last_node is not None:
            self.retention.hit(r.last_node)
        if self.sessions is not None and r.session is not None and r.session.key is None:
            self.sessions.admitted(r, self.clock())

    def model_identity(self) -> bytes:
        """16 bytes naming what this engine's KV means (weights, config, dtype, page
        size, tokenizer: `radixkv.storage.identity`), computed once."""
        if self._identity is None:
            self._identity = identity_of(
                self.model, self.engine_config, self.tokenizer, self._source_files
            )
        return self._identity

    def _prefetch(self, r: EngineReq) -> None:
        usable = len(r.input_ids) - 1  # the last prompt token is always computed
        self._load_below(r.token_array(), r.extra_key, usable)

    def _load_below(self, tokens: Any, ns: Any, usable: int, ahead: bool = False,
                    kv_only: bool = False) -> None:  # fmt: skip
        """The pages (and a layer type's window pages, checkpoints) of ``tokens[:usable]``
        that the tiers below the device hold and the device lacks, brought back; slots
        made by the tree's eviction. ``ahead``: for a session before its request;
        ``kv_only``: the full pages alone (toward a checkpoint, `LoadAhead`)."""

        def alloc(n: int) -> Any:
            slots = self.mgr.allocator.alloc(n)
            if slots is None:
                self.mgr.evicted_tokens += self.cache.evict(n - self.mgr.allocator.available_size())
                slots = self.mgr.allocator.alloc(n)
            return slots

        if kv_only or not any(t.loads_pages for t in self.layer_tiers):
            self.tier.load(tokens, ns, usable, alloc, ahead=ahead)
        for t in self.layer_tiers if not kv_only else ():  # (a window: before the deepest end)
            t.load(tokens, ns, usable, alloc, ahead=ahead)

    def publish_kv_events(
        self,
        publish: Callable[[Any], None],
        salt_key: bytes | None = None,
        tokens: bool = True,
        arrays: bool = False,
    ) -> None:
        """Report the cache's pages as KV events (`radixkv.events`): after each step the
        step's events go to ``publish`` as one `KVEventBatch`. Call it before the first
        request (the cache must be empty). ``salt_key`` keys the namespace tags;
        ``tokens=False`` publishes block hashes only; ``arrays`` hands token ids
        and block hashes over as arrays, for a ``publish`` that only encodes them
        (`radixkv.events.EventCollector`). Only blocks a match could end at are told
        (`event_blocks`): on a recurrent model a prefix is servable only up to a
        checkpoint, so the events tell one block per checkpoint
        (`radixkv.kvcache.recurrent`), never the pages between; with the sliding layers'
        KV apart, a page only while the window before it is held, withdrawn when that
        window goes (`radixkv.kvcache.window.servable`)."""
        from radixkv.events import EventCollector

        collector = EventCollector(salt_key, tokens, arrays)
        if not any([m.publish(collector) for m in self.mgr.managers]):
            self.cache.set_event_sink(collector)
        self._events = (collector, publish)

    @property
    def event_blocks(self) -> str:
        """What this engine's KV events' blocks are: ``"pages"`` (each with the run
        before it), ``"checkpoints"`` (a recurrent model's, each alone) or
        ``"windows"`` (pages whose window is held, each alone: the runs have holes)."""
        return next((m.event_blocks for m in self.mgr.managers if m.event_blocks), "pages")

    def _flush_events(self) -> None:
        if self._events is not None:
            batch = self._events[0].drain()
            if batch is not None:
                self._events[1](batch)

    # --- requests ---------------------------------------------------------------------------
    def encode(
        self, prompt: str | Sequence[int] | list[dict], chat: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:  # fmt: skip
        """Token ids of a prompt: ids as given, a list of chat messages (rendered with
        ``tools``, if any), or a string (wrapped in the chat template when ``chat``). Every
        id lies in the model's vocabulary, the tokenizer's too (a folder whose tokenizer
        and weights disagree).

        Raises:
            ValueError: an id that is not an int, or outside ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            if chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                return self._in_vocabulary(text, made=True)
            return self._in_vocabulary(self.tokenizer.encode(prompt), made=True)
        if prompt and isinstance(prompt[0], dict):
            ids = self._render(list(prompt), tools)  # type: ignore[arg-type]
            self._in_vocabulary(ids, made=True)
            if not self.mgr.managers:  # only the managers (window, states) use the marks
                return ids
            return self.chat_boundaries(prompt, ids, tools)  # type: ignore[arg-type]
        ids = list(prompt)
        if not all(type(t) is int for t in ids):  # the common case checked at C speed
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"token ids must be ints, got {t!r}")
        self._in_vocabulary(ids)
        marks = getattr(prompt, "boundaries", ())
        return MarkedIds(ids, marks) if marks else ids  # ids marked stay marked

    def _in_vocabulary(self, ids: list[int], made: bool = False) -> list[int]:
        """``ids``, checked; ``made``: by the tokenizer (then the folder is at fault)."""
        vocab = self.config.vocab_size
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            if not made:
                raise ValueError(f"token ids must lie in [0, {vocab})")
            bad = max(ids) if max(ids) >= vocab else min(ids)
            raise ValueError(f"the tokenizer made token id {bad}, outside the model's "
                             f"vocabulary [0, {vocab}): its tokenizer and its weights "
                             "disagree")  # fmt: skip
        return ids

    def _render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        if tools:
            return self.tokenizer.apply_chat_template(messages, tools)  # type: ignore[call-arg]
        return self.tokenizer.apply_chat_template(messages)

    def chat_boundaries(
        self, messages: list[dict], ids: list[int], tools: list[dict] | None = None
    ) -> MarkedIds:
        """``ids`` (the messages' rendering) marked at the end of the leading system
        messages: where the rendering of those alone stops agreeing with it (the
        template's own tokens after the message included, whatever the template). Safe
        to call off the engine's thread (the tokenizer only)."""
        k = 0
        while k < len(messages) and messages[k].get("role") in ("system", "developer"):
            k += 1
        if k == 0 or k == len(messages):
            return MarkedIds(ids)
        n = self.rendered_prefix(messages[:k], ids, tools)
        return MarkedIds(ids, (n,) if 0 < n < len(ids) else ())

    def rendered_prefix(
        self, messages: list[dict], ids: Sequence[int], tools: list[dict] | None = None
    ) -> int:
        """How far ``ids`` (a chat's rendering) agrees with the rendering of ``messages``
        alone (its first messages, the last one possibly cut short): where they end in
        it, the template's own tokens after them included. The tokenizer only: safe off
        the engine's thread."""
        alone = self._render(list(messages), tools)
        n = 0
        while n < min(len(alone), len(ids)) and alone[n] == ids[n]:
            n += 1
        return n

    def add_request(
        self,
        prompt: str | Sequence[int] | list[dict],
        sampling: SamplingParams | None = None,
        rid: Any = None,
        extra_key: Any = None,
        chat: bool = True,
        group: Any = None,
        cache: CacheSpec | None = None,
        session: SessionTag | None = None,
    ) -> Any:
        """Queue a request; returns its id (``rid``, or a fresh number).

        Args:
            prompt: token ids, chat messages, or text (see `encode`).
            sampling: how it generates (`SamplingParams`).
            extra_key: its cache namespace (a tenant's salt): requests in different
                namespaces never share cached tokens.
            group: the request it is one of ``n`` choices of: the scheduler runs at most
                half its slots for one group at a time (`radixkv.engine.scheduler`).
            cache: what it asks of the prompt cache (`CacheSpec`: prefixes to retain,
                a limit on what is cached, no lookup); positions lie in the prompt.
            session: the agent session it belongs to (`SessionTag`; read by the
                ``session`` eviction policy).

        Raises:
            ValueError: an empty prompt, bad token ids, a duplicate ``rid``, or a request
                that can never fit the context or the KV pool. Nothing is queued then.
        """
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if extra_key is not None:
            check_namespace(extra_key)
        ids = self.encode(prompt, chat)
        if not ids:
            raise ValueError("the prompt is empty")
        marks = getattr(ids, "boundaries", getattr(prompt, "boundaries", ()))
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= len(ids)
               for b in marks):  # fmt: skip
            raise ValueError(f"boundaries must be positions in (0, {len(ids)}], got {marks!r}")
        spec = self._check_spec(cache, len(ids))
        retained = [p for p, _ in spec.retain]
        for m in self.mgr.managers:  # (a window: a page short of each, where a resend hits)
            retained += m.retained_marks(retained, self.cache.page_size)
        marks = tuple(sorted({*marks, *(p for p in retained if 0 < p < len(ids))}))
        order = next(self._order)
        rid = order if rid is None else rid
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        gen = None
        if not sampling.greedy:
            gen = torch.Generator()
            # modulo 2**64, as torch takes a negative seed (choice i of n is seeded
            # seed + i: 2**64 - 1 + 1 used to overflow, and the 400 named max_tokens)
            gen.manual_seed(sampling.seed % 2**64 if sampling.seed is not None else torch.seed())
        req = EngineReq(
            rid, ids, extra_key=extra_key, sampling=sampling, generator=gen, order=order,
            group=group, arrival=time.perf_counter(), arrived_step=self.counters.steps,
            boundaries=marks, cache_limit=spec.limit,
            cache_read=spec.read, retain=spec.retain, cache_spec=cache is not None,
            session=session,
        )  # fmt: skip
        self.scheduler.add(req)  # raises for a request that can never fit
        self.requests[rid] = req
        if session is not None and session.key is not None and self.sessions is not None:
            self.sessions.started(session.key, self.clock())  # (None: at admission)
        self.counters.prompt_tokens += len(ids)
        return rid

    @staticmethod
    def _check_spec(cache: CacheSpec | None, n: int) -> CacheSpec:
        if cache is None:
            return CacheSpec()
        if not isinstance(cache, CacheSpec):
            raise TypeError(f"cache must be a CacheSpec, got {type(cache).__name__}")
        for pos, ttl in cache.retain:
            if isinstance(pos, bool) or not isinstance(pos, int) or not 0 < pos <= n:
                raise ValueError(f"cache.retain: positions must lie in (0, {n}], got {pos!r}")
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
                raise ValueError(f"cache.retain: seconds must be positive, got {ttl!r}")
        if cache.limit is not None and (
            isinstance(cache.limit, bool) or not isinstance(cache.limit, int) or cache.limit < 0
        ):
            raise ValueError(f"cache.limit must be an int >= 0, got {cache.limit!r}")  # fmt: skip
        return cache

    def abort(self, rid: Any) -> bool:
        """Drop request ``rid`` at any stage (waiting, prefilling, decoding) and free its
        KV; the next ``step`` reports it with finish reason ``abort``. Returns False
        when no such request is unfinished."""
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        self.outputs.finish(req)
        self._finish(req, "abort")
        self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> float:
        """Fraction of the KV pool held by running requests and the cache."""
        return self.memory.usage()

    def flush_cache(self) -> int:
        """Drop every cached token no running request holds, retained ones too; returns
        how many."""
        self.retention.release_all()
        if self.ahead is not None:  # (nor loaded back ahead)
            self.ahead.clear()
        n = self.cache.evict(self.cache.evictable_size())
        self.mgr.evicted_tokens += n
        self._flush_events()
        return n

    def idle(self) -> int:
        """Work for an engine with no request to run (`AsyncEngine` calls it between
        waits): a waiting agent's pages loaded back ahead of its predicted return
        (``prefetch_within``: `radixkv.engine.ahead`), at most `IDLE_CHUNKS` chunks a
        call: call again while it loads. Returns the tokens loaded."""
        cap = IDLE_CHUNKS * self.engine_config.chunk_size  # (what an arrival may wait for)
        n = self.ahead.run(self.clock(), cap) if self.ahead is not None else 0
        if n and self.engine_config.check_memory:
            self._check()
        self._flush_events()
        return n

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule, run the model, process the sampled tokens; what each request
        produced this step."""
        self.retention.expire()
        if self.sessions is not None:  # sessions away longer than predicted: stamped again
            self.sessions.tick(self.clock())
        self._load_ahead_busy()
        self._run_ahead()
        plan = self.scheduler.schedule(self.runner.knows_ahead)
        inputs = self.mgr.step_inputs(plan)  # each cache manager's part (snapshots)
        logits = self.runner.forward(plan, self.mgr.req_pool, inputs) if plan else None
        outputs = self._process(plan, logits)
        if self.engine_config.check_memory:
            self._check()
        self._flush_events()
        return outputs

    def _load_ahead_busy(self) -> None:
        """Before a busy step with no request waiting to be admitted (a waiting request's
        own loads come first): a waiting agent's pages loaded back ahead, at most a
        chunk's worth (copying it costs far less than computing it) and never room the
        running requests still need for their prompts and answers (taken, it would be
        evicted again before they end)."""
        if self.ahead is None:
            return
        if self.scheduler.waiting:
            self.ahead.release()  # (the KV a busy load held toward a checkpoint: its room)
            return
        need = sum(len(r.input_ids) + r.sampling.max_new_tokens - r.kv_len
                   for r in self.scheduler.running)  # fmt: skip
        self.ahead.run(self.clock(), cap=self.engine_config.chunk_size, keep=need)

    def _run_ahead(self) -> None:
        """A runner that knows the tokens ahead (a replay's) decodes a run of them in one
        step where that decides what one-token steps would (`Scheduler.steady_run`)."""
        k = self.scheduler.steady_run() if self.runner.knows_ahead else 1
        for r in self.scheduler.running if k > 1 else ():
            for token in self.runner.ahead(r, k - 1):
                self.outputs.append(r, token)
            self.counters.generation_tokens += k - 1

    def _process(
        self, plan: list[tuple[EngineReq, int]], logits: torch.Tensor | None
    ) -> list[StepOutput]:
        """Sample a token for every request whose prompt is done, decide who finished,
        cache what was computed (once for the step, in one call each). A request whose
        row cannot be sampled (non-finite logits) or whose token's processing raises
        fails alone (`_fail`); the model failing for every row is the engine's fault
        (`EngineFault`)."""
        outputs = [self.outputs.output(r) for r in self._aborted]
        self._aborted.clear()
        if not plan:
            return outputs
        self.counters.steps += 1
        now = time.perf_counter()
        computed, finished = [], []
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # type: ignore[union-attr]
        for (r, n), row_logits, ok in zip(plan, logits, finite, strict=True):  # type: ignore[arg-type]
            was_prefill = r.kv_len - n < len(r.input_ids)
            if was_prefill:
                self.counters.prefill_tokens += n
            if r.kv_len < r.num_tokens:  # a prompt chunk: cache it, no token yet
                computed.append(r)
                continue
            try:
                if not ok:
                    raise NonFiniteLogits("the model's logits for this request are not finite")
                token = self.runner.sample(r, row_logits)
                self.faults.sampled(r, None)
                r.first_token_at = r.first_token_at or now
                self.counters.generation_tokens += 1
                reason = self.outputs.append(r, token)
                if reason is not None:
                    self.mgr.finishing(r)  # (a recurrent model's end state)
                    self._save_to_tiers(r)
            except Exception as e:  # this request's own failure: it fails alone
                if isinstance(e, NonFiniteLogits) and self.faults.sampled(r, e):
                    self._send_canary()
                outputs.append(self._fail(r, e))
                continue
            if reason is not None:
                finished.append(r)
                del self.requests[r.rid]
                self._finish(r, reason)
            elif was_prefill:
                computed.append(r)
            outputs.append(self.outputs.output(r))
        self.mgr.cache_unfinished_batch(computed, self.scheduler.last_run)
        self.scheduler.finish(finished)
        if self.sessions is not None:  # (after the inserts: where each path ends is known)
            self.sessions.requests_stopped(finished, self.clock())
        if finished:
            self._retain([r for r in finished if r.cache_spec], outputs)
        return outputs

    def _send_canary(self) -> None:
        """`FaultWatch`'s canary: the BOS token (else token 0), one greedy token,
        nothing read from or written to the cache (raises EngineFault if it fails)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        token = bos if isinstance(bos, int) and 0 <= bos < self.config.vocab_size else 0
        self.add_request([token], SamplingParams(1), self.faults.canary, chat=False,
                         cache=CacheSpec(limit=0, read=False))  # fmt: skip

    def _fail(self, r: EngineReq, error: Exception) -> StepOutput:
        """``r`` failed alone: free its KV, slots, states and locks as an abort does,
        finish it with reason ``error``; its last output says why."""
        log.warning("request %r failed: %r", r.rid, error)
        self.requests.pop(r.rid, None)
        self.scheduler.abort(r)
        r.error = f"{type(error).__name__}: {error}"
        self._finish(r, "error")
        return self.outputs.output(r)

    def _retain(self, reqs: list[EngineReq], outputs: list[StepOutput]) -> None:
        """Pin the prefixes finished requests asked to retain; their last outputs say
        how many prompt tokens that added (``cache_write_tokens``)."""
        last = {out.rid: out for out in outputs}
        for r in reqs:
            kept = 0
            for pos, ttl in r.retain:
                key = RadixKey(r.token_array()[:pos], r.extra_key)
                kept = max(kept, self.retention.pin(key, ttl))
            last[r.rid].cache_write_tokens = max(0, kept - max(r.prompt_cached, 0))

    def _save_to_tiers(self, r: EngineReq) -> None:
        if self.tier is not None:
            n = r.kv_len - r.kv_len % self.cache.page_size
            slots = self.mgr.req_pool.read(r.row, 0, n).clone()
            tokens = r.token_array()[:n]
            hashes = self.tier.save(tokens, r.extra_key, slots)
            if self.ahead is not None and r.session is not None and r.session.key is not None:
                self.ahead.remember(r.session.key, tokens, r.extra_key)
            resend = align_down(len(r.input_ids) - 1, self.cache.page_size)
            for t in self.layer_tiers:  # (the page hashes once for all)
                t.save(tokens, r.extra_key, r.row, n, hashes, resend)

    def _check(self) -> None:
        self.mgr.check_memory()
        self.memory.check()
        self.retention.check()
        self.cache.check_integrity()
        ahead = self.ahead.locks() if self.ahead is not None else []
        self.cache.check_locks([*(r.last_node for r in self.mgr.running.values()),
                                *self.retention.locks(), *ahead])  # fmt: skip
        for t in [self.tier, *self.layer_tiers] if self.tier is not None else ():
            t.check()

    def _finish(self, r: EngineReq, reason: str) -> None:
        r.finish_reason = reason
        r.finished_at = time.perf_counter()
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        if self.served_log is not None:
            self.served_log.record(r, self.counters.steps)
        if self.sessions is not None and reason in ("abort", "error"):  # (nothing cached)
            self.sessions.requests_stopped([r], self.clock())

    # --- offline ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | list[dict]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        ignore_eos: bool = False,
        on_step: Callable[[int, int], None] | None = None,
    ) -> GenerateResult:
        """Run ``prompts`` to completion (all arrive at once): a wrapper over the online
        API. Request ``i`` samples with seed ``seed * 1_000_003 + i``.

        Args:
            max_new_tokens: generated tokens per request at most.
            temperature: 0 for greedy; else sampling with ``top_p``, seeded per request.
            ignore_eos: keep generating past the end-of-sequence token.
            on_step: called after each step with (finished requests, all requests).
        """
        if self.requests:
            raise RuntimeError("generate: the engine has unfinished online requests")
        encoded = []
        for i, p in enumerate(prompts):  # validate every prompt before queueing any
            ids = self.encode(p, chat)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            encoded.append(ids)
        for i, ids in enumerate(encoded):
            try:
                self.scheduler.check_fits(len(ids), max_new_tokens)
            except DoesNotFit as e:
                raise DoesNotFit(f"prompt {i}: {e}", e.limit, len(ids), max_new_tokens) from None
        t0 = time.perf_counter()
        preempted0, prefill0 = self.scheduler.preemptions, self.counters.prefill_tokens
        steps0 = self.counters.steps
        rids = [self.add_request(ids, SamplingParams(max_new_tokens, temperature, top_p, seed
                                 * 1_000_003 + i, (), ignore_eos), chat=False)
                for i, ids in enumerate(encoded)]  # fmt: skip
        reqs = [self.requests[rid] for rid in rids]
        done = 0
        while self.has_unfinished():
            done += sum(o.finished for o in self.step())
            if on_step:
                on_step(done, len(reqs))
        stats = RunStats(
            requests=len(reqs),
            prompt_tokens=sum(len(r.input_ids) for r in reqs),
            cached_tokens=sum(r.prompt_cached for r in reqs),
            prefill_tokens=self.counters.prefill_tokens - prefill0,
            decode_tokens=sum(len(r.output_ids) for r in reqs),
            steps=self.counters.steps - steps0,
            preemptions=self.scheduler.preemptions - preempted0,
            wall_s=time.perf_counter() - t0,
            ttft_p50_s=statistics.median([_ttft(r, t0) for r in reqs] or [0.0]),
        )
        outputs = [RequestOutput(text=r.text, token_ids=list(r.output_ids),
                                 prompt_tokens=len(r.input_ids), cached_tokens=r.prompt_cached,
                                 ttft_s=_ttft(r, t0), finish_reason=r.finish_reason or "",
                                 error=r.error) for r in reqs]  # fmt: skip
        return GenerateResult(outputs, stats)


def _ttft(r: EngineReq, t0: float) -> float:
    """Seconds from ``t0`` to the request's first token (to its end if it had none: it
    failed)."""
    return (r.first_token_at or r.finished_at or t0) - t0
