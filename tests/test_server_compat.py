"""What clients of other servers send and expect, on /v1/completions and /v1/chat/completions:
the fields OpenAI's SDK and typed clients fill in (nulls, an assistant message sent back as
returned, OpenAI fields that ask nothing of a local server), vLLM's extensions
(``return_token_ids``, ``request_id``, ``add_special_tokens``, ``documents``), and logprob
bytes that rebuild the text even where a token holds part of a character."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from test_server import events, serve

USER = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _bos(model: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).bos_token_id


def test_return_token_ids_whole_and_streamed(model) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's; streamed, the prompt's
    with the first chunk of output and each chunk's new ids, which add up to the whole."""
    base = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def body(client, engine):
        return [await client.post(path, json={**extra, **base, **more})
                for path, extra in (("/v1/completions", {"prompt": "the cat sat"}),
                                    ("/v1/chat/completions", {"messages": USER}))
                for more in ({}, {"stream": True})]

    comp, comp_stream, chat, chat_stream = serve(model, body)
    (choice,) = comp.json()["choices"]
    assert len(choice["token_ids"]) == 8 and choice["prompt_token_ids"][0] == _bos(model)
    chunks = [c["choices"][0] for c in events(comp_stream.text) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert "prompt_token_ids" not in chunks[-1] or len(chunks) == 1
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    whole = chat.json()
    (c,) = whole["choices"]
    assert len(c["token_ids"]) == 8 and whole["prompt_token_ids"]
    streamed = [e for e in events(chat_stream.text) if e["choices"]]
    firsts = [e["prompt_token_ids"] for e in streamed if "prompt_token_ids" in e]
    assert firsts == [whole["prompt_token_ids"]]
    assert [t for e in streamed for t in e["choices"][0].get("token_ids", [])] == c["token_ids"]


def test_request_id_names_the_response(model) -> None:
    import asyncio

    async def body(client, engine):
        # The same id twice at once (a client's retry) is not refused.
        both = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 2, "request_id": "abc123"}) for _ in range(2)))
        return both, await client.post("/v1/chat/completions", json={
            "messages": USER, "max_tokens": 2, "request_id": "xyz", "stream": True})

    comps, chat = serve(model, body)
    assert [c.json()["id"] for c in comps] == ["cmpl-abc123"] * 2
    assert {e["id"] for e in events(chat.text)} == {"chatcmpl-xyz"}


def test_add_special_tokens_as_vllm_has_it(model) -> None:
    """Completions add the tokenizer's BOS unless told not to; a chat's template places its
    own, and add_special_tokens=true adds the tokenizer's too."""
    async def body(client, engine):
        out = []
        for path, extra in (("/v1/completions", {"prompt": "the cat"}),
                            ("/v1/chat/completions", {"messages": USER})):
            for special in (None, True, False):
                flag = {} if special is None else {"add_special_tokens": special}
                r = await client.post(path, json={**extra, **flag, "max_tokens": 1,
                                                   "return_token_ids": True})
                assert r.status_code == 200, r.text
                ids = r.json()["choices"][0].get("prompt_token_ids") or \
                    r.json()["prompt_token_ids"]
                out.append(ids)
        return out

    plain, with_bos, without, chat, chat_bos, chat_without = serve(model, body)
    bos = _bos(model)
    assert plain == with_bos and plain[0] == bos and without == plain[1:]
    assert chat == chat_without and chat_bos == [bos, *chat]


def test_nulls_and_the_fields_clients_fill_in_are_served(model) -> None:
    """A body as typed clients send it: every field, null where not set; an assistant
    message as OpenAI's SDK returned it; OpenAI fields that ask nothing of this server."""
    sdk_reply = {"role": "assistant", "content": "it sat", "refusal": None,
                 "annotations": None, "audio": None, "function_call": None,
                 "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                                 "function": {"name": "f", "arguments": "{}"}}]}
    chat = {"messages": [*USER, sdk_reply, {"role": "tool", "tool_call_id": "c1",
                                            "content": "ok"}],
            "n": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None,
            "stream": None, "parallel_tool_calls": None, "top_logprobs": None,
            "max_tokens": 3, "store": False, "metadata": {"app": "x"}, "service_tier": None,
            "prompt_cache_key": "k", "safety_identifier": "s", "user": None}
    completion = {"prompt": "the cat", "max_tokens": 3, "n": None, "presence_penalty": None,
                  "frequency_penalty": None, "stream": None, "echo": None, "logprobs": None}

    async def body(client, engine):
        return (await client.post("/v1/chat/completions", json=chat),
                await client.post("/v1/completions", json=completion),
                await client.post("/v1/completions", json={**completion,
                                                           "max_tokens": None}))

    c, r, rest = serve(model, body)
    assert c.status_code == 200 and len(c.json()["choices"]) == 1, c.text
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    # max_tokens null keeps its own meaning: the rest of the context.
    assert rest.status_code == 200 and rest.json()["usage"]["completion_tokens"] > 3


def test_reasoning_effort_documents_and_earlier_thinking_reach_the_template(
        model, tmp_path) -> None:
    out = Path(tmp_path) / "m"
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(
        "{{ 'effort=' ~ (reasoning_effort or 'none') }}"
        "{% for d in documents or [] %}{{ ' doc=' ~ d.text }}{% endfor %}"
        "{% for m in messages %}{{ ' ' ~ m.role ~ ':' ~ m.content }}"
        "{% if m.reasoning_content %}{{ ' thought:' ~ m.reasoning_content }}{% endif %}"
        "{% endfor %}")
    messages = [*USER, {"role": "assistant", "content": "yes", "reasoning_content": "hmm"},
                {"role": "user", "content": "why"}]

    async def body(client, engine):
        r = await client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 1, "return_token_ids": True,
            "add_generation_prompt": False, "reasoning_effort": "low",
            "documents": [{"title": "t", "text": "paris"}]})
        assert r.status_code == 200, r.text
        return engine.tokenizer.decode(r.json()["prompt_token_ids"])

    text = serve(str(out), body)
    assert text == ("effort=low doc=paris user:the cat sat on the mat assistant:yes "
                    "thought:hmm user:why")


def test_logprob_bytes_rebuild_characters_split_over_tokens(model) -> None:
    """A token holding part of a UTF-8 character reads "\\ufffd"; its bytes are its own, so
    joining every token's bytes gives the text back (OpenAI's reason for the field)."""
    pytest.importorskip("xgrammar", reason="the reply is forced with a regex")
    word = "Жизнь ℵ"

    async def body(client, engine):
        return await client.post("/v1/chat/completions", json={
            "messages": USER, "max_tokens": 30, "logprobs": True, "top_logprobs": 1,
            "structured_outputs": {"regex": word}})

    r = serve(model, body)
    assert r.status_code == 200, r.text
    *entries, eos = r.json()["choices"][0]["logprobs"]["content"]
    assert eos["token"] == "</s>"  # the stop token has its entry, not its text
    # Some token holds part of a character (else this proves nothing): its text is what it
    # completes after the tokens before it, or "" (vLLM's), and its bytes are its own.
    assert any(bytes(e["bytes"]) != e["token"].encode() for e in entries)
    assert not any("\ufffd" in e["token"] for e in entries)
    assert "".join(e["token"] for e in entries) == word
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == word
    assert json.loads(r.text)["choices"][0]["message"]["content"] == word


def test_null_inside_stream_options_and_min_tokens_past_the_context(model, tmp_path) -> None:
    """A null inside stream_options is its default too; a min_tokens past the context is
    refused for the context, not for a max_tokens the body never sent; a tool's
    cache_control hint does not reach the prompt (templates write tools with tojson)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    out = Path(tmp_path) / "m"
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(
        "{{ tools | tojson }}{% for m in messages %}{{ m.role ~ ':' ~ m.content }}{% endfor %}")

    async def body(client, engine):
        s = await client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
        m = await client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 100000, "min_tokens": 100000})
        toks = [await client.post("/tokenize", json={"messages": USER, "tools": [t]})
                for t in (tool, {**tool, "cache_control": {"type": "ephemeral"}})]
        return s, m, toks

    s, m, (plain, hinted) = serve(str(out), body)
    assert s.status_code == 200 and events(s.text)
    assert m.status_code == 400 and m.json()["error"]["param"] == "min_tokens"
    assert "max_model_len" in m.json()["error"]["message"], m.text
    assert plain.status_code == 200, plain.text
    assert plain.json()["tokens"] == hinted.json()["tokens"]
    assert plain.json()["count"] > 10  # the tools are in the prompt


def test_a_max_tokens_past_the_context_is_cut_on_every_endpoint(model) -> None:
    """vLLM's server cuts a max_tokens the context cannot hold to what it holds; so do the
    endpoints in other APIs' shapes, whose replies then say they were cut."""
    async def body(client, engine):
        return (await client.post("/v1/chat/completions", json={
                    "messages": USER, "max_completion_tokens": 10**6, "ignore_eos": True}),
                await client.post("/v1/responses", json={
                    "input": "hi", "max_output_tokens": 10**6}),
                await client.post("/v1/messages", json={
                    "messages": USER, "max_tokens": 10**6}))

    chat, responses, messages = serve(model, body)
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "length"
    assert responses.status_code == 200, responses.text
    assert messages.status_code == 200, messages.text
    assert messages.json()["stop_reason"] in ("max_tokens", "end_turn")
