"""`EventSubscriber`: one worker's ordered event stream into a `KvIndex`.

A SUB socket receives ``(topic, seq, payload)``; when a sequence number skips ahead,
the missed batches are asked for on the worker's replay socket (DEALER to its ROUTER,
vLLM's protocol; again from where an answer stopped, until caught up) and applied in
order before the new one. While that replay runs the worker's entries are marked
untrusted (``on_stale``): the index then holds a past state of the worker (pages stored
long ago, their removals not yet replayed), and a router that routed on it sent requests
to pages long gone. A batch that cannot be recovered (the replay buffer no longer has it)
is counted as lost.

Trust (the stream may come from a buggy worker, or anyone who can publish on its
address): every message is decoded and applied inside one guard, so none can stop the
thread. A message that fails (not three frames, a sequence number that is not 8 bytes,
undecodable, nested too deeply, refused by the index: `radixkv.router.index.BadBatch`)
is counted by kind (``failures``), logged once per kind, and skipped. A worker whose
stream keeps failing (`STALE_AFTER` failures in a row) is marked stale: the router stops
trusting its index entries (routing to it falls back to its load) and the subscriber
starts it over, dropping what the index held of it and replaying from its buffer; the
first good batch makes it fresh again. The socket refuses messages over
`MAX_MESSAGE_BYTES` (ZeroMQ drops the connection that sends one).

Owns: one worker's stream: order, gaps, restarts, failures. Must not touch: the index's
contents (it hands batches to ``apply``), routing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

from radixkv.events import END_SEQ, AllBlocksCleared, KVEventBatch, decode_batch

log = logging.getLogger("radixkv.router")
REPLAY_TIMEOUT_MS = 1000
MAX_MESSAGE_BYTES = 64 << 20  # a step of 64 long prompts publishes a few MB
STALE_AFTER = 8  # failed messages in a row that make a worker's entries untrusted
SEQ_BYTES = 8


class EventSubscriber:
    """Follow one worker's events on a background thread.

    Args:
        worker: the worker's name in the index.
        endpoint: its PUB address (``tcp://127.0.0.1:5557``).
        replay_endpoint: its ROUTER replay address, or ``None``.
        apply: called with (worker, batch) for every batch, in sequence order; the
            caller serialises it with whatever else touches the index, and may raise
            to refuse a batch (it is then counted, as an undecodable one is).
        on_stale: called with (worker, stale) when the stream turns untrusted or good.
    """

    def __init__(
        self,
        worker: Hashable,
        endpoint: str,
        replay_endpoint: str | None,
        apply: Callable[[Hashable, KVEventBatch], None],
        on_stale: Callable[[Hashable, bool], None] | None = None,
    ) -> None:
        import zmq

        self.worker, self.endpoint, self.replay_endpoint = worker, endpoint, replay_endpoint
        self._apply, self._on_stale = apply, on_stale
        self.last_seq = -1
        self.replayed = 0
        self.lost = 0
        self.restarts = 0  # times the worker's stream started over
        self.failures: Counter[str] = Counter()  # failed messages, by kind
        self.failed_in_a_row = 0
        self.stale = False
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._replay.connect(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name=f"events-{worker}", daemon=True)
        self._thread.start()

    @property
    def bad(self) -> int:
        """Messages that failed, all kinds together."""
        return sum(self.failures.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sub.poll(50):
                    continue
                frames = self._sub.recv_multipart()
            except Exception as e:  # the socket itself failed: log, and keep going
                self._failed("socket", e)
                time.sleep(0.05)
                continue
            try:
                self._message(frames)
            except Exception as e:  # any message, however malformed, is skipped
                self._failed(getattr(e, "kind", type(e).__name__), e)
        self._sub.close()
        if self._replay is not None:
            self._replay.close()

    def _message(self, frames: list[Any]) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            raise _Bad("frames", f"{len(frames)} frames (sequence of {len(frames[1:2])} parts)")
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:
            raise _Bad("frames", f"sequence number {seq}")
        if seq <= self.last_seq:
            # the live stream never repeats or goes back (replays stop short of the
            # batch that asked for them): the worker restarted, even if its first
            # batches were missed. Start over; the replay fills in from 0.
            self._start_over()
            self.restarts += 1
        if seq > self.last_seq + 1:  # a gap, or joining late: replay from there
            # while the replay runs the index holds a past state of the worker (a late
            # joiner replays pages stored long ago before their removals): the router
            # must not route on it, so the worker's entries are untrusted until done
            hide = not self.stale and self._on_stale is not None
            if hide:
                self._on_stale(self.worker, True)  # type: ignore[misc]
            try:
                self._catch_up(seq)
            finally:
                if hide and not self.stale:
                    self._on_stale(self.worker, False)  # type: ignore[misc]
        self.last_seq = seq  # a batch that fails below is not asked for again
        self._deliver(payload)

    def _deliver(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except RecursionError:
            raise _Bad("nested", "a payload nested too deeply") from None
        except ValueError as e:
            raise _Bad("undecodable", str(e)) from None
        self._apply(self.worker, batch)
        self.failed_in_a_row = 0
        if self.stale:
            self.stale = False
            log.warning("worker %s: its event stream is good again", self.worker)
            if self._on_stale is not None:
                self._on_stale(self.worker, False)

    def _failed(self, kind: str, e: BaseException) -> None:
        self.failures[kind] += 1
        self.failed_in_a_row += 1
        if self.failures[kind] == 1:  # once per kind: a flood must not flood the log
            log.warning("worker %s: skipping an event message (%s: %s)", self.worker, kind,
                        str(e)[:200])  # fmt: skip
        if self.failed_in_a_row >= STALE_AFTER and not self.stale:
            self.stale = True
            log.warning("worker %s: %d event messages failed in a row; its index entries are "
                        "not trusted until its stream is good again", self.worker,
                        self.failed_in_a_row)  # fmt: skip
            if self._on_stale is not None:
                self._on_stale(self.worker, True)
            self._start_over()

    def _start_over(self) -> None:
        """Drop what the index held of the worker; the next batch replays from 0."""
        try:
            self._apply(self.worker, KVEventBatch(time.time(), [AllBlocksCleared()]))
        except Exception as e:  # the index refuses nothing of this: never seen
            log.warning("worker %s: could not clear its entries: %s", self.worker, e)
        self.last_seq = -1

    def _catch_up(self, upto: int) -> None:
        """Replay batches ``last_seq + 1 .. upto - 1``; what cannot be had is lost.

        One replay answer holds at most the publisher's `REPLAY_MAX_BYTES`, from the
        oldest batch asked for on, so this asks again from where it got to until it is
        caught up or an answer brings nothing new (taking only the first answer once left
        a late joiner with a busy worker's oldest pages and none of their removals)."""
        while self._replay is not None and self.last_seq < upto - 1:
            before = self.last_seq
            self._replay_once(upto)
            if self.last_seq == before:
                break
        missing = upto - self.last_seq - 1
        if missing > 0:
            self.lost += missing
            log.warning("worker %s: %d event batches lost", self.worker, missing)
            self.last_seq = upto - 1

    def _replay_once(self, upto: int) -> None:
        """One replay request from ``last_seq + 1``: deliver what it answers below
        ``upto``, counting the batches it skips (gone from the worker's buffer) lost."""
        assert self._replay is not None
        self._replay.send_multipart((b"", (self.last_seq + 1).to_bytes(SEQ_BYTES, "big")))
        while self._replay.poll(REPLAY_TIMEOUT_MS):
            frames: list[Any] = self._replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != SEQ_BYTES:
                continue
            _, _, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq < seq < upto:
                self.lost += seq - self.last_seq - 1
                self.last_seq = seq
                try:
                    self._deliver(payload)
                except Exception as e:
                    self._failed(getattr(e, "kind", type(e).__name__), e)
                self.replayed += 1


class _Bad(ValueError):
    """A message that is not an event batch of this stream; ``kind`` for counting."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
