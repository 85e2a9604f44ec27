"""No silently ignored field: every field of the `openai` package's request types, for both
endpoints, is either honoured (a test here shows its effect) or refused with a 400 naming
it. A real server process and the official client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from radixkv.web.process import ServerProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
A = 65  # "A" under the random model's byte tokenizer
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ["--model", "random", "--page-size", "4", "--kv-tokens", "4096",
            "--max-context-len", "512"]  # fmt: skip
    with ServerProcess(*args, timeout=60) as srv:
        yield srv


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)


def complete(srv: ServerProcess, **kw) -> openai.types.Completion:
    args = dict(model="random", prompt="hello there", max_tokens=8, temperature=0)
    return client(srv).completions.create(**{**args, **kw}, extra_body={"ignore_eos": True})


# --- what each honoured field does -----------------------------------------------------------
def test_logit_bias_steers_the_tokens(server):
    assert complete(server).choices[0].text != "A" * 8
    assert complete(server, logit_bias={str(A): 1.5}).choices[0].text == "A" * 8
    r = client(server).chat.completions.create(
        model="random", messages=MESSAGES, max_tokens=4, temperature=0,
        logit_bias={str(A): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].message.content == "AAAA"


def test_presence_and_frequency_penalties(server):
    once = complete(server, logit_bias={str(A): 1.5}, presence_penalty=2.0).choices[0].text
    assert once.count("A") == 1 and once.startswith("A")  # present once: pushed below others
    thrice = complete(server, logit_bias={str(A): 2.5}, frequency_penalty=1.0).choices[0].text
    assert thrice.startswith("AAA") and thrice.count("A") == 3  # 2.5 - 1 per occurrence


def test_repetition_penalty_lowers_a_prompt_token(server):
    def first_logprob(penalty: float) -> float:
        r = client(server).completions.create(
            model="random", prompt="AAAA", max_tokens=1, temperature=0, logprobs=0,
            logit_bias={str(A): 5}, extra_body={"repetition_penalty": penalty},
        )  # fmt: skip
        return r.choices[0].logprobs.token_logprobs[0]

    assert first_logprob(2.0) < first_logprob(1.0)


def test_completion_logprobs(server):
    r = complete(server, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 8
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and abs(chosen - max(top.values())) < 1e-5  # greedy: the top one
    assert lp.text_offset == sorted(lp.text_offset)
    assert complete(server).choices[0].logprobs is None  # only when asked


def test_chat_logprobs_plain_and_streamed(server):
    c = client(server)
    kw = dict(model="random", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    streamed = [
        t for chunk in c.chat.completions.create(**kw, stream=True)
        for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content
    ]  # fmt: skip
    assert [t.logprob for t in streamed] == [t.logprob for t in content]
    assert c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}
                                     ).choices[0].logprobs is None  # fmt: skip


def test_n_choices_share_the_prompt(server):
    r = complete(server, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds seed, seed + 1, seed + 2
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == 11
    again = complete(server, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    stream = client(server).chat.completions.create(
        model="random", messages=MESSAGES, max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert set(texts) == {0, 1} and usage.completion_tokens == 6


def test_models_retrieve(server):
    c = client(server)
    assert c.models.retrieve("random").id == "random"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


# --- error shapes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"65": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
        # a digit to str.isdigit, not to int(); and a key int() refuses: both were 500s
        ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "extra": 1, "repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_out_of_range_values_name_their_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "random", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_errors_name_the_field_that_is_wrong(server):
    """A breakpoint's ttl was reported at ``messages.0.content.str`` (pydantic's first
    union branch); a seed at the top of its range with n=2 overflowed choice 2's seed and
    the 400 named max_tokens; 100k content parts took over a second to refuse."""
    bad = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit",
                                                                   "ttl": "1h"}}  # fmt: skip
    body = {"model": "random", "messages": [{"role": "user", "content": [bad]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", r.text
    assert err["message"].startswith("messages.0.content.0.prompt_cache_breakpoint.ttl: ")
    c = client(server).completions.create(model="random", prompt="x", n=2, seed=2**64 - 1,
                                          temperature=1, max_tokens=2)  # fmt: skip
    assert len(c.choices) == 2  # choice 2 is seeded 2**64 - 1 + 1, modulo 2**64
    parts = [{"type": "text", "text": "x"}] * 100_000
    body = {"model": "random", "messages": [{"role": "user", "content": parts}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "more than the 8,192 a request may hold" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tool_call_history_is_refused_by_a_template_without_tools(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": "random", "messages": messages})  # fmt: skip
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "tool" in err["message"]


# --- every field ---------------------------------------------------------------------------------
def test_prompt_cache_key_is_counted_and_checked(server):
    """One server has one cache: a key changes no output there; it is counted (a router
    keeps a key's requests on one worker, tests/router/test_route.py) and checked."""
    import re

    def count() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        m = re.search(r"radixkv:prompt_cache_key_requests_total\{[^}]*\} ([0-9.]+)", text)
        return float(m.group(1)) if m else 0.0

    def chat(**kw) -> str:
        r = client(server).chat.completions.create(
            model="random", messages=MESSAGES, max_tokens=4, temperature=0, **kw
        )
        return r.choices[0].message.content

    before = count()
    assert chat(prompt_cache_key="tenant-7") == chat()  # the official client's field
    assert count() == before + 1
    for bad in ("", "k" * 1025, 7):
        body = {"model": "random", "prompt": "x", "prompt_cache_key": bad}
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text


HONOURED = {  # field -> the test above (or the base suite) that shows its effect
    "prompt_cache_key": test_prompt_cache_key_is_counted_and_checked,
    "prompt_cache_options": "test_prompt_cache.py: retention, explicit mode, breakpoints",
    "prompt_cache_retention": "test_prompt_cache.py: 24h survives a flood",
    "frequency_penalty": test_presence_and_frequency_penalties,
    "presence_penalty": test_presence_and_frequency_penalties,
    "logit_bias": test_logit_bias_steers_the_tokens,
    "logprobs": test_completion_logprobs,
    "top_logprobs": test_chat_logprobs_plain_and_streamed,
    "n": test_n_choices_share_the_prompt,
    "seed": test_n_choices_share_the_prompt,
    "max_tokens": "test_server.py: max_tokens bounds the output",
    "max_completion_tokens": "test_server.py: the chat endpoint",
    "model": "test_server.py: an unknown model is a 404",
    "prompt": "every completion",
    "messages": "every chat completion",
    "stop": "test_server.py: stop strings",
    "stream_options": test_n_choices_share_the_prompt,
    "temperature": "test_server.py: seeded sampling",
    "top_p": "test_server.py: seeded sampling",
    "user": "an end-user id for OpenAI's abuse monitoring: accepted, changes no output",
}
# a value that asks for something, per field
SAMPLES = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "function_call": "auto", "functions": [{"name": "f"}],
    "logit_bias": {"65": 1}, "max_completion_tokens": 2, "max_tokens": 2,
    "metadata": {"k": "v"}, "modalities": ["text", "audio"], "model": "random",
    "moderation": {"mode": "strict"}, "n": 2, "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 1,
    "service_tier": "flex", "stop": ["\n"], "store": True,
    "stream_options": {"include_usage": True}, "suffix": "s", "temperature": 0.5,
    "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}],
    "top_p": 0.5, "user": "u", "verbosity": "low", "web_search_options": {},
}  # fmt: skip


@pytest.mark.parametrize(
    "path, fields, base",
    [
        ("/v1/completions", completion_params.CompletionCreateParamsBase.__annotations__,
         {"prompt": "x", "max_tokens": 1}),
        ("/v1/chat/completions", chat_params.CompletionCreateParamsBase.__annotations__,
         {"messages": MESSAGES, "max_tokens": 1}),
    ],
    ids=["completions", "chat"],
)  # fmt: skip
def test_every_openai_field_is_honoured_or_refused(server, path, fields, base):
    refused = []
    for field in sorted(fields):
        if field in ("prompt", "messages"):
            continue
        body = {"model": "random", **base}
        if field == "logprobs":
            body[field] = True if "chat" in path else 1
        elif field == "top_logprobs":
            body.update(logprobs=True, top_logprobs=2)
        else:
            assert field in SAMPLES, f"a new OpenAI field {field!r}: honour it or refuse it"
            body[field] = SAMPLES[field]
        r = httpx.post(f"{server.url}{path}", json=body)
        if field in HONOURED:
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field, (field, r.text)
            refused.append(field)
    assert refused  # the refusals are real
