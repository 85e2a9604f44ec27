"""Tool calls without a server: each family's parser on what its models write, the
streaming split against the whole-output parse (any chunking), the tools' chat template
against transformers', and the checks of tools and tool history."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.server import chat
from radixkv.server.protocol import ApiError
from radixkv.server.tools import Stream, make_parser, parser_for

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a <b> & \"q\""}


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes_parses_calls_and_keeps_the_text_before_them():
    p = make_parser("hermes")
    out = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
           f'{json.dumps(WEATHER)}}}\n</tool_call>\n<tool_call>\n{{"name": "now", '
           '"arguments": {}}\n</tool_call>')  # fmt: skip
    parsed = p.parse(out)
    assert parsed.content == "Let me look."
    assert _calls(parsed) == [("get_weather", WEATHER), ("now", {})]
    assert len({c.id for c in parsed.calls}) == 2 and parsed.calls[0].id.startswith("call_")
    # an unclosed last call (the model stopped at EOS after the JSON) still parses
    assert _calls(p.parse('<tool_call>\n{"name": "now", "arguments": {}}')) == [("now", {})]


@pytest.mark.parametrize("text", [
    "plain text", '<tool_call>\n{"name": "f", "arguments": {"a": 1}', "<tool_call>not json",
    '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
])  # fmt: skip
def test_output_that_does_not_parse_is_text(text):
    parsed = make_parser("hermes").parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_a_nest_deeper_than_json_recurses_is_text_not_an_error():
    deep = "[" * 100_000 + "]" * 100_000
    for name, text in (("hermes", f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}'),
                       ("llama3_json", f'{{"name": "f", "parameters": {{"a": {deep}}}}}'),
                       ("mistral", f'[TOOL_CALLS][{{"name": "f", "arguments": {deep}}}]')):
        parsed = make_parser(name).parse(text)
        assert parsed.calls == [] and parsed.content == text, name


def test_llama3_json_and_mistral_formats():
    llama = make_parser("llama3_json")
    one = llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert _calls(one) == [("get_weather", {"city": "Paris"})] and one.content is None
    two = llama.parse('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert _calls(two) == [("a", {}), ("b", {"x": 1})]
    assert llama.parse("The answer is {x}").calls == []
    mistral = make_parser("mistral")
    v3 = mistral.parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", '
                       '"arguments": {}}]')  # fmt: skip
    assert _calls(v3) == [("a", {"x": 1}), ("b", {})]
    v11 = mistral.parse('Sure.[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert _calls(v11) == [("a", {"x": 1}), ("b", {})] and v11.content == "Sure."
    assert mistral.parse("[TOOL_CALLS]nonsense").calls == []


def test_the_parser_is_the_one_the_template_teaches():
    from radixkv.cli.make_model import CHATML

    assert parser_for(CHATML) == "hermes"
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert parser_for("{{ tools }} [TOOL_CALLS] {{ messages }}") == "mistral"
    assert parser_for('{{ tools }} {"name": ..., "parameters": ...}') == "llama3_json"


@pytest.mark.parametrize("opening_for", [None, "get_weather"])
def test_a_forced_opening_is_completed_by_the_output(opening_for):
    p = make_parser("hermes")
    opening = p.opening(opening_for)
    rest = ('get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' if opening_for is None
            else '{"city": "Paris"}}\n</tool_call>')  # fmt: skip
    assert _calls(p.parse(opening + rest)) == [("get_weather", {"city": "Paris"})]


OUTPUTS = [
    "no calls at all, just < and <tool and text",
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
    '"arguments": {"x": [1, 2]}}\n</tool_call>',
    "<tool_call>\n{broken",
]


@given(st.sampled_from(OUTPUTS), st.lists(st.integers(1, 12), min_size=1, max_size=40))
def test_streaming_any_chunking_gives_the_whole_outputs_parse(output, sizes):
    parser = make_parser("hermes")
    whole = parser.parse(output)
    stream, sent, at, k = Stream(parser), [], 0, 0
    while at < len(output):
        n = sizes[k % len(sizes)]
        sent.append(stream.feed(output[at : at + n]))
        at, k = at + n, k + 1
    rest, calls = stream.end()
    text = "".join(sent) + (rest or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    assert text.rstrip() == (whole.content or "").rstrip()
    if not whole.calls:
        assert text == output  # nothing held back is lost


def test_streaming_llama3_decides_on_the_first_character():
    p = make_parser("llama3_json")
    s = Stream(p)
    assert s.feed("  ") == "" and s.feed('{"name": "f", ') == ""
    assert s.feed('"parameters": {}}') == ""
    assert [(c.name, c.arguments) for c in s.end().calls] == [("f", "{}")]
    s = Stream(p)
    assert s.feed("Hello") == "Hello" and s.feed(" {x}") == " {x}"


def test_make_models_template_renders_tools_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from radixkv.cli.make_model import write_tokenizer
    from radixkv.tokenizer import HFTokenizer

    write_tokenizer(tmp_path)
    ours, theirs = HFTokenizer.from_folder(tmp_path), transformers.AutoTokenizer.from_pretrained(
        tmp_path)  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w <x> é",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris"}}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Rome"}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "c2", "content": "rain"}],
    ]  # fmt: skip
    for messages in chats:
        for t in (tools, None):
            want = theirs.apply_chat_template(messages, tools=t, add_generation_prompt=True,
                                              tokenize=False)  # fmt: skip
            got = ours.apply_chat_template(messages, t)
            assert got == theirs(want, add_special_tokens=False)["input_ids"]
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    from radixkv.tokenizer.template import render

    old = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert ours.apply_chat_template(plain) == ours.encode_plain(
        render(old, 1 << 20, messages=plain, add_generation_prompt=True))  # fmt: skip


def _bad(fn, *args, param=None, words=()):
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400 and (param is None or e.value.param == param), e.value.message
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value


def test_tool_checks_name_what_is_wrong():
    def tool(name="f", params=None):
        return {"name": name, "parameters": params}

    _bad(chat.check_tools, [tool(f"t{i}") for i in range(10_000)], "tools", "parameters",
         param="tools", words=("at most 128",))  # fmt: skip
    _bad(chat.check_tools, [tool("bad name")], "tools", "parameters", param="tools")
    _bad(chat.check_tools, [tool(), tool()], "tools", "parameters", words=("twice",))
    _bad(chat.check_tools, [tool(params={"type": "no-such-type"})], "tools", "parameters",
         words=("tools[0].parameters", "JSON Schema"))  # fmt: skip
    _bad(chat.check_tools, [tool(params={"properties": 3})], "tools", "parameters",
         words=("JSON Schema",))  # fmt: skip
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["properties"] = {"x": {}}
        node = node["properties"]["x"]
    _bad(chat.check_tools, [tool(params=deep)], "tools", "parameters", words=("nested",))
    chat.check_tools([tool(params={"type": "object", "properties": {"a": {"type": "string"}}})],
                     "tools", "parameters")  # fmt: skip


def test_tool_history_checks():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]
    chat.check_answers([{"role": "assistant", "content": None, "tool_calls": calls},
                        {"role": "tool", "tool_call_id": "c1", "content": "x"}])  # fmt: skip
    _bad(chat.check_answers, [{"role": "user", "content": "hi"},
                              {"role": "tool", "tool_call_id": "c9", "content": "x"}],
         param="messages", words=("c9", "no earlier"))  # fmt: skip
    _bad(chat.arguments, "[1, 2]", "m", words=("JSON object",))
    _bad(chat.arguments, "{" * 100 + "}" * 100, "m")
    _bad(chat.arguments, json.dumps(json.loads("[" * 80 + "]" * 80) and {"a": json.loads(
        "[" * 80 + "]" * 80)}), "m", words=("deeper",))  # fmt: skip
    f = [{"name": "f", "parameters": {"type": "object"}}]
    _bad(chat.plan, None, f, "auto", True, param="tools", words=("--tool-call-parser",))
    _bad(chat.plan, make_parser("hermes"), [], "required", True, param="tool_choice")
    assert chat.plan(make_parser("hermes"), f, "none", True).parser is None
    assert chat.plan(make_parser("hermes"), f, "f", False).single


def test_calls_of_unknown_tools_or_breaking_a_strict_schema_are_text():
    from radixkv.server.tools import Call

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    strict = chat.plan(make_parser("hermes"), [{"name": "w", "parameters": schema,
                                                "strict": True}], None, True)  # fmt: skip
    loose = chat.plan(make_parser("hermes"), [{"name": "w", "parameters": schema}], None, True)
    good, bad = Call("1", "w", '{"city": "Paris"}'), Call("2", "w", '{"town": 3}')
    assert strict.accepts([good]) and not strict.accepts([good, bad])
    # a client's regular expression is never run on the event loop (catastrophic ones)
    evil = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^(a+)+$"}}}
    p = chat.plan(make_parser("hermes"), [{"name": "w", "parameters": evil, "strict": True}],
                  None, True)  # fmt: skip
    assert p.accepts([Call("4", "w", json.dumps({"city": "a" * 40 + "!"}))])
    assert loose.accepts([good, bad]) and not loose.accepts([Call("3", "other", "{}")])
