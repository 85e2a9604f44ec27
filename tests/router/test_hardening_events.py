"""Hardening, round 3: the router against any event stream (a forged publisher is a real
ZeroMQ socket the test owns, in front of a real router process), its HTTP edge, the
publisher's replays, and ``n`` choices against the queue. Each test failed on the code
before the fix (the note of issue 29 says how)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import zmq

from radixkv.events import BlockStored, KVEventBatch, ZmqEventPublisher, encode_batch
from radixkv.router.index import MAX_BATCH_BLOCKS
from radixkv.router.subscriber import STALE_AFTER
from radixkv.web.process import ServerProcess, free_port_pair

WORKER = ["--model", "random", "--page-size", "4", "--kv-tokens", "4096",
          "--max-context-len", "512"]  # fmt: skip
POOL_BLOCKS = 4096 // 4  # what the worker's card says its pool holds


class ForgedEvents:
    """A PUB socket in a worker's place: sends whatever the test asks, numbered."""

    def __init__(self) -> None:
        self.port = free_port_pair()
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0

    def frames(self, *frames: bytes) -> None:
        self.sock.send_multipart(frames)

    def payload(self, payload: bytes) -> None:
        self.frames(b"kv-events", self.seq.to_bytes(8, "big"), payload)
        self.seq += 1

    def batch(self, *events) -> None:
        self.payload(encode_batch(KVEventBatch(time.time(), list(events))))

    def close(self) -> None:
        self.sock.close()


def stored(first: int, blocks: int, size: int = 4, **kw) -> BlockStored:
    hashes = list(range(first, first + blocks))
    tokens = [t for h in hashes for t in [h % 50_000] * size]
    return BlockStored(hashes, None, tokens, size, **kw)


@pytest.fixture
def forged():
    """A real worker (its card says its page size and pool), a forged event stream in
    its place, and a real router over them."""
    worker = ServerProcess(*WORKER)
    events = ForgedEvents()
    spec = f"{worker.url},tcp://127.0.0.1:{events.port}"
    router = ServerProcess("--model", "random", "--worker", spec, command="route")
    try:
        settle(events, router)
        yield worker, events, router
    finally:
        router.stop()
        worker.stop()
        events.close()


def state(router) -> dict:
    return httpx.get(f"{router.url}/route/state", timeout=5).json()["workers"][0]


def failed(router, kind: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("radixkv_router:event_messages_failed_total{") and f'"{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def settle(events: ForgedEvents, router) -> None:
    """PUB/SUB's slow joiner: send a first good block until the router has it."""
    events.batch(stored(10**9, 1))
    first = events.seq
    assert wait(lambda: state(router)["indexed_blocks"] >= 1 or resend(events, first))


def resend(events: ForgedEvents, first: int) -> bool:
    if events.seq == first:  # nothing new sent since: the same batch again, renumbered
        events.seq = 0
        events.batch(stored(10**9, 1))
    return False


def test_no_message_stops_the_subscriber(forged):
    """One malformed message used to kill the worker's subscriber thread for good
    (ValueError, TypeError, OverflowError, RecursionError): later valid events were
    ignored and routing for that worker went stale silently."""
    _, events, router = forged
    before = state(router)["indexed_blocks"]
    events.batch(BlockStored([1], None, [1, 2, 3], 4))  # 3 token ids for a block of 4
    events.batch(stored(2, 1, extra_keys=[[["unhashable"]]]))  # a list inside extra_keys
    events.frames(b"kv-events", (1 << 64).to_bytes(9, "big"), b"x")  # a 9-byte number
    events.payload(b"\x93\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\xc0")  # nested deep
    events.payload(b"not msgpack at all")
    events.batch(stored(100, 3))  # and then a good one
    assert wait(lambda: state(router)["indexed_blocks"] == before + 3)
    for kind in ("token_count", "not_plain", "frames", "nested", "undecodable"):
        assert failed(router, kind) == 1, kind


def test_the_first_event_does_not_fix_the_block_size(forged):
    """A forged event with block size 1 used to set the index's block size, so every
    honest worker's events failed from then on."""
    _, events, router = forged
    before = state(router)["indexed_blocks"]
    events.batch(stored(500, 1, size=1))
    events.batch(stored(600, 2, size=4))
    assert wait(lambda: state(router)["indexed_blocks"] == before + 2)
    assert failed(router, "block_size") == 1


def test_a_worker_holds_no_more_than_its_pool_and_a_batch_is_bounded(forged):
    """60 s of forged distinct blocks took a router from 252 MB past 4 GB; one batch
    of 2 million blocks held the index lock for 15.5 s."""
    _, events, router = forged
    events.batch(stored(10_000, MAX_BATCH_BLOCKS + 1))  # refused whole
    for i in range(4):  # 4 x 400 distinct blocks, where the pool holds 1,024
        events.batch(stored(20_000 + 1000 * i, 400))
    events.batch(stored(90_000, 1, size=4))  # a marker: everything before is applied
    assert wait(lambda: failed(router, "over_capacity") >= 1)
    assert failed(router, "too_many_blocks") == 1
    assert state(router)["indexed_blocks"] <= POOL_BLOCKS


def test_a_stream_that_keeps_failing_turns_stale_and_back(forged):
    """A worker whose stream is unparseable is not trusted (routing falls back to its
    load) until its stream is good again."""
    _, events, router = forged
    for _ in range(STALE_AFTER):
        events.payload(b"garbage")
    assert wait(lambda: state(router)["events_stale"])
    assert state(router)["indexed_blocks"] == 0  # started over: its entries are gone
    events.batch(stored(700, 2))
    assert wait(lambda: not state(router)["events_stale"])
    assert state(router)["indexed_blocks"] >= 2


def test_replays_are_bounded_in_bytes_and_peers(monkeypatch):
    """300 replay peers of a 1,000-batch buffer grew a server by 2.7 GB in 30 s: now at
    most REPLAY_PEERS distinct peers are served a window, each at most REPLAY_MAX_BYTES,
    and the buffer keeps at most REPLAY_BUFFER_BYTES."""
    from radixkv import events as ev

    monkeypatch.setattr(ev, "REPLAY_MAX_BYTES", 20_000)
    monkeypatch.setattr(ev, "REPLAY_BUFFER_BYTES", 60_000)
    now = [100.0]
    port = free_port_pair()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 1000,
                            clock=lambda: now[0])  # fmt: skip
    peers = []
    try:
        for i in range(40):  # 40 batches of ~5 KB: the buffer keeps ~60 KB of them
            pub.publish(KVEventBatch(0.0, [stored(i * 1000, 300)]))
        assert wait(lambda: pub.published == 40)
        assert pub._buffer_bytes <= 60_000 and len(pub._buffer) < 40
        poller, answered = zmq.Poller(), {}
        for i in range(ev.REPLAY_PEERS + 4):
            now[0] += 2.0  # past the per-second limit: only the peer cap binds
            peer = zmq.Context.instance().socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(pub.replay_endpoint)
            peers.append(peer)
            poller.register(peer, zmq.POLLIN)
            peer.send_multipart((b"", (0).to_bytes(8, "big")))
            assert wait(lambda i=i: pub.replays_asked == i + 1)  # taken at this clock
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and pub.replays_dropped < 4:
            for peer, _ in poller.poll(50):
                *_, payload = peer.recv_multipart()
                answered.setdefault(peer, 0)
                answered[peer] += len(payload)
        while True:  # what is left in flight
            got = poller.poll(300)
            if not got:
                break
            for peer, _ in got:
                *_, payload = peer.recv_multipart()
                answered[peer] = answered.get(peer, 0) + len(payload)
        assert pub.replays_dropped == 4 and len(answered) == ev.REPLAY_PEERS
        assert max(answered.values()) <= 20_000 + 6_000  # one batch past the cap at most
    finally:
        for peer in peers:
            peer.close()
        pub.close()


@pytest.mark.slow
def test_the_router_refuses_an_overlong_prompt_itself_off_its_loop():
    """The router tokenized on its event loop (a 3.9 MB prompt stalled its /health for
    3.2 s) and forwarded what no worker could take; now it checks the length against
    the workers' context first and answers itself, off the loop, as a server does."""
    worker = ServerProcess(*WORKER)
    router = ServerProcess("--model", "random", "--worker", worker.url, command="route")
    try:
        body = {"model": "random", "prompt": "x" * 600_000, "max_tokens": 4}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "x-radixkv-worker" not in r.headers
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    finally:
        router.stop()
        worker.stop()


def test_a_chunked_body_over_the_limit_gets_413_from_the_router():
    """A chunked body over 4 MiB got a 500 from the router (a server gives 413)."""
    worker = ServerProcess(*WORKER)
    router = ServerProcess("--model", "random", "--worker", worker.url, command="route")
    try:

        def chunks():
            yield b'{"model": "random", "prompt": "'
            for _ in range(5):
                yield b"x" * (1 << 20)
            yield b'"}'

        r = httpx.post(f"{router.url}/v1/completions", content=chunks(), timeout=60,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        router.stop()
        worker.stop()


@pytest.mark.slow
def test_n_choices_count_against_the_queue_and_share_the_slots():
    """n=128 choices were submitted one at a time, never waiting: they bypassed
    --max-queue, and one request took 31 running slots for 65 s while others waited.
    And a stream of more choices than the group's share of slots sent nothing until the
    first choices had finished (it waited for every choice's first token)."""
    with ServerProcess(*WORKER, "--max-queue", "4", "--max-running", "4") as srv:
        body = {"model": "random", "prompt": "x", "n": 8, "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        first_choice_done: list[float] = []
        running = threading.Event()

        def big() -> None:  # 4 long choices, streamed: when does the first one end?
            body = {"model": "random", "prompt": "big shares nothing", "n": 4,
                    "max_tokens": 480, "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    running.set()
                    if '"finish_reason":"' in line and not first_choice_done:
                        first_choice_done.append(time.monotonic())

        t = threading.Thread(target=big)
        t.start()
        # the big request's choices are running (a token streamed): the small one comes
        # ~480 decode steps before the first choice can end, not after a fixed sleep
        assert running.wait(60)
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "model": "random", "prompt": "small", "max_tokens": 2, "ignore_eos": True})  # fmt: skip
        small_done = time.monotonic()
        t.join()
        assert r.status_code == 200
        # a slot was left for it: it did not wait for one of the big request's choices
        assert first_choice_done and small_done < first_choice_done[0]


class CookieWorker:
    """A worker that sets a cookie on every answer and records the headers it is sent: a
    real worker's card and health (forwarded to it), its own answers to the rest."""

    def __init__(self, real: ServerProcess) -> None:
        import http.server

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the card and /health: the real worker's
                r = httpx.get(f"{real.url}{self.path}", timeout=10)
                self.answer(r.status_code, r.content)

            def do_POST(self) -> None:
                seen.append({k.lower(): v for k, v in self.headers.items()})
                self.rfile.read(int(self.headers["content-length"]))
                body = json.dumps({"id": "x", "object": "chat.completion", "choices": [],
                                   "usage": {"prompt_tokens": 1}}).encode()  # fmt: skip
                self.answer(200, body, [("Set-Cookie", "tenant=a-secret; Path=/")])

            def answer(self, status: int, body: bytes, extra=()) -> None:
                self.send_response(status)
                for k, v in [("Content-Type", "application/json"), *extra]:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_a) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # by name: a client keeps no cookie from an address, one from a name it may
        self.url = f"http://localhost:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_no_cookie_or_compression_crosses_from_one_request_to_the_next():
    """The router keeps one connection pool to its workers for every client: a cookie a
    worker set for one request must not ride along with the next (another tenant's), and
    the router asks for no compression (it relays the bytes as they come)."""
    real = ServerProcess(*WORKER)
    worker = CookieWorker(real)
    router = ServerProcess("--model", "random", "--worker", worker.url, command="route")
    try:
        for who in ("first", "second"):
            body = {"model": "random", "messages": [{"role": "user", "content": who}]}
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200 and "set-cookie" not in r.headers
        assert len(worker.seen) == 2
        for headers in worker.seen:
            assert "cookie" not in headers
            assert "gzip" not in headers.get("accept-encoding", "")
    finally:
        router.stop()
        real.stop()
        worker.close()
