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
                replies.append((r.status_code, r.text if body.get("stream") else r.json()))
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
    ({"max_output_tokens": 10**6}, "max_output_tokens", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"temperature": -1}, "temperature", ""),
    ({"input": []}, "input", ""),
    ({"text": {"format": {"type": "json_schema"}}}, "text", "needs a schema"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"frequency_penalty": 1}, "frequency_penalty", ""),
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
        assert got[-1]["response"]["status"] == "failed"
        await freed(client, engine)

    serve_limited(model, body, slow=True, request_timeout=0.4)
