"""Reasoning parsers (core/server/reasoning.py): a reasoning model's ``<think> ... </think>``
comes back as ``reasoning_content`` beside ``content``, whole or streamed, and a stream
never sends a marker's characters as either; the answer is what the tool parser reads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

import httpx
from test_async_engine import with_engine
from test_server import events

from cadence.server.app import build_app
from cadence.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningStream,
)

USER = [{"role": "user", "content": "think first"}]


def _stream(parser, pieces: list[str]) -> tuple[str, str]:
    s = ReasoningStream(parser)
    got = [s.delta(0, p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(t for t, _ in got), "".join(a for _, a in got)


@pytest.mark.parametrize("text", [
    "<think>step one</think>The answer", "\n<think>\nhmm</think>\n\nok", "no thinking here",
    "<think>cut short", "<think></think>x", "<thin", "", "The <think> comes late</think>",
])
def test_parsers_split_whole_and_streamed_alike(text: str) -> None:
    for parser in (Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()):
        thinking, answer = parser.split(text)
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
        assert _stream(parser, pieces) == (thinking or "", answer or ""), (parser.name, text)
        # One character at a time too: markers split anywhere.
        assert _stream(parser, [*text] or [""]) == (thinking or "", answer or "")


def test_what_each_parser_calls_thinking() -> None:
    q, d = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()
    assert q.split("<think>a</think>b") == d.split("<think>a</think>b") == ("a", "b")
    assert q.split("plain") == (None, "plain")
    # DeepSeek-R1's template opens <think> in the prompt: the reply thinks from its start.
    assert d.split("a</think>b") == ("a", "b")
    assert d.split("still thinking") == ("still thinking", None)
    assert q.split("<think>still thinking") == ("still thinking", None)
    # Nothing is sent while the reply might still open with the marker.
    s = ReasoningStream(q)
    assert s.delta(0, "<thi") == ("", "")
    assert s.delta(0, "nk>deep") == ("deep", "")
    assert s.delta(0, "er</thi") == ("er", "")
    assert s.delta(0, "nk>done", final=True) == ("", "done")


def _post(model: str, *bodies, **app_kw) -> list:
    async def run(engine):
        app = build_app(engine, "tiny", **app_kw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            out = []
            for b in bodies:
                r = await client.post("/v1/chat/completions", json=b)
                assert r.status_code == 200, r.text
                out.append(r.text if b.get("stream") else r.json())
            return out

    return with_engine(model, run)


def test_server_returns_reasoning_content(tiny_model_dir) -> None:
    pytest.importorskip("xgrammar", reason="the reply is forced with a regex (structured extra)")
    model = tiny_model_dir("llama")
    # The random model is made to think and answer, then to think and call a tool.
    body = {"messages": USER, "max_tokens": 120,
            "structured_outputs": {"regex": "<think>let me see</think>It is 4"}}
    call = (r'<think>a tool</think><tool_call>\{"name": "f", "arguments": \{\}\}</tool_call>')
    tool = {"type": "function", "function": {"name": "f"}}
    whole, streamed, with_call = _post(
        model, body, {**body, "stream": True},
        {"messages": USER, "max_tokens": 120, "tools": [tool],
         "structured_outputs": {"regex": call}},
        reasoning_parser="qwen3", tool_call_parser="hermes")
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("let me see", "It is 4")
    deltas = [c["choices"][0]["delta"] for c in events(streamed) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "let me see"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4"
    message = with_call["choices"][0]["message"]
    assert message["reasoning_content"] == "a tool" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {}
    assert with_call["choices"][0]["finish_reason"] == "tool_calls"
    # Without a reasoning parser the thinking is plain content.
    (plain,) = _post(model, body)
    assert plain["choices"][0]["message"]["content"] == "<think>let me see</think>It is 4"
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_a_forced_call_or_json_reply_is_not_read_as_thinking(tiny_model_dir) -> None:
    """deepseek_r1 reads a reply that never closes </think> as all thinking; a JSON
    constraint (a named or required tool, a response format) leaves no room to think, so
    its reply is the answer: the call, or the JSON content."""
    pytest.importorskip("xgrammar", reason="the reply is forced by a JSON grammar")
    model = tiny_model_dir("llama")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}}}
    named = {"messages": USER, "max_tokens": 40, "tools": [tool],
             "tool_choice": {"type": "function", "function": {"name": "f"}}}
    fmt = {"messages": USER, "max_tokens": 60, "response_format": {"type": "json_schema",
           "json_schema": {"name": "x", "schema": tool["function"]["parameters"]}}}
    whole, streamed, as_json = _post(model, named, {**named, "stream": True}, fmt,
                                     reasoning_parser="deepseek_r1")
    message = whole["choices"][0]["message"]
    assert message.get("reasoning_content") is None, message
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(message["tool_calls"][0]["function"]["arguments"])["a"], int)
    deltas = [c["choices"][0]["delta"] for c in events(streamed) if c["choices"]]
    assert not any(d.get("reasoning_content") for d in deltas)
    assert any(d.get("tool_calls") for d in deltas)
    if as_json["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(as_json["choices"][0]["message"]["content"])["a"], int)
    assert as_json["choices"][0]["message"].get("reasoning_content") is None
