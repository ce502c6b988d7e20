"""``SamplingParams.logit_bias`` and ``allowed_token_ids``: applied after the grammar mask
and the raw logprobs and before penalties (the allowed ids first), as vLLM V1 orders them;
only their own rows move; the engine gives the same tokens with async output processing on
or off and under async scheduling. (The bad values are in tests/bad_input_cases.py; every
backend's check is in the conformance kit.)"""

from __future__ import annotations

import torch
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.backend import SamplingMetadata
from cadence.layers import sampler


def _meta(rows: int, **kw) -> SamplingMetadata:
    return SamplingMetadata(temperature=[0.0] * rows, top_k=[0] * rows, top_p=[1.0] * rows,
                            min_p=[0.0] * rows, seeds=[None] * rows, output_lens=[0] * rows,
                            all_greedy=True, **kw)


def test_bias_moves_only_its_row_and_not_the_logprobs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    want = logits.argmax(dim=-1)
    meta = _meta(3, logit_bias=[{7: 100.0}, {}, {int(want[2]): -100.0, 3: 0.5}],
                 num_logprobs=[2, 2, 2], max_num_logprobs=2)
    out = sampler.sample(logits, meta)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] == want[1]
    second = logits[2].clone()
    second[int(want[2])] -= 100.0
    second[3] += 0.5
    assert out.token_ids[2] == second.argmax()
    # Logprobs are the raw model's, before the bias (vLLM V1's default).
    sampled_lp, _, top_ids, _ = out.logprobs
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(sampled_lp[0], raw[0, 7])
    assert top_ids[0, 0] == want[0]


def test_allowed_ids_restrict_only_their_rows_and_not_the_logprobs() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)
    meta = _meta(3, allowed_token_ids=[[4, 9], [], [7]], logit_bias=[{}, {}, {8: 100.0}],
                 num_logprobs=[1, 1, 1], max_num_logprobs=1)
    out = sampler.sample(logits, meta)
    assert out.token_ids[0] == (4 if logits[0, 4] > logits[0, 9] else 9)
    assert out.token_ids[1] == logits[1].argmax()
    assert out.token_ids[2] == 7  # a bias cannot bring back a token the list leaves out
    assert out.logprobs[2][1] == logits[1].argmax()  # top-1 of the raw row 1
    random = _meta(2, allowed_token_ids=[[3, 5, 8], []])
    random.temperature, random.all_greedy = [1.0, 1.0], False
    for seed in range(20):
        draw = sampler.sample(logits[:2], random, torch.Generator().manual_seed(seed))
        assert int(draw.token_ids[0]) in (3, 5, 8)


def test_bias_adds_to_the_logit_and_keeps_masked_tokens_out() -> None:
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.0]])
    biased = sampler.apply_logit_bias(logits, [{0: 1.5, 2: 100.0, 3: -0.25}])
    assert biased.tolist() == [[2.5, 2.0, float("-inf"), -0.25]]
    assert logits[0, 0] == 1.0  # the caller's tensor is left as it was


def test_bias_comes_before_penalties() -> None:
    # A repetition penalty divides a positive logit: 4 + 2 = 6 -> 3, not 4 / 2 + 2 = 4.
    logits = torch.tensor([[4.0, 3.5]])
    meta = _meta(1, logit_bias=[{0: 2.0}], presence_penalty=[0.0], frequency_penalty=[0.0],
                 repetition_penalty=[2.0], prompt_token_ids=[[0]], output_token_ids=[[]])
    assert sampler.sample(logits, meta).token_ids.tolist() == [1]


def test_engine_modes_agree(tiny_model_dir) -> None:
    model = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 6, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                             logit_bias={11: 100.0}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                             logit_bias={t: -100.0 for t in range(20, 40)}),
              SamplingParams(temperature=0.8, seed=6, max_tokens=8, ignore_eos=True,
                             logit_bias={12: 4.0}, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                             allowed_token_ids=[13, 14, 15], logit_bias={14: -1.0})]
    runs = []
    for kw in ({}, {"backend_options": {"overlap": "process"}},
               {"backend_options": {"overlap": "process"}, "async_scheduling": True}):
        llm = make_llm(model, **kw)
        try:
            runs.append([o.outputs[0].token_ids for o in generate(llm, prompts, params)])
        finally:
            llm.shutdown()
    assert runs[0][0] == [11] * 8
    assert not set(runs[0][1]) & set(range(20, 40))
    assert set(runs[0][3]) <= {13, 14, 15}
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_server_reads_openai_keys_and_caps_the_entries() -> None:
    import pytest

    pytest.importorskip("pydantic")
    from cadence.server.protocol import MAX_LOGIT_BIAS, CompletionRequest, RequestError

    def bias(entries: dict) -> dict | None:
        return CompletionRequest(prompt="x", logit_bias=entries)._logit_bias()

    assert bias({"0": 1.0, "50256": -2}) == {0: 1.0, 50256: -2}
    assert bias({}) is None
    assert len(bias({str(i): 0.5 for i in range(MAX_LOGIT_BIAS)})) == MAX_LOGIT_BIAS
    for bad in ({str(i): 0.5 for i in range(MAX_LOGIT_BIAS + 1)}, {"05": 1.0}, {"-1": 1.0},
                {" 5": 1.0}, {"5.0": 1.0}, {"\u0665": 1.0}):
        with pytest.raises(RequestError) as e:
            bias(bad)
        assert e.value.param == "logit_bias"


def test_server_names_the_field_and_key_of_a_bad_bias(tiny_model_dir) -> None:
    import pytest

    pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
    pytest.importorskip("fastapi", reason="the server tests need the server extra")
    from test_server import serve

    async def body(client, engine):
        for bias, words in (({"5": True}, ["(key '5')"]), ({"str": "x"}, ["(key 'str')"]),
                            ({"5": 101}, ["[-100, 100]", "token 5"])):
            r = await client.post("/v1/completions", json={
                "prompt": "a b", "max_tokens": 2, "logit_bias": bias})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "logit_bias", error
            for word in words:
                assert word in error["message"], error
        r = await client.post("/v1/completions", json={
            "prompt": "a b", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"9": 100}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert engine.num_pending_requests == 0

    serve(tiny_model_dir("llama"), body)


def test_a_bias_cannot_bring_back_what_the_grammar_forbids(tiny_model_dir) -> None:
    import re

    import pytest

    pytest.importorskip("xgrammar")
    from cadence import StructuredOutputsParams

    llm = make_llm(tiny_model_dir("llama"))
    try:
        tok = llm.get_tokenizer()
        # Push hard towards tokens the pattern cannot start with, and towards a digit.
        pushed = {t: 100.0 for t in tok.encode("zebra quartz", add_special_tokens=False)}
        regex = r"[0-9]{2,3}"
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=8, logit_bias=pushed,
                                structured_outputs=StructuredOutputsParams(regex=regex))
        for out in generate(llm, ["a", "b", "c"], params):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    finally:
        llm.shutdown()

