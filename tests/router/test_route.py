"""Routing: the policies as pure decisions, the replica simulator, and ``radixkv route``
over two real tiny-model servers publishing KV events."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from radixkv.cli import main
from radixkv.key import RadixKey
from radixkv.router import policies
from radixkv.router.proxy import WorkerSpec
from radixkv.sim.replicas import ROUTERS, pooled_bound, simulate_replicas
from radixkv.sim.traces import SimRequest, Trace
from radixkv.web.process import ServerProcess, free_port_pair

# real servers and routers, many of them: the slow set (python3 -m pytest -m slow)
pytestmark = pytest.mark.slow
A, B, C = "a", "b", "c"


# --- decisions -----------------------------------------------------------------------------
def test_round_robin_and_least_load():
    assert [policies.round_robin([A, B, C], t) for t in range(4)] == [A, B, C, A]
    assert policies.least_load([A, B, C], {A: 3, B: 1, C: 1}) == B


def test_approx_prefers_a_good_match_then_the_smallest_tree_and_balances_load():
    loads = {A: 0, B: 0, C: 0}
    assert policies.approx([A, B, C], loads, {A: 10, B: 40}, 100, {A: 5, B: 9, C: 7}) == B
    # 0.25 of the request matched: not above the 0.3 threshold, so the smallest tree
    assert policies.approx([A, B, C], loads, {A: 25}, 100, {A: 5, B: 9, C: 2}) == C
    # imbalanced: 100 vs 10 in flight (> 64 apart and > 1.5x): the least loaded wins
    assert policies.approx([A, B], {A: 100, B: 10}, {A: 100}, 100, {A: 1, B: 1}) == B
    # 100 vs 40: 60 apart is within the absolute threshold, so the cache still wins
    assert policies.approx([A, B], {A: 100, B: 40}, {A: 100}, 100, {A: 1, B: 1}) == A


def test_kv_cost_weighs_overlap_against_load():
    # a 20-block request; A holds 15 of it. Dynamo's weight 1: A costs 5 + in flight, B 20
    w1 = policies.DYNAMO_DEFAULT_WEIGHT
    assert policies.kv([A, B], {A: 15}, 20, {A: 12, B: 0}, weight=w1) == A  # 17 < 20
    assert policies.kv([A, B], {A: 15}, 20, {A: 30, B: 0}, weight=w1) == B  # 35 > 20
    assert policies.kv([A, B], {A: 15}, 20, {A: 30, B: 0}, weight=4) == A  # 20 + 30 < 80
    assert policies.kv([A, B], {A: 15}, 20, {A: 70, B: 0}, weight=4) == B  # 20 + 70 > 80
    # the worker's queued prefills count at a quarter of its own: a holder whose queue
    # costs more than the prefix saves loses the request to an empty worker (B: 16 x 20)
    assert policies.kv([A, B], {A: 15}, 20, {}, queued_blocks={A: 56}) == A  # 304 < 320
    assert policies.kv([A, B], {A: 15}, 20, {}, queued_blocks={A: 64}) == B  # 336 > 320
    # equal cost: the worker caching fewer blocks takes a cold prompt
    assert policies.kv([A, B, C], {}, 10, {}, cached_blocks={A: 9, B: 3, C: 5}) == B


# --- the simulator ------------------------------------------------------------------------
def conversations(n_conv: int, turns: int, gap_ms: float = 1000.0) -> Trace:
    """Chats whose every turn extends the previous one: a unit id per whole prefix."""
    trace, uid, t = Trace("chats", 16), 0, 0.0
    history: dict[int, list[int]] = {c: [] for c in range(n_conv)}
    for _ in range(turns):
        for c in range(n_conv):
            history[c] = history[c] + list(range(uid, uid + 4))
            uid += 4
            units = list(history[c])
            trace.requests.append(SimRequest(units, len(units), 16 * len(units), t, 8))
            t += gap_ms
    return trace


def test_cache_aware_routers_keep_conversations_together():
    trace = conversations(13, 6)  # 13 chats over 4 replicas: round robin scatters them
    res = {r: simulate_replicas(trace, 4, 200, r) for r in ROUTERS}
    assert res["kv"].token_hit_rate > 2 * res["round_robin"].token_hit_rate
    assert res["approx"].token_hit_rate > 2 * res["round_robin"].token_hit_rate
    bound = pooled_bound(trace, 4, 200)
    for r in res.values():
        assert r.token_hit_rate <= bound + 1e-9
        assert r.prefill_tokens + r.hit_tokens == r.prompt_tokens
    assert res["kv"].load_imbalance < 1.5


def test_simulate_replicas_command(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = []
    for c in range(6):
        ids = []
        for turn in range(3):
            ids += [c * 100 + turn * 2, c * 100 + turn * 2 + 1]
            lines.append(
                f'{{"timestamp": {turn * 1000 + c}, "input_length": {512 * len(ids)}, '
                f'"output_length": 20, "hash_ids": {ids}}}'
            )
    trace.write_text("\n".join(lines))
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(trace), "--replicas", "2,3", "--capacity", "20blocks",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    import json

    rows = json.loads(out.read_text())["results"]
    assert {(r["replicas"], r["router"]) for r in rows} == {(n, p) for n in (2, 3) for p in ROUTERS}
    assert main(["simulate", "--workload", "few-shot", "--router", "kv"]) == 2
    assert main([*argv[:5], "--router", "nope"]) == 2
    assert main(["simulate", "--trace", str(trace), "--replicas", "0"]) == 2
    assert "error: --replicas" in capsys.readouterr().err


def test_worker_specs():
    spec = WorkerSpec.parse("http://127.0.0.1:8001,tcp://127.0.0.1:5557")
    assert spec.events == "tcp://127.0.0.1:5557" and spec.replay == "tcp://127.0.0.1:5558"
    assert (
        WorkerSpec.parse("http://h:1/").url == "http://h:1"
        and WorkerSpec.parse("http://h:1").events is None
    )
    for bad in ("127.0.0.1:8001", "http://h:1,udp://x:1", "http://h:1,tcp://x:y"):
        with pytest.raises(ValueError, match="worker"):
            WorkerSpec.parse(bad)


# --- real processes -------------------------------------------------------------------------
WORKER = [
    "--model",
    "random",
    "--page-size",
    "4",
    "--kv-tokens",
    "4096",
    "--max-context-len",
    "512",
]


def Router(workers: list[str], policy: str = "kv") -> ServerProcess:
    """``radixkv route`` over ``workers`` (``URL,EVENTS``) on a free port."""
    args = [a for w in workers for a in ("--worker", w)]
    # no --model: the router tokenizes as the workers' cards say they do
    return ServerProcess("--policy", policy, "--health-interval", "0.2",
                         *args, command="route", timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def fleet():
    ports = [free_port_pair() for _ in range(2)]
    workers = [
        ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60) for p in ports
    ]
    specs = [f"{w.url},tcp://127.0.0.1:{p}" for w, p in zip(workers, ports, strict=True)]
    router = Router(specs)
    yield router, workers
    router.stop()
    for w in workers:
        w.stop()


def complete(url: str, prompt: str, headers: dict | None = None, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers=headers)


def test_a_shared_prefix_lands_where_it_is_cached(fleet):
    router, _ = fleet
    system = "You are the routing test assistant; answer briefly and politely. " * 3
    first = complete(router.url, system + "first?")
    assert first.status_code == 200
    holder = first.headers["x-radixkv-worker"]
    deadline = time.monotonic() + 30  # the holder's events reach the router
    while not any(w["url"] == holder and w["indexed_blocks"] >= len(system) // 4 - 1
                  for w in httpx.get(f"{router.url}/route/state").json()["workers"]):  # fmt: skip
        assert time.monotonic() < deadline, "the holder's events never reached the router"
        time.sleep(0.05)
    for q in ("second?", "third?", "fourth?"):
        r = complete(router.url, system + q)
        assert r.headers["x-radixkv-worker"] == holder
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > len(system) - 8
    other = complete(router.url, "A different prompt altogether, nothing shared. " * 3)
    assert other.status_code == 200
    state = httpx.get(f"{router.url}/route/state").json()
    assert state["block_size"] == 4
    assert any(w["indexed_blocks"] > 0 for w in state["workers"])
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "radixkv_router:requests_total" in metrics


def test_streaming_passes_through(fleet):
    router, _ = fleet
    body = {
        "prompt": "stream through the router",
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    bad = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "n": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"  # the worker's answer


def test_n_choices_count_as_n_in_flight_on_their_worker(fleet):
    """A request of ``n`` choices runs ``n`` sequences on its worker; the router counted
    it as one, so least-load and the key's load bound saw a worker running 4 as 1."""
    router, _ = fleet
    body = {"prompt": "four long choices", "n": 4, "max_tokens": 480, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        worker = r.headers["x-radixkv-worker"]
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream (an abort)
        next(lines)  # it runs: 480 tokens to go
        gauge = 'radixkv_router:in_flight{worker="' + worker + '"} '
        line = [x for x in httpx.get(f"{router.url}/metrics").text.splitlines()
                if x.startswith(gauge)]  # fmt: skip
        assert line == [gauge + "4.0"]
        assert [x for x in lines if x][-1] == "data: [DONE]"
    state = httpx.get(f"{router.url}/route/state").json()  # over: its load is gone
    assert all(w["in_flight"] == 0 for w in state["workers"]), state


def test_killing_a_worker_loses_no_request_that_had_not_started():
    ports = [free_port_pair() for _ in range(2)]
    workers = [
        ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60) for p in ports
    ]
    specs = [f"{w.url},tcp://127.0.0.1:{p}" for w, p in zip(workers, ports, strict=True)]
    router = Router(specs, policy="round_robin")
    try:
        assert complete(router.url, "warm up").status_code == 200
        workers[0].proc.kill()  # gone without a word
        workers[0].proc.wait()
        codes = [complete(router.url, f"request {i} after the crash").status_code for i in range(6)]
        assert codes == [200] * 6
        state = httpx.get(f"{router.url}/route/state").json()
        assert [w["alive"] for w in state["workers"]] == [False, True]
        assert (
            'radixkv_router:retries_total{worker="' + workers[0].url
            in httpx.get(f"{router.url}/metrics").text
            or not state["workers"][0]["alive"]
        )
    finally:
        router.stop()
        for w in workers:
            w.stop()


def replayed_payloads(events: str) -> list[bytes]:
    """Every batch a worker's replay socket still holds (what any subscriber can read)."""
    import zmq

    from radixkv.events import replay_endpoint

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(replay_endpoint(events))
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    out = []
    while True:
        _, _, seq, payload = sock.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:
            break
        out.append(payload)
    sock.close()
    return out


@pytest.mark.parametrize("mode", ["tokens", "hashes"])
def test_private_events_route_salted_tenants_without_showing_salts_or_prompts(mode):
    from radixkv.events import decode_batch

    key, salt = "fleet-events-key", "tenant-salt-do-not-leak"
    ports = [free_port_pair() for _ in range(2)]
    private = ["--kv-events-key", key, "--kv-events-mode", mode]
    workers = [
        ServerProcess(*WORKER, *private, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60)
        for p in ports
    ]
    specs = [f"{w.url},tcp://127.0.0.1:{p}" for w, p in zip(workers, ports, strict=True)]
    args = [a for s in specs for a in ("--worker", s)]
    router = ServerProcess("--model", "random", "--policy", "kv", "--kv-events-key", key,
                           *args, command="route", timeout=60)  # fmt: skip
    try:
        system = "Confidential briefing for the tenant: quarterly numbers follow. " * 2
        first = complete(router.url, system + "first?", cache_salt=salt)
        holder = first.headers["x-radixkv-worker"]
        deadline = time.monotonic() + 30  # bounded: the holder's events reach the router
        while not any(w["indexed_blocks"] for w in
                      httpx.get(f"{router.url}/route/state").json()["workers"]):  # fmt: skip
            assert time.monotonic() < deadline, "no event reached the router"
            time.sleep(0.05)
        for q in ("second?", "third?"):
            r = complete(router.url, system + q, cache_salt=salt)
            assert r.headers["x-radixkv-worker"] == holder
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 60
        payloads = [p for w in ports for p in replayed_payloads(f"tcp://127.0.0.1:{w}")]
        assert payloads and not any(salt.encode() in p for p in payloads)
        stored = [e for p in payloads for e in decode_batch(p).events if hasattr(e, "token_ids")]
        assert stored
        if mode == "hashes":
            assert all(not e.token_ids and not e.extra_keys for e in stored)
        else:
            assert any(e.extra_keys for e in stored)  # tagged, not in clear
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_events_beyond_loopback_need_an_explicit_flag(capsys):
    assert main(["serve", "--model", "random", "--kv-events", "tcp://0.0.0.0:5557"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kv-events tcp://0.0.0.0:5557") and "insecure" in err


@pytest.mark.parametrize("policy", ["least_load", "kv"])
def test_a_burst_spreads_one_per_worker_before_any_answers(policy):
    """Load counts from the moment a request is chosen, not from the worker's first byte:
    6 simultaneous prompts sharing nothing, over 3 workers, land 2/2/2. Each is a stream
    held open until all six have started (so none has finished when the others are
    chosen, however slow the machine), then closed: the router releases every load."""
    import asyncio
    from collections import Counter as Tally

    ports = [free_port_pair() for _ in range(3)]
    workers = [ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60)
               for p in ports]  # fmt: skip
    specs = [f"{w.url},tcp://127.0.0.1:{p}" for w, p in zip(workers, ports, strict=True)]
    router = Router(specs, policy)
    try:

        async def burst() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as c, contextlib.AsyncExitStack() as held:
                body = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}

                async def start(i: int) -> str:
                    r = await held.enter_async_context(c.stream(
                        "POST", f"{router.url}/v1/completions",
                        json={**body, "prompt": f"{i} " + chr(65 + i) * 40}))  # fmt: skip
                    assert r.status_code == 200
                    return r.headers["x-radixkv-worker"]

                return list(await asyncio.gather(*(start(i) for i in range(6))))

        assert sorted(Tally(asyncio.run(burst())).values()) == [2, 2, 2]
        deadline = time.monotonic() + 60  # the closed streams' loads are released
        while any(w["in_flight"] for w in httpx.get(f"{router.url}/route/state").json()["workers"]):
            assert time.monotonic() < deadline, "a load was never released"
            time.sleep(0.05)
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_a_stream_a_worker_breaks_off_ends_with_an_error_event():
    port = free_port_pair()
    worker = ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{port}", timeout=60)
    router = Router([f"{worker.url},tcp://127.0.0.1:{port}"])
    try:
        body = {"prompt": "tell a long story", "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        lines = []
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    worker.proc.kill()  # gone mid-answer
        assert r.status_code == 200 and lines[-1] != "data: [DONE]"
        assert '"code": "worker_failed"' in lines[-1] and lines[-1].startswith("data: {")
        metrics = httpx.get(f"{router.url}/metrics").text
        assert "radixkv_router:streams_cut_total" in metrics
        assert 'streams_cut_total{worker="' + worker.url + '"} 1.0' in metrics
    finally:
        router.stop()
        worker.stop()


def test_the_simulator_decomposes_reuse_and_queues_prefills():
    trace = conversations(13, 6)
    res = {r: simulate_replicas(trace, 4, 200, r) for r in ROUTERS}
    for r in res.values():  # what any replica held bounds what the chosen one served
        assert r.fleet_hit_rate >= r.token_hit_rate - 1e-9
    rr = res["round_robin"]
    assert rr.fleet_hit_rate > 2 * rr.token_hit_rate  # reuse lost to routing, visible
    assert res["kv"].fleet_hit_rate - res["kv"].token_hit_rate < 0.05
    # one shared 1,024-token prefix, requests 1 ms apart: piling onto the replica that
    # holds it (oracle) queues the prefills there; kv weighs the queue
    shared = Trace("shared", 16)
    for i in range(200):
        units = list(range(64)) + [1000 + 4 * i + k for k in range(4)]
        shared.requests.append(SimRequest(units, len(units), 16 * len(units), float(i), 4))
    piled = simulate_replicas(shared, 4, None, "oracle")
    spread = simulate_replicas(shared, 4, None, "kv")
    assert piled.ttft_p90_s > 2 * spread.ttft_p90_s
    assert spread.ttft_p50_s > 0 and spread.token_hit_rate > 0.5


def test_the_router_decomposes_the_reuse(fleet):
    """Per request: what the fleet held (the index's longest prefix on any worker), what
    routing captured (the chosen worker's, by the index), what the engine served (its
    usage's cached_tokens), as /metrics counters."""
    router, _ = fleet

    def totals() -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{router.url}/metrics").text.splitlines():
            for name in ("prompt_tokens", "fleet_available_tokens",
                         "routing_captured_tokens", "engine_delivered_tokens"):  # fmt: skip
                if line.startswith(f"radixkv_router:{name}_total "):
                    out[name] = float(line.rsplit(" ", 1)[1])
        return out

    system = "A decomposed reuse check: the shared prefix of every question here. " * 3
    first = complete(router.url, system + "one?")
    holder = first.headers["x-radixkv-worker"]
    deadline = time.monotonic() + 30  # bounded: the holder's events reach the router
    while not next(w for w in httpx.get(f"{router.url}/route/state").json()["workers"]
                   if w["url"] == holder)["indexed_blocks"]:  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = totals()
    r = complete(router.url, system + "two?", stream=True,
                 stream_options={"include_usage": True})  # fmt: skip
    assert r.status_code == 200
    plain = complete(router.url, system + "three?")
    d = {k: v - before[k] for k, v in totals().items()}
    served = plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert d["prompt_tokens"] > 0 and served > 0
    assert d["fleet_available_tokens"] >= d["routing_captured_tokens"] > 0
    assert d["engine_delivered_tokens"] >= served  # the stream's usage counted too
    assert d["fleet_available_tokens"] <= d["prompt_tokens"]


def test_route_refuses_workers_it_would_misroute(fleet, tmp_path, capsys):
    """A router whose tokenizer is not the workers' would see every overlap as 0; workers
    with different page sizes cannot share one index. Both are refused at start."""
    from support.models import hf_folder

    _, workers = fleet
    folder = hf_folder(tmp_path / "other-tokenizer")
    args = ["route", "--policy", "kv", "--port", str(free_port_pair())]
    assert main([*args, "--model", str(folder), "--worker", workers[0].url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: worker {workers[0].url}") and "tokenizes with" in err
    with ServerProcess(*WORKER[:2], "--page-size", "16", timeout=60) as odd:
        assert main([*args, "--model", "random", "--worker", workers[0].url,
                     "--worker", odd.url]) == 2  # fmt: skip
    assert "page sizes differ" in capsys.readouterr().err
    card = httpx.get(f"{workers[0].url}/v1/models").json()["data"][0]
    assert card["radixkv"]["page_size"] == 4 and len(card["radixkv"]["tokenizer"]) == 16
    assert card["radixkv"]["tokenizer_source"] == "byte"


def test_route_takes_the_workers_tokenizer_and_refuses_a_fleet_that_disagrees(
    fleet, tmp_path, capsys
):
    """Without --model the router loads what the workers' cards name (a folder's
    tokenizer here, a byte tokenizer in the fleet) and checks it against their
    fingerprint; workers that tokenize differently are refused, naming each."""
    from support.models import hf_folder

    from radixkv.router.fleet import workers_tokenizer
    from radixkv.tokenizer import ByteTokenizer, tokenizer_fingerprint

    _, workers = fleet
    folder = hf_folder(tmp_path / "own-tokenizer")
    with ServerProcess("--model", str(folder), timeout=60) as other:
        cards = {w.url: httpx.get(f"{w.url}/v1/models").json()["data"][0]
                 for w in (workers[0], other)}  # fmt: skip
        mine = cards[other.url]["radixkv"]
        assert mine["tokenizer_source"] == str(folder.resolve())
        tok = workers_tokenizer({other.url: cards[other.url]})
        assert tok is not None and tokenizer_fingerprint(tok) == mine["tokenizer"]
        assert type(workers_tokenizer({workers[0].url: cards[workers[0].url]})) is ByteTokenizer
        args = ["route", "--port", str(free_port_pair()), "--worker", workers[0].url]
        assert main([*args, "--worker", other.url]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the workers tokenize differently")
        assert workers[0].url in err and other.url in err
    # a source that does not load here into the workers' tokenizer: --model is needed
    moved = {**mine, "tokenizer_source": str(tmp_path / "elsewhere")}
    with pytest.raises(ValueError, match="give --model"):
        workers_tokenizer({other.url: {**cards[other.url], "radixkv": moved}})
    assert workers_tokenizer({other.url: None}) is None  # nobody says: --model auto


def test_a_restarted_worker_gets_traffic_again_under_load():
    """A worker restarted empty, beside one holding the chat template and a shared system
    prompt, takes traffic again (finding: 0 of 12 after a restart, the shared prefix
    outweighing any load the holder had)."""
    import asyncio

    ports = [free_port_pair() for _ in range(2)]
    workers = [ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60)
               for p in ports]  # fmt: skip
    specs = [f"{w.url},tcp://127.0.0.1:{p}" for w, p in zip(workers, ports, strict=True)]
    router = Router(specs)
    system = "You are a helpful assistant for the routing tests. " + "Be brief. " * 20

    async def chats(first: int, n: int) -> list[str]:
        async def one(c: httpx.AsyncClient, i: int) -> str:
            r = await c.post(f"{router.url}/v1/chat/completions", json={
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"question {i}: " + "why " * 6}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200
            return r.headers["x-radixkv-worker"]

        async with httpx.AsyncClient(timeout=60) as c:
            sem = asyncio.Semaphore(2)  # two at a time

            async def bounded(i: int) -> str:
                async with sem:
                    return await one(c, i)

            return list(await asyncio.gather(*(bounded(i) for i in range(first, first + n))))

    try:
        asyncio.run(chats(0, 8))
        victim = workers[1]
        victim.proc.kill()
        victim.proc.wait()
        asyncio.run(chats(100, 4))  # the router sees it gone; the other holds everything
        workers[1] = ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{ports[1]}",
                                   timeout=60, port=victim.port)  # fmt: skip
        deadline = time.monotonic() + 30
        while not all(w["alive"] for w in httpx.get(f"{router.url}/route/state").json()["workers"]):
            assert time.monotonic() < deadline, "the router never saw the restarted worker"
            time.sleep(0.1)
        after = asyncio.run(chats(200, 16))
        assert after.count(victim.url) >= 2, after
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_workers_with_another_model_behind_one_tokenizer_are_refused(tmp_path, capsys):
    """Same tokenizer, other weights: the same prompt would not mean the same KV."""
    from support.models import hf_folder, save_checkpoint

    from radixkv.engine.models.llama import ModelConfig
    from radixkv.engine.weights import random_model

    one, two = hf_folder(tmp_path / "one"), hf_folder(tmp_path / "two")
    vocab = json.loads((two / "config.json").read_text())["vocab_size"]
    save_checkpoint(random_model(ModelConfig(vocab_size=vocab), seed=3), tmp_path / "w")
    (tmp_path / "w" / "model.safetensors").replace(two / "model.safetensors")
    with ServerProcess("--model", str(one), timeout=60) as a, \
         ServerProcess("--model", str(two), timeout=60) as b:  # fmt: skip
        cards = [httpx.get(f"{w.url}/v1/models").json()["data"][0]["radixkv"] for w in (a, b)]
        assert cards[0]["tokenizer"] == cards[1]["tokenizer"]
        assert cards[0]["model"] != cards[1]["model"] and len(cards[0]["model"]) == 32
        args = ["route", "--port", str(free_port_pair()), "--model", str(one)]
        assert main([*args, "--worker", a.url, "--worker", b.url]) == 2
        assert "serve different models" in capsys.readouterr().err


def test_workers_join_and_leave_at_run_time_with_the_admin_key():
    ports = [free_port_pair() for _ in range(2)]
    workers = [ServerProcess(*WORKER, "--kv-events", f"tcp://127.0.0.1:{p}", timeout=60)
               for p in ports]  # fmt: skip
    first = f"{workers[0].url},tcp://127.0.0.1:{ports[0]}"
    router = ServerProcess("--model", "random", "--worker", first, "--admin-key", "adm",
                           "--api-key", "usr", command="route", timeout=60)  # fmt: skip
    admin = {"authorization": "Bearer adm"}
    user = {"authorization": "Bearer usr"}
    new = {"url": workers[1].url, "events": f"tcp://127.0.0.1:{ports[1]}"}
    try:
        # the API key guards the proxy; the admin key, and only it, changes the fleet
        assert complete(router.url, "no key").status_code == 401
        assert httpx.post(f"{router.url}/workers", json=new, headers=user).status_code == 401
        assert httpx.get(f"{router.url}/workers", headers=user).status_code == 401
        r = httpx.post(f"{router.url}/workers", json=new, headers=admin)
        assert r.status_code == 201 and r.json()["id"] == workers[1].url.split("://")[1]
        again = httpx.post(f"{router.url}/workers", json=new, headers=admin)
        assert again.status_code == 409 and again.json()["error"]["code"] == "worker_exists"
        bad = httpx.post(f"{router.url}/workers", json={"url": "127.0.0.1:1"}, headers=admin)
        assert bad.status_code == 400 and "worker" in bad.json()["error"]["message"]
        with ServerProcess(*WORKER[:2], "--page-size", "16", timeout=60) as odd:
            r = httpx.post(f"{router.url}/workers", json={"url": odd.url}, headers=admin)
            assert r.status_code == 400 and "page sizes differ" in r.json()["error"]["message"]
        listed = httpx.get(f"{router.url}/workers", headers=admin).json()["workers"]
        assert [w["url"] for w in listed] == [workers[0].url, workers[1].url]
        # the new worker takes traffic (round robin would; kv spreads cold prompts)
        seen = {complete(router.url, f"{i} " + chr(65 + i) * 40, headers=user).headers[
            "x-radixkv-worker"] for i in range(4)}  # fmt: skip
        assert seen == {workers[0].url, workers[1].url}
        gone = httpx.delete(f"{router.url}/workers/{listed[0]['id']}", headers=admin)
        assert gone.status_code == 200
        seen = {complete(router.url, f"after {i}", headers=user).headers["x-radixkv-worker"]
                for i in range(3)}  # fmt: skip
        assert seen == {workers[1].url}
        state = httpx.get(f"{router.url}/route/state", headers=user).json()
        assert [w["url"] for w in state["workers"]] == [workers[1].url]
        last = httpx.delete(f"{router.url}/workers/{listed[1]['id']}", headers=admin)
        assert last.status_code == 409
        assert httpx.delete(f"{router.url}/workers/nowhere:1", headers=admin).status_code == 404
    finally:
        router.stop()
        for w in workers:
            w.stop()


def test_a_router_without_an_admin_key_cannot_be_reconfigured_and_reaches_keyed_workers():
    with ServerProcess(*WORKER, "--api-key", "wk", timeout=60) as worker:
        router = ServerProcess("--model", "random", "--worker", worker.url,
                               "--worker-api-key", "wk", command="route", timeout=60)  # fmt: skip
        try:
            r = httpx.post(f"{router.url}/workers", json={"url": "http://127.0.0.1:1"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
            r = complete(router.url, "through the router to a keyed worker")
            assert r.status_code == 200 and r.headers["x-radixkv-worker"] == worker.url
            assert complete(worker.url, "directly, without the key").status_code == 401
        finally:
            router.stop()


def test_a_slow_health_check_neither_takes_a_worker_out_nor_forgets_its_cache():
    """The eviction-pressure run that lost two workers to one slow health check each and
    piled 36 of 48 requests on the third."""
    from radixkv.engine.engine import load_tokenizer
    from radixkv.events import BlockStored, KVEventBatch
    from radixkv.router.fleet import HEALTH_FAILURES
    from radixkv.router.fleet import Router as RouterState

    specs = [WorkerSpec.parse(u) for u in ("http://127.0.0.1:1", "http://127.0.0.1:2")]
    router = RouterState(specs, "kv", load_tokenizer("random"), block_size=4)
    a, b = router.workers
    tokens = list(range(1, 33))
    router.apply(a.url, KVEventBatch(0, [BlockStored(list(range(8)), None, tokens, 4)]))

    def choose(tokens: list[int]):  # the choice, its load released at once
        ticket = router.core.choose(tokens, None)
        ticket.release(served=False)
        return router.worker_of(ticket), ticket

    assert choose(tokens)[0] is a
    for _ in range(HEALTH_FAILURES - 1):
        router.health_checked(a, False)
    assert a.alive and choose(tokens)[0] is a
    router.health_checked(a, True)  # the count starts over
    for _ in range(HEALTH_FAILURES - 1):
        router.health_checked(a, False)
    assert a.alive
    router.health_checked(a, False)
    assert not a.alive and router.index.num_blocks(a.url) == 8  # out, not forgotten
    assert choose(list(range(100, 132)))[0] is b
    router.health_checked(a, True)  # back, with what it held
    worker, ticket = choose(tokens)
    assert a.alive and worker is a and ticket.held == 8
    router.health_checked(a, False, certain=True)  # /health answered 503: out at once
    assert not a.alive and choose(tokens)[0] is b
    router.health_checked(a, True)
    assert a.alive


def test_a_routed_prompt_counts_as_cached_only_until_the_worker_could_have_reported_it():
    """Claims outliving their requests kept sending a chat's turns to a worker that had
    evicted it (eviction pressure: 36 of 48 requests on one thrashing worker)."""
    from radixkv.router import core

    now = [0.0]
    routing = core.RoutingCore("kv", clock=lambda: now[0])
    for name in ("a", "b"):
        routing.add(name)
    routing.index.block_size = 4
    tokens = list(range(1, 65))
    first = routing.choose(tokens)
    again = routing.choose(tokens)  # no events yet: the claim stands
    assert again.worker is first.worker and again.prefill == 0
    again.release(served=False)  # that one never reached its worker
    first.release(served=True)  # done: the claim stands for the grace period
    first.release(served=False)  # a second release changes nothing
    assert first.worker.in_flight == 0 and first.worker.queued_blocks == 0
    third = routing.choose(tokens)
    assert third.worker is first.worker
    third.release(served=True)
    now[0] += core.EVENTS_GRACE_S + 0.001  # past the grace period of every claim
    # the index (empty: the worker reported nothing, e.g. it evicted at once) decides
    assert routing.choose(tokens).prefill == len(tokens) // 4


def test_a_recurrent_workers_claim_holds_only_through_the_prompts_end():
    """A recurrent worker serves a routed prompt's prefix only from the checkpoint at its
    end: a prompt that continues it is claimed to its last whole page, one that leaves
    it midway not at all (a full-attention worker shares every page up to there)."""
    from radixkv.router import core

    routing = core.RoutingCore("kv", clock=lambda: 0.0)
    recurrent, plain = routing.add("r"), routing.add("p")
    routing.index.block_size = 4
    first = list(range(1, 39))  # 38 tokens: the checkpoint at 36
    for w in (recurrent, plain):
        w.claims.append([1.0, RadixKey(first)])
    longer, other = RadixKey([*first, 50, 51]), RadixKey([*first[:30], 99, 98, 97])
    assert recurrent.claimed(longer, 0.0, 4) == 36 and plain.claimed(longer, 0.0) == 38
    assert recurrent.claimed(other, 0.0, 4) == 0 and plain.claimed(other, 0.0) == 30
    # the routing core treats the workers its index knows as recurrent so: the prompt
    # that leaves the claimed one midway counts nothing as claimed on "r"
    plain.claims.clear()
    routing.index.sparse.add("r")
    ticket = routing.choose(list(other.token_ids), max_tokens=1)
    assert ticket.prefill == len(other) // 4


def test_a_ticket_releases_its_load_exactly_once_on_every_path():
    """Every way a request ends (an answer, a failure before it, a retry elsewhere)
    releases its charge once; the load returns to zero whatever the order."""
    from radixkv.router import core

    routing = core.RoutingCore("least_load")
    for name in ("a", "b"):
        routing.add(name)
    tokens = list(range(64))
    tickets = [routing.choose(tokens, max_tokens=16) for _ in range(4)]
    assert [t.worker.name for t in tickets] == ["a", "b", "a", "b"]  # a burst spreads
    a = routing.workers["a"]
    assert a.in_flight == 2 and a.active_blocks == 2 * (64 + 16) // 16
    assert a.queued_blocks == 2 * 64 // 16
    tickets[0].started()
    tickets[0].started()  # the answer's start counts once
    assert a.queued_blocks == 64 // 16
    retry = routing.assign("b", tokens)  # tickets[2] failed on a: the load moves to b
    tickets[2].release(served=False)
    for t in (tickets[0], tickets[1], tickets[3], retry, tickets[0], retry):
        t.release()
    for w in routing.workers.values():
        assert (w.in_flight, w.active_blocks, w.queued_blocks) == (0, 0, 0)
    # n choices run as n sequences on their worker: the prompt once, n outputs
    many = routing.choose(tokens, max_tokens=16, n=4)
    assert (many.worker.in_flight, many.worker.active_blocks) == (4, (64 + 4 * 16) // 16)
    after = [routing.choose(tokens, max_tokens=16) for _ in range(3)]
    assert all(t.worker is not many.worker for t in after)  # 4 in flight there, 1-3 here
    retry = routing.assign(many.worker.name, tokens, 16, n=4)
    for t in (many, *after, retry, many):
        t.release()
    for w in routing.workers.values():
        assert (w.in_flight, w.active_blocks, w.queued_blocks) == (0, 0, 0)


def test_a_prefix_many_prompts_share_does_not_pin_the_traffic_to_its_first_holder():
    """A 10-block system prompt cached on A only, a 12-block request, A busy: without
    the fan-out A wins on its 10 cached blocks; priced as held everywhere, B does."""
    assert policies.kv([A, B], {A: 10}, 12, {A: 40, B: 0}) == A  # 16 x 2 + 40 < 16 x 12
    assert policies.kv([A, B], {A: 10}, 12, {A: 40, B: 0}, shared_blocks=10) == B
    # a conversation's own history (beyond the shared part) still keeps it on its holder
    assert policies.kv([A, B], {A: 11}, 12, {A: 40, B: 0}, shared_blocks=8) == A


def test_the_index_tells_a_shared_prefix_from_one_conversation():
    from radixkv.events import BlockStored, KVEventBatch
    from radixkv.router.index import SHARED_FANOUT, KvIndex

    index = KvIndex(2)
    system = [7, 7, 8, 8]  # two pages every conversation starts with
    for c in range(SHARED_FANOUT):
        tokens = system + [c, c, c, 50]
        index.apply("a", KVEventBatch(0, [BlockStored([100 * c + i for i in range(4)], None,
                                                      tokens, 2)]))  # fmt: skip
        held, shared = index.lookup(tokens)
        assert held == {"a": 4} and shared == (2 if c + 1 >= SHARED_FANOUT else 0)
    index.apply("a", KVEventBatch(0, [BlockStored([999], 3, [0, 50], 2)]))  # a 2nd turn
    assert index.lookup(system + [0, 0, 0, 50, 0, 50])[1] == 2  # the history is not shared
    index.check()


@pytest.mark.parametrize("policy", ["kv", "least_load", "approx", "round_robin"])
def test_a_prompt_cache_key_keeps_a_tenant_on_one_worker_and_spills_under_load(policy):
    """Rendezvous hashing with bounded loads: a key's requests go to one worker at light
    load whatever their prompts, keys spread over the workers, a salt changes the
    key's worker space (a key never crosses a salt), and a loaded home spills to one
    other worker; the spill is counted."""
    from radixkv.router import core

    routing = core.RoutingCore(policy)
    for name in ("a", "b", "c"):
        routing.add(name)

    def home(key: str, salt: str | None = None) -> set:
        got = set()
        for i in range(6):
            t = routing.choose(list(range(i * 64, i * 64 + 40)), salt, 8, cache_key=key)
            got.add(t.worker.name)
            t.release()
        return got

    homes = [home(f"tenant-{k}") for k in range(12)]
    assert all(len(h) == 1 for h in homes)
    assert len(set().union(*homes)) == 3  # the keys spread
    assert any(home("tenant-0", salt) != homes[0] for salt in ("s1", "s2", "s3", "s4"))
    (first,) = homes[0]
    held = [routing.choose(list(range(40)), None, 8, cache_key="tenant-0") for _ in range(8)]
    assert [t.worker.name for t in held[:4]] == [first] * 4  # a burst stays home
    spilled = {t.worker.name for t in held if t.key_spilled}
    assert len(spilled) == 1 and first not in spilled  # then one other worker takes it
    assert routing.key_spills == sum(t.key_spilled for t in held) > 0


def test_under_kv_a_cold_tenant_goes_to_its_keys_worker_though_it_is_busier():
    """The key's worker had a one-block edge in the kv cost, which one request in flight
    there outweighed: a cold tenant's first request went to an idle worker, its claim
    pulled the next ones after it, and the key's worker pulled others back (in a burst
    of 24 tenants most landed on 2-3 workers). Within the load bound the key decides,
    unless another worker holds a longer prefix of the request."""
    from radixkv.router import core

    routing = core.RoutingCore("kv")
    for name in ("a", "b", "c"):
        routing.add(name)
    home, _ = policies.key_home(["a", "b", "c"], "tenant-9", None, {})
    busy = [routing.assign(home, list(range(1000, 1800))) for _ in range(2)]  # 2 in flight
    prompt = list(range(5000, 5900))
    first = routing.choose(prompt, None, 8, cache_key="tenant-9")
    again = routing.choose(prompt[:880] + [1, 2, 3], None, 8, cache_key="tenant-9")
    assert first.worker.name == again.worker.name == home
    plain = routing.choose(list(range(7000, 7900)), None, 8)  # no key: the load decides
    assert plain.worker.name != home
    for t in (*busy, first, again, plain):
        t.release()


def test_the_router_passes_prompt_cache_key_and_keeps_it_together(fleet):
    router, _ = fleet
    seen = set()
    for i in range(5):
        r = complete(router.url, f"question number {i} about something else entirely",
                     prompt_cache_key="tenant-a")  # fmt: skip
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-radixkv-worker"])
    assert len(seen) == 1
    metrics = httpx.get(f"{router.url}/metrics").text
    assert "radixkv_router:prompt_cache_key_requests_total 5.0" in metrics


def test_the_router_passes_the_prompt_caching_fields_through(fleet):
    """Retention, explicit mode and breakpoints are the worker's to honour: the router
    forwards them, and the worker's answer (and its refusals) come back unchanged."""
    router, _ = fleet
    r = complete(router.url, "retain this preamble, please " * 4,
                 prompt_cache_options={"mode": "implicit", "ttl": "30m"},
                 prompt_cache_retention="24h")  # fmt: skip
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cache_write_tokens"] > 0
    part = {"type": "text", "text": "system", "prompt_cache_breakpoint": {"mode": "explicit"}}
    body = {"messages": [{"role": "system", "content": [part]},
                         {"role": "user", "content": "hi"}], "max_tokens": 1}  # fmt: skip
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cache_write_tokens"]
    r = complete(router.url, "x", prompt_cache_options={"mode": "never"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_options"


def test_the_router_loads_neither_torch_nor_the_engine(fleet):
    """A fleet's router tokenizes and routes; it never runs a model: the running
    ``radixkv route`` has no libtorch mapped, and importing the router's modules loads
    neither torch nor the engine (0.6 s here, from 1.6 s when the tree pulled torch in)."""
    import subprocess
    import sys

    router, _ = fleet
    with open(f"/proc/{router.proc.pid}/maps", encoding="utf-8") as f:
        maps = f.read()
    assert "libtorch" not in maps and "libc10" not in maps
    code = ("import sys, radixkv.router, radixkv.router.proxy, radixkv.router.fleet, "
            "radixkv.router.core, radixkv.cli.route; "
            "print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith('radixkv.engine')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "[]"
