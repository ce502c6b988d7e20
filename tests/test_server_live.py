"""The server over real sockets: a client that hangs up mid-stream aborts its request, and
``engine serve`` starts, answers like LLM.generate and shuts down cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
uvicorn = pytest.importorskip("uvicorn", reason="the server tests need the server extra")

from engine_helpers import generate, make_llm  # noqa: E402
from test_async_engine import all_blocks_free, make_async  # noqa: E402

from cadence import SamplingParams  # noqa: E402
from cadence.server.app import build_app  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@contextlib.contextmanager
def live_server(engine):
    """Serve ``engine`` with uvicorn on a free port in a thread; yield the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the server to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_client_disconnect_aborts_the_request(model):
    engine = make_async(model)
    execute = engine.engine.backend.execute

    def slow_execute(mi, post_sample):  # >= 2.5 s for 250 tokens, whatever the machine
        time.sleep(0.01)
        return execute(mi, post_sample)

    engine.engine.backend.execute = slow_execute
    with live_server(engine) as base:
        url = f"{base}/v1/completions"
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        received = 0
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        received += 1
                        if received == 3:
                            break  # hang up mid-stream
        wait_for(lambda: engine.stats().finish_reasons.get("abort") == 1, 30, "the abort")
        wait_for(lambda: all_blocks_free(engine), 30, "the blocks to be freed")
        assert engine.num_pending_requests == 0
        assert engine.stats().num_generation_tokens < 200
        # A non-streamed request whose client gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={**body, "stream": False, "max_tokens": 250}, timeout=1.0)
        wait_for(lambda: engine.stats().finish_reasons.get("abort") == 2, 30, "the 2nd abort")
        wait_for(lambda: all_blocks_free(engine), 30, "the blocks to be freed")
        assert engine.stats().num_generation_tokens < 450
        # Others are still served.
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert not engine.is_running, "the app's shutdown stops the engine"


@pytest.mark.slow
def test_engine_serve_command(model, tmp_path):
    """The CLI end to end, with the CPU backend's default (process) overlap strategy."""
    llm = make_llm(model)
    want = generate(llm, ["the quick brown fox"],
                    SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    llm.shutdown()
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cadence.cli.main", "serve", "--model", model,
         "--max-model-len", "256", "--port", str(port), "--served-model-name", "tiny",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, _read(log)
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 180, "engine serve to answer /health")
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "the quick brown fox", "max_tokens": 16,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
        datas = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert datas[-1] == "[DONE]" and json.loads(datas[-2])["choices"][0]["finish_reason"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, _read(log)


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-3000:]


def test_the_official_openai_client_works(model):
    """The openai SDK against a live server: completions, chat, streaming, errors."""
    openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")
    engine = make_async(model, max_pending_requests=64)
    with live_server(engine) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        whole = client.completions.create(model="tiny", prompt="the quick brown fox",
                                          max_tokens=10, temperature=0, seed=1)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 10
        streamed = client.completions.create(model="tiny", prompt="the quick brown fox",
                                             max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == \
            whole.choices[0].text
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=2)
        assert chat.choices[0].message.role == "assistant"
        assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
        pieces = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(pieces)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.completions.create(model="tiny", prompt="x", temperature=-1)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="x")
