"""`AsyncEngine`: the engine's step loop on one background thread, for asyncio callers.

The thread is the only one that touches the engine, and so its cache, pools and model
(a `RadixCache` is not thread-safe). Callers on any event loop talk to it through a
command queue (``add``, ``abort``, ``flush``, any function of the engine via ``call``);
outputs come back to each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. While nothing is unfinished the thread sleeps on the
command queue, calling `Engine.idle` between waits (a waiting agent's pages loaded
back ahead of its return, one session's at a time); otherwise it steps as fast as the
model runs, taking new commands between steps.

Owns: the engine's thread, its command queue and the output streams. Must not touch: the
engine's internals; everything goes through commands on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing
from typing import Any, TypeVar

from radixkv.engine.engine import Engine
from radixkv.engine.request import CacheSpec, SamplingParams, StepOutput

log = logging.getLogger("radixkv.engine")
T = TypeVar("T")
IDLE_WAIT_S = 0.1  # how long an idle loop sleeps on the command queue at a time


class EngineDead(RuntimeError):
    """The engine loop has stopped (shut down, or failed); no request can be served."""


class QueueFull(RuntimeError):
    """``max_queue`` requests are already waiting; try again later."""


class RequestFailed(RuntimeError):
    """The request failed alone (finish reason ``error``: its logits went non-finite, or
    processing its token raised); its KV was freed and the engine goes on."""


class AsyncEngine:
    """Serve an `Engine` to asyncio code.

    Args:
        engine: the engine, or a function that builds it. A function runs on the loop
            thread, which is faster: torch work on a thread other than the one whose
            parallel regions first started OpenMP's worker team runs about 2x slower
            (measured on 2 CPU cores: a tiny model's step 3.5 ms -> 7.9 ms). From
            ``start()`` on, only the loop thread may use the engine.
        max_queue: waiting (not yet admitted) requests at most; beyond, ``generate``
            raises `QueueFull`.
        on_death: called once, on the loop thread, with the exception when the engine
            fails (not when it is stopped): a server exits so a supervisor restarts it.
    """

    def __init__(
        self,
        engine: Engine | Callable[[], Engine],
        max_queue: int = 1024,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive int, got {max_queue!r}")
        self._factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine = engine if isinstance(engine, Engine) else None  # type: ignore[assignment]
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running = threading.Event()
        self._running.set()
        self.error: BaseException | None = None  # what killed the loop, if anything
        self.on_death = on_death

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (building the engine there, when given a function);
        returns once the engine is ready, raising what building it raised."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        ready: Future = Future()
        self._thread = threading.Thread(
            target=self._loop, args=(ready,), name="radixkv-engine", daemon=True
        )
        self._thread.start()
        ready.result()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def pause(self) -> None:
        """Stop stepping (commands are still taken); for maintenance and tests."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def abort_all(self) -> Future:
        """Abort every unfinished request (thread-safe; e.g. from a signal handler)."""

        def abort_all(engine: Engine) -> int:
            rids = list(engine.requests)
            for rid in rids:
                engine.abort(rid)
            self._dispatch(engine.step())  # reports the aborts; nothing is left to run
            return len(rids)

        return self._submit(abort_all)

    async def stop(self) -> None:
        """Abort what is in flight (streams end with finish reason ``abort``), then end
        the loop and join its thread."""
        if self._thread is None or self._stopping or self.error is not None:
            return  # (a failed loop has ended already, and told every stream)
        await asyncio.wrap_future(self.abort_all())
        self._stopping = True
        self._running.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # --- calls ------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[Engine], T]) -> Future:
        fut: Future = Future()
        if self._stopping or self.error is not None or self._thread is None:
            fut.set_exception(EngineDead("the engine is not running"))
            return fut
        self._commands.put((fn, fut))
        return fut

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and return its result."""
        return await asyncio.wrap_future(self._submit(fn))

    async def flush_cache(self) -> int:
        return await self.call(lambda e: e.flush_cache())

    async def submit(
        self,
        prompt: Any,
        sampling: SamplingParams | None = None,
        rid: Any = None,
        extra_key: Any = None,
        chat: bool = True,
    ) -> AsyncIterator[StepOutput]:
        """Queue a request; returns the async iterator of its outputs (the last one has
        a finish reason). Closing the iterator early (``aclose``, ``break`` inside
        ``aclosing``, cancellation) aborts the request and frees its KV.

        It does not wait for the engine thread to take the request (one thread handoff
        less before the first token): a refusal arrives as the iterator's first item.

        Raises (from the iterator's first ``__anext__``):
            ValueError / TypeError: a bad request (from `Engine.add_request`).
            QueueFull: ``max_queue`` requests are waiting.
            EngineDead: the loop is not running.
        and from any ``__anext__``: RequestFailed (the request failed alone),
        EngineDead (the engine failed meanwhile).
        """
        (outputs,) = await self.submit_choices(prompt, [sampling], extra_key, chat, [rid])
        return outputs

    async def submit_choices(
        self,
        prompt: Any,
        samplings: list[SamplingParams | None],
        extra_key: Any = None,
        chat: bool = True,
        rids: list[Any] | None = None,
        cache: CacheSpec | None = None,
        session: Any = None,
    ) -> list[AsyncIterator[StepOutput]]:
        """Queue the ``n`` choices of one request (one sampling each), all or none: they
        count as ``n`` against ``max_queue``, and run as one group (the scheduler gives
        a group at most its share of the running slots). Returns each choice's outputs,
        as `submit` does; a refusal arrives as the first item of every one. ``session``:
        the agent session they belong to (`radixkv.engine.request.SessionTag`)."""
        loop = asyncio.get_running_loop()
        streams: list[asyncio.Queue] = [asyncio.Queue() for _ in samplings]
        rids = [uuid.uuid4().hex if r is None else r for r in (rids or [None] * len(samplings))]
        group = rids[0] if len(samplings) > 1 else None

        def add(engine: Engine) -> None:
            added: list[Any] = []
            try:
                waiting = engine.num_waiting()
                if waiting + len(samplings) > self.max_queue:
                    raise QueueFull(f"{waiting} requests are waiting already")
                for rid, sampling in zip(rids, samplings, strict=True):
                    added.append(engine.add_request(prompt, sampling, rid, extra_key, chat,
                                                    group, cache, session))  # fmt: skip
            except Exception as e:
                for rid in added:  # all or none: nobody hears of these
                    engine.abort(rid)
                for stream in streams:
                    loop.call_soon_threadsafe(stream.put_nowait, e)
                return
            for rid, stream in zip(rids, streams, strict=True):
                self._streams[rid] = (loop, stream)

        fut = self._submit(add)
        if fut.done() and fut.exception() is not None:  # the loop is not running
            for stream in streams:
                stream.put_nowait(fut.exception())
        return [self._outputs(rid, stream) for rid, stream in zip(rids, streams, strict=True)]

    async def _outputs(self, rid: Any, stream: asyncio.Queue) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = True  # nothing to abort: the loop is gone
                    raise out
                finished = out.finished
                if out.error is not None:  # it failed alone; nothing is left to abort
                    raise RequestFailed(out.error)
                yield out
        finally:
            if not finished:
                self._submit(lambda e: (self._streams.pop(rid, None), e.abort(rid)))

    async def generate(
        self,
        prompt: Any,
        sampling: SamplingParams | None = None,
        rid: Any = None,
        extra_key: Any = None,
        chat: bool = True,
    ) -> AsyncIterator[StepOutput]:
        """`submit` and iterate in one: ``async for out in engine.generate(...)``."""
        outputs = await self.submit(prompt, sampling, rid, extra_key, chat)
        async with aclosing(outputs):
            async for out in outputs:
                yield out

    # --- the loop ---------------------------------------------------------------------------
    def _loop(self, ready: Future) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:
                self.error = e
                ready.set_exception(e)
                return
        ready.set_result(None)
        engine, loading = self.engine, False
        while True:
            idle = not engine.has_unfinished() or not self._running.is_set()
            self._run_commands(wait=idle and not self._stopping and not loading)
            if self._stopping:
                break
            if not self._running.is_set():
                continue
            busy = engine.has_unfinished()  # (idle: work for an idle engine, `Engine.idle`)
            try:
                outputs = engine.step() if busy else engine.idle()
            except BaseException as e:  # a bug or a device failure: fail loudly, once
                log.exception("the engine %s failed; the engine stops", "step" if busy else "idle")
                self._die(e)
                if self.on_death is not None:
                    self.on_death(e)
                return
            if busy:
                self._dispatch(outputs)
            loading = not busy and bool(outputs)  # (an idle load in chunks: on at once)
        self._die(EngineDead("the engine was shut down"))

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.rid)
            if target is None:
                continue
            if out.finished:
                del self._streams[out.rid]
            target[0].call_soon_threadsafe(target[1].put_nowait, out)

    def _run_commands(self, wait: bool) -> None:
        try:
            item = self._commands.get(timeout=IDLE_WAIT_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _die(self, error: BaseException) -> None:
        self.error = error
        dead = error if isinstance(error, EngineDead) else EngineDead(f"engine failed: {error!r}")
        for loop, stream in self._streams.values():
            loop.call_soon_threadsafe(stream.put_nowait, dead)
        self._streams.clear()
        while True:  # commands that arrived too late
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(dead)


async def merge_choices(
    runs: list[tuple[StepOutput | None, AsyncIterator[StepOutput]]],
) -> AsyncIterator[tuple[int, StepOutput]]:
    """The outputs of a request's ``n`` choices (each a first output already taken, or
    None, and the rest) as they come, tagged with the choice's index; closing this
    closes (aborts) every choice still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, first: StepOutput | None, outputs: AsyncIterator[StepOutput]) -> None:
        try:
            async with aclosing(outputs):
                out = first if first is not None else await anext(outputs)
                await queue.put((i, out))
                while not out.finished:
                    out = await anext(outputs)
                    await queue.put((i, out))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, f, o)) for i, (f, o) in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
