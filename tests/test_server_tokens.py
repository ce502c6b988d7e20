"""The server's /tokenize and /detokenize (vLLM's bodies): a prompt's ids are the ids the
completion endpoint feeds the model, a conversation's are the chat endpoint's (its usage
counts them), ids turn back into the text, and bad bodies are 400s naming the field, with
nothing queued."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from test_server import serve

from cadence.server.protocol import RequestError
from cadence.server.tokens import DetokenizeRequest, detokenize

TEXT = "the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def test_tokenize_matches_what_the_endpoints_feed_the_model(model):
    async def body(client, engine):
        tok = engine.tokenizer
        r = await client.post("/tokenize", json={"model": "tiny", "prompt": TEXT,
                                                 "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        ids = list(tok.encode(TEXT))
        assert got == {"count": len(ids), "max_model_len": engine.max_model_len,
                       "tokens": ids, "token_strs": tok.convert_ids_to_tokens(ids)}
        # The completion endpoint tokenizes a string prompt the same way.
        r = await client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == got["count"]
        plain = (await client.post("/tokenize", json={
            "prompt": TEXT, "add_special_tokens": False})).json()
        assert plain["tokens"] == list(tok.encode(TEXT, add_special_tokens=False))
        assert plain["token_strs"] is None

        # A conversation: the chat template's ids, as the chat endpoint counts them.
        chat = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
        flat = [MESSAGES[0], {"role": "user", "content": "hello there"}]
        text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == list(tok.encode(text, add_special_tokens=False))
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                            "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == chat["count"]
        bare = (await client.post("/tokenize", json={
            "messages": MESSAGES, "add_generation_prompt": False})).json()
        no_prompt = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=False)
        assert bare["tokens"] == list(tok.encode(no_prompt, add_special_tokens=False))
        assert bare["count"] < chat["count"]

        # And back: the ids' text.
        r = await client.post("/detokenize", json={"model": "tiny", "tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": tok.decode(ids)}
        assert TEXT in r.json()["prompt"]
        assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
        r = await client.post("/detokenize", json={"tokens": [engine.engine.vocab_size]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        # A model whose vocabulary is wider than its tokenizer's (padded embeddings, as in
        # many real models): ids past the tokenizer can be produced, and decode to nothing.
        wide = len(tok) + 8
        got = detokenize(tok, wide, DetokenizeRequest(tokens=[*ids, len(tok), wide - 1]))
        assert got == {"prompt": tok.decode(ids)}
        with pytest.raises(RequestError, match=f"in \\[0, {wide}\\)"):
            detokenize(tok, wide, DetokenizeRequest(tokens=[wide]))
        assert engine.num_pending_requests == 0

    serve(model, body)


@pytest.mark.parametrize(("path", "body", "status", "field", "needle"), [
    ("/tokenize", {}, 400, "prompt", "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt", "exactly one"),
    ("/tokenize", {"messages": []}, 400, "messages", "must not be empty"),
    ("/tokenize", {"prompt": "a", "add_special_token": True}, 400, "add_special_token",
     "valid fields: add_generation_prompt, add_special_tokens"),
    ("/tokenize", {"prompt": 3}, 400, "prompt", "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model", "does not exist"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens", "got -1"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens", "the model's vocabulary"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, 400,
     "add_generation_prompt", "applies to messages"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "tokens"),
    ("/detokenize", {}, 400, "tokens", "tokens is required"),
])
def test_bad_token_bodies_name_the_field(model, path, body, status, field, needle):
    async def run(client, engine):
        r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == field, error
        assert needle in error["message"], error
        assert engine.num_pending_requests == 0

    serve(model, run)
