"""/v1/completions ``echo`` and the ``prompt_logprobs`` extension (vLLM's), over HTTP: the
reply begins with the prompt, its logprobs with the prompt tokens' (the first has none), as
the scoring clients (lm-evaluation-harness's ``local-completions``) read them; max_tokens=0
returns the prompt alone; a stream's first chunk of each choice carries the prompt; chat and
completions return ``prompt_logprobs`` equal to the engine's."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
pytest.importorskip("fastapi", reason="the server tests need the server extra")

from engine_helpers import generate, make_llm
from test_server import events, serve

from cadence import SamplingParams

IDS = [5, 9, 11, 40, 2, 7, 7, 30, 8, 1, 77, 12]
TEXT = "the small cat sings"


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine_view(model):
    """What LLM.generate gives for IDS: prompt logprobs (2 most likely) and 3 greedy tokens
    with theirs, and the tokenizer's text of IDS."""
    llm = make_llm(model)
    try:
        (out,) = generate(llm, [{"prompt_token_ids": IDS}], SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2))
        return out, llm.get_tokenizer().decode(IDS)
    finally:
        llm.shutdown()


def _post(model, *bodies, endpoint="/v1/completions"):
    async def body(client, engine):
        replies = []
        for b in bodies:
            r = await client.post(endpoint, json=b)
            assert r.status_code == 200, r.text
            replies.append(r.text if b.get("stream") else r.json())
        return replies

    return serve(model, body)


def test_echo_with_logprobs_is_what_a_scoring_client_reads(model, engine_view) -> None:
    out, text = engine_view
    base = {"prompt": IDS, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    plain, echoed = _post(model, base, {**base, "echo": True})
    (c,), (e,) = plain["choices"], echoed["choices"]
    assert e["text"] == text + c["text"]
    lp, clp = e["logprobs"], c["logprobs"]
    n = len(IDS)
    assert len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, n):
        want = out.prompt_logprobs[t][IDS[t]]
        assert lp["token_logprobs"][t] == pytest.approx(want.logprob, abs=1e-6)
        assert lp["tokens"][t] == want.decoded_token
        assert len(lp["top_logprobs"][t]) in (2, 3)
    assert lp["token_logprobs"][n:] == clp["token_logprobs"]
    assert lp["tokens"][n:] == clp["tokens"]
    # Offsets run on over the prompt's tokens into the completion's.
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i])
                                   for i in range(len(offsets) - 1))
    assert echoed["usage"] == plain["usage"]


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(model, engine_view) -> None:
    _, text = engine_view
    (r,) = _post(model, {"prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 1})
    (c,) = r["choices"]
    assert c["text"] == text
    assert len(c["logprobs"]["tokens"]) == len(IDS)
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(IDS)
    (t,) = _post(model, {"prompt": TEXT, "max_tokens": 0, "echo": True})
    assert t["choices"][0]["text"] == TEXT and t["choices"][0]["logprobs"] is None


def test_a_stream_echoes_the_prompt_first_in_every_choice(model) -> None:
    base = {"prompt": TEXT, "max_tokens": 4, "temperature": 0.9, "seed": 3, "n": 2,
            "ignore_eos": True, "logprobs": 1, "echo": True}
    whole, streamed = _post(model, base, {**base, "stream": True})
    for index in (0, 1):
        chunks = [ch["choices"][0] for ch in events(streamed)
                  if ch["choices"] and ch["choices"][0]["index"] == index]
        assert chunks[0]["text"].startswith(TEXT)
        want = whole["choices"][index]
        assert "".join(ch["text"] for ch in chunks) == want["text"]
        joined = [tok for ch in chunks if ch["logprobs"] for tok in ch["logprobs"]["tokens"]]
        assert joined == want["logprobs"]["tokens"]
        offsets = [o for ch in chunks if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
        assert offsets == want["logprobs"]["text_offset"]
    (only,) = _post(model, {"prompt": TEXT, "max_tokens": 0, "echo": True, "stream": True})
    chunks = [ch["choices"][0] for ch in events(only) if ch["choices"]]
    assert "".join(ch["text"] for ch in chunks) == TEXT
    assert chunks[-1]["finish_reason"] is not None


def test_prompt_logprobs_field_on_both_endpoints(model, engine_view) -> None:
    out, _ = engine_view
    (r,) = _post(model, {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2})
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(IDS)
    for t in range(1, len(IDS)):
        want = out.prompt_logprobs[t]
        assert set(got[t]) == {str(tid) for tid in want}
        entry = got[t][str(IDS[t])]
        assert entry["logprob"] == pytest.approx(want[IDS[t]].logprob, abs=1e-6)
        assert entry["rank"] == want[IDS[t]].rank
        assert entry["decoded_token"] == want[IDS[t]].decoded_token
    (plain,) = _post(model, {"prompt": IDS, "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]
    (chat,) = _post(model, {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 1,
                            "prompt_logprobs": 0}, endpoint="/v1/chat/completions")
    pl = chat["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in pl[1:])  # k=0: the prompt token alone
