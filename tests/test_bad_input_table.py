"""The bad-input table (tests/bad_input_cases.py) walked through the Python API and over HTTP.

Each bad case must end in a ValueError (Python) or a 400 in OpenAI's error shape (HTTP) whose
message names the field, and so does its ``param`` (the body's ``param``; a ``FieldError``'s
from ``add_request``), with nothing left queued and every KV block free; each served case
must run to its end. After every case a greedy request must give exactly the output it gave
before the table: no refused request changes what a later one gets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest
from bad_input_cases import (
    BOTH,
    CASES,
    CHAT,
    GENERATE,
    HTTP,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    MAX_NUM_SAMPLES,
    MAX_TOKENS,
    OMIT,
    PYTHON,
    SERVED,
    SURFACES,
    Case,
    resolve,
)
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.output_state import OutputKind
from cadence.sampling_params import FieldError

REFERENCE_PROMPT = "the quick brown fox"
REFERENCE_TOKENS = 8
# Fields whose Python errors carry no ``param``: StructuredOutputsParams checks its own.
_NO_PARAM = {"structured_outputs"}


def _cases(*surfaces: str) -> list:
    return [pytest.param(c, id=c.id) for c in CASES if c.on in surfaces]


def test_the_table_has_at_least_100_cases():
    assert len(CASES) >= 100, len(CASES)
    ids = Counter(c.id for c in CASES)
    assert not [i for i, k in ids.items() if k > 1], "case ids must be unique"
    assert all(c.on in SURFACES and isinstance(c.expect, str) and c.expect for c in CASES)
    by_surface = Counter(c.on for c in CASES)
    # The two surfaces share most of the table; each also has cases of its own.
    assert by_surface[BOTH] >= 100, by_surface
    assert all(by_surface[s] for s in SURFACES), by_surface
    assert sum(c.expect == SERVED for c in CASES) >= 30  # the valid edges


# ---- the Python API ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=MAX_MODEL_LEN,
                   max_num_samples=MAX_NUM_SAMPLES)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def python_reference(llm) -> tuple:
    return _python_greedy(llm)


def _python_greedy(llm) -> tuple:
    out = generate(llm, [REFERENCE_PROMPT], SamplingParams(temperature=0.0,
                                                           max_tokens=REFERENCE_TOKENS))
    c = out[0].outputs[0]
    return tuple(c.token_ids), c.text


def _run_python(llm, case: Case, rid: str) -> None:
    """Submit ``case`` as the Python API would; for a served case, run it to its end."""
    vocab = llm.engine.vocab_size
    if case.on == GENERATE:
        kwargs = {"sampling_params": SamplingParams(max_tokens=MAX_TOKENS), **case.request}
        outs = llm.generate(use_tqdm=False, **resolve(kwargs, vocab))
        assert all(o.finished and o.outputs for o in outs)
        return
    eng = llm.engine
    kwargs = {"request_id": rid, "prompt": resolve(case.prompt, vocab), "priority": 0,
              "output_kind": OutputKind.FINAL_ONLY, **case.request}
    if "params" not in kwargs:
        kwargs["params"] = SamplingParams(**resolve({"max_tokens": MAX_TOKENS, **case.params},
                                                    vocab))
    eng.add_request(**kwargs)
    finals = []
    while eng.has_unfinished_requests():
        finals += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finals] == [rid]
    params = kwargs["params"] or SamplingParams()
    assert len(finals[0].outputs) == params.n
    assert all(c.finish_reason in ("stop", "length") for c in finals[0].outputs)


@pytest.mark.parametrize("case", _cases(BOTH, PYTHON, GENERATE))
def test_python_api(llm, python_reference, case: Case):
    eng = llm.engine
    added = eng.stats.num_requests_added
    if case.expect == SERVED:
        _run_python(llm, case, f"table-{case.id}")
    else:
        with pytest.raises(ValueError) as info:
            _run_python(llm, case, f"table-{case.id}")
        assert case.expect in str(info.value), (case, str(info.value))
        if case.on != GENERATE and case.expect not in _NO_PARAM:
            # The field also as data: the token ids are the ``prompt`` argument's.
            assert isinstance(info.value, FieldError), (case, info.value)
            assert info.value.param in case.expect, (case, info.value.param)
        if case.on != GENERATE:  # generate may queue and abort a batch's earlier prompts
            assert eng.stats.num_requests_added == added
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert _python_greedy(llm) == python_reference


# ---- HTTP ----------------------------------------------------------------------------------
class _Server:
    """One engine, app and client for the whole module, on one event loop: an engine per
    case would cost seconds each."""

    def __init__(self, model: str) -> None:
        import httpx
        from test_async_engine import make_async

        from cadence.server.app import build_app

        self.loop = asyncio.new_event_loop()
        self.engine = make_async(model, max_model_len=MAX_MODEL_LEN,
                                 max_num_samples=MAX_NUM_SAMPLES)
        app = build_app(self.engine, "tiny", max_logprobs=MAX_LOGPROBS)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://test", timeout=60)

    def post(self, path: str, body: dict):
        # json.dumps writes NaN/Infinity and escapes lone surrogates, as a client could.
        content = json.dumps(body).encode()
        return self.loop.run_until_complete(self.client.post(
            path, content=content, headers={"content-type": "application/json"}))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
    pytest.importorskip("fastapi", reason="the server tests need the server extra")
    s = _Server(tiny_model_dir("llama"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def http_reference(server, python_reference) -> str:
    text = _http_greedy(server)
    assert text == python_reference[1]  # the same model over both surfaces
    return text


def _http_greedy(server: _Server) -> str:
    r = server.post("/v1/completions", {"prompt": REFERENCE_PROMPT, "temperature": 0,
                                        "max_tokens": REFERENCE_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _http_prompt(prompt):
    if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    if isinstance(prompt, dict) and set(prompt) == {"prompt"}:
        return prompt["prompt"]
    return prompt


def _http_body(case: Case, vocab: int) -> tuple[str, dict]:
    if case.on == CHAT:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "hello there"}]}
    else:
        path = "/v1/completions"
        body = {"prompt": _http_prompt(case.prompt)}
    body = {**body, "max_tokens": MAX_TOKENS, **case.params, **case.request, **case.body}
    return path, {k: v for k, v in resolve(body, vocab).items() if v is not OMIT}


@pytest.mark.parametrize("case", _cases(BOTH, HTTP, CHAT))
def test_http(server, http_reference, case: Case):
    engine = server.engine
    path, body = _http_body(case, engine.engine.vocab_size)
    r = server.post(path, body)
    if case.expect == SERVED:
        assert r.status_code == 200, (body, r.text)
        choices = r.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices)
    else:
        assert r.status_code == 400, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error", error
        assert case.expect in error["message"], (body, error)
        # Engine-side errors too (top_k past the vocabulary, fcfs priority): the server
        # names the body's field, not only the message.
        assert error["param"] is not None and case.expect in error["param"], (body, error)
    assert engine.num_pending_requests == 0
    # An aborted batch entry is freed by the engine thread, a moment after the answer.
    eng = engine.engine
    _wait_until(lambda: not eng.has_unfinished_requests()
                and eng.block_manager.num_free_blocks == eng.num_blocks)
    assert _http_greedy(server) == http_reference


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the engine did not settle"
        time.sleep(0.005)


def test_generate_argument_errors_name_their_argument(llm):
    # LLM.generate's own checks (before any request is built) carry ``param`` too.
    sp = SamplingParams(max_tokens=2)
    cases = [({"prompts": 5}, "prompts"),
             ({"prompts": ["a", "b"], "sampling_params": [sp]}, "sampling_params"),
             ({"prompts": ["a"], "sampling_params": ["greedy"]}, "sampling_params"),
             ({"prompts": ["a", "b"], "sampling_params": sp, "priority": [0]}, "priority")]
    added = llm.engine.stats.num_requests_added
    for kwargs, param in cases:
        with pytest.raises(FieldError) as info:
            llm.generate(use_tqdm=False, **kwargs)
        assert info.value.param == param and param in str(info.value), (kwargs, info.value)
    assert llm.engine.stats.num_requests_added == added
