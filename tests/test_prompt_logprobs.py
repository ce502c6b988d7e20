"""``SamplingParams.prompt_logprobs`` (vLLM's field): per prompt token, its logprob given the
tokens before it, its rank and the most likely tokens there. They equal transformers' own
log-softmax; they are the same whether the prompt is chunked, preempted, sampled n times,
run with async output processing, async scheduling or in the worker process; a request
asking for them takes no prefix-cache hits, and the others still do; a stream carries them
once; a backend that cannot compute them refuses the request. (The server's echo and
prompt_logprobs fields are in tests/test_server_echo.py, the CUDA backend's host path in
tests/test_cuda_async_scheduling.py; every backend's check is in the conformance kit.)"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.output_state import OutputKind

PROMPTS = [list(range(5, 45)), [7, 3, 9, 100, 41, 12, 12, 12, 5], [42]]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _rounded(pl) -> list | None:
    """Prompt logprobs in a comparable form: per position sorted (id, logprob, rank)."""
    if pl is None:
        return None
    return [None if d is None else sorted((t, round(lp.logprob, 5), lp.rank, lp.decoded_token)
                                          for t, lp in d.items()) for d in pl]


def _run(model: str, k: int = 3, params: SamplingParams | None = None, **llm_kw):
    llm = make_llm(model, **llm_kw)
    try:
        params = params or SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                          prompt_logprobs=k)
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
        eng = llm.engine
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.num_blocks
        return outs
    finally:
        llm.shutdown()


def test_match_transformers(model) -> None:
    from transformers import AutoModelForCausalLM

    outs = _run(model, k=3)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        pl = out.prompt_logprobs
        assert pl is not None and len(pl) == len(prompt) and pl[0] is None
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for t in range(1, len(prompt)):
            entry, row, token = pl[t], ref[t - 1], prompt[t]
            assert token in entry and len(entry) in (3, 4), entry
            assert abs(entry[token].logprob - row[token].item()) < 1e-5
            assert entry[token].rank == int((row > row[token] + 1e-5).sum()) + 1 or \
                bool(((row - row[token]).abs() < 1e-5).sum() > 1)  # a near-tie
            top = row.topk(3)
            assert sorted(t for t, lp in entry.items() if lp.rank <= 3) == \
                sorted(top.indices.tolist())
            assert entry[token].decoded_token is not None
    # A one-token prompt has nothing to predict.
    assert outs[2].prompt_logprobs == [None]


def test_tokens_and_logprobs_do_not_depend_on_how_the_prompt_runs(model) -> None:
    base = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
    asked = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2,
                           prompt_logprobs=2)
    plain = _run(model, params=base)
    runs = {
        "whole": {},
        "chunked": {"max_num_batched_tokens": 16},
        "preempted": {"num_kv_blocks": 8, "block_size": 8, "max_model_len": 64},
        "no async output": {"disable_async_output_proc": True},
        "async scheduling": {"async_scheduling": True, "max_num_batched_tokens": 16},
        "worker process": {"backend_options": {"overlap": "process"},
                           "max_num_batched_tokens": 16},
    }
    got = {name: _run(model, params=asked, **kw) for name, kw in runs.items()}
    want = [_rounded(o.prompt_logprobs) for o in got["whole"]]
    for name, outs in got.items():
        assert [_rounded(o.prompt_logprobs) for o in outs] == want, name
        # Asking for them changes nothing else.
        for a, b in zip(outs, plain, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
            assert [round(d[t].logprob, 5) for d, t in zip(a.outputs[0].logprobs,
                                                           a.outputs[0].token_ids)] == \
                [round(d[t].logprob, 5) for d, t in zip(b.outputs[0].logprobs,
                                                        b.outputs[0].token_ids)], name


def test_preemption_really_happened(model) -> None:
    llm = make_llm(model, num_kv_blocks=8, block_size=8, max_model_len=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                prompt_logprobs=1)
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
        assert llm.engine.stats.num_preemptions > 0
        assert all(o.prompt_logprobs is not None for o in outs)
    finally:
        llm.shutdown()


def test_decode_logprobs_equal_the_prompt_logprobs_of_the_same_tokens(model) -> None:
    llm = make_llm(model)
    try:
        (first,) = generate(llm, [{"prompt_token_ids": PROMPTS[1]}],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                           logprobs=0))
        ids = PROMPTS[1] + first.outputs[0].token_ids
        (again,) = generate(llm, [{"prompt_token_ids": ids}],
                            SamplingParams(max_tokens=1, prompt_logprobs=0))
        n = len(PROMPTS[1])
        for j, (tok, entry) in enumerate(zip(first.outputs[0].token_ids,
                                             first.outputs[0].logprobs, strict=True)):
            assert abs(again.prompt_logprobs[n + j][tok].logprob - entry[tok].logprob) < 1e-5
            assert again.prompt_logprobs[n + j][tok].rank == 1  # greedy took the top token
    finally:
        llm.shutdown()


def test_prefix_cache_skipped_for_the_asking_request_only(model) -> None:
    llm = make_llm(model, block_size=8)
    try:
        prompt = {"prompt_token_ids": PROMPTS[0]}
        plain = SamplingParams(temperature=0.0, max_tokens=2)
        generate(llm, [prompt], plain)
        (asked,) = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=2,
                                                          prompt_logprobs=1))
        assert asked.num_cached_tokens == 0
        assert len(asked.prompt_logprobs) == len(PROMPTS[0])
        (again,) = generate(llm, [prompt], plain)
        assert again.num_cached_tokens > 0
    finally:
        llm.shutdown()


def test_n_samples_compute_them_once(model) -> None:
    llm = make_llm(model)
    rows: list[int] = []
    execute = llm.engine.backend.execute

    def spy(mi, post_sample):
        rows.append(len(mi.prompt_logprob_rows))
        return execute(mi, post_sample)

    llm.engine.backend.execute = spy
    try:
        (one,) = generate(llm, [{"prompt_token_ids": PROMPTS[0]}],
                          SamplingParams(max_tokens=3, prompt_logprobs=2))
        rows.clear()
        (three,) = generate(llm, [{"prompt_token_ids": PROMPTS[0]}],
                            SamplingParams(max_tokens=3, prompt_logprobs=2, n=3, seed=1))
        assert sum(rows) == len(PROMPTS[0]) - 1
        assert len(three.outputs) == 3
        assert _rounded(three.prompt_logprobs) == _rounded(one.prompt_logprobs)
    finally:
        llm.shutdown()


def test_a_stream_carries_them_once(model) -> None:
    llm = make_llm(model, max_num_batched_tokens=16)
    eng = llm.engine
    try:
        eng.add_request("s", {"prompt_token_ids": PROMPTS[0]},
                        SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1),
                        output_kind=OutputKind.DELTA)
        eng.add_request("c", {"prompt_token_ids": PROMPTS[0]},
                        SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))
        seen: dict[str, list] = {"s": [], "c": []}
        while eng.has_unfinished_requests():
            for out in eng.step():
                seen[out.request_id].append(out.prompt_logprobs)
        assert len(seen["s"]) > 1
        assert seen["s"][0] is not None and all(p is None for p in seen["s"][1:])
        assert all(p is not None for p in seen["c"])  # cumulative outputs: every time
        assert _rounded(seen["s"][0]) == _rounded(seen["c"][-1])
    finally:
        llm.shutdown()


def test_a_backend_without_them_refuses_the_request(model) -> None:
    llm = make_llm(model)
    try:
        llm.engine.backend.supports_prompt_logprobs = False
        with pytest.raises(ValueError, match="prompt_logprobs is not supported") as e:
            llm.engine.add_request("r", "the cat", SamplingParams(prompt_logprobs=1))
        assert e.value.param == "prompt_logprobs"
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_each_request_gets_its_own_number_of_top_entries(model) -> None:
    # One step computes every row with the most any request asks for.
    llm = make_llm(model)
    try:
        outs = generate(llm, [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                        [SamplingParams(max_tokens=1, prompt_logprobs=0),
                         SamplingParams(max_tokens=1, prompt_logprobs=4)])
        assert all(len(d) == 1 for d in outs[0].prompt_logprobs[1:])
        assert all(len(d) in (4, 5) for d in outs[1].prompt_logprobs[1:])
    finally:
        llm.shutdown()


def test_token_ranks_count_the_strictly_more_likely() -> None:
    from cadence.layers.ranks import token_ranks

    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 50257, 129, 7):
        x = torch.randn(5, vocab, generator=g)
        x[0, :4] = x[0, 2]  # a tie shares the better rank
        chosen = torch.randint(0, vocab, (5, 1), generator=g)
        chosen[0] = 2
        lp = x.gather(1, chosen)
        assert torch.equal(token_ranks(x, lp), (x > lp).sum(dim=-1) + 1), vocab
    # 300 entries above the chosen one: more than a uint8 chunk could hold.
    x = torch.zeros(1, 1000)
    x[0, :300] = 1.0
    assert token_ranks(x, torch.zeros(1, 1)).tolist() == [301]


def test_the_chosen_token_comes_first_then_the_top_k_by_rank(model) -> None:
    """vLLM's dict order, which code reading ``next(iter(d))`` relies on: the sampled (or
    prompt) token first, then the top k in rank order, each token once."""
    (out,) = _run(model, k=4, params=SamplingParams(temperature=1.5, seed=3, max_tokens=12,
                                                    ignore_eos=True, logprobs=4,
                                                    prompt_logprobs=4))[:1]
    sample = out.outputs[0]
    entries = [(tok, d) for tok, d in zip(PROMPTS[0][1:], out.prompt_logprobs[1:])]
    entries += list(zip(sample.token_ids, sample.logprobs, strict=True))
    outside = 0
    for tok, d in entries:
        ids = list(d)
        assert ids[0] == tok
        rest = [lp.rank for t, lp in d.items() if t != tok]
        assert rest == sorted(rest) and len(d) in (4, 5)
        outside += len(d) == 5
    assert outside > 0  # some chosen tokens were outside the top 4 (temperature 1.5)


def test_detokenize_false_leaves_every_text_out(model) -> None:
    """vLLM: no text, and no ``decoded_token`` in sample or prompt logprobs; the ids and
    logprobs are those of the same request with text."""
    base = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2,
            "prompt_logprobs": 2}
    with_text, without = (_run(model, params=SamplingParams(**base, detokenize=d))[0]
                          for d in (True, False))
    sample, bare = with_text.outputs[0], without.outputs[0]
    assert bare.text == "" and bare.token_ids == sample.token_ids
    assert any(lp.decoded_token for d in sample.logprobs for lp in d.values())
    for got, want in zip(bare.logprobs + without.prompt_logprobs[1:],
                         sample.logprobs + with_text.prompt_logprobs[1:], strict=True):
        assert list(got) == list(want)
        assert all(lp.decoded_token is None for lp in got.values())
        assert [lp.logprob for lp in got.values()] == [lp.logprob for lp in want.values()]
