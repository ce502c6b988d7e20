"""``use_beam_search`` over HTTP (vLLM's extension): /v1/completions returns ``n`` beams
per prompt and /v1/chat/completions ``n`` beams of the reply, equal to ``LLM.beam_search``;
fields beam search would not honour are 400s naming them; ``length_penalty`` without beam
search is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from engine_helpers import make_llm
from test_server import serve

from cadence.beam_search import BeamSearchParams
from cadence.chat import render_chat

IDS = [[5, 9, 11, 40, 2, 7], [3, 4, 100, 8]]
MESSAGES = [{"role": "user", "content": "the small cat"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def offline(model):
    llm = make_llm(model)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
        chat_ids = render_chat(llm.get_tokenizer(), MESSAGES).token_ids
        outs = llm.beam_search([{"prompt_token_ids": p} for p in [*IDS, chat_ids]], params)
        return outs, chat_ids
    finally:
        llm.shutdown()


def test_completions_and_chat_return_the_beams(model, offline) -> None:
    outs, chat_ids = offline

    async def body(client, engine):
        r1 = await client.post("/v1/completions", json={
            "prompt": IDS, "n": 3, "max_tokens": 6, "use_beam_search": True,
            "length_penalty": 0.5, "temperature": 0})
        r2 = await client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "n": 3, "max_tokens": 6, "use_beam_search": True,
            "length_penalty": 0.5, "request_id": "beams"})
        assert r1.status_code == 200, r1.text
        assert r2.status_code == 200, r2.text
        assert not engine.engine.has_unfinished_requests()
        return r1.json(), r2.json()

    cmpl, chat = serve(model, body)
    assert chat["id"] == "chatcmpl-beams"  # the body's request_id names the response
    want = [s for o in outs[:2] for s in o.sequences]
    assert [c["index"] for c in cmpl["choices"]] == list(range(6))
    assert [c["text"] for c in cmpl["choices"]] == [s.text for s in want]
    assert [c["finish_reason"] for c in cmpl["choices"]] == [s.finish_reason for s in want]
    assert cmpl["usage"]["completion_tokens"] == sum(len(s.output_token_ids) for s in want)
    assert cmpl["usage"]["prompt_tokens"] == sum(map(len, IDS))
    assert [c["message"]["content"] for c in chat["choices"]] == \
        [s.text for s in outs[2].sequences]
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)


@pytest.mark.parametrize(("endpoint", "extra", "param"), [
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),  # 0 == False, yet it asks for some
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),  # the engine's own check
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"seed": 3}, "seed"),
    ("/v1/completions", {"n": 100}, "n"),
    ("/v1/completions", {"return_token_ids": True}, "return_token_ids"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}},
     "response_format"),
])
def test_fields_beam_search_would_not_honour_are_400s(model, endpoint, extra, param) -> None:
    body = {"use_beam_search": True, "n": 2, "max_tokens": 4}
    body.update({"prompt": "the cat"} if endpoint == "/v1/completions" else
                {"messages": MESSAGES})
    body.update(extra)

    async def run(client, engine):
        r = await client.post(endpoint, json=body)
        assert not engine.engine.has_unfinished_requests()
        return r.status_code, r.json()

    status, reply = serve(model, run)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_length_penalty_needs_beam_search(model) -> None:
    async def run(client, engine):
        r = await client.post("/v1/completions", json={"prompt": "a", "length_penalty": 2.0})
        return r.status_code, r.json()

    status, reply = serve(model, run)
    assert status == 400 and reply["error"]["param"] == "length_penalty"
