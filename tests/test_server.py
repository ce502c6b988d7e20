"""The OpenAI-compatible server: responses equal LLM.generate, streams concatenate to the
whole response, errors carry the right status and name the field, rejected or abandoned
requests hold no KV blocks, and /metrics reports what happened."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from engine_helpers import generate, make_llm  # noqa: E402
from test_async_engine import all_blocks_free, wait_until, with_engine  # noqa: E402

from cadence import SamplingParams  # noqa: E402
from cadence.server.app import build_app  # noqa: E402

PROMPTS = ["the quick brown fox", "a small bird sings", "hello there"]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def serve(model: str, body, **kw):
    """Run ``body(client, engine)`` against a fresh app; always shut the engine down."""
    limits = {k: kw.pop(k) for k in ("max_request_bytes", "max_logprobs") if k in kw}

    async def run(engine):
        app = build_app(engine, "tiny", **limits)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            return await body(client, engine)

    return with_engine(model, run, **kw)


def events(text: str) -> list:
    """The JSON payloads of a server-sent-event body; asserts it ends with [DONE]."""
    datas = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert datas and datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def test_completions_equal_offline_generate(model):
    llm = make_llm(model)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    want = generate(llm, PROMPTS, params)
    llm.shutdown()

    async def body(client, engine):
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPTS, "max_tokens": 20, "temperature": 0,
            "logprobs": 2})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "text_completion" and got["model"] == "tiny"
        assert [c["index"] for c in got["choices"]] == [0, 1, 2]
        for choice, ref in zip(got["choices"], want):
            c = ref.outputs[0]
            assert choice["text"] == c.text
            assert choice["finish_reason"] == c.finish_reason
            lp = choice["logprobs"]
            assert lp["token_logprobs"] == pytest.approx(
                [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])
            assert len(lp["tokens"]) == len(c.token_ids) == len(lp["top_logprobs"])
            assert all(len(top) <= 3 for top in lp["top_logprobs"])
        usage = got["usage"]
        assert usage["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
        assert usage["completion_tokens"] == sum(len(o.outputs[0].token_ids) for o in want)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    serve(model, body)


def test_streamed_completion_equals_whole_response(model):
    request = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0.8, "seed": 3,
               "n": 2, "stop": [" the", "ab"], "logprobs": 1}

    async def body(client, engine):
        whole = (await client.post("/v1/completions", json=request)).json()
        r = await client.post("/v1/completions", json={
            **request, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r.text)
        assert len({c["id"] for c in chunks}) == 1
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage == whole["usage"]
        for choice in whole["choices"]:
            mine = [c for ch in chunks[:-1] for c in ch["choices"]
                    if c["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
            assert all(c["finish_reason"] is None for c in mine[:-1])
            assert mine[-1]["stop_reason"] == choice["stop_reason"]
            tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
            assert tokens == choice["logprobs"]["tokens"]
            offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
            assert offsets == choice["logprobs"]["text_offset"]
        # A stop string never shows up in the text, streamed or not.
        assert all(" the" not in c["text"] and "ab" not in c["text"]
                   for c in whole["choices"])
        # vLLM's continuous_usage_stats, for both endpoints.
        for path, extra in (("/v1/completions", {}),
                            ("/v1/chat/completions", {"messages": [
                                {"role": "user", "content": PROMPTS[0]}]})):
            streamed = {**request, **extra, "stream": True, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}}
            if "messages" in streamed:
                streamed.pop("prompt"), streamed.pop("logprobs")
            # Each chunk counts its own choice's tokens so far (vLLM's); the last count of
            # every choice adds up to the whole response's.
            for extra_n in ({}, {"n": 2, "seed": 3, "temperature": 1.0}):
                chunks = events((await client.post(path, json={**streamed, **extra_n})).text)
                last: dict[int, int] = {}
                for c in chunks:
                    if c["choices"] and "usage" in c:
                        index, n = c["choices"][0]["index"], c["usage"]["completion_tokens"]
                        assert n >= last.get(index, 0)
                        last[index] = n
                assert last and sum(last.values()) == chunks[-1]["usage"]["completion_tokens"]

    serve(model, body)


def test_chat_completions(model):
    llm = make_llm(model)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    flat = [messages[0], {"role": "user", "content": "hello there"}]
    text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    want = generate(llm, [{"prompt_token_ids": ids}],
                    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))[0].outputs[0]
    llm.shutdown()

    async def body(client, engine):
        req = {"messages": messages, "max_completion_tokens": 12, "temperature": 0,
               "logprobs": True, "top_logprobs": 2}
        r = await client.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "chat.completion"
        choice = got["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want.text}
        content = choice["logprobs"]["content"]
        assert [e["logprob"] for e in content] == pytest.approx(
            [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)])
        assert all(len(e["top_logprobs"]) == 2 for e in content)
        assert all(e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
                   for e in content)
        assert got["usage"]["prompt_tokens"] == len(ids)

        r = await client.post("/v1/chat/completions", json={**req, "stream": True})
        chunks = events(r.text)
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [c["choices"][0] for c in chunks[1:]]
        assert "".join(d["delta"].get("content", "") for d in deltas) == want.text
        assert deltas[-1]["finish_reason"] == want.finish_reason
        assert [e["token"] for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]] \
            == [e["token"] for e in content]

    serve(model, body)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, 400, "max_token", "valid fields"),
    ("/v1/completions", {"prompt": [[5] * 300]}, 400, "prompt", "maximum context length"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt", "prompt_token_ids must be in"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "echo=true"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "prompt_logprobs", "stream=true"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "must equal n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", ">= 1"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "prompt is required"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream=true"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400,
     "messages.0.role", "at least 1 character"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools.0.function",
     "is required"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature",
     "valid number"),
    ("/v1/completions", {"prompt": "x", "top_k": 10**20}, 400, "top_k",
     "top_k must be <= the vocabulary size"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2, "stop_token_ids": [10**6]}, 400,
     "stop_token_ids", "stop_token_ids must be in"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, 400, "priority",
     "needs the priority scheduling policy"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "priority": -1}, 400, "priority", "scheduling policy"),
    ("/v1/completions", {"prompt": [3, 4.5]}, 400, "prompt", "list[int]"),
    # Inside a union the value's own shape decides what is named: a list of parts is not
    # told it should have been a string.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages.0.content.0.text", "is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content", "one of: str, list[ContentPart | RefusalPart]"),
]


def test_bad_requests_get_clear_errors_and_queue_nothing(model):
    async def body(client, engine):
        for path, req, status, param, words in BAD_REQUESTS:
            r = await client.post(path, json=req)
            assert r.status_code == status, (req, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (req, err)
            assert words in err["message"], (req, err)
        r = await client.post("/v1/completions", content=b"{oops",
                              headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        for raw, words in ((b'{"prompt": "a \\ud800 b"}', "valid Unicode"),
                           (b'{"prompt": "\xff\xfe"}', "not valid JSON")):
            r = await client.post("/v1/completions", content=raw,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.status_code, r.text)
            assert "error" in r.json(), (raw, r.text)
            assert words in r.json()["error"]["message"], (raw, r.text)
        r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and "at most 4096" in r.json()["error"]["message"]

        async def chunked():  # no Content-Length: the limit must still hold
            for _ in range(10):
                yield b" " * 1000

        r = await client.post("/v1/completions", content=chunked(),
                              headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert engine.num_pending_requests == 0 and all_blocks_free(engine)
        assert engine.stats().num_requests_added == 0
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

    serve(model, body, max_request_bytes=4096)


def test_engine_field_names_become_the_body_fields():
    # The engine names fields as the Python API does; chat's body calls some differently.
    from cadence.server.chat_protocol import ChatCompletionRequest
    from cadence.server.protocol import CompletionRequest

    names = ("prompt", "max_tokens", "logprobs", "top_k")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert [chat.body_field(n) for n in names] == \
        ["messages", "max_tokens", "top_logprobs", "top_k"]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 max_completion_tokens=3)
    assert chat.body_field("max_tokens") == "max_completion_tokens"
    assert [CompletionRequest(prompt="x").body_field(n) for n in names] == list(names)


UNREADABLE_BODIES = [  # (body, content type, words the message must hold)
    (b"", "application/json", "no body"),
    (b"[]", "application/json", "JSON object with the request's fields, got an array"),
    # Media types are case-insensitive: this one is JSON, and the array is the problem.
    (b"[]", "Application/JSON", "JSON object with the request's fields, got an array"),
    (b"null", "application/json", "JSON object with the request's fields, got null"),
    (b'"x"', "application/json", "JSON object with the request's fields, got a string"),
    (b'{"prompt": "x"}', "text/plain",
     "'Content-Type: application/json', got 'Content-Type: text/plain'"),
    (b'{"prompt": "x"}', "application/x-www-form-urlencoded", "'Content-Type: application/json'"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", "nested too deeply"),
    (b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}", "application/json", "4300 digits"),
    (b'{"prompt": "caf\xe9"}', "application/json", "not UTF-8"),
]


def test_bodies_that_are_no_request_object_say_why(model):
    async def body(client, engine):
        for raw, content_type, words in UNREADABLE_BODIES:
            r = await client.post("/v1/completions", content=raw,
                                  headers={"content-type": content_type})
            assert r.status_code == 400, (raw[:40], r.text)
            error = r.json()["error"]
            assert words in error["message"], (raw[:40], error)
            assert error["type"] == "invalid_request_error"
        assert engine.stats().num_requests_added == 0

    serve(model, body)


def test_overload_is_429_and_the_admitted_requests_finish(model):
    async def body(client, engine):
        long = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        first = [asyncio.ensure_future(client.post("/v1/completions", json=long))
                 for _ in range(2)]
        await wait_until(lambda: engine.num_pending_requests == 2)
        r = await client.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "max_pending_requests=2" in r.json()["error"]["message"]
        for resp in await asyncio.gather(*first):
            assert resp.status_code == 200
            assert resp.json()["usage"]["completion_tokens"] == 60
        assert all_blocks_free(engine)

    serve(model, body, max_pending_requests=2)


def test_models_health_and_metrics(model):
    async def body(client, engine):
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
        assert (await client.get("/health")).status_code == 200
        for stop in (None, ["zzz"]):
            r = await client.post("/v1/completions", json={
                "prompt": PROMPTS, "max_tokens": 5, "ignore_eos": True, "stop": stop})
            assert r.status_code == 200
        text = (await client.get("/metrics")).text

        def value(name: str, labels: str = 'backend="cpu",engine="0",model_name="tiny"') -> float:
            m = re.search(rf"^vllm:{name}{{{re.escape(labels)}}} (\S+)$", text, re.M)
            assert m, name
            return float(m.group(1))

        assert value("generation_tokens_total") == 2 * 3 * 5
        assert value("request_success_total",
                     'backend="cpu",engine="0",finished_reason="length",model_name="tiny"') == 6
        assert value("time_to_first_token_seconds_count") == 6
        assert value("e2e_request_latency_seconds_bucket",
                     'backend="cpu",engine="0",le="+Inf",model_name="tiny"') == 6
        assert value("num_requests_running") == 0
        assert "# TYPE vllm:time_to_first_token_seconds histogram" in text

    serve(model, body)
