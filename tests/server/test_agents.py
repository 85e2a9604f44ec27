"""Agents against a real `radixkv serve` process: tool calls through the official `openai`
client (whole and streamed), Anthropic's Messages API through the official `anthropic`
client (tools, streaming, prompt caching and its usage), the OpenAI Agents SDK's loop,
and the bad inputs of both. The model folder is make-model's (real weights, tokenizer
and template); its answers are scripted (`support.scripted`): random weights never
write a tool call."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from support.scripted import scripted_server

KEY = "sk-agents-test"
MODEL = "tiny"


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


SCRIPT = {"rules": [
    {"when": "weather in Paris", "reply": _call("get_weather", {"city": "Paris"})},
    {"when": "<tool_response>\nsunny", "reply": "It is sunny in Paris."},
    {"when": "two cities", "reply": "Both.\n" + _call("get_weather", {"city": "Paris"}) + "\n"
     + _call("get_weather", {"city": "Rome"})},
    {"when": "Plan a trip", "reply": _call("get_weather", {"city": "Paris"})},
    {"when": "WEATHER-RESULT", "reply": _call("get_time", {"city": "Paris"})},
    {"when": "TIME-RESULT", "reply": "Go now: sunny at noon."},
    {"when": 'tool_call>\n{"name": "', "reply": 'get_weather", "arguments": {"city": "Oslo"}}'
     "\n</tool_call>"},
    {"when": '{"name": "get_time", "arguments": ', "reply": '{"city": "Lima"}}\n</tool_call>'},
    {"when": "count to three", "reply": "one two STOP three"},
    {"when": "broken call", "reply": "<tool_call>\n{not json"},
    {"when": "a long story", "reply": "Once upon a time. " * 300},
], "default": "Hello from radixkv."}  # fmt: skip

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
A_WEATHER = {"name": "get_weather", "description": "The weather in a city",
             "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
SYSTEM = "You are a travel agent who knows the weather everywhere. " * 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from radixkv.cli import main

    path = tmp_path_factory.mktemp("agents") / "qwen3"
    assert main(["make-model", "qwen3", str(path), "--context", "65536"]) == 0
    return str(path)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory) -> Iterator:
    srv = scripted_server(SCRIPT, folder, tmp_path_factory.mktemp("script"), "--api-key", KEY,
                          "--served-model-name", MODEL, "--page-size", "16",
                          "--max-context-len", "65536", "--kv-tokens", "131072")  # fmt: skip
    yield srv
    assert srv.stop() == 0 and "Traceback" not in srv.stderr(), srv.stderr()[-3000:]


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


# --- OpenAI -------------------------------------------------------------------------------
def test_openai_tool_round_trip(server):
    c = oai(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"} and call.id.startswith("call_")  # fmt: skip
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "It is sunny in Paris."
    # the second request's prompt starts with the first's: its KV is reused
    assert r2.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 16


def test_openai_streamed_calls_reassemble_into_the_same_calls(server):
    c = oai(server)
    messages = [{"role": "user", "content": "Weather in two cities please"}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    calls: dict[int, dict] = {}
    text, reasons = "", []
    for chunk in c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                           stream=True):  # fmt: skip
        delta = chunk.choices[0].delta
        text += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or ():
            got = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            got["id"] = tc.id or got["id"]
            got["name"] += (tc.function.name or "") if tc.function else ""
            got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    want = whole.choices[0].message
    assert text.strip() == want.content == "Both."
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        (t.function.name, json.loads(t.function.arguments)) for t in want.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]  # fmt: skip
    assert all(calls[i]["id"] for i in calls) and reasons[-1] == "tool_calls"
    assert not any(chunk_reason for chunk_reason in reasons[:-1])
    # the client's own accumulator reassembles the stream into the same message
    with c.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER]) as s:
        got = s.get_final_completion().choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Both."
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == [
        (t.function.name, t.function.arguments) for t in want.tool_calls]  # fmt: skip
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].id == chunks[0].id and chunks[-2].choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_named_and_no_parallel_calls(server):
    c = oai(server)
    hi = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=hi, tools=[WEATHER, TIME],
                                  tool_choice="required")  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    got = (call.function.name, json.loads(call.function.arguments))
    assert got == ("get_weather", {"city": "Oslo"})
    r = c.chat.completions.create(model=MODEL, messages=hi, tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}})  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    got = (call.function.name, json.loads(call.function.arguments))
    assert got == ("get_time", {"city": "Lima"})
    two = [{"role": "user", "content": "two cities"}]
    r = c.chat.completions.create(model=MODEL, messages=two, tools=[WEATHER],
                                  parallel_tool_calls=False)  # fmt: skip
    assert len(r.choices[0].message.tool_calls) == 1
    r = c.chat.completions.create(model=MODEL, messages=two, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    broken = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                       "broken call"}], tools=[WEATHER])  # fmt: skip
    assert broken.choices[0].finish_reason == "stop"
    assert broken.choices[0].message.content == "<tool_call>\n{not json"


def _status(r: httpx.Response, code: int, param: str | None, *words: str) -> dict:
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert param is None or err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def test_openai_bad_tool_inputs_name_the_field(server):
    url, auth = f"{server.url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    hi = [{"role": "user", "content": "hi"}]

    def post(**body):
        return httpx.post(url, json={"model": MODEL, "messages": hi, **body}, headers=auth,
                          timeout=60)  # fmt: skip

    bad_schema = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": 7}}}
    _status(post(tools=[bad_schema]), 400, "tools", "JSON Schema")
    many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(10_000)]
    _status(post(tools=many), 400, "tools", "at most 128")
    _status(post(tools=[{"type": "function", "function": {"name": "f", "nope": 1}}]), 400,
            "tools")  # fmt: skip
    _status(post(tool_choice="required"), 400, "tool_choice")
    _status(post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
            400, "tool_choice", "no tool named")  # fmt: skip
    deep = json.dumps({"a": json.loads("[" * 100 + "]" * 100)})
    history = [*hi, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type":
               "function", "function": {"name": "get_weather", "arguments": deep}}]}]  # fmt: skip
    _status(post(messages=history, tools=[WEATHER]), 400, "messages", "deeper")
    stray = [*hi, {"role": "tool", "tool_call_id": "never", "content": "x"}]
    _status(post(messages=stray, tools=[WEATHER]), 400, "messages", "never")
    big = [*hi, {"role": "tool", "tool_call_id": "c1", "content": "x" * (100 << 20)}]
    r = httpx.post(url, content=json.dumps({"model": MODEL, "messages": big}), headers={
        **auth, "Content-Type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"]
    assert post().status_code == 200  # the server goes on


def test_the_openai_agents_sdk_runs_a_two_tool_loop(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(("get_weather", city))
        return f"WEATHER-RESULT: sunny in {city}"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The time in a city."""
        seen.append(("get_time", city))
        return f"TIME-RESULT: noon in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="travel", instructions="Plan trips.", tools=[get_weather, get_time],
                         model=model)  # fmt: skip
    result = agents.Runner.run_sync(agent, "Plan a trip to Paris", max_turns=5)
    assert seen == [("get_weather", "Paris"), ("get_time", "Paris")]
    assert result.final_output == "Go now: sunny at noon."


# --- Anthropic ------------------------------------------------------------------------------
def _identity(u, prompt: int | None = None) -> None:
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert min(u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) >= 0
    split = u.cache_creation.ephemeral_5m_input_tokens + u.cache_creation.ephemeral_1h_input_tokens
    assert split == u.cache_creation_input_tokens
    if prompt is not None:
        assert total == prompt


def test_anthropic_messages_tools_and_prompt_caching(server):
    c = claude(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = c.messages.count_tokens(model=MODEL, system=system, messages=ask,
                                     tools=[A_WEATHER]).input_tokens  # fmt: skip
    r = c.messages.create(model=MODEL, max_tokens=200, system=system, messages=ask,
                          tools=[A_WEATHER], extra_body={"cache_salt": "fresh-1"})  # fmt: skip
    assert r.stop_reason == "tool_use" and r.type == "message" and r.role == "assistant"
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    _identity(r.usage, prompt)
    assert r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens > 0.8 * (
        prompt)  # the system prompt, up to its breakpoint  # fmt: skip
    assert r.usage.cache_creation.ephemeral_1h_input_tokens == 0
    def follow(ttl: str) -> list:
        return [*ask, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                 "content": "sunny", "cache_control": {"type": "ephemeral", "ttl": ttl}}]}]

    with pytest.raises(anthropic.BadRequestError):  # 1h after 5m: Anthropic's order rule
        c.messages.create(model=MODEL, max_tokens=200, system=system, messages=follow("1h"),
                          tools=[A_WEATHER])  # fmt: skip
    system_1h = [{**system[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    r2 = c.messages.create(model=MODEL, max_tokens=200, system=system_1h, messages=follow("5m"),
                           tools=[A_WEATHER], extra_body={"cache_salt": "fresh-1"})  # fmt: skip
    assert r2.stop_reason == "end_turn" and r2.content[0].text == "It is sunny in Paris."
    prompt2 = r2.usage.input_tokens + r2.usage.cache_read_input_tokens + (
        r2.usage.cache_creation_input_tokens)  # fmt: skip
    _identity(r2.usage)
    assert r2.usage.cache_read_input_tokens >= 0.9 * prompt2
    assert r2.usage.cache_creation.ephemeral_1h_input_tokens == 0  # the 1h prefix was read
    assert r2.usage.cache_creation.ephemeral_5m_input_tokens == r2.usage.cache_creation_input_tokens
    # another tenant shares nothing
    r3 = c.messages.create(model=MODEL, max_tokens=200, system=system, messages=ask,
                           tools=[A_WEATHER], extra_body={"cache_salt": "other"})  # fmt: skip
    assert r3.usage.cache_read_input_tokens == 0


def test_anthropic_streaming_events_and_usage(server):
    c = claude(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    two = [{"role": "user", "content": "Weather in two cities please"}]
    kinds = []
    with c.messages.stream(model=MODEL, max_tokens=200, system=system, messages=two,
                           tools=[A_WEATHER]) as s:  # fmt: skip
        for event in s:
            kinds.append(event.type)
        final = s.get_final_message()
    whole = c.messages.create(model=MODEL, max_tokens=200, system=system, messages=two,
                              tools=[A_WEATHER])  # fmt: skip
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content]  # fmt: skip
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.stop_reason == "tool_use" and kinds[0] == "message_start"
    assert kinds[-1] == "message_stop" and "input_json" in kinds
    _identity(final.usage)
    # raw events: message_start carries the cache usage; a ping follows it
    with httpx.stream("POST", f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                      json={"model": MODEL, "max_tokens": 50, "stream": True, "system": system,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"]  # fmt: skip
    start = json.loads(lines[1].removeprefix("data: "))["message"]["usage"]
    assert start["cache_read_input_tokens"] > 0.8 * sum(start[k] for k in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))  # fmt: skip


def test_anthropic_stop_reasons_and_prefill(server):
    c = claude(server)
    r = c.messages.create(model=MODEL, max_tokens=50, stop_sequences=["STOP"], messages=[
        {"role": "user", "content": "count to three"}])  # fmt: skip
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "STOP",
                                                                  "one two ")  # fmt: skip
    r = c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2
    r = c.messages.create(model=MODEL, max_tokens=50, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure:"}])  # fmt: skip
    assert r.stop_reason == "end_turn" and r.content[0].text == "Hello from radixkv."


BAD_MESSAGES = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]},
        {"role": "user", "content": "y"}]}, "never thinks"),
    ({"top_k": 5}, "top_k"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "clear_tool_uses"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "JSON Schema"),
    ({"tools": [{"name": f"t{i}", "input_schema": {}} for i in range(10_000)]}, "at most 1024"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope",
                                                 "content": "x"}]}]}, "no earlier"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 5},
     "maximum of 4"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral",
                                                                 "ttl": "10m"}}]}, "ttl"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "structured"),
    ({"surprise": 1}, "surprise"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": ["x" * 5000]}, "stop_sequences"),
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": json.loads(
            "[" * 100 + "]" * 100)}}]}, {"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": "t1", "content": "ok"}]}]}, "deeper"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "words"), BAD_MESSAGES)
def test_anthropic_refusals_in_anthropics_error_shape(server, change, words):
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert words in out["error"]["message"], out


# a value that asks for something, per field of Anthropic's (and its beta's) request
A_SAMPLES = {
    "betas": ["x-2030-01-01"], "billing_policy": {"type": "x"}, "cache_control":
    {"type": "ephemeral"}, "compaction": {"type": "auto"}, "container": "c1",
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "diagnostics": {"x": 1}, "fallback_credit_token": "t", "fallbacks": [{"model": "m"}],
    "inference_geo": "us", "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}],
    "metadata": {"user_id": "u"}, "output_config": {"effort": "low"},
    "service_tier": "standard_only", "speed": "fast", "stop_sequences": ["zzz"],
    "system": "be brief", "thinking": {"type": "enabled", "budget_tokens": 1024},
    "thread": {"id": "t"}, "tool_choice": {"type": "auto"}, "tools": [A_WEATHER],
    "user_profile_id": "p", "workspace_id": "w", "stream": True,
}  # fmt: skip
A_HONOURED = {  # field -> where its effect (or that it changes nothing here) is shown
    "betas": "accepted as the anthropic-beta header is: no effect",
    "cache_control": "test_anthropic_messages_tools_and_prompt_caching (blocks); the end",
    "context_management": "clear_thinking only: this model never thinks (refusals: others)",
    "metadata": "an end-user id: changes no output",
    "output_config": "effort: a thinking budget hint; format is refused",
    "service_tier": "one tier here", "stop_sequences": test_anthropic_stop_reasons_and_prefill,
    "system": test_anthropic_messages_tools_and_prompt_caching,
    "thinking": "this model never thinks: no thinking blocks (docs/agents.md)",
    "tool_choice": "test_tool_choice_required_named_and_no_parallel_calls (shared plan)",
    "tools": test_anthropic_messages_tools_and_prompt_caching,
    "user_profile_id": "an account id: changes no output", "workspace_id": "the same",
    "stream": test_anthropic_streaming_events_and_usage,
}


def test_every_anthropic_field_is_honoured_or_refused(server):
    from anthropic.types import message_count_tokens_params as counted
    from anthropic.types import message_create_params as plain
    from anthropic.types.beta import message_create_params as beta

    fields = {*plain.MessageCreateParamsBase.__annotations__,
              *beta.MessageCreateParamsBase.__annotations__, "stream"}  # fmt: skip
    refused = []
    for field in sorted(fields - {"model", "messages", "max_tokens"}):
        assert field in A_SAMPLES, f"a new Anthropic field {field!r}: honour it or refuse it"
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                field: A_SAMPLES[field]}  # fmt: skip
        if field == "tool_choice":  # (only with tools, as Anthropic's rule is)
            body["tools"] = [A_WEATHER]
        r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY},
                       timeout=60)  # fmt: skip
        if field in A_HONOURED:
            assert r.status_code == 200, (field, r.text)
        else:
            assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
            refused.append(field)
    assert len(refused) >= 8
    for field in counted.MessageCountTokensParams.__annotations__:  # count_tokens takes them
        assert field in A_SAMPLES or field in ("model", "messages"), field


def test_anthropic_accepts_what_claude_code_sends(server):
    body = {"model": MODEL, "max_tokens": 32000, "stream": False,
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "system": [{"type": "text", "text": "billing"},
                       {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "system", "content": "Agent types: none."}],
            "tools": [A_WEATHER]}  # fmt: skip
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,some-future-beta-2030-01-01"}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": "Hello from radixkv.",
                                    "citations": None}]  # fmt: skip


def test_anthropic_auth_and_model_errors(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(server).messages.create(model="claude-opus-4", max_tokens=5,
                                       messages=[{"role": "user", "content": "x"}])  # fmt: skip
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/messages", content=b"{", headers={
        "x-api-key": KEY, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --- through the router ----------------------------------------------------------------------
def test_anthropic_requests_route_by_their_prompt(folder, tmp_path):
    """``radixkv route`` forwards /v1/messages with the same cache-aware choice: an
    agent's next turn goes where its prefix is cached; streams and errors pass through."""
    import time

    from radixkv.web.process import ServerProcess, free_port_pair

    ports = [free_port_pair() for _ in range(2)]
    workers = [scripted_server(SCRIPT, folder, tmp_path, "--served-model-name", MODEL,
                               "--page-size", "16", "--max-context-len", "65536",
                               "--kv-events", f"tcp://127.0.0.1:{p}") for p in ports]  # fmt: skip
    specs = [a for w, p in zip(workers, ports, strict=True)
             for a in ("--worker", f"{w.url},tcp://127.0.0.1:{p}")]  # fmt: skip
    router = ServerProcess("--policy", "kv", "--health-interval", "0.2", *specs,
                           command="route", timeout=60)  # fmt: skip
    try:
        c = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]

        def ask(q: str):
            return c.messages.with_raw_response.create(
                model=MODEL, max_tokens=20, system=system, tools=[A_WEATHER],
                messages=[{"role": "user", "content": q}])  # fmt: skip

        first = ask("first?")
        holder = first.headers["x-radixkv-worker"]
        deadline = time.monotonic() + 30  # the holder's events reach the router
        state = f"{router.url}/route/state"
        while not any(w["url"] == holder and w["indexed_blocks"] >= len(SYSTEM) // 16 - 2
                      for w in httpx.get(state).json()["workers"]):  # fmt: skip
            assert time.monotonic() < deadline, "the holder's events never reached the router"
            time.sleep(0.05)
        for q in ("second?", "third?", "fourth?"):
            r = ask(q)
            assert r.headers["x-radixkv-worker"] == holder
            u = r.parse().usage
            assert u.cache_read_input_tokens >= len(SYSTEM) - 32
        with c.messages.stream(model=MODEL, max_tokens=200, system=system, tools=[A_WEATHER],
                               messages=[{"role": "user", "content": "Weather in two cities"}]
                               ) as s:  # fmt: skip
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
        assert c.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": "hi"}]).input_tokens > 0  # fmt: skip
        bad = httpx.post(f"{router.url}/v1/messages", content=b"[", headers={
            "content-type": "application/json"})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        with pytest.raises(anthropic.BadRequestError) as e:  # the worker's, as it gave it
            c.messages.create(model=MODEL, max_tokens=5, extra_body={"top_k": 3},
                              messages=[{"role": "user", "content": "x"}])  # fmt: skip
        assert "top_k" in e.value.body["error"]["message"]
    finally:
        router.stop()
        for w in workers:
            w.stop()


MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}"
    "{% endif %}<|im_end|>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}"
    "[/TOOL_RESULTS]{% endif %}{% endfor %}"
)


def test_a_marker_that_is_a_special_token_still_parses(folder, tmp_path):
    """Mistral's ``[TOOL_CALLS]`` is one special token: decoding the output drops it,
    so the server puts it back where its id was, whole and streamed (a folder whose
    template shows the model ``[TOOL_CALLS]``: the parser is chosen from it)."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    mistral = tmp_path / "mistral"
    shutil.copytree(folder, mistral)
    tk = Tokenizer.from_file(str(mistral / "tokenizer.json"))
    tk.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tk.save(str(mistral / "tokenizer.json"))
    config = json.loads((mistral / "tokenizer_config.json").read_text())
    (mistral / "tokenizer_config.json").write_text(json.dumps({**config,
                                                               "chat_template": MISTRAL_TEMPLATE}))
    script = {"rules": [{"when": "Paris", "reply": '[TOOL_CALLS][{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}]'}], "default": "ok"}  # fmt: skip
    srv = scripted_server(script, str(mistral), tmp_path, "--served-model-name", MODEL)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        r = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER])
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris"})  # fmt: skip
        streamed = [ch.choices[0].delta for ch in c.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER], stream=True)]  # fmt: skip
        names = [t.function.name for d in streamed for t in d.tool_calls or () if t.function.name]
        assert names == ["get_weather"] and not "".join(d.content or "" for d in streamed)
    finally:
        assert srv.stop() == 0


def test_a_client_that_leaves_a_stream_has_its_request_aborted(server):
    import re
    import time

    def metrics() -> str:
        r = httpx.get(f"{server.url}/metrics", headers={"x-api-key": KEY})
        assert r.status_code == 200
        return r.text

    def busy() -> float:
        text = metrics()
        return sum(float(v) for v in re.findall(
            r"radixkv:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.]+)", text))  # fmt: skip

    def aborted() -> float:
        found = re.search(r'request_success_total\{finished_reason="abort"[^}]*\} ([0-9.]+)',
                          metrics())  # fmt: skip
        return float(found.group(1)) if found else 0.0

    before = aborted()
    for stream in (True, False):
        body = {"model": MODEL, "max_tokens": 4000, "stream": stream,
                "messages": [{"role": "user", "content": "tell me a long story"}]}  # fmt: skip
        if stream:
            with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=60,
                              headers={"x-api-key": KEY}) as r:  # fmt: skip
                next(r.iter_lines())  # the answer started; the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/messages", json=body, timeout=0.5,
                           headers={"x-api-key": KEY})  # fmt: skip
        deadline = time.monotonic() + 20
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy() == 0
    assert aborted() == before + 2


def _session_server(folder: str, tmp_path, *extra: str):
    """The scripted server in the session order, its pool 6,144 tokens."""
    return scripted_server(SCRIPT, folder, tmp_path, "--served-model-name", MODEL,
                           "--page-size", "16", "--max-context-len", "8192",
                           "--kv-tokens", "6144", "--eviction-policy", "session",
                           *extra)  # fmt: skip


def _agent_turn(c: anthropic.Anthropic, session: str, system: str, text: str):
    """One call of agent ``session`` (Claude Code's session header), the weather tool
    offered."""
    return c.messages.create(model=MODEL, max_tokens=100, system=system, tools=[A_WEATHER],
                             messages=[{"role": "user", "content": text}],
                             extra_headers={"X-Claude-Code-Session-Id": session})  # fmt: skip


def test_the_session_order_keeps_the_agent_that_called_a_tool(folder, tmp_path):
    """``--eviction-policy session`` through /v1/messages: Claude Code's session header
    names each agent; A's answer called a tool, B's ended the turn, then a third
    session needs room. A's next turn reads its whole prompt from the cache; B lost
    some of its own."""
    srv = _session_server(folder, tmp_path)
    try:
        c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        turn = functools.partial(_agent_turn, c)
        systems = {k: f"You are agent {k}. " * n for k, n in (("A", 110), ("B", 110), ("C", 140))}
        a = turn("A", systems["A"], "What is the weather in Paris?")
        assert a.stop_reason == "tool_use"
        assert turn("B", systems["B"], "hi").stop_reason == "end_turn"
        assert turn("C", systems["C"], "hi").stop_reason == "end_turn"
        back_a = turn("A", systems["A"], "What is the weather in Paris?").usage
        back_b = turn("B", systems["B"], "hi").usage
        prompt_b = back_b.input_tokens + back_b.cache_read_input_tokens + (
            back_b.cache_creation_input_tokens)  # fmt: skip
        assert back_a.cache_read_input_tokens >= a.usage.input_tokens - 16
        assert back_b.cache_read_input_tokens < prompt_b - 200
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'radixkv:agent_sessions_waiting{model_name="tiny"} 3.0' in metrics
        assert 'radixkv:agent_sessions_running{model_name="tiny"} 0.0' in metrics
        later = re.search(r'radixkv:session_evicted_tokens_total\{model_name="tiny",'
                          r'reason="back_later"\} ([0-9.e+]+)', metrics)  # fmt: skip
        assert later and float(later.group(1)) >= 200  # (B's turn ended: back in minutes)
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True])
def test_an_idle_server_loads_a_waiting_agents_pages_back_before_it_returns(
    folder, tmp_path, ahead
):
    """``--prefetch-within``: A's answer called a tool; D's long prompt then pushes A's
    pages down to the host tier. While the server idles, A (predicted back in seconds)
    comes back to the device, so its next call reads its prompt from the cache with
    nothing loaded on arrival; without the flag the same call loads it from the host."""
    extra = ("--prefetch-within", "3600") if ahead else ()  # (A overdue under load: still due)
    srv = _session_server(folder, tmp_path, "--host-tokens", "16384", *extra)
    try:
        c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        turn = functools.partial(_agent_turn, c)
        counter = functools.partial(_counter, srv.url)
        system_a = "You are agent A. " * 110
        a = turn("A", system_a, "What is the weather in Paris?")
        assert a.stop_reason == "tool_use"
        per_rep = a.usage.input_tokens / 110
        assert turn("D", "You are agent D. " * int(5600 / per_rep), "hi").stop_reason == "end_turn"
        if ahead:  # the engine idles now: A comes back while the client thinks
            _wait_for(counter, "loaded_ahead_tokens")
        host_before = counter("host_hit_tokens")
        back = turn("A", system_a, "What is the weather in Paris?").usage
        assert back.cache_read_input_tokens >= a.usage.input_tokens - 16
        loaded_on_arrival = counter("host_hit_tokens") - host_before
        assert (loaded_on_arrival == 0) == ahead, loaded_on_arrival
        if not ahead:
            assert counter("loaded_ahead_tokens") == 0
    finally:
        assert srv.stop() == 0 and "Traceback" not in srv.stderr(), srv.stderr()[-3000:]


def _counter(url: str, name: str) -> float:
    """A counter's value in the server's /metrics."""
    found = re.search(rf"radixkv:{name}_total\{{[^}}]*\}} ([0-9.e+]+)",
                      httpx.get(f"{url}/metrics").text)  # fmt: skip
    assert found, name
    return float(found.group(1))


def _wait_for(counter, name: str) -> None:
    """Until the server's idle load ahead shows in ``name`` (at most 30 s)."""
    import time

    deadline = time.monotonic() + 30
    while counter(name) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter(name) > 0, name


@pytest.mark.slow
def test_an_idle_server_loads_a_hybrid_agent_back_before_it_returns(tmp_path):
    """The same on Qwen3.5 (recurrent layers) in one byte budget, the answers scripted
    (a tool call for A, the end of a turn for D: which one a random model's answer is
    depends on its weights): D's prompt pushes A's down to the host; the idle server
    brings back A's deepest checkpoint with the KV up to it, so A's next call reads its
    prompt from the cache with nothing loaded on arrival."""
    from radixkv.cli import main

    path = tmp_path / "qwen3.5"
    assert main(["make-model", "qwen3.5", str(path), "--context", "16384"]) == 0
    srv = scripted_server(SCRIPT, str(path), tmp_path, "--served-model-name", MODEL,
                          "--page-size", "16", "--max-context-len", "8192", "--cache-bytes",
                          "1000000", "--host-tokens", "8192", "--eviction-policy", "session",
                          "--prefetch-within", "3600")  # fmt: skip
    try:
        c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
        turn = functools.partial(_agent_turn, c)
        counter = functools.partial(_counter, srv.url)
        system_a = "You are agent A. " * 80  # ~1,400 tokens; D's ~2,900; the budget 3,872
        a = turn("A", system_a, "What is the weather in Paris?")
        assert a.stop_reason == "tool_use"
        assert turn("D", "You are agent D. " * 170, "hi").stop_reason == "end_turn"
        _wait_for(counter, "state_checkpoints_loaded_ahead")
        assert counter("loaded_ahead_tokens") > 0
        host_before = counter("host_hit_tokens")
        back = turn("A", system_a, "What is the weather in Paris?").usage
        assert back.cache_read_input_tokens >= a.usage.input_tokens - 16
        assert counter("host_hit_tokens") == host_before
    finally:
        assert srv.stop() == 0 and "Traceback" not in srv.stderr(), srv.stderr()[-3000:]
