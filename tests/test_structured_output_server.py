"""Structured output through the OpenAI-compatible server: the ``openai`` client's
``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and older
``guided_*`` fields, all on both endpoints; a schema that does not parse is a 400 naming the
problem, and the requests beside it finish with nothing held."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")
pytest.importorskip("fastapi", reason="the server tests need the server extra")
pytest.importorskip("xgrammar")

from test_async_engine import all_blocks_free, wait_until, with_engine

from cadence.server.app import build_app

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                         "temp": {"type": "integer", "minimum": -30, "maximum": 45}},
          "required": ["city", "temp"]}


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def test_openai_client_response_format_and_vllm_fields(model):
    async def run(engine):
        app = build_app(engine, "tiny")
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=60)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                    http_client=http, max_retries=0)
        msgs = [{"role": "user", "content": "weather?"}]
        schema_fmt = {"type": "json_schema",
                      "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
        chats = await asyncio.gather(*[client.chat.completions.create(
            model="tiny", messages=msgs, response_format=schema_fmt, temperature=1.0,
            seed=i, max_tokens=60, n=2) for i in range(6)])
        # response_format allows any whitespace between JSON tokens (as vLLM does), which a
        # random model may keep choosing until max_tokens; every finished one must validate.
        finished = [c for chat in chats for c in chat.choices if c.finish_reason == "stop"]
        assert len(finished) >= 3
        for choice in finished:
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        obj = await client.chat.completions.create(
            model="tiny", messages=msgs, response_format={"type": "json_object"},
            max_tokens=60, temperature=0.0, extra_body={"structured_outputs": None})
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        comp = await client.completions.create(
            model="tiny", prompt="pick", max_tokens=20, temperature=1.0, n=3,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
        assert {c.text for c in comp.choices} <= {"red", "green", "blue"}
        comp = await client.completions.create(
            model="tiny", prompt="code", max_tokens=20, temperature=1.0,
            extra_body={"guided_regex": r"[A-Z]{2}\d{2}"})
        assert re.fullmatch(r"[A-Z]{2}\d{2}", comp.choices[0].text)
        comp = await client.completions.create(
            model="tiny", prompt="code", max_tokens=20, temperature=1.0,
            extra_body={"guided_grammar": 'root ::= "a" | "b" "c"'})
        assert comp.choices[0].text in ("a", "bc")
        # response_format on completions, as vLLM takes it (the SDK passes it in extra_body).
        comp = await client.completions.create(
            model="tiny", prompt="weather", max_tokens=60, temperature=1.0, n=4, seed=3,
            extra_body={"response_format": schema_fmt})
        finished = [c for c in comp.choices if c.finish_reason == "stop"]
        assert finished
        for choice in finished:
            jsonschema.validate(json.loads(choice.text), SCHEMA)

        # A bad schema is a 400 naming the problem, while another request runs.
        slow = asyncio.ensure_future(client.completions.create(
            model="tiny", prompt="one two", max_tokens=30, temperature=1.0,
            extra_body={"structured_outputs": {"json": SCHEMA,
                                               "disable_any_whitespace": True}}))
        bad = {"type": "json_schema", "json_schema": {"name": "x",
                                                      "schema": {"type": "objectx"}}}
        with pytest.raises(openai.BadRequestError, match="objectx"):
            await client.chat.completions.create(model="tiny", messages=msgs,
                                                 response_format=bad)
        for body, needle in [
            ({"response_format": {"type": "yaml"}}, "json_schema"),
            ({"response_format": {"type": "json_schema"}}, "schema"),
            ({"guided_regex": "(a", "extra": 1}, "extra"),
            ({"guided_regex": "(a"}, "parenthesis"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "only one"),
            ({"structured_outputs": {"regexp": "a"}}, "unknown fields"),
        ]:
            for path, prompt in (("/v1/chat/completions", {"messages": msgs}),
                                 ("/v1/completions", {"prompt": "p"})):
                r = await http.post(path, json={**prompt, "max_tokens": 5, **body})
                assert r.status_code == 400, (path, body, r.text)
                assert needle in r.json()["error"]["message"], r.text
        done = await slow
        jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
        await wait_until(lambda: all_blocks_free(engine))
        await http.aclose()

    with_engine(model, run)
