"""`EventSubscriber`: one worker's ordered event stream into a `KvIndex`.

A SUB socket receives ``(topic, seq, payload)``; when a sequence number skips ahead,
the missed batches are asked for on the worker's replay socket (DEALER to its ROUTER,
vLLM's protocol) and applied in order before the new one. A batch that cannot be
recovered (the replay buffer no longer has it) is counted as lost.

Owns: one worker's ordered stream. Must not touch: the index's contents (it hands
batches to ``apply``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from radixkv.events import END_SEQ, AllBlocksCleared, KVEventBatch, decode_batch

log = logging.getLogger("radixkv.router")
REPLAY_TIMEOUT_MS = 1000


class EventSubscriber:
    """Follow one worker's events on a background thread.

    Args:
        worker: the worker's name in the index.
        endpoint: its PUB address (``tcp://127.0.0.1:5557``).
        replay_endpoint: its ROUTER replay address, or ``None``.
        apply: called with (worker, batch) for every batch, in sequence order; the
            caller serialises it with whatever else touches the index.
    """

    def __init__(
        self,
        worker: Hashable,
        endpoint: str,
        replay_endpoint: str | None,
        apply: Callable[[Hashable, KVEventBatch], None],
    ) -> None:
        import zmq

        self.worker, self.endpoint, self.replay_endpoint = worker, endpoint, replay_endpoint
        self._apply = apply
        self.last_seq = -1
        self.replayed = 0
        self.lost = 0
        self.bad = 0
        self.restarts = 0  # times the worker's stream started over
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name=f"events-{worker}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                self.bad += 1
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                # the live stream never repeats or goes back (replays stop short of the
                # batch that asked for them): the worker restarted, even if its first
                # batches were missed. Start over; the replay fills in from 0.
                self._apply(self.worker, KVEventBatch(time.time(), [AllBlocksCleared()]))
                self.last_seq = -1
                self.restarts += 1
            if seq > self.last_seq + 1:  # a gap, or joining late: replay from there
                self._catch_up(seq)
            self._deliver(seq, payload)
        self._sub.close()
        if self._replay is not None:
            self._replay.close()

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            self.bad += 1
            log.warning("worker %s: undecodable event batch %d: %s", self.worker, seq, e)
        else:
            self._apply(self.worker, batch)
        self.last_seq = seq

    def _catch_up(self, upto: int) -> None:
        """Replay batches ``last_seq + 1 .. upto - 1``; what cannot be had is lost."""
        want = self.last_seq + 1
        if self._replay is not None:
            self._replay.send_multipart((b"", want.to_bytes(8, "big")))
            while self._replay.poll(REPLAY_TIMEOUT_MS):
                frames: list[Any] = self._replay.recv_multipart()
                if len(frames) != 4:
                    continue
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq < seq < upto:
                    self.lost += seq - self.last_seq - 1
                    self._deliver(seq, payload)
                    self.replayed += 1
        missing = upto - self.last_seq - 1
        if missing > 0:
            self.lost += missing
            log.warning("worker %s: %d event batches lost", self.worker, missing)
            self.last_seq = upto - 1
