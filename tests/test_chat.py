"""Chat prompts: ``LLM.chat``, ``engine generate --chat`` and /v1/chat/completions render a
conversation the same way, and its token ids equal transformers'
``apply_chat_template(..., tokenize=True)``: a template's own ``{{ bos_token }}`` is the only
BOS."""

from __future__ import annotations

import asyncio
import shutil
import types

import pytest
from engine_helpers import make_llm
from model_factory import CHAT_TEMPLATE

from cadence import SamplingParams
from cadence.chat import render_chat
from cadence.cli.main import main

BOS_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE
HELLO = [{"role": "user", "content": "hello there"}]
TALK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a cat"},
        {"role": "assistant", "content": "runs"}, {"role": "user", "content": "why"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def bos_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Llama whose chat template starts with ``{{ bos_token }}``, as Llama's do."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("bos-chat") / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.chat_template = BOS_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return str(out)


def hf_ids(tokenizer, messages, **kw) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_llm_chat_equals_transformers(bos_model):
    llm = make_llm(bos_model)
    try:
        tok = llm.get_tokenizer()
        want = hf_ids(tok, HELLO)
        assert want[0] == tok.bos_token_id and want[1] != tok.bos_token_id
        (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == want
        # A list of conversations: one output each, in order.
        outs = llm.chat([HELLO, TALK], GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [want, hf_ids(tok, TALK)]
        # A template of the caller's replaces the tokenizer's.
        (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=CHAT_TEMPLATE)
        assert out.prompt_token_ids == hf_ids(tok, HELLO, chat_template=CHAT_TEMPLATE)
        assert out.prompt_token_ids[0] != tok.bos_token_id
        # Tools reach the template as transformers passes them.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        tool_template = "{{ tools[0].function.name if tools else '-' }}" + CHAT_TEMPLATE
        (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=tool_template,
                          tools=tools)
        assert out.prompt_token_ids == hf_ids(tok, HELLO, chat_template=tool_template,
                                              tools=tools)
        assert out.prompt != llm.chat(HELLO, GREEDY, use_tqdm=False,
                                      chat_template=tool_template)[0].prompt
        # Text parts are joined with a newline, as vLLM joins them (and the server).
        parts = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                              {"type": "text", "text": "there"}]}]
        joined = [{"role": "user", "content": "hello\nthere"}]
        assert llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == \
            hf_ids(tok, joined)
        with pytest.raises(ValueError, match="^chat_template does not parse"):
            llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template="{% for m in messages %}")
        with pytest.raises(ValueError, match="^continue_final_message=True .* "
                                             "add_generation_prompt=False"):
            llm.chat(HELLO, GREEDY, use_tqdm=False, continue_final_message=True)
        for bad, field in (([], "messages"), ("hi", "messages"),
                           ([{"content": "hi"}], r"messages\[0\]"),
                           ([{"role": "user", "content": 5}], r"messages\[0\].content"),
                           (HELLO, "chat_template")):
            kw = {"chat_template": ""} if field == "chat_template" else {}
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.chat(bad, GREEDY, use_tqdm=False, **kw)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_render_chat_needs_a_template():
    tokenizer = types.SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="^chat_template: this model's tokenizer has no chat"):
        render_chat(tokenizer, HELLO)


@pytest.fixture
def cli_prompt_ids(monkeypatch) -> list[list[int]]:
    import cadence.request_factory

    seen: list[list[int]] = []
    original = cadence.request_factory.tokenize_prompt

    def tokenize(tokenizer, prompt):
        text, ids = original(tokenizer, prompt)
        seen.append(ids)
        return text, ids

    monkeypatch.setattr(cadence.request_factory, "tokenize_prompt", tokenize)
    return seen


@pytest.mark.parametrize("kind", ["bos-template", "plain-template"])
def test_cli_chat_equals_transformers(kind, bos_model, tiny_model_dir, cli_prompt_ids):
    from transformers import AutoTokenizer

    model = bos_model if kind == "bos-template" else tiny_model_dir("llama")
    assert main(["generate", "--model", model, "--prompt", "hello there", "--chat",
                 "--max-tokens", "2", "--max-model-len", "256", "--cpu-overlap", "sync"]) == 0
    assert cli_prompt_ids == [hf_ids(AutoTokenizer.from_pretrained(model), HELLO)]


def test_server_chat_equals_transformers(bos_model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_async_engine import make_async

    from cadence.server.app import build_app

    async def run() -> tuple:
        engine = make_async(bos_model)
        seen: list[list[int]] = []
        original = engine.add_request

        async def add_request(prompt, *args, **kw):
            seen.append(prompt["prompt_token_ids"])
            return await original(prompt, *args, **kw)

        engine.add_request = add_request
        try:
            app = build_app(engine, "tiny")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as client:
                r = await client.post("/v1/chat/completions", json={
                    "messages": TALK, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                return seen[0], r.json()["usage"]["prompt_tokens"], engine.tokenizer
        finally:
            await engine.shutdown()

    ids, num_prompt, tokenizer = asyncio.run(run())
    assert ids == hf_ids(tokenizer, TALK) and num_prompt == len(ids)
