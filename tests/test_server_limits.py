"""The server's limits (docs/server.md, "Limits"): the API key, the default max_tokens, the
caps on n and temperature, the body-read deadline and the per-request deadline. Each
rejection has its status and the OpenAI error shape, queues nothing or frees what it held,
and the next request is served."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import select
import socket
import threading
import time
import types

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
uvicorn = pytest.importorskip("uvicorn", reason="the server tests need the server extra")

from test_async_engine import all_blocks_free, make_async, wait_until, with_engine
from test_server import events
from test_server import serve as serve_with
from test_server_live import free_port, wait_for

from cadence.cli import main as cli
from cadence.server.app import build_app
from cadence.server.limits import ServerLimits

KEY = "sk-test-0123456789"
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def serve(model: str, body, api_key: str | None = None, slow: bool = False, **limits):
    """Run ``body(client, engine)`` against a fresh app with ``ServerLimits(**limits)``;
    ``slow`` makes each step take >= 10 ms, so a deadline can fall mid-generation."""
    async def run(engine):
        if slow:
            _slow_down(engine)
        app = build_app(engine, "tiny", api_key=api_key, limits=ServerLimits(**limits))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            return await body(client, engine)

    return with_engine(model, run)


def _slow_down(engine) -> None:
    execute = engine.engine.backend.execute

    def slow_execute(mi, post_sample):
        time.sleep(0.01)
        return execute(mi, post_sample)

    engine.engine.backend.execute = slow_execute


def error_of(r, status: int, param: str | None = None) -> dict:
    """The OpenAI error object of ``r``, checked for status, shape and ``param``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    return err


async def served(client) -> None:
    """A normal request still gets its answer."""
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                   "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


# ---- the API key -------------------------------------------------------------------------
ROUTES = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/version", None),
          ("GET", "/openapi.json", None),
          ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})]


def test_api_key_is_required_everywhere_but_health(model):
    async def body(client, engine):
        bad = {"none": {}, "wrong": {"Authorization": f"Bearer {KEY}x"},
               "short": {"Authorization": "Bearer sk"}, "basic": {"Authorization": f"Basic {KEY}"},
               "bare": {"Authorization": KEY}}
        for method, path, req in ROUTES:
            for what, headers in bad.items():
                r = await client.request(method, path, json=req, headers=headers)
                err = error_of(r, 401)
                assert err["type"] == "authentication_error", (path, what, err)
                assert err["code"] == "invalid_api_key"
                assert "Authorization: Bearer" in err["message"]
                assert r.headers["www-authenticate"] == "Bearer"
        assert engine.stats().num_requests_added == 0 and engine.num_pending_requests == 0
        # No key is needed to learn the key is missing: an oversized body gets 401, not 413.
        r = await client.post("/v1/completions", content=b" " * (5 << 20))
        error_of(r, 401)
        assert (await client.get("/health")).status_code == 200
        for method, path, req in ROUTES:
            for scheme in ("Bearer", "bearer"):
                r = await client.request(method, path, json=req,
                                         headers={"Authorization": f"{scheme} {KEY}"})
                assert r.status_code == 200, (path, r.text)
        r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and len(events(r.text)) >= 1

    serve(model, body, api_key=KEY)


def test_anthropic_clients_send_the_key_as_x_api_key(model):
    """Anthropic's SDK sends ``x-api-key``, not a bearer token; a 401 on the Messages
    endpoint comes in Anthropic's error shape."""
    msgs = {"messages": CHAT, "max_tokens": 2}

    async def body(client, engine):
        for path, req in (("/v1/messages", msgs), ("/v1/completions", {"prompt": "x",
                                                                        "max_tokens": 2})):
            r = await client.post(path, json=req, headers={"x-api-key": KEY})
            assert r.status_code == 200, r.text
            r = await client.post(path, json=req, headers={"x-api-key": KEY + "x"})
            assert r.status_code == 401 and "x-api-key" in r.text, r.text
        # A bearer token, when sent, is the one checked.
        r = await client.post("/v1/messages", json=msgs, headers={
            "Authorization": f"Bearer {KEY}x", "x-api-key": KEY})
        assert r.status_code == 401
        r = await client.post("/v1/messages", json=msgs)
        assert r.status_code == 401
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "x-api-key" in body["error"]["message"]
        assert engine.stats().num_requests_added == 2

    serve(model, body, api_key=KEY)


@pytest.mark.parametrize("key", ["", "has space", "naïve", "tab\there"])
def test_api_key_that_cannot_travel_in_a_header_is_refused_at_build(key):
    engine = types.SimpleNamespace(tokenizer=None, max_model_len=256)
    with pytest.raises(ValueError, match="api_key"):
        build_app(engine, "tiny", api_key=key)


# ---- default max_tokens, n, temperature ------------------------------------------------------
def test_default_max_tokens_caps_requests_that_leave_it_out(model):
    async def body(client, engine):
        async def tokens(path: str, req: dict) -> int:
            r = await client.post(path, json={**req, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]

        assert await tokens("/v1/chat/completions", {"messages": CHAT}) == 5
        assert await tokens("/v1/chat/completions", {"messages": CHAT, "max_tokens": None}) == 5
        assert await tokens("/v1/chat/completions", {"messages": CHAT, "max_tokens": 7}) == 7
        # Completions keep OpenAI's 16 when max_tokens is left out; null means the default.
        assert await tokens("/v1/completions", {"prompt": "x"}) == 16
        assert await tokens("/v1/completions", {"prompt": "x", "max_tokens": None}) == 5
        # The rest of the context when that is less (max_model_len is 256).
        assert await tokens("/v1/completions", {"prompt": [5] * 253, "max_tokens": None}) == 3
        # More than the context holds is cut to it, as vLLM's server cuts it.
        r = await client.post("/v1/completions", json={"prompt": [5] * 250, "max_tokens": 7,
                                                       "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"

    serve(model, body, default_max_tokens=5)


def test_default_max_tokens_off_means_the_rest_of_the_context(model):
    async def body(client, engine):
        r = await client.post("/v1/completions", json={
            "prompt": [5] * 250, "max_tokens": None, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6

    serve(model, body, default_max_tokens=None)


def test_n_and_best_of_above_the_cap_are_400(model):
    async def body(client, engine):
        for path, req, param in (
                ("/v1/completions", {"prompt": "x", "n": 5}, "n"),
                ("/v1/completions", {"prompt": "x", "n": 10**9}, "n"),
                ("/v1/completions", {"prompt": "x", "n": 5, "best_of": 5}, "n"),
                ("/v1/completions", {"prompt": "x", "best_of": 5}, "best_of"),
                ("/v1/chat/completions", {"messages": CHAT, "n": 5}, "n")):
            err = error_of(await client.post(path, json={**req, "max_tokens": 2}), 400, param)
            assert f"{param} must be <= 4" in err["message"] and "--max-n" in err["message"]
        assert engine.stats().num_requests_added == 0
        r = await client.post("/v1/completions", json={"prompt": "x", "n": 4, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        await served(client)

    serve(model, body, max_n=4)


@pytest.mark.parametrize("allow", [False, True])
def test_temperature_above_two_needs_the_opt_out(model, allow):
    async def body(client, engine):
        for path, req in (("/v1/completions", {"prompt": "x"}),
                          ("/v1/chat/completions", {"messages": CHAT})):
            r = await client.post(path, json={**req, "temperature": 2.5, "max_tokens": 2})
            if allow:
                assert r.status_code == 200, r.text
            else:
                err = error_of(r, 400, "temperature")
                assert "[0, 2]" in err["message"] and "2.5" in err["message"]
                assert "--allow-any-temperature" in err["message"]
            r = await client.post(path, json={**req, "temperature": 2, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert engine.num_pending_requests == 0
        await served(client)

    serve(model, body, allow_any_temperature=allow)


# ---- the body-read deadline ----------------------------------------------------------------
def test_stalled_or_trickled_body_is_408_and_queues_nothing(model):
    async def stalled():
        yield b'{"prompt": "x",'
        await asyncio.sleep(5)  # cancelled by the deadline long before
        yield b' "max_tokens": 2}'

    async def trickled():
        for part in (b'{"prompt"', b': "x", ', b'"max_tokens"', b': 2', b'}') * 3:
            await asyncio.sleep(0.1)
            yield part

    async def prompt_enough():
        yield b'{"prompt": "x", '
        await asyncio.sleep(0.05)
        yield b'"max_tokens": 2}'

    async def body(client, engine):
        headers = {"content-type": "application/json"}
        for content in (stalled, trickled):
            start = time.monotonic()
            r = await client.post("/v1/completions", content=content(), headers=headers)
            assert time.monotonic() - start < 1.5
            err = error_of(r, 408)
            assert err["type"] == "timeout_error" and err["code"] == "request_body_timeout"
            assert "0.3 s" in err["message"] and "--request-body-timeout" in err["message"]
            assert r.headers["connection"] == "close"
        assert engine.num_pending_requests == 0 and engine.stats().num_requests_added == 0
        r = await client.post("/v1/completions", content=prompt_enough(), headers=headers)
        assert r.status_code == 200, r.text
        await served(client)

    serve(model, body, request_body_timeout=0.3)


@contextlib.contextmanager
def live_server(engine, **limits):
    """``build_app`` with ``ServerLimits(**limits)`` under uvicorn on a free port."""
    port = free_port()
    app = build_app(engine, "tiny", limits=ServerLimits(**limits))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the server to start")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_stalled_body_over_a_socket_gets_408_and_the_connection_closes(model):
    engine = make_async(model)
    with live_server(engine, request_body_timeout=0.3) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n"
                      b'{"prompt": "x",')
            start = time.monotonic()
            reply = b""
            while chunk := s.recv(4096):  # until the server closes the connection
                reply += chunk
            assert time.monotonic() - start < 5
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"--request-body-timeout" in reply
        assert engine.num_pending_requests == 0 and engine.stats().num_requests_added == 0
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200, r.text
    assert not engine.is_running


# ---- the per-request deadline --------------------------------------------------------------
LONG = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}


async def freed(client, engine) -> None:
    """The timed-out request is gone from the engine and holds no KV blocks."""
    await wait_until(lambda: engine.num_pending_requests == 0 and all_blocks_free(engine))
    await served(client)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert stats.finish_reasons.get("abort", 0) >= 1


def test_request_timeout_is_504_and_frees_the_request(model):
    async def body(client, engine):
        for path, req in (("/v1/completions", LONG),
                          ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 200,
                                                    "ignore_eos": True})):
            start = time.monotonic()
            r = await client.post(path, json=req)
            assert time.monotonic() - start < 1.5
            err = error_of(r, 504)
            assert err["type"] == "timeout_error" and err["code"] == "request_timeout"
            assert "0.4 s" in err["message"] and "--request-timeout" in err["message"]
            await freed(client, engine)

    serve(model, body, slow=True, request_timeout=0.4)


def test_request_timeout_ends_a_stream_with_an_error_event(model):
    async def body(client, engine):
        for path, req in (("/v1/completions", LONG),
                          ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 200,
                                                    "ignore_eos": True})):
            r = await client.post(path, json={**req, "stream": True, "n": 2})
            assert r.status_code == 200
            chunks = events(r.text)  # ends with [DONE]
            err = chunks[-1]["error"]
            assert err["type"] == "timeout_error" and err["code"] == "request_timeout"
            assert "--request-timeout" in err["message"]
            assert all("error" not in c for c in chunks[:-1]) and len(chunks) > 1
            await freed(client, engine)

    serve(model, body, slow=True, request_timeout=0.4)


# ---- the command line ---------------------------------------------------------------------
def test_serve_flags_reach_the_app_and_uvicorn(monkeypatch):
    from cadence.async_engine import AsyncLLM

    started = []
    fake = types.SimpleNamespace(tokenizer=None, max_model_len=256, generation_defaults=())
    monkeypatch.setattr(AsyncLLM, "from_engine_args",
                        classmethod(lambda cls, *a, **kw: started.append(1) or fake))
    runs: list[tuple] = []
    import cadence.cli.serve

    monkeypatch.setattr(cadence.cli.serve, "serve_app",
                        lambda app, sock, msg, **kw: runs.append((app, kw)))
    monkeypatch.setenv("CADENCE_API_KEY", "from-env")
    base = ["serve", "--served-model-name", "tiny", "--log-level", "warning", "--port", "0"]
    assert cli.main(base + ["--timeout-keep-alive", "7"]) == 0
    assert cli.main(base + ["--api-key", "from-flag"]) == 0
    assert runs[0][1]["timeout_keep_alive"] == 7 and runs[1][1]["timeout_keep_alive"] == 5

    async def status(app, key: str) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            return r.status_code

    assert asyncio.run(status(runs[0][0], "from-env")) == 200
    assert asyncio.run(status(runs[1][0], "from-flag")) == 200
    assert asyncio.run(status(runs[1][0], "from-env")) == 401
    # Bad limits are refused before the model loads.
    for bad in (["--max-n", "0"], ["--request-body-timeout", "-1"], ["--api-key", "a b"],
                ["--default-max-tokens", "-3"], ["--timeout-keep-alive", "-1"]):
        assert cli.main(base + bad) == 2, bad
    assert len(started) == 2


# ---- slow headers ---------------------------------------------------------------------------
@contextlib.contextmanager
def bare_server(header_timeout: float):
    """A trivial app under uvicorn with the header deadline (no engine needed)."""
    from cadence.server.connections import header_timeout_protocol

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=30,
                                           http=header_timeout_protocol(header_timeout)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the server to start")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    start, reply = time.monotonic(), b""
    while chunk := s.recv(4096):
        reply += chunk
    return reply, time.monotonic() - start


def test_a_connection_that_never_sends_its_headers_gets_408_and_is_closed():
    with bare_server(0.3) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            reply, waited = _read_until_closed(s)  # sends nothing at all
        assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply, reply
        assert waited < 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            # Headers that never end, a byte every 50 ms: each byte would reset uvicorn's
            # keep-alive timer, and must not move this deadline.
            s.sendall(b"GET / HTTP/1.1\r\n")
            start, reply = time.monotonic(), b""
            for byte in itertools.cycle(b"X-Padding: aaaa\r\n"):
                if select.select([s], [], [], 0.05)[0]:
                    reply, _ = _read_until_closed(s)
                    break
                s.sendall(bytes([byte]))
                assert time.monotonic() - start < 5, "still open after 5 s"
        assert reply.startswith(b"HTTP/1.1 408"), reply


def test_the_header_deadline_spares_prompt_clients_and_restarts_after_each_response():
    with bare_server(0.5) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            for _ in range(2):  # two requests on one keep-alive connection, each in time
                time.sleep(0.3)
                s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                reply = b""
                while not reply.endswith(b"ok"):
                    reply += s.recv(4096)
                assert reply.startswith(b"HTTP/1.1 200"), reply
            reply, waited = _read_until_closed(s)  # then silence: the deadline again
        assert reply.startswith(b"HTTP/1.1 408") and waited < 5, reply


def test_header_timeout_flag_is_checked_and_reaches_uvicorn(monkeypatch):
    from cadence.async_engine import AsyncLLM

    fake = types.SimpleNamespace(tokenizer=None, max_model_len=256, generation_defaults=())
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, *a, **kw: fake))
    runs: list[dict] = []
    import cadence.cli.serve

    monkeypatch.setattr(cadence.cli.serve, "serve_app",
                        lambda app, sock, msg, **kw: runs.append(kw))
    base = ["serve", "--served-model-name", "tiny", "--log-level", "warning", "--port", "0"]
    assert cli.main(base) == 0
    assert cli.main(base + ["--header-timeout", "0"]) == 0
    assert runs[0]["http"].__name__ == "HeaderTimeoutProtocol" and "http" not in runs[1]
    with pytest.raises(ValueError, match="--header-timeout must be >= 0"):
        cadence.cli.serve.cmd_serve(cli.build_parser().parse_args(base + ["--header-timeout",
                                                                          "-1"]))


def test_more_prompts_than_the_server_takes_at_once_is_a_400(model):
    """A 429 would ask for a retry that can never succeed: the body's own prompts are what
    fills --max-pending-requests."""
    async def body(client, engine):
        too_many = await client.post("/v1/completions", json={
            "prompt": ["a b"] * 3, "max_tokens": 2})
        assert not engine.engine.has_unfinished_requests()
        fits = await client.post("/v1/completions", json={"prompt": ["a b"] * 2,
                                                          "max_tokens": 2})
        return too_many, fits

    too_many, fits = serve_with(model, body, max_pending_requests=2)
    assert too_many.status_code == 400, too_many.text
    err = too_many.json()["error"]
    assert err["param"] == "prompt" and "at most 2" in err["message"], err
    assert fits.status_code == 200, fits.text


def test_a_fault_while_streaming_ends_the_stream_with_an_error_event(model, monkeypatch):
    """Not a connection cut mid-chunk: an error event and [DONE]; and a fault outside a
    stream is a 500 in the error shape, not plain text."""
    from cadence.server import formats

    def broken(*args, **kwargs):
        raise TypeError("a fault of ours")

    monkeypatch.setattr(formats, "completion_choice_of", broken)

    async def run(engine):
        # Starlette answers the 500, then raises the fault again for the server to log:
        # a real server logs it; this client must not raise it.
        transport = httpx.ASGITransport(app=build_app(engine, "tiny"),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            streamed = await client.post("/v1/completions", json={
                "prompt": "a b", "max_tokens": 3, "stream": True})
            whole = await client.post("/v1/completions", json={"prompt": "a b",
                                                                "max_tokens": 3})
        await wait_until(lambda: not engine.engine.has_unfinished_requests())
        assert all_blocks_free(engine)
        return streamed, whole

    streamed, whole = with_engine(model, run)
    assert streamed.status_code == 200
    assert "a fault of ours" in events(streamed.text)[-1]["error"]["message"]
    assert whole.status_code == 500 and "a fault of ours" in whole.json()["error"]["message"]
