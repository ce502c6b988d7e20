"""vLLM's chat-template options on /v1/chat/completions and /tokenize:
``chat_template_kwargs`` reach the template as variables (Qwen3's ``enable_thinking`` is
one) and ``continue_final_message`` continues the last assistant message; the ids equal
transformers' ``apply_chat_template`` with the same arguments."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

import httpx
from test_async_engine import with_engine

from cadence.server.app import build_app

TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}{{ '/no_think\\n' }}"
    "{% endif %}{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
    "{% if not (loop.last and continue_final_message) %}{{ '</s>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
PARTIAL = [{"role": "user", "content": "name a colour"},
           {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> str:
    out = Path(tmp_path_factory.mktemp("options-model")) / "m"
    shutil.copytree(tiny_model_dir("llama"), out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return str(out)


def _post(model: str, *calls) -> list:
    async def run(engine):
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            return [await client.post(path, json=body) for path, body in calls]

    return with_engine(model, run)


def test_template_options_reach_the_template(model) -> None:
    from cadence.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(model)

    def hf(messages, **kw) -> list[int]:
        ids = tok.apply_chat_template(messages, tokenize=True, **kw)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    cont = {"messages": PARTIAL, "add_generation_prompt": False,
            "continue_final_message": True}
    quiet = {"messages": PARTIAL[:1], "chat_template_kwargs": {"enable_thinking": False}}
    tokenized, chat, tokenized_quiet, chat_quiet = _post(
        model, ("/tokenize", cont), ("/v1/chat/completions", {**cont, "max_tokens": 1}),
        ("/tokenize", quiet), ("/v1/chat/completions", {**quiet, "max_tokens": 1}))
    want = hf(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert tokenized.json()["tokens"] == want
    assert chat.json()["usage"]["prompt_tokens"] == len(want)
    want = hf(PARTIAL[:1], add_generation_prompt=True, enable_thinking=False)
    assert want != hf(PARTIAL[:1], add_generation_prompt=True)
    assert tokenized_quiet.json()["tokens"] == want
    assert chat_quiet.json()["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": PARTIAL, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": PARTIAL, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": PARTIAL, "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": PARTIAL, "chat_template_kwargs": 3},
     "chat_template_kwargs"),
])
def test_misuse_is_a_400_naming_the_field(model, path, body, param) -> None:
    (r,) = _post(model, (path, body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_messages_name_reaches_the_template() -> None:
    """As vLLM hands it over: templates that know speakers' names render them."""
    from cadence.server.chat_protocol import ChatMessage

    named = ChatMessage(role="user", content="hi", name="ada").as_template_dict()
    assert named == {"role": "user", "content": "hi", "name": "ada"}
    assert "name" not in ChatMessage(role="user", content="hi").as_template_dict()


def test_echo_begins_the_reply_with_a_continued_message(model) -> None:
    """vLLM's chat ``echo``: the last message's text before the reply when it has the
    reply's role (here the assistant message continued), whole and streamed alike; a last
    user message under a generation prompt is not echoed."""
    import json

    cont = {"messages": PARTIAL, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 4, "temperature": 0}
    plain, echoed, streamed, user = _post(
        model, ("/v1/chat/completions", cont),
        ("/v1/chat/completions", {**cont, "echo": True}),
        ("/v1/chat/completions", {**cont, "echo": True, "stream": True}),
        ("/v1/chat/completions", {"messages": PARTIAL[:1], "max_tokens": 4,
                                  "temperature": 0, "echo": True}))
    reply = plain.json()["choices"][0]["message"]["content"]
    whole = echoed.json()["choices"][0]["message"]["content"]
    assert whole == "The colour is" + reply
    assert echoed.json()["usage"] == plain.json()["usage"]  # the echo is not generated
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(pieces) == whole and "The colour is" in pieces
    assert not user.json()["choices"][0]["message"]["content"].startswith("name a colour")
