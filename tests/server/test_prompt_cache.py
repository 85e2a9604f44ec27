"""OpenAI's prompt-caching fields end to end: a real server process and the official
`openai` client. A breakpoint or a 24h retention keeps its prefix through a flood that
evicts everything else (without them it is gone), ``mode: "explicit"`` caches only up to
the last breakpoint and, without one, neither reads nor writes, usage reports the tokens
written, the quota and the metrics, and bad values are 400s naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from radixkv.web.process import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SYSTEM = "You are a careful assistant. " * 6  # 174 tokens under the byte tokenizer
BP = {"mode": "explicit"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ["--model", "random", "--page-size", "4", "--kv-tokens", "1024",
            "--max-context-len", "512", "--max-retained-tokens", "400"]  # fmt: skip
    with ServerProcess(*args, timeout=60) as srv:
        yield srv


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def chat(srv, user: str, system: str | None = SYSTEM, breakpoint=None, **kw):
    msgs = []
    if system is not None:
        part = {"type": "text", "text": system}
        if breakpoint is not None:
            part["prompt_cache_breakpoint"] = breakpoint
        msgs.append({"role": "system", "content": [part]})
    msgs.append({"role": "user", "content": user})
    return (
        client(srv)
        .chat.completions.create(model="random", messages=msgs, max_tokens=2, temperature=0, **kw)
        .usage
    )


def flood(srv, tag: str) -> None:
    """Enough other prompts to evict everything the pool holds unretained."""
    for i in range(8):
        client(srv).completions.create(
            model="random", prompt=f"{tag}{i} " + "x" * 300, max_tokens=1, temperature=0
        )


def metric(srv, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    m = re.search(rf"^radixkv:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_breakpoint_keeps_its_prefix_through_a_flood(server):
    first = chat(server, "question one", breakpoint=BP, extra_body={"cache_salt": "bp"})
    written = first.prompt_tokens_details.cache_write_tokens
    assert SYSTEM.count(" ") < written < first.prompt_tokens  # the system message's end
    flood(server, "a")
    again = chat(server, "question two", extra_body={"cache_salt": "bp"})
    assert again.prompt_tokens_details.cached_tokens >= written - 4  # whole pages of it
    assert again.prompt_tokens_details.cache_write_tokens is None  # it asked for nothing
    # the same without a breakpoint: gone after the flood
    chat(server, "question one", extra_body={"cache_salt": "plain"})
    flood(server, "b")
    plain = chat(server, "question two", extra_body={"cache_salt": "plain"})
    assert plain.prompt_tokens_details.cached_tokens == 0


def test_24h_retention_keeps_the_whole_prompt(server):
    preamble = "a long shared preamble " * 10
    u = chat(server, preamble, system=None, prompt_cache_retention="24h")
    whole = u.prompt_tokens // 4 * 4  # whole pages of the prompt
    assert u.prompt_tokens_details.cache_write_tokens == whole
    assert metric(server, "prompt_cache_retained_tokens") >= whole
    flood(server, "c")
    again = chat(server, preamble, system=None)
    # all of it but the page holding its last token (always computed, for its logits)
    assert again.prompt_tokens_details.cached_tokens == (u.prompt_tokens - 1) // 4 * 4


def test_explicit_mode_caches_only_up_to_the_breakpoint(server):
    salt = {"cache_salt": "explicit"}
    opts = {"mode": "explicit", "ttl": "30m"}
    # no breakpoint: the request does not use the prompt cache at all
    for _ in range(2):
        u = chat(server, "same question", system=None, prompt_cache_options=opts, extra_body=salt)
        assert u.prompt_tokens_details.cached_tokens == 0
        assert u.prompt_tokens_details.cache_write_tokens == 0
    # a breakpoint: cached (and retained) up to it, not the user's question after it
    u = chat(server, "what now?", breakpoint=BP, prompt_cache_options=opts, extra_body=salt)
    bp = u.prompt_tokens_details.cache_write_tokens
    assert 0 < bp < u.prompt_tokens
    again = chat(server, "what now?", extra_body=salt)  # the same prompt, implicit
    assert again.prompt_tokens_details.cached_tokens == bp


def test_the_quota_and_bad_values(server):
    before = metric(server, "prompt_cache_retain_refused_total")
    long = "z" * 450  # more than --max-retained-tokens alone
    client(server).completions.create(
        model="random",
        prompt=long,
        max_tokens=1,
        extra_body={"prompt_cache_options": {"ttl": "30m"}},
    )
    assert metric(server, "prompt_cache_retain_refused_total") == before + 1
    base = {"model": "random", "max_tokens": 1}
    part = {"type": "text", "text": "x", "prompt_cache_breakpoint": BP}
    for body, param in (
        ({"messages": [{"role": "user", "content": [part] * 5}]}, "prompt_cache_breakpoint"),
        ({"messages": [{"role": "user", "content": [{**part, "prompt_cache_breakpoint":
            {"mode": "explicit", "ttl": "1h"}}]}]}, "messages"),
        ({"prompt": "x", "prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options"),
        ({"prompt": "x", "prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options"),
        ({"prompt": "x", "prompt_cache_options": {"keep": True}}, "prompt_cache_options"),
        ({"prompt": "x", "prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ):  # fmt: skip
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(f"{server.url}{path}", json={**base, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for reason in ("expired", "quota", "pressure", "flush"):
        assert f'reason="{reason}"' in httpx.get(f"{server.url}/metrics").text


# --- tenants and hybrid models -----------------------------------------------------------
def retained(srv, prompt, salt: str, model: str = "random", **kw):
    """A completion whose whole prompt is retained for 24 h; its usage."""
    body = {"cache_salt": salt, "prompt_cache_retention": "24h", **kw}
    return (
        client(srv)
        .completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=body
        )
        .usage
    )


def again(srv, prompt, salt: str, model: str = "random"):
    return (
        client(srv)
        .completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        .usage
    )


def test_another_tenants_retention_never_takes_a_prefix_within_its_share():
    """Per-salt quotas are their own, and the all-salts cap (twice the quota by default)
    is shared fairly. Another salt's 24h traffic churns only its own pins; a client
    rotating salts takes from a salt over its share (that one), and a pin that would put
    its new salt over its share is refused; the victim, within its share, keeps its
    prefix. The cap used to equal the quota, and any other salt's 24h request released
    the oldest pin of all: the victim's (0/721 cached after one 500-token one)."""
    args = ["--model", "random", "--page-size", "4", "--kv-tokens", "8192",
            "--max-context-len", "1024"]  # fmt: skip
    with ServerProcess(*args, timeout=60) as srv:  # 1,024 tokens a salt, 2,048 in all
        victim = "v" * 400
        assert retained(srv, victim, "victim").prompt_tokens_details.cache_write_tokens == 400
        for i in range(4):  # over its quota: its own oldest go
            retained(srv, f"a{i} " + "x" * 497, "a")
        for salt in ("b1", "b2", "b3"):  # the third would be over its share: refused
            retained(srv, f"{salt} " + "x" * 496, salt)
        for i in range(12):  # a flood that evicts everything unretained
            again(srv, f"flood {i} " + "y" * 880, "flood")
        usage = again(srv, victim + " and more", "victim")
        assert usage.prompt_tokens_details.cached_tokens == 400
        text = httpx.get(f"{srv.url}/metrics").text
        assert re.search(r'retain_released_total\{[^}]*reason="quota"\} 3\.0', text), text
        assert metric(srv, "prompt_cache_retain_refused_total") == 1


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from helpers import qwen3_5_folder

    return qwen3_5_folder(tmp_path_factory.mktemp("qwen3_5"))


def ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "least"), [(16, 384), (1, 399)])
def test_a_prompt_sent_twice_hits_on_a_recurrent_model(qwen, page, least):
    """A recurrent model serves a prefix only from a state checkpoint, and a request
    computes at least its last token: with a checkpoint at a page-aligned prompt's end
    alone, the same 400-token prompt sent again got 0 cached. The last page boundary
    before the end is a checkpoint too now."""
    args = ["--model", qwen, "--page-size", str(page), "--kv-tokens", "4096",
            "--max-context-len", "1024", "--served-model-name", "q"]  # fmt: skip
    with ServerProcess(*args, timeout=120) as srv:
        prompt = ids(400, 0)
        first = retained(srv, prompt, "s", "q")
        assert first.prompt_tokens == 400 and first.prompt_tokens_details.cached_tokens == 0
        assert again(srv, prompt, "s", "q").prompt_tokens_details.cached_tokens >= least
        assert again(srv, prompt + ids(8, 1), "s", "q").prompt_tokens_details.cached_tokens == 400


@pytest.mark.slow
def test_a_retained_prefix_keeps_its_state_checkpoints_whatever_other_salts_do(qwen):
    """Checkpoints protected for retention are bounded per salt: another salt's pins
    cannot take them all first (they could: half of --max-checkpoints, first come, first
    served), so the victim's prefix keeps the checkpoints a hit starts from through a
    flood that turns every other checkpoint over."""
    args = ["--model", qwen, "--page-size", "16", "--kv-tokens", "8192", "--max-checkpoints",
            "8", "--max-context-len", "1024", "--served-model-name", "q"]  # fmt: skip
    with ServerProcess(*args, timeout=120) as srv:
        for i in range(4):  # the other salt retains first
            retained(srv, ids(200, 10 + i), "other", "q")
        victim = ids(400, 0)
        retained(srv, victim, "victim", "q")
        for i in range(12):
            again(srv, ids(300, 100 + i), "flood", "q")
        assert again(srv, victim, "victim", "q").prompt_tokens_details.cached_tokens >= 384
        more = again(srv, victim + ids(8, 1), "victim", "q")
        assert more.prompt_tokens_details.cached_tokens == 400
