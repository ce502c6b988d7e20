"""/v1/embeddings over HTTP: every input form OpenAI takes (a string, strings, token ids,
lists of them) gives the vectors ``LLM.embed`` gives, in input order, as floats or base64;
usage counts the prompt tokens; vLLM's extra fields work; bad bodies are 400s that name the
field, and a refused request leaves the engine idle."""

from __future__ import annotations

import base64
import struct

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from engine_helpers import make_llm
from test_server import serve

from cadence import PoolingParams

TEXTS = ["the small cat sings", "a dog", "blue"]
IDS = [5, 9, 11, 40, 2, 7, 7, 30, 8, 1]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def offline(model):
    """LLM.embed's vectors for TEXTS (as the tokenizer encodes them), IDS, and IDS' last 4
    tokens unnormalized."""
    llm = make_llm(model)
    try:
        tok = llm.get_tokenizer()
        ids = [tok.encode(t) for t in TEXTS]
        outs = llm.embed([{"prompt_token_ids": p} for p in [*ids, IDS]], use_tqdm=False)
        (raw,) = llm.embed([{"prompt_token_ids": IDS[-4:]}], PoolingParams(normalize=False),
                           use_tqdm=False)
        return [o.outputs.embedding for o in outs], ids, raw.outputs.embedding
    finally:
        llm.shutdown()


def _close(a, b, atol=1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= atol


def test_every_input_form(model, offline) -> None:
    vectors, ids, raw = offline

    async def body(client, engine):
        replies = []
        for b in ({"input": TEXTS[0], "model": "tiny"}, {"input": TEXTS},
                  {"input": IDS}, {"input": [IDS, ids[1]], "encoding_format": "base64"},
                  {"input": IDS, "truncate_prompt_tokens": 4, "normalize": False}):
            r = await client.post("/v1/embeddings", json=b)
            assert r.status_code == 200, r.text
            replies.append(r.json())
        assert not engine.engine.has_unfinished_requests()
        return replies

    one, many, tokens, b64, extras = serve(model, body)
    assert one["object"] == "list" and one["model"] == "tiny"
    assert one["data"][0]["object"] == "embedding" and one["data"][0]["index"] == 0
    assert _close(one["data"][0]["embedding"], vectors[0])
    assert one["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    assert all(_close(d["embedding"], v) for d, v in zip(many["data"], vectors))
    assert many["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert _close(tokens["data"][0]["embedding"], vectors[3])
    decoded = [list(struct.unpack(f"<{len(vectors[0])}f", base64.b64decode(d["embedding"])))
               for d in b64["data"]]
    # float32 on the wire: as close as a float32 rounding.
    assert _close(decoded[0], vectors[3], 1e-6) and _close(decoded[1], vectors[1], 1e-6)
    assert _close(extras["data"][0]["embedding"], raw)
    assert extras["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", ""]}, "input", "empty"),
    ({"input": list(range(300))}, "input", "maximum context length"),
    ({"input": [10**6]}, "input", "must be in"),
    ({"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": "a", "dimensions": 0}, "dimensions", "integer >= 1"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "a", "truncate_prompt_tokens": 256}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "a", "pooling": "max"}, "pooling", None),
    ({"input": ["a"] * 2049}, "input", "at most 2048"),
    ({"input": 3}, "input", None),
])
def test_bad_bodies_are_400s_naming_the_field(model, body, param, words) -> None:
    async def run(client, engine):
        r = await client.post("/v1/embeddings", json=body)
        assert not engine.engine.has_unfinished_requests()
        return r.status_code, r.json()

    status, reply = serve(model, run)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    if words is not None:
        assert words in reply["error"]["message"], reply


def test_unknown_model_is_404(model) -> None:
    async def run(client, engine):
        r = await client.post("/v1/embeddings", json={"input": "a", "model": "other"})
        return r.status_code

    assert serve(model, run) == 404


def test_a_bodys_inputs_enter_the_engine_together(model) -> None:
    """The inputs of one body are queued at once, so they share steps (awaited one by one,
    each would enter the engine a step after the one before it)."""
    async def body(client, engine):
        steps = engine.engine.stats.num_steps
        r = await client.post("/v1/embeddings", json={"input": [[5, 6, 7 + i] for i in range(48)]})
        assert r.status_code == 200, r.text
        return engine.engine.stats.num_steps - steps

    assert serve(model, body, max_num_seqs=64) <= 3


def test_more_inputs_than_the_server_takes_at_once_is_a_400(model) -> None:
    async def body(client, engine):
        r = await client.post("/v1/embeddings", json={"input": ["a"] * 9})
        ok = await client.post("/v1/embeddings", json={"input": ["a"] * 8})
        return r.status_code, r.json(), ok.status_code

    status, reply, ok = serve(model, body, max_pending_requests=8)
    assert status == 400 and reply["error"]["param"] == "input", reply
    assert "at most 8" in reply["error"]["message"] and ok == 200


def test_a_conversation_is_embedded_as_its_chat_template_renders_it(model) -> None:
    """vLLM's chat form: ``messages`` rendered with the chat template (no generation prompt
    unless asked) and embedded like the token ids the rendering gives."""
    from cadence.chat import render_chat

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "the small cat"}]
    llm = make_llm(model)
    try:
        tok = llm.get_tokenizer()
        ids = render_chat(tok, messages, add_generation_prompt=False).token_ids
        with_prompt = render_chat(tok, messages, add_generation_prompt=True).token_ids
        want = llm.embed([{"prompt_token_ids": ids}, {"prompt_token_ids": with_prompt}],
                         use_tqdm=False)
    finally:
        llm.shutdown()

    async def body(client, engine):
        ok = []
        for extra in ({}, {"add_generation_prompt": True}):
            r = await client.post("/v1/embeddings", json={"messages": messages, **extra})
            assert r.status_code == 200, r.text
            ok.append(r.json())
        bad = []
        for b in ({"messages": messages, "input": "x"}, {},
                  {"input": "x", "add_generation_prompt": True},
                  {"messages": messages, "add_special_tokens": True},
                  {"messages": []}):
            r = await client.post("/v1/embeddings", json=b)
            bad.append((r.status_code, r.json()["error"]["param"]))
        return ok, bad

    (plain, prompted), bad = serve(model, body)
    assert _close(plain["data"][0]["embedding"], want[0].outputs.embedding)
    assert _close(prompted["data"][0]["embedding"], want[1].outputs.embedding)
    assert plain["usage"]["prompt_tokens"] == len(ids)
    assert bad == [(400, "messages"), (400, "input"), (400, "add_generation_prompt"),
                   (400, "add_special_tokens"), (400, "messages")]
