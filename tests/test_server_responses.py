"""OpenAI's Responses API (core/server/responses.py): the same conversation as the chat
endpoint's, reshaped into a ``response`` object or the Responses event stream; input items
(messages, earlier calls and their outputs) rendered as the chat messages they stand for;
tool calls as ``function_call`` items; misuse a 400 naming the Responses field."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from test_async_engine import with_engine
from test_server_tools import (  # noqa: F401  (fixtures)
    HISTORY,
    USER,
    WEATHER,
    _constrained,
    model,
    model_rendering_tools,
)

from cadence.server.app import build_app


def _post(model_dir: str, *requests: tuple[str, dict]) -> list:
    async def run(engine):
        app = build_app(engine, "tiny")
        replies = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            for path, body in requests:
                r = await client.post(path, json=body)
                replies.append((r.status_code, r.text if body.get("stream") is True
                                else r.json()))
        assert not engine.engine.has_unfinished_requests()
        return replies

    return with_engine(model_dir, run)


def _events(text: str) -> list[dict]:
    """(type, payload) of each server-sent event; each ``event:`` line names its payload."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        payload = json.loads(lines["data"])
        assert payload["type"] == lines["event"]
        out.append(payload)
    return out


def test_a_response_is_the_chat_reply_reshaped(model) -> None:  # noqa: F811
    sampling = {"temperature": 0, "seed": 3}
    chat = {"messages": [{"role": "system", "content": "be brief"}, *USER], "max_tokens": 6,
            **sampling}
    resp = {"instructions": "be brief", "input": USER[0]["content"], "max_output_tokens": 6,
            **sampling}
    [(s1, c), (s2, r), (s3, streamed)] = _post(
        model, ("/v1/chat/completions", chat), ("/v1/responses", resp),
        ("/v1/responses", {**resp, "stream": True}))
    assert (s1, s2, s3) == (200, 200, 200), (c, r)
    text = c["choices"][0]["message"]["content"]
    assert r["object"] == "response" and r["id"].startswith("resp_")
    (item,) = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": text, "annotations": []}]
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["usage"]["output_tokens"] == c["usage"]["completion_tokens"]
    assert r["usage"]["total_tokens"] == c["usage"]["total_tokens"]
    if c["choices"][0]["finish_reason"] == "length":
        assert r["status"] == "incomplete"
        assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert r["status"] == "completed" and r["incomplete_details"] is None

    events = _events(streamed)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if r["status"] == "completed"
                          else "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == text
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"] == r["usage"]


def test_input_items_are_the_chat_messages_they_stand_for(model_rendering_tools) -> None:  # noqa: F811
    """A message list with an earlier call and its output renders as the chat endpoint's
    messages do (the prompt's token count shows it)."""
    user, call, answer = HISTORY[0], HISTORY[1]["tool_calls"][0], HISTORY[2]
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": user["content"]}]},
             {"type": "function_call", "call_id": call["id"],
              "name": call["function"]["name"], "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": answer["tool_call_id"],
              "output": answer["content"]}]
    tools = [{"type": "function", **WEATHER["function"]}]
    [(s1, c), (s2, r)] = _post(
        model_rendering_tools,
        ("/v1/chat/completions", {"messages": HISTORY, "tools": [WEATHER],
                                  "tool_choice": "none", "max_tokens": 2}),
        ("/v1/responses", {"input": items, "tools": tools, "tool_choice": "none",
                           "max_output_tokens": 2}))
    assert (s1, s2) == (200, 200), (c, r)
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["tools"] == tools and r["tool_choice"] == "none"


def test_a_forced_call_is_a_function_call_item(model) -> None:  # noqa: F811
    _constrained()
    body = {"input": USER[0]["content"], "max_output_tokens": 40, "temperature": 0,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    [(status, r), (sstatus, streamed)] = _post(model, ("/v1/responses", body),
                                               ("/v1/responses", {**body, "stream": True}))
    assert (status, sstatus) == (200, 200), r
    (item,) = r["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert "city" in json.loads(item["arguments"]) and item["call_id"]
    events = _events(streamed)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(d["type"], d["name"], d["arguments"]) for d in done] == \
        [("function_call", "get_weather", item["arguments"])]
    assert events[-1]["type"] == "response.completed"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps none"),
    ({"reasoning": {"effort": "low"}}, "reasoning", ""),
    # The chat endpoint's message, in this body's words.
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"temperature": -1}, "temperature", ""),
    ({"input": []}, "input", ""),
    ({"text": {"format": {"type": "json_schema"}}}, "text", "needs a schema"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"frequency_penalty": 1}, "frequency_penalty", ""),
    # Inside an item: the branch the client meant (by its type), not the first one tried.
    ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input.0.content",
     "one of: str, list"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text", "is required"),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "f"}]},
     "input.0.arguments", "is required"),
    ({"input": [{"type": "weird"}]}, "input.0.type", "'message', 'function_call'"),
    ({"input": [{"type": "function_call_output", "call_id": "a", "output": "x", "y": 1}]},
     "input.0.y", "valid fields: call_id, id, output, status, type"),
])
def test_misuse_is_a_400_naming_the_responses_field(model, body, param, words) -> None:  # noqa: F811
    [(status, r)] = _post(model, ("/v1/responses", {"input": "hi", **body}))
    assert status == 400, r
    assert r["error"]["param"] is not None and r["error"]["param"].startswith(param), r
    assert words in r["error"]["message"], r


def test_a_deadline_mid_stream_ends_it_with_an_error_and_response_failed(model) -> None:  # noqa: F811
    from test_server_limits import freed
    from test_server_limits import serve as serve_limited

    async def body(client, engine):
        r = await client.post("/v1/responses", json={
            "input": "hello there", "max_output_tokens": 200, "stream": True,
            "temperature": 0})  # greedy: the same tokens, no EOS, every run
        assert r.status_code == 200
        got = _events(r.text)
        assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
        assert got[-2]["code"] == "request_timeout"
        failed = got[-1]["response"]
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "request_timeout" and failed["error"]["message"]
        await freed(client, engine)

    serve_limited(model, body, slow=True, request_timeout=0.4)


def test_calls_in_a_row_and_reasoning_sent_back_render_as_one_turn(
        model_rendering_tools) -> None:  # noqa: F811
    """Three calls after a reply's text are that one assistant message's text and calls,
    and an earlier reply's reasoning item, sent back with its output, is dropped."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
             for i, c in enumerate(("Paris", "Rome", "Oslo"))]
    chat = [USER[0], {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            *[{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]]
    items = [{"type": "message", "role": "user", "content": USER[0]["content"]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "they want weather"}]},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Let me look.", "annotations": [],
                  "logprobs": []}]},
             *[{"type": "function_call", "call_id": c["id"], "name": "get_weather",
                "arguments": c["function"]["arguments"]} for c in calls],
             *[{"type": "function_call_output", "call_id": c["id"], "output": "sunny"}
               for c in calls]]
    [(s1, c), (s2, r)] = _post(
        model_rendering_tools,
        ("/v1/chat/completions", {"messages": chat, "tools": [WEATHER], "tool_choice": "none",
                                  "max_tokens": 2}),
        ("/v1/responses", {"input": items, "tools": [{"type": "function",
                                                      **WEATHER["function"]}],
                           "tool_choice": "none", "max_output_tokens": 2}))
    assert (s1, s2) == (200, 200), (c, r)
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": True}, "max_output_tokens"), ({"max_output_tokens": "5"},
                                                          "max_output_tokens"),
    ({"temperature": "0.5"}, "temperature"), ({"stream": "yes"}, "stream"),
    ({"top_k": 3.0}, "top_k"),
])
def test_values_are_not_coerced(model, body, param) -> None:  # noqa: F811
    """As on the chat endpoint: true is not 1, "5" is not 5, "yes" is not true."""
    [(status, r)] = _post(model, ("/v1/responses", {"input": "hi", **body}))
    assert status == 400 and r["error"]["param"] == param, r


def test_streamed_reasoning_is_its_own_item_with_deltas() -> None:
    """The chat stream's reasoning_content becomes a reasoning item streamed as
    reasoning_text deltas, finished when the answer starts; usage counts its tokens."""
    import asyncio

    from cadence.server.chat_shaped import ReplyContext
    from cadence.server.responses import response_events
    from cadence.server.responses_protocol import ResponsesRequest

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
        body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            body = {"choices": [], "usage": usage}
        return body

    async def chat_chunks():
        for piece in ("think", "ing"):
            yield chunk({"reasoning_content": piece})
        for piece in ("Hel", "lo"):
            yield chunk({"content": piece})
        yield chunk({}, "stop")
        yield chunk({}, usage={"prompt_tokens": 5, "completion_tokens": 4,
                               "total_tokens": 9})

    async def run():
        req = ResponsesRequest(input="hi")
        ctx = ReplyContext("m", 5, lambda text: len(text) // 4)
        return [e async for e in response_events(chat_chunks(), req, ctx)]

    events = _events("".join(asyncio.run(run())))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "thinking"
    assert final["output"][1]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert {e["output_index"] for e in events if "reasoning" in e["type"]} == {0}
