"""Tool calling on /v1/chat/completions (core/server/tools.py): the parsers read calls out
of text and never let a stream send the start of one as content; a named or "required"
tool choice constrains the reply to the tools' schemas and returns it as calls; "auto"
reads the calls the model wrote with the server's parser; the tools reach the chat
template; a conversation carrying earlier calls and tool answers renders; every misuse is
a 400 naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

import httpx
from test_async_engine import with_engine
from test_server import events

from cadence.server.app import build_app
from cadence.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
)
from cadence.server.tools import (
    NamedToolChoice,
    ToolDef,
    ToolStream,
    constraint,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                              "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


# ---- parsers and constraints, no engine --------------------------------------------------
def test_hermes_parser() -> None:
    p = HermesToolParser()
    one = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = p.extract(one)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("f", {"a": 1})]
    two = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>')
    content, calls = p.extract(two)
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert len({c.id for c in calls}) == 2
    for plain in ("no call here", "<tool_call>not json</tool_call>",
                  '<tool_call>{"arguments": {}}</tool_call>'):
        assert p.extract(plain) == (plain, [])
    # A stream never sends what may be the start of a call.
    assert p.streamable("Hello <tool") == len("Hello ")
    assert p.streamable("Hello <") == len("Hello ")
    assert p.streamable("Hello") == 5
    assert p.streamable("x<tool_call>{") == 1


def test_llama3_json_parser() -> None:
    p = Llama3JsonToolParser()
    content, calls = p.extract('{"name": "f", "parameters": {"a": 1}}')
    assert content is None and json.loads(calls[0].arguments) == {"a": 1}
    content, calls = p.extract('<|python_tag|>{"name": "f", "parameters": {}}; '
                               '{"name": "g", "parameters": {"b": 2}}')
    assert [c.name for c in calls] == ["f", "g"]
    for plain in ("Hello", '{"name": 3}', 'Hi {"name": "f", "parameters": {}}'):
        assert p.extract(plain) == (plain, [])
    # Text after the calls is dropped, and calls may be separated by commas (vLLM's).
    for after in ('{"name": "f", "parameters": {}} Let me know.',
                  '{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}'):
        content, calls = p.extract(after)
        assert content is None and calls[0].name == "f"
    assert len(p.extract(after)[1]) == 2
    for held in ("", "  ", " {", "<|py", "<|python_tag|>{"):
        assert p.streamable(held) == 0
    assert p.streamable("Hi there") == len("Hi there")


def test_mistral_parser() -> None:
    p = MistralToolParser()
    content, calls = p.extract('Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}},'
                               ' {"name": "g", "arguments": {}}]')
    assert content == "Checking. " and [c.name for c in calls] == ["f", "g"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral's templates
    for plain in ("no call", "[TOOL_CALLS] not json", '[TOOL_CALLS] [{"arguments": {}}]',
                  "[TOOL_CALLS]f[ARGS]not json", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]",
                  '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g oops'):
        assert p.extract(plain) == (plain, [])
    assert p.streamable("ok [TOOL_") == len("ok ")
    # Text after the list is dropped, as vLLM drops it.
    content, calls = p.extract('[TOOL_CALLS] [{"name": "f", "arguments": {}}] Hope it helps.')
    assert content is None and [c.name for c in calls] == ["f"]
    # v11 and later: a marker before each call, its name, then [ARGS] (or not) and the JSON.
    content, calls = p.extract('Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                               '[TOOL_CALLS]get_time{"zone": "utc"} and more')
    assert content == "Sure.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "utc"})]
    # Blank text before the marker is no content.
    assert p.extract('\n [TOOL_CALLS]f{}')[0] is None


def test_arguments_written_as_text_go_out_as_json() -> None:
    """A model that writes its arguments as a string: plain text becomes a JSON string
    (vLLM's), so a client's json.loads works; a string that is JSON text is kept."""
    p = HermesToolParser()
    for written, sent in (('"Paris"', '"Paris"'), ('"city=Paris"', '"city=Paris"'),
                          (json.dumps('{"city": "Paris"}'), '{"city": "Paris"}')):
        (call,) = p.extract(f'<tool_call>{{"name": "f", "arguments": {written}}}'
                            '</tool_call>')[1]
        assert call.arguments == sent
        json.loads(call.arguments)
    (call,) = Llama3JsonToolParser().extract('{"name": "f", "parameters": "x=1"}')[1]
    assert json.loads(call.arguments) == "x=1"


def test_pythonic_parser() -> None:
    p = PythonicToolParser()
    content, calls = p.extract("[get_weather(city='Paris', days=2), now()]")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
    _, calls = p.extract("<|python_start|>[f(x=[1, 2], y=None)]<|python_end|>")
    assert json.loads(calls[0].arguments) == {"x": [1, 2], "y": None}
    for plain in ("Hello", "[1, 2]", "[f(1)]", "[f(x=y)]", "[f(**k)]", "[]", "[f(x=1",
                  # Python literals JSON has no form for, and ones literal_eval refuses
                  # with a TypeError: plain content, never a failed request.
                  "[f(a={1})]", "[f(a=b'x')]", "[f(a=1j)]", "[f(a=1e999)]",
                  "[f(a={(1, 2): 3})]", "[f(a={[1]: 2})]", "[f(a=[1, {2}])]",
                  # An escape that decodes to a lone surrogate: no UTF-8 body carries it.
                  r"[f(a='\ud800')]", r"[f\u0301(a=1)]"):
        assert p.extract(plain) == (plain, [])
    hermes = r'<tool_call>{"name": "f", "arguments": {"a": "\ud800"}}</tool_call>'
    assert HermesToolParser().extract(hermes) == (hermes, [])
    nan = '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'
    assert HermesToolParser().extract(nan) == (nan, [])
    for held in ("", " [", "<|python"):
        assert p.streamable(held) == 0
    assert p.streamable("Hi") == 2


def test_constraints() -> None:
    tools = [ToolDef(**WEATHER), ToolDef(**TIME)]
    named = constraint(tools, NamedToolChoice(type="function",
                                              function={"name": "get_time"}), True)
    assert named.json == TIME["function"]["parameters"]
    required = constraint(tools, "required", True).json
    assert required["minItems"] == 1 and "maxItems" not in required
    names = [alt["properties"]["name"]["enum"] for alt in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert constraint(tools, "required", False).json["maxItems"] == 1
    # References into a tool's own definitions still resolve from the array's root.
    with_defs = ToolDef(type="function", function={"name": "g", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}}}})
    schema = constraint([with_defs], "required", True).json
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["properties"]["parameters"]
    assert "$defs" in with_defs.function.parameters  # the request's own is left alone
    assert constraint(tools, "auto", True) is None
    assert constraint(tools, "none", True) is None


def test_tool_stream_holds_back_a_call_and_sends_it_last() -> None:
    s = ToolStream("auto", HermesToolParser())
    pieces = ["Let me ", "check.<tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}</tool_call>']
    deltas = [s.delta(0, piece) for piece in pieces]
    assert "".join(d["content"] for d in deltas if d) == "Let me check."
    last, finish = s.finish(0, "stop")
    assert finish == "tool_calls" and "content" not in last
    (call,) = last["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    plain = ToolStream("auto", HermesToolParser())
    assert plain.delta(0, "a <") == {"content": "a "}
    assert plain.finish(0, "length") == ({"content": "<"}, "length")
    # A named call streams its arguments as they come; the first delta names it.
    named = ToolStream(NamedToolChoice(type="function", function={"name": "f"}), None)
    first, second = named.delta(0, '{"a":'), named.delta(0, "1}")
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a":'}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}
    assert named.finish(0, "stop") == (None, "stop")


# ---- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


# A chat template that writes the tools' names, and earlier calls with their arguments read
# as a dict (as templates that ``tojson`` them expect).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}"
    "{{ '\\n' }}{% endif %}{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name + '(' + c.function.arguments.city + ')' }}"
    "{% endfor %}{{ '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
HISTORY = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def model_rendering_tools(model, tmp_path_factory) -> str:
    """The tiny model with ``TOOLS_TEMPLATE`` as its chat template."""
    out = Path(tmp_path_factory.mktemp("tools-model")) / "m"
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return str(out)


def test_tools_and_earlier_calls_reach_the_template(model_rendering_tools) -> None:
    from cadence.server.chat_protocol import ChatMessage
    from cadence.server.serving import render_messages
    from cadence.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(model_rendering_tools)
    chat = render_messages(tok, [ChatMessage(**m) for m in HISTORY], True, "",
                           [ToolDef(**WEATHER).model_dump(exclude_none=True)])
    assert chat.text.startswith("tools: get_weather\n")
    assert "<|assistant|>\nget_weather(Paris)</s>" in chat.text
    assert "<|tool|>\nsunny</s>" in chat.text


def _post(model: str, *bodies, parser: str | None = None) -> list:
    async def run(engine):
        app = build_app(engine, "tiny", tool_call_parser=parser)
        replies = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            for b in bodies:
                # JSON's escapes, so that a lone surrogate travels as clients send it.
                r = await client.post("/v1/chat/completions", content=json.dumps(b),
                                      headers={"Content-Type": "application/json"})
                replies.append((r.status_code, r.text if b.get("stream") else r.json()))
        return replies

    return with_engine(model, run)


def _constrained() -> None:
    pytest.importorskip("xgrammar", reason="named and required tool choices need the "
                                           "structured extra (xgrammar)")


def test_named_tool_choice_returns_a_call_with_valid_arguments(model) -> None:
    _constrained()
    body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 40, "temperature": 0.9,
            "seed": 1, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    [(status, r), (sstatus, streamed)] = _post(model, body, {**body, "stream": True})
    assert status == 200, r
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("utc", "cet")
    assert sstatus == 200
    chunks = [c["choices"][0] for c in events(streamed) if c["choices"]]
    got = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    # The arguments stream as they come; the first delta names the call.
    assert got[0]["function"]["name"] == "get_time" and got[0]["id"]
    assert "".join(d["function"]["arguments"] for d in got) == \
        call["function"]["arguments"]  # same seed, same call
    assert {d["index"] for d in got} == {0}
    assert chunks[-1]["finish_reason"] == "stop"
    assert not "".join(c["delta"].get("content") or "" for c in chunks)


def test_a_named_call_cut_short_by_max_tokens_is_content(model) -> None:
    """Its arguments do not parse: not a call (docs/server.md), as under "required". In a
    stream the arguments went out as they came: it stays a call, sent once."""
    _constrained()
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 3, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    [(status, r), (sstatus, streamed)] = _post(model, body, {**body, "stream": True})
    assert status == 200, r
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    text = choice["message"]["content"]
    assert text.startswith("{")
    assert sstatus == 200
    chunks = [c["choices"][0] for c in events(streamed) if c["choices"]]
    assert "".join(d["function"]["arguments"] for c in chunks
                   for d in c["delta"].get("tool_calls", [])) == text
    assert not "".join(c["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["finish_reason"] == "length"


def test_required_tool_choice_returns_calls_of_the_tools(model) -> None:
    _constrained()
    body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 80, "temperature": 0.8,
            "seed": 3, "tool_choice": "required", "parallel_tool_calls": False}
    [(status, r)] = _post(model, body)
    assert status == 200, r
    (choice,) = r["choices"]
    calls = choice["message"].get("tool_calls")
    if choice["finish_reason"] == "length":
        pytest.skip("the random model ran past max_tokens inside the JSON")
    assert choice["finish_reason"] == "tool_calls"
    assert len(calls) == 1 and calls[0]["function"]["name"] in ("get_weather", "get_time")
    json.loads(calls[0]["function"]["arguments"])


def test_auto_reads_the_calls_with_the_servers_parser(model) -> None:
    _constrained()
    # The random model is made to write a Hermes call (a regex beside tool_choice "auto").
    call = r'Hi<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    body = {"messages": USER, "tools": [WEATHER], "max_tokens": 200,
            "structured_outputs": {"regex": call}}
    [(status, r), (_, streamed), (_, plain)] = _post(
        model, body, {**body, "stream": True},
        {"messages": USER, "tools": [WEATHER], "max_tokens": 5}, parser="hermes")
    assert status == 200, r
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Hi"
    (got,) = choice["message"]["tool_calls"]
    assert got["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = [c["choices"][0] for c in events(streamed) if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Hi"
    (delta,) = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert delta["function"]["name"] == "get_weather"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # No call written: plain content, the usual finish.
    (choice,) = plain["choices"]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(model) -> None:
    """vLLM's rule for every tool choice: with parallel_tool_calls false, a reply of two
    calls returns the first, whole and streamed."""
    _constrained()
    one = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    two = one + r'\n<tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"\}\}</tool_call>'
    body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 200,
            "structured_outputs": {"regex": two}, "parallel_tool_calls": False}
    [(status, r), (_, streamed), (_, both)] = _post(
        model, body, {**body, "stream": True}, {**body, "parallel_tool_calls": True},
        parser="hermes")
    assert status == 200, r
    (choice,) = r["choices"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == \
        ["get_weather"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [d for c in events(streamed) if c["choices"]
             for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [d["function"]["name"] for d in calls] == ["get_weather"]
    assert len(both["choices"][0]["message"]["tool_calls"]) == 2


def test_blank_content_beside_calls_and_a_reply_all_thinking_are_null() -> None:
    """A blank line before the calls (Qwen3 writes one after its thinking) is no content,
    whole or streamed; a reply that never leaves its thinking has null content under
    "auto" too, as its stream has."""
    from cadence.server.chat_reply import ChatReply
    from cadence.server.reasoning import REASONING_PARSERS

    text = ('<think>ok</think>\n\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}</tool_call>')
    reply = ChatReply("auto", HermesToolParser(), REASONING_PARSERS["qwen3"]())
    fields, finish = reply.whole(text, "stop")
    assert fields["content"] is None and fields["reasoning_content"] == "ok"
    assert len(fields["tool_calls"]) == 1 and finish == "tool_calls"
    stream = ChatReply("auto", HermesToolParser(), REASONING_PARSERS["qwen3"]())
    deltas = [stream.delta(0, ch, False) for ch in text]
    last, finish = stream.finish(0, "stop")
    assert not any(d and d.get("content") for d in [*deltas, last])
    assert finish == "tool_calls" and len(last["tool_calls"]) == 1
    # Blank text alone is still the reply's content.
    plain = ToolStream("auto", HermesToolParser())
    assert plain.delta(0, "\n\n") is None
    assert plain.finish(0, "stop") == ({"content": "\n\n"}, "stop")
    thinking = ChatReply("auto", HermesToolParser(), REASONING_PARSERS["deepseek_r1"]())
    fields, finish = thinking.whole("still thinking", "length")
    assert fields["content"] is None and fields["reasoning_content"] == "still thinking"
    assert "tool_calls" not in fields and finish == "length"


def test_a_conversation_with_calls_is_served(model_rendering_tools) -> None:
    base = {"max_tokens": 1, "tool_choice": "none", "tools": [WEATHER]}
    [(s1, asked), (s2, answered)] = _post(model_rendering_tools, {**base, "messages": USER},
                                          {**base, "messages": HISTORY})
    assert (s1, s2) == (200, 200), answered
    assert answered["usage"]["prompt_tokens"] > asked["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "distinct"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"tools": [{"type": "function", "function": {"nam": "x"}}]}, "tools", ""),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    # A schema the grammar compiler refuses is the tools' fault, not a field never sent.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "foo"}}}], "tool_choice": "required"}, "tools", "foo"),
])
def test_misuse_is_a_400_naming_the_field(model, body, param, words) -> None:
    [(status, r)] = _post(model, {"messages": USER, "max_tokens": 2, **body})
    assert status == 400, r
    assert r["error"]["param"].startswith(param), r
    assert words in r["error"]["message"], r


def test_a_lone_surrogate_in_the_tools_is_a_400_naming_them(model) -> None:
    body = {"messages": USER, "max_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f\ud800"}}]}
    [(status, r)] = _post(model, body)
    assert status == 400 and r["error"]["param"] == "tools", r
    assert "lone surrogate" in r["error"]["message"], r


def test_serve_flags_name_every_parser_and_go_together(model) -> None:
    from cadence.cli.main import build_parser, main
    from cadence.server.tool_parsers import TOOL_PARSERS

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (flag,) = [a for a in serve._actions if "--tool-call-parser" in a.option_strings]
    assert set(flag.choices) == set(TOOL_PARSERS)
    # Checked before the model loads: exit status 2 with the reason.
    assert main(["serve", "--model", model, "--enable-auto-tool-choice"]) == 2
    assert main(["serve", "--model", model, "--tool-call-parser", "hermes"]) == 2


def test_tokenize_counts_the_tools_as_the_chat_endpoint_does(model_rendering_tools) -> None:
    async def run(engine):
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            chat = await client.post("/v1/chat/completions", json={
                "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none",
                "max_tokens": 1})
            counted = await client.post("/tokenize", json={"messages": HISTORY,
                                                           "tools": [WEATHER]})
            bare = await client.post("/tokenize", json={"messages": HISTORY})
            wrong = await client.post("/tokenize", json={"prompt": "x", "tools": [WEATHER]})
        return chat.json(), counted.json(), bare.json(), wrong

    chat, counted, bare, wrong = with_engine(model_rendering_tools, run)
    assert counted["count"] == chat["usage"]["prompt_tokens"] > bare["count"]
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tools"
