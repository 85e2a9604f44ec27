"""KV cache events and vLLM's wire for them (msgspec msgpack over ZeroMQ).

A cache with an event sink reports each page (block) as it enters or leaves:
``BlockStored`` (the new pages' chained hashes, the parent page's hash, their token ids,
the block size, and the namespace per block as ``extra_keys``), ``BlockRemoved`` and
``AllBlocksCleared``. The field names are vLLM's, so routers written for vLLM (Dynamo,
llm-d, SGLang's) read radixkv's stream, and radixkv's router reads vLLM's.

Wire: a batch is msgpack ``[ts, events, data_parallel_rank]``; an event is a map with a
``"type"`` field (vLLM's current encoding, what `encode_batch` writes) or, in streams
from before mid-2026, a tagged array ``["BlockStored", block_hashes, ...]``;
`decode_batch` reads both and ignores fields it does not know.

Publisher (`ZmqEventPublisher`): its own thread encodes each batch and a PUB socket
sends it as three frames (topic, 8-byte big-endian sequence number, payload); a ROUTER
socket answers a replay request (one frame: the first wanted sequence number, 8 bytes
big-endian) with ``("", topic, seq, payload)`` for each buffered batch from there on, then
``("", "", -1, "")``, as vLLM's publisher does. Replays are bounded in bytes, so peers
that ask and never read cannot grow the publisher's memory without bound: the buffer
keeps at most ``buffer_steps`` batches and `REPLAY_BUFFER_BYTES`; one replay sends at
most `REPLAY_MAX_BYTES` (from the batch asked for on; a peer asks again for the rest);
a peer's unread queue holds at most one replay (ZeroMQ drops beyond); at most
`REPLAYS_PER_S` replays are served a second, and at most `REPLAY_PEERS` distinct peers
within `REPLAY_PEER_WINDOW_S` (others get no answer, counted in ``replays_dropped``).
So what unread replays can hold is about `REPLAY_PEERS` x `REPLAY_MAX_BYTES` a window.

Privacy (what a subscriber learns): a tenant's cache salt never goes out in clear. A
namespace travels as `salt_tag`: a keyed BLAKE2b digest under the fleet's events key
(``--kv-events-key``, shared by workers and router), which a router holding the key
compares with the tag of a request's salt; without a key it is an unkeyed digest (a
guessable salt can then be confirmed by hashing guesses). ``tokens=False`` (serve's
``--kv-events-mode hashes``) publishes block hashes without token ids or namespaces: a
subscriber learns how many pages were stored and removed, and can test whether a prompt
it already knows (with its salt) is cached, but reads no prompt. Block hashes are 64-bit
chains over the pages and the namespace: with token ids, the fast vectorized chain of
`radixkv.hashing.fast` (the tokens are on the wire anyway; a collision could only misroute);
hashes only, BLAKE2b-128 chains cut to vLLM's 64-bit integers (`radixkv.tree.page_hash`),
which do not give the tokens away.

Owns: the event classes, their wire and the publisher. Must not touch: the tree (it
hears of pages through the sink protocol).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

log = logging.getLogger("radixkv.events")
MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BlockHash = int | bytes


REPLAYS_PER_S = 8  # replay requests served a second, all peers together
REPLAY_BUFFER_BYTES = 64 << 20  # what the replay buffer keeps, at most (oldest go first)
REPLAY_MAX_BYTES = 16 << 20  # what one replay sends, at most
REPLAY_PEERS = 8  # distinct peers served a replay within REPLAY_PEER_WINDOW_S, at most
REPLAY_PEER_WINDOW_S = 60.0


def salt_tag(namespace: Any, key: bytes | None = None) -> str:
    """What a namespace (a tenant's cache salt) looks like on the event wire: a keyed
    BLAKE2b-128 digest (unkeyed without ``key``), never the salt itself."""
    raw = namespace.encode() if isinstance(namespace, str) else repr(namespace).encode()
    h = hashlib.blake2b(raw, digest_size=16, key=key or b"", person=b"radixkv-ns-tag")
    return "ns:" + h.hexdigest()


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for ``ipc://``/``inproc://`` and ``tcp://`` on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def exposure_problem(endpoint: str, replay: str | None, insecure: bool) -> str | None:
    """Why publishing events at ``endpoint`` (and replaying at ``replay``, by default the
    next port) is refused, or ``None``: events are unauthenticated, so a non-loopback
    address needs the operator's explicit ``insecure``."""
    try:
        replay = replay or replay_endpoint(endpoint)
    except ValueError as e:
        return f"--kv-events: {e}"
    for flag, where in (("--kv-events", endpoint), ("--kv-events-replay", replay)):
        if not is_loopback_endpoint(where) and not insecure:
            return (f"{flag} {where}: not a loopback address, and KV events are "
                    "unauthenticated; add --kv-events-insecure to publish there")  # fmt: skip
    return None


def replay_endpoint(endpoint: str) -> str:
    """The replay address that goes with a PUB address: the next port, vLLM's convention
    (``tcp://HOST:5557`` -> ``tcp://HOST:5558``).

    Raises:
        ValueError: not ``tcp://HOST:PORT``.
    """
    head, _, port = endpoint.rpartition(":")
    if not head.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"events endpoint must look like tcp://127.0.0.1:5557, got {endpoint!r}")
    return f"{head}:{int(port) + 1}"


class KVCacheEvent(msgspec.Struct, tag=True, gc=False):
    """Base of the events; encoded as a map with ``"type"``: the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one per block


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
# Positional fields of the legacy tagged-array encoding, in order (later ones optional).
_LEGACY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # kept as arrays (EventCollector(arrays=True))
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} in a KV event")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The batch in vLLM's current encoding (events as maps with ``"type"``); token ids
    and block hashes held as arrays go out as the same lists."""
    return _encoder.encode(batch)


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _LEGACY_FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))  # extra trailing fields ignored
    else:
        raise ValueError(f"not a KV event: {raw!r:.80}")
    cls = EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown KV event type {kind!r}")
    known = set(cls.__struct_fields__)
    return msgspec.convert({k: v for k, v in fields.items() if k in known}, cls)  # type: ignore[return-value]


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in either encoding vLLM has shipped (maps with ``"type"``, or tagged
    arrays); unknown extra fields are ignored.

    Raises:
        ValueError: not a KV event batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, ...]")
    try:
        events = [_event(e) for e in raw[1]]
        rank = raw[2] if len(raw) > 2 else None
        return KVEventBatch(float(raw[0]), events, rank)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"bad KV event: {e}") from None


class EventCollector:
    """A cache's event sink (`radixkv.tree.CacheEventSink`) that buffers events until
    `drain` (the engine drains it once per step into one batch).

    Args:
        salt_key: the events key namespaces are tagged with (`salt_tag`).
        tokens: publish token ids and namespace tags (``False``: block hashes only).
        arrays: keep each stored event's token ids (the cache's int64 array, a
            read-only view, no copy) and block hashes (a uint64 array) as arrays, not
            lists; `encode_batch` writes them as the same lists. For batches that only
            go to the wire: the publisher's thread then makes the lists, not the
            engine's step.
    """

    def __init__(
        self, salt_key: bytes | None = None, tokens: bool = True, arrays: bool = False
    ) -> None:
        self._events: list[Event] = []
        self.salt_key, self.tokens = salt_key, tokens
        self.arrays = arrays
        # hash-only events show a subscriber nothing but the hashes: those must be
        # BLAKE2b (radixkv.tree.page_hash), not the fast chain that token events carry
        self.strong_hashes = not tokens
        self._tags: dict[Any, str] = {}
        self._flushes: list[Callable[[], None]] = []

    @property
    def events(self) -> list[Event]:
        """The events buffered so far, the attached caches' pending pages reported
        first (so reading them right after an insert shows its pages)."""
        for flush in self._flushes:
            flush()
        return self._events

    def attach(self, flush: Callable[[], None]) -> None:
        """Call ``flush`` before handing events out: a cache reports the pages it stored
        since the last drain then, hashed in one batch (`radixkv.tree.RadixCache.flush_events`)."""
        if flush not in self._flushes:
            self._flushes.append(flush)

    def stored(
        self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int],
        block_size: int, extra_key: Any,
    ) -> None:  # fmt: skip
        extra = None
        if not self.tokens:
            token_ids = []  # the hashes chain the tokens and the namespace already
        elif extra_key is not None:
            tag = self._tags.get(extra_key)
            if tag is None:
                if len(self._tags) > 4096:
                    self._tags.clear()
                tag = self._tags[extra_key] = salt_tag(extra_key, self.salt_key)
            extra = [(tag,)] * len(block_hashes)
        self._events.append(
            BlockStored(block_hashes, parent_hash, token_ids, block_size, extra_keys=extra)
        )

    def removed(self, block_hashes: list[int]) -> None:
        self._events.append(BlockRemoved(block_hashes))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def drain(self, rank: int | None = None) -> KVEventBatch | None:
        """The buffered events as one batch (``None`` when there are none)."""
        events = self.events
        if not events:
            return None
        self._events = []
        return KVEventBatch(time.time(), events, rank)


class ZmqEventPublisher:
    """Publish batches on a PUB socket, with a ROUTER socket that replays the last
    ``buffer_steps`` batches (see the module docstring). A background thread owns the
    sockets; `publish` only queues.

    Args:
        endpoint: where PUB binds, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: where ROUTER binds (``None``: no replay).
        buffer_steps: batches kept for replay; a replay sends at most the last
            ``buffer_steps`` and a peer's unread queue holds at most that many.
        topic: the first frame of every message.
        clock: seconds, for the replay rate limit (tests pass a fake one).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 1_000,
        topic: str = "kv-events",
        clock: Any = time.monotonic,
    ) -> None:
        import zmq

        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_bytes = 0
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)  # raises zmq.ZMQError on a bad or busy address
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)  # one replay per peer
            self._replay.bind(replay_endpoint)
        self._clock = clock
        self._replays: deque[float] = deque()  # when recent replays were served
        self._peers: dict[bytes, float] = {}  # peers served a replay, and when last
        self.replays_asked = 0  # replay requests taken (answered or dropped)
        self.replays_dropped = 0
        self.replay_bytes = 0  # sent in replays, all peers together
        self._thread = threading.Thread(target=self._run, name="radixkv-events", daemon=True)
        self._thread.start()

    @property
    def published(self) -> int:
        """Batches sent so far (the next one's sequence number)."""
        return self._seq

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` (thread-safe; never blocks). The publisher's thread encodes
        it, so the caller (the engine's step) pays for neither msgpack nor the send;
        ``batch`` must not change afterwards (`EventCollector.drain` hands out a new one
        each time)."""
        self._queue.put(batch)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                break
            try:
                payload = encode_batch(batch)
            except Exception:  # a bad batch is dropped; the stream goes on
                log.exception("dropping a KV event batch that does not encode")
                continue
            seq, self._seq = self._seq, self._seq + 1
            self._keep(seq, payload)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _keep(self, seq: int, payload: bytes) -> None:
        """Buffer a batch for replay: at most ``buffer_steps`` and the byte bound."""
        if len(self._buffer) == self._buffer.maxlen:
            self._buffer_bytes -= len(self._buffer[0][1])
        self._buffer.append((seq, payload))
        self._buffer_bytes += len(payload)
        while self._buffer_bytes > REPLAY_BUFFER_BYTES and len(self._buffer) > 1:
            self._buffer_bytes -= len(self._buffer.popleft()[1])

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        self.replays_asked += 1
        now = self._clock()
        while self._replays and self._replays[0] < now - 1.0:
            self._replays.popleft()
        for peer, when in list(self._peers.items()):
            if when < now - REPLAY_PEER_WINDOW_S:
                del self._peers[peer]
        new_peer = client not in self._peers and len(self._peers) >= REPLAY_PEERS
        if len(self._replays) >= REPLAYS_PER_S or new_peer or len(start) != 8:
            self.replays_dropped += 1  # the peer sees no answer and may ask again
            return
        self._replays.append(now)
        self._peers[client] = now
        first, sent = int.from_bytes(start, "big"), 0
        for seq, payload in self._buffer:
            if seq >= first:
                if sent and sent + len(payload) > REPLAY_MAX_BYTES:
                    break  # the rest on the peer's next request
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
                sent += len(payload)
        self.replay_bytes += sent
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
