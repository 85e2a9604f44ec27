"""`radixkv serve` exposed: keys, admin endpoints, content types, Host names, body and
prompt limits, malformed bodies. A real server process, the official `openai` client,
and raw HTTP for what a client library would not send."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from radixkv.web.process import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
BASE = ["--model", "random", "--page-size", "4", "--kv-tokens", "4096",
        "--max-context-len", "512"]  # fmt: skip
KEY, ADMIN = "sk-test-api-key", "sk-test-admin-key"


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    with ServerProcess(*BASE, "--api-key", KEY, "--admin-key", ADMIN, timeout=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    with ServerProcess(*BASE, "--max-request-bytes", str(32 << 20), timeout=60) as srv:
        yield srv


def client(srv: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- keys --------------------------------------------------------------------------------
def test_an_api_key_is_needed_everywhere_but_health(keyed):
    with pytest.raises(openai.AuthenticationError) as e:
        client(keyed, "wrong").completions.create(model="random", prompt="hi", max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"]
    r = client(keyed, KEY).completions.create(model="random", prompt="hi", max_tokens=1)
    assert r.usage.completion_tokens == 1
    assert client(keyed, KEY).models.list().data[0].id == "random"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{keyed.url}{path}").status_code == 401
        assert httpx.get(f"{keyed.url}{path}", headers=bearer("x" + KEY)).status_code == 401
        assert httpx.get(f"{keyed.url}{path}", headers=bearer(KEY)).status_code == 200
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # probes need no key


def test_admin_endpoints_need_the_admin_key(keyed, open_server):
    url = keyed.url
    assert httpx.post(f"{url}/flush_cache").status_code == 401
    assert httpx.post(f"{url}/flush_cache", headers=bearer(KEY)).status_code == 401
    assert httpx.post(f"{url}/flush_cache", headers=bearer(ADMIN)).status_code == 200
    r = httpx.post(f"{open_server.url}/flush_cache")  # an open API still keeps it shut
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


# --- what a web page could send ------------------------------------------------------------
def test_a_cross_origin_simple_post_is_refused_before_it_runs(open_server):
    url = open_server.url
    prompt = '{"model": "random", "prompt": "a page sent this", "max_tokens": 1}'
    page = {"Content-Type": "text/plain", "Origin": "https://evil.example"}
    r = httpx.post(f"{url}/v1/completions", content=prompt, headers=page)
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type"
    r = httpx.post(f"{url}/flush_cache", headers={"Content-Type": "text/plain"})
    assert r.status_code == 403


def test_a_foreign_host_name_is_refused(open_server):
    port = open_server.port
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}"):
        assert httpx.get(f"{open_server.url}/v1/models", headers={"Host": host}).status_code == 200


# --- size ----------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413(keyed):
    big = {"model": "random", "prompt": "x" * (5 << 20), "max_tokens": 1}
    r = httpx.post(f"{keyed.url}/v1/completions", json=big, headers=bearer(KEY), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    async def chunked() -> int:  # no Content-Length: counted as it arrives
        async def body():
            yield b'{"prompt": "'
            for _ in range(80):
                yield b"x" * 65536
            yield b'"}'

        async with httpx.AsyncClient() as c:
            headers = {**bearer(KEY), "Content-Type": "application/json"}
            r = await c.post(f"{keyed.url}/v1/completions", content=body(), timeout=60,
                             headers=headers)  # fmt: skip
            return r.status_code

    assert asyncio.run(chunked()) == 413


def test_a_5mb_prompt_is_refused_while_health_and_others_answer(open_server):
    """The prompt is refused by its length before it is tokenized, off the event loop:
    /health and a small request running beside it are answered, and answered right."""
    url = open_server.url
    small = {"model": "random", "prompt": "a small request", "max_tokens": 4,
             "temperature": 0}  # fmt: skip
    want = httpx.post(f"{url}/v1/completions", json=small).json()["choices"][0]["text"]

    async def together() -> tuple[httpx.Response, list[int], list[str]]:
        async with httpx.AsyncClient(timeout=60) as c:
            big = asyncio.ensure_future(c.post(f"{url}/v1/completions", json={
                "model": "random", "prompt": "y" * (5 << 20), "max_tokens": 1}))  # fmt: skip
            health, texts = [], []
            while not big.done() or not health:
                health.append((await c.get(f"{url}/health")).status_code)
                r = await c.post(f"{url}/v1/completions", json=small)
                texts.append(r.json()["choices"][0]["text"])
            return await big, health, texts

    big, health, texts = asyncio.run(together())
    assert big.status_code == 400
    assert big.json()["error"]["code"] == "context_length_exceeded"
    assert big.json()["error"]["param"] == "prompt"
    assert set(health) == {200} and set(texts) == {want}


# --- malformed bodies ------------------------------------------------------------------------
def test_deeply_nested_json_is_a_400(open_server):
    deep = '{"model": "random", "prompt": "hi", "user": ' + "[" * 3000 + "]" * 3000 + "}"
    r = httpx.post(f"{open_server.url}/v1/completions", content=deep,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
