"""`radixkv serve` as a user meets it: a real server process on a free loopback port, the
official `openai` client, and raw HTTP for what a client library would not send."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from radixkv.engine.engine import Engine
from radixkv.web.process import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SERVER_ARGS = ["--model", "random", "--page-size", "4", "--kv-tokens", "4096"]
SERVER_ARGS += ["--max-running", "8", "--max-context-len", "512", "--check-memory"]
SERVER_ARGS += ["--admin-key", "test-admin-key"]
ADMIN = {"Authorization": "Bearer test-admin-key"}


class Server(ServerProcess):
    """A server whose standard error the test reads, with the client and metrics helpers."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args, timeout=60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            m = re.match(r"radixkv:(\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def finish(self, sig: int = signal.SIGINT) -> tuple[int, str]:
        code = self.stop(sig)
        return code, self.stderr()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(*SERVER_ARGS)
    yield srv
    code, err = srv.finish()
    assert code == 0 and "Traceback" not in err, err


def metric(srv: Server, name: str) -> float:
    return srv.metrics()[f'{name}{{model_name="random"}}']


# --- the happy paths -------------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["random"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_chat_and_cached_tokens_on_a_shared_prefix(server):
    client = server.client()
    system = "You are a careful assistant who answers in one sentence. " * 3
    first = client.chat.completions.create(
        model="random",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "One?"}],
        max_tokens=4,
        temperature=0,
    )
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens == 4 and first.choices[0].finish_reason == "length"
    second = client.chat.completions.create(
        model="random",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Two?"}],
        max_tokens=4,
        temperature=0,
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(system) - 8  # the byte tokenizer: a token per character
    done = client.completions.create(model="random", prompt="Hello there", max_tokens=3)
    assert done.usage.prompt_tokens == len("Hello there") and done.choices[0].text is not None


def test_streaming_completion_and_chat_end_with_usage(server):
    client = server.client()
    chunks = list(
        client.completions.create(
            model="random",
            prompt="stream me",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks[:-1])
    whole = client.completions.create(
        model="random", prompt="stream me", max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].text
    chat = list(
        client.chat.completions.create(
            model="random",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"


def test_sse_wire_ends_with_done(server):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_greedy_outputs_equal_the_in_process_engine(server):
    prompts = ["The capital of France is", "The capital of Italy is", [5, 6, 7, 8, 9, 10]]
    want = Engine("random").generate(prompts, max_new_tokens=8, ignore_eos=True, chat=False)
    client = server.client()
    for prompt, expected in zip(prompts, want.outputs, strict=True):
        got = client.completions.create(
            model="random",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == expected.text


def test_seed_makes_sampling_repeat(server):
    client = server.client()
    runs = [
        client.completions.create(
            model="random", prompt="seeded", max_tokens=8, temperature=0.9, top_p=0.9, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_stop_strings_cut_the_completion(server):
    client = server.client()
    full = (
        client.completions.create(
            model="random",
            prompt="stop here",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    cut = client.completions.create(
        model="random", prompt="stop here", max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.find(stop)]


def test_salts_isolate_tenants(server):
    client = server.client()
    prompt = "Tenant secret: the launch code is 0000-1111-2222-3333. Repeat it. " * 2

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        r = client.completions.create(
            model="random", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another tenant does not see tenant a's prompt
    assert cached(None) == 0  # nor does an unsalted request
    assert cached("tenant-a") > 100
    assert cached(None) > 100  # unsalted requests share with each other


# --- bad requests ----------------------------------------------------------------------------
BAD = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("wrong type 2", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty ids", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("bad token id", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("too long", "/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}, 400, "max_tokens"),
    ("zero tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p big", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("stop", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("salt", "/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400,
     "messages"),
    ("chat n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                          "n": 129}, 400, "n"),
    ("chat model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
    ("no route", "/v1/embeddings", {"input": "x"}, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(
    server, name, path, body, status, param
):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param, error
    assert "Traceback" not in r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model="random", prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="random", prompt="x" * 500, max_tokens=100)


# --- load, disconnects, flush ------------------------------------------------------------------
def test_concurrent_load_with_disconnects_leaks_nothing(server):
    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        gate = asyncio.Semaphore(16)
        stems = [f"You are assistant {g}. Follow the rules carefully. " * 3 for g in range(4)]

        async def one(i: int) -> int:
            async with gate:
                stream = await client.completions.create(
                    model="random",
                    prompt=stems[i % 4] + f"Question {i}?",
                    max_tokens=24,
                    temperature=0.5 if i % 3 else 0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                n = 0
                async for _chunk in stream:
                    n += 1
                    if i % 4 == 1 and n >= 3:
                        await stream.close()  # a client that goes away mid-stream
                        break
                return n

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 120)
        finally:
            await client.close()

    counts = asyncio.run(main())
    assert all(c >= 1 for c in counts)
    deadline = time.monotonic() + 10  # the server sees the disconnects a moment later
    while time.monotonic() < deadline and (
        metric(server, "num_requests_running") or metric(server, "num_requests_waiting")
    ):
        time.sleep(0.1)
    m = server.metrics()
    label = '{model_name="random"}'
    assert m[f"num_requests_running{label}"] == 0 and m[f"num_requests_waiting{label}"] == 0
    # idle: every slot in use is a cached one (nothing leaked to a finished request)
    assert m[f"kv_cache_usage_perc{label}"] * 4096 == m[f"prefix_cache_tokens{label}"]
    assert m['request_success_total{finished_reason="abort",model_name="random"}'] >= 1
    assert m[f"prefix_cache_hits_total{label}"] > 0
    # --check-memory ran check_memory and check_integrity after every step: still alive
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_flush_cache_drops_what_is_cached(server):
    client = server.client()
    client.completions.create(model="random", prompt="flush me " * 10, max_tokens=1)
    assert metric(server, "prefix_cache_tokens") > 0
    r = httpx.post(f"{server.url}/flush_cache", headers=ADMIN)
    assert r.status_code == 200 and r.json()["flushed_tokens"] > 0
    assert metric(server, "prefix_cache_tokens") == 0
    again = client.completions.create(model="random", prompt="flush me " * 10, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_are_prometheus_text(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "evicted_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ):
        assert f"radixkv:{name}" in text, name


# --- a full queue and shutdown -----------------------------------------------------------------
def test_a_full_queue_answers_503_then_shutdown_aborts_streams_and_exits_0():
    srv = Server(
        "--model", "random", "--max-running", "1", "--max-queue", "1", "--kv-tokens", "4096"
    )
    try:
        body = {"prompt": "long " * 20, "max_tokens": 3900, "ignore_eos": True, "stream": True}
        results: list = []

        async def until(name: str, value: float) -> None:
            while metric(srv, name) != value:  # the server says so, however fast it is
                await asyncio.sleep(0.01)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as http:

                async def stream() -> None:
                    async with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            results.append((r.status_code, r.headers.get("retry-after")))
                            await r.aread()
                            return
                        lines = [line async for line in r.aiter_lines() if line]
                        results.append((200, lines[-2]))

                tasks = [asyncio.ensure_future(stream())]  # one runs
                await until("num_requests_running", 1)
                tasks.append(asyncio.ensure_future(stream()))  # one waits
                await until("num_requests_waiting", 1)
                tasks += [asyncio.ensure_future(stream()) for _ in range(2)]  # refused
                while len(results) < 2:
                    await asyncio.sleep(0.01)
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(asyncio.gather(*tasks), 30)

        asyncio.run(main())
        refused = [r for r in results if r[0] == 503]
        served = [r for r in results if r[0] == 200]
        assert refused and all(r[1] == "1" for r in refused), results
        assert served and all('"finish_reason":"abort"' in r[1] for r in served), results
        assert srv.proc.wait(30) == 0
        assert "Traceback" not in srv.stderr()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


# --- bench-serve -----------------------------------------------------------------------------
def test_bench_serve_reports_latencies_and_the_servers_hit_rate(server, tmp_path, capsys):
    from radixkv.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench-serve", "--url", server.url, "--num-prompts", "12", "--groups", "2",
            "--prompts-per-group", "6", "--system-words", "60", "--max-tokens", "4",
            "--max-concurrency", "4", "--time-limit", "60", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["requests"] == {"planned": 12, "completed": 12, "failed": 0, "not_finished": 0}
    assert rep["output_tokens"] == 48 and len(rep["outputs"]) == 12
    assert 0.5 < rep["server_hit_rate"] <= 1 and rep["cached_tokens"] > 0
    assert rep["ttft_s"]["p50"] > 0 and rep["e2e_s"]["p99"] >= rep["e2e_s"]["p50"]
    assert "time to first token" in capsys.readouterr().out
    turns = ["bench-serve", "--url", server.url, "--workload", "multi-turn",
             "--conversations", "2", "--turns", "3", "--num-prompts", "6", "--max-tokens", "3",
             "--first-words", "20", "--message-words", "5", "--json", str(out)]  # fmt: skip
    assert main(turns) == 0
    rep = json.loads(out.read_text())
    assert rep["requests"]["completed"] == 6 and rep["cached_tokens"] > 0  # later turns hit


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1"])
def test_bench_serve_only_loads_loopback(url, capsys):
    from radixkv.cli import main

    assert main(["bench-serve", "--url", url]) == 2
    assert capsys.readouterr().err.startswith("error: --url")


def test_bench_serve_stops_at_its_time_limit(server, capsys):
    from radixkv.cli import main

    code = main(["bench-serve", "--url", server.url, "--num-prompts", "40",
                 "--max-tokens", "200", "--system-words", "10", "--max-concurrency", "2",
                 "--time-limit", "1.5"])  # fmt: skip
    out = capsys.readouterr().out
    row = re.search(r"(\d+) / (\d+) / (\d+)", out)  # completed / failed / unfinished
    assert code in (0, 1) and row is not None and int(row.group(3)) > 0, out


def test_the_docs_openai_snippet_gets_cached_tokens_on_its_second_call(server, capsys):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```python serve\n(.*?)```", docs, flags=re.S)
    assert len(blocks) == 1
    code = blocks[0].replace("http://127.0.0.1:8000", server.url)
    exec(compile(code, "docs/serving.md", "exec"), {})
    lines = capsys.readouterr().out.split("\n")
    (p1, c1), (p2, c2) = (map(int, line.split()) for line in lines[:2])
    assert c1 < p1 and c2 > 0.8 * p2  # the second call reuses the shared system prompt


def test_a_client_leaving_mid_body_leaves_no_traceback(server):
    """The module's server must log no traceback (checked when it stops): a client that
    closes its connection before the body it announced arrived is not a server error."""
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  b'{"prompt": "')  # fmt: skip
    assert server.client().completions.create(model="random", prompt="after", max_tokens=1)
