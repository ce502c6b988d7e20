"""Anthropic's Messages API (core/server/anthropic.py): the chat endpoint's conversation
reshaped into a ``message`` or Anthropic's event stream; tool use and tool results rendered
as the chat messages they stand for; stop reasons; misuse a 400 naming the Messages field."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from test_server_responses import _post
from test_server_tools import (  # noqa: F401  (fixtures)
    HISTORY,
    USER,
    WEATHER,
    _constrained,
    model,
    model_rendering_tools,
)


def _anthropic_events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"]
        out.append(payload)
    return out


def test_a_message_is_the_chat_reply_reshaped(model) -> None:  # noqa: F811
    chat = {"messages": [{"role": "system", "content": "be brief"}, *USER], "max_tokens": 6,
            "temperature": 0}
    msg = {"system": [{"type": "text", "text": "be brief"}], "max_tokens": 6,
           "temperature": 0, "messages": [{"role": "user", "content": [
               {"type": "text", "text": USER[0]["content"]}]}]}
    [(s1, c), (s2, m), (s3, streamed)] = _post(
        model, ("/v1/chat/completions", chat), ("/v1/messages", msg),
        ("/v1/messages", {**msg, "stream": True}))
    assert (s1, s2, s3) == (200, 200, 200), (c, m)
    choice = c["choices"][0]
    text = choice["message"]["content"]
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": text}]
    assert m["usage"] == {"input_tokens": c["usage"]["prompt_tokens"],
                          "output_tokens": c["usage"]["completion_tokens"]}
    assert m["stop_reason"] == ("max_tokens" if choice["finish_reason"] == "length"
                                else "end_turn")
    events = _anthropic_events(streamed)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert events[0]["message"]["usage"]["input_tokens"] == m["usage"]["input_tokens"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in events
                   if e["type"] == "content_block_delta") == text
    assert events[-2]["delta"]["stop_reason"] == m["stop_reason"]
    assert events[-2]["usage"] == m["usage"]


def test_a_stop_sequence_is_named(model) -> None:  # noqa: F811
    base = {"max_tokens": 12, "temperature": 0, "messages": USER}
    [(_, whole)] = _post(model, ("/v1/messages", base))
    text = whole["content"][0]["text"]
    stop = text[3:5]
    [(status, m)] = _post(model, ("/v1/messages", {**base, "stop_sequences": [stop]}))
    assert status == 200, m
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop
    assert m["content"][0]["text"] == text[:text.index(stop)]


def test_tool_use_and_results_are_the_chat_messages_they_stand_for(
        model_rendering_tools) -> None:  # noqa: F811
    user, call, answer = HISTORY[0], HISTORY[1]["tool_calls"][0], HISTORY[2]
    turns = [{"role": "user", "content": user["content"]},
             {"role": "assistant", "content": [{
                 "type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])}]},
             {"role": "user", "content": [{"type": "tool_result",
                                           "tool_use_id": answer["tool_call_id"],
                                           "content": answer["content"]}]}]
    tools = [{"name": WEATHER["function"]["name"],
              "description": WEATHER["function"]["description"],
              "input_schema": WEATHER["function"]["parameters"]}]
    [(s1, c), (s2, m)] = _post(
        model_rendering_tools,
        ("/v1/chat/completions", {"messages": HISTORY, "tools": [WEATHER],
                                  "tool_choice": "none", "max_tokens": 2}),
        ("/v1/messages", {"messages": turns, "tools": tools, "tool_choice": {"type": "none"},
                          "max_tokens": 2}))
    assert (s1, s2) == (200, 200), (c, m)
    assert m["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]


def test_a_forced_tool_is_a_tool_use_block(model) -> None:  # noqa: F811
    _constrained()
    body = {"messages": USER, "max_tokens": 40, "temperature": 0,
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    [(status, m), (sstatus, streamed)] = _post(model, ("/v1/messages", body),
                                               ("/v1/messages", {**body, "stream": True}))
    assert (status, sstatus) == (200, 200), m
    (block,) = m["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert isinstance(block["input"]["city"], str) and m["stop_reason"] == "tool_use"
    events = _anthropic_events(streamed)
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta")
    assert json.loads(partial) == block["input"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking", ""),
    ({"tool_choice": {"type": "tool"}}, "tool_choice", "name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0", "image blocks are not served"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, "messages.1.content.0", "document blocks"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "'any' needs tools"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "txt": "x"}]}]},
     "messages.0.content.0.text", "is required"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id", "is required"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
     "messages.0.content.0.y", "valid fields: cache_control, citations, text, type"),
    ({"temperature": -1}, "temperature", ""),
    # Not coerced, as on the chat endpoint: true is not 1, "5" is not 5.
    ({"max_tokens": True}, "max_tokens", ""), ({"max_tokens": "5"}, "max_tokens", ""),
    ({"temperature": "0.5"}, "temperature", ""), ({"top_k": 3.0}, "top_k", ""),
])
def test_misuse_is_a_400_naming_the_messages_field(model, body, param, words) -> None:  # noqa: F811
    [(status, r)] = _post(model, ("/v1/messages", {"messages": USER, "max_tokens": 4,
                                                   **body}))
    assert status == 400, r
    assert r["error"]["param"] is not None and r["error"]["param"].startswith(param), r
    assert words in r["error"]["message"], r


def test_max_tokens_is_required(model) -> None:  # noqa: F811
    [(status, r)] = _post(model, ("/v1/messages", {"messages": USER}))
    assert status == 400 and r["error"]["param"] == "max_tokens", r


def test_a_last_assistant_turn_is_continued(model) -> None:  # noqa: F811
    """Anthropic's prefill: the reply continues the assistant's text, as the chat
    endpoint's continue_final_message does."""
    turns = [*USER, {"role": "assistant", "content": "Sure, the"}]
    [(s1, c), (s2, m)] = _post(
        model,
        ("/v1/chat/completions", {"messages": turns, "max_tokens": 3, "temperature": 0,
                                  "add_generation_prompt": False,
                                  "continue_final_message": True}),
        ("/v1/messages", {"messages": turns, "max_tokens": 3, "temperature": 0}))
    assert (s1, s2) == (200, 200), (c, m)
    assert m["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert m["content"][0]["text"] == c["choices"][0]["message"]["content"]


def test_a_tool_result_in_an_assistant_turn_is_refused(model) -> None:  # noqa: F811
    turns = [*USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "x"}]}]
    [(status, r)] = _post(model, ("/v1/messages", {"messages": turns, "max_tokens": 2}))
    assert status == 400 and r["error"]["param"] == "messages", r
    assert "tool_result" in r["error"]["message"]


def test_errors_come_in_anthropics_shape(model) -> None:  # noqa: F811
    """Anthropic's clients read ``{"type": "error", "error": {"type", "message"}}``; the
    other endpoints keep OpenAI's shape."""
    [(s1, missing), (s2, unknown), (s3, field), (s4, chat)] = _post(
        model, ("/v1/messages", {"messages": USER}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2, "model": "nope"}),
        ("/v1/messages", {"messages": USER, "max_tokens": 2, "n": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "model": "nope"}))
    assert (s1, s2, s3, s4) == (400, 404, 400, 404)
    for body, kind in ((missing, "invalid_request_error"), (unknown, "not_found_error"),
                       (field, "invalid_request_error")):
        assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert "max_tokens" in missing["error"]["message"]
    assert "'n'" in field["error"]["message"] and "stop_sequences" in field["error"]["message"]
    assert "type" not in chat and chat["error"]["type"] == "not_found_error"


def test_count_tokens_is_the_prompt_the_messages_endpoint_runs(
        model_rendering_tools) -> None:  # noqa: F811
    msg = {"system": "be brief", "messages": USER, "max_tokens": 2, "temperature": 0}
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    count = {k: v for k, v in msg.items() if k in ("system", "messages")}
    [(s1, m), (s2, c), (s3, with_tools), (s4, m_tools), (s5, bad)] = _post(
        model_rendering_tools, ("/v1/messages", msg), ("/v1/messages/count_tokens", count),
        ("/v1/messages/count_tokens", {**count, "tools": tools,
                                       "tool_choice": {"type": "none"}}),
        ("/v1/messages", {**msg, "tools": tools, "tool_choice": {"type": "none"}}),
        ("/v1/messages/count_tokens", {**count, "max_tokens": 2}))
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 200, 400), (c, with_tools, bad)
    assert c == {"input_tokens": m["usage"]["input_tokens"]}
    # The tools are rendered by this template: they count.
    assert with_tools["input_tokens"] == m_tools["usage"]["input_tokens"] > c["input_tokens"]
    assert bad["type"] == "error" and "max_tokens" in bad["error"]["message"]


def test_consecutive_turns_of_a_role_are_one_turn(model) -> None:  # noqa: F811
    """Anthropic combines them; the chat messages they become alternate, as templates that
    insist on alternating roles need. A reply's citations and redacted thinking sent back
    are accepted and not rendered."""
    split = [{"role": "user", "content": "what is"},
             {"role": "user", "content": [{"type": "text", "text": "the weather?",
                                           "citations": None}]},
             {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                               {"type": "text", "text": "Sunny"}]},
             {"role": "assistant", "content": "."},
             {"role": "user", "content": "thanks"}]
    chat = [{"role": "user", "content": "what is\nthe weather?"},
            {"role": "assistant", "content": "Sunny\n."}, {"role": "user", "content": "thanks"}]
    [(s1, m), (s2, c)] = _post(
        model, ("/v1/messages", {"messages": split, "max_tokens": 2, "temperature": 0}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 2, "temperature": 0}))
    assert (s1, s2) == (200, 200), (m, c)
    assert m["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    text = "".join(b["text"] for b in m["content"] if b["type"] == "text")
    assert text == (c["choices"][0]["message"]["content"] or "")


def test_a_streamed_call_cut_short_sends_its_arguments_as_generated(model) -> None:  # noqa: F811
    """A forced call that max_tokens cuts off: its partial JSON goes in the input_json_delta
    (Anthropic streams partial JSON as it comes), not an empty object."""
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    body = {"messages": USER, "max_tokens": 4, "temperature": 0, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    [(s1, whole), (s2, streamed)] = _post(model, ("/v1/messages", body),
                                          ("/v1/messages", {**body, "stream": True}))
    assert (s1, s2) == (200, 200)
    assert whole["stop_reason"] == "max_tokens"
    (text,) = [b["text"] for b in whole["content"] if b["type"] == "text"]
    events = _anthropic_events(streamed)
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta")
    assert partial == text and partial.startswith("{")
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
