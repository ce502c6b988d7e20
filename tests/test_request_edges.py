"""The edges of a request's life: ids reused at once, leaving a stream early, sample ids
that collide, and the post-sample hook seeing every output."""

from __future__ import annotations

import dataclasses
import gc

import pytest
from engine_helpers import make_llm
from test_async_engine import all_blocks_free, wait_until, with_engine

from cadence import SamplingParams
from cadence.hookspecs import hookimpl
from cadence.plugins import get_registry

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def test_an_id_reused_right_after_an_abort_gets_its_own_outputs(model):
    async def body(engine):
        old = await engine.add_request("hello", LONG, request_id="x")
        await wait_until(lambda: engine.stats().num_generation_tokens > 0)
        old.abort()
        new = await engine.add_request("hello", SHORT, request_id="x")  # same moment
        outs = [o async for o in new]
        assert outs[-1].finished and outs[-1].request_id == "x"
        assert outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == 5  # everything so far, at the end
        await wait_until(lambda: engine.num_pending_requests == 0)
        await wait_until(lambda: engine.stats().num_running == 0)
        assert engine.stats().finish_reasons == {"abort": 1, "length": 1}

    with_engine(model, body)


def test_leaving_an_async_for_early_aborts_at_once(model):
    async def body(engine):
        gen = engine.generate("hello", LONG)
        async for _ in gen:
            break
        # ``gen`` is still referenced, so nothing was collected: closing is explicit.
        await gen.aclose()
        await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 1, timeout=5)
        # Without a reference left, leaving the loop is enough.
        async for _ in engine.generate("hello", LONG):
            break
        gc.disable()  # no collection may help: the abort must come from the loop's exit
        try:
            await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 2,
                             timeout=5)
        finally:
            gc.enable()
        await wait_until(lambda: all_blocks_free(engine))

    with_engine(model, body)


def test_sample_ids_that_collide_leave_nothing_behind(model):
    llm = make_llm(model)
    engine = llm.engine
    engine.add_request("0_x", "hello", SHORT)
    with pytest.raises(ValueError, match="'0_x' of one of its samples is in use"):
        engine.add_request("x", "hello", SamplingParams(n=2, max_tokens=3))
    assert set(engine.output_processor.parents) == {"0_x"}
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 50, "the engine never ran out of work"
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    llm.shutdown()


class _Seen:
    def __init__(self) -> None:
        self.finals: dict[str, str] = {}

    @hookimpl
    def cadence_post_sample(self, outputs):
        for o in outputs:
            if o.finished:
                self.finals[o.request_id] = o.outputs[0].finish_reason


@pytest.fixture
def seen():
    hook = _Seen()
    registry = get_registry()
    registry.pm.register(hook, name="seen")
    yield hook
    registry.pm.unregister(hook)


def test_the_post_sample_hook_sees_aborts_and_preemption_churn(model, seen):
    llm = make_llm(model, num_kv_blocks=16, max_model_len=64, block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["the"], ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", f"prompt {i} " * 3, params)
    engine.add_request("gone", "hello", SamplingParams(max_tokens=30, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.outputs[0].finish_reason
        if "gone" in engine.output_processor.parents and engine.stats.num_steps == 3:
            engine.abort_request("gone")
    assert finals["gone"] == "abort" and engine.stats.num_preemptions > 0
    assert seen.finals == finals, "the hook missed outputs the caller saw"
    llm.shutdown()


def test_the_post_sample_hook_sees_a_stop_found_when_settling(model, seen):
    """A stop string in output not yet finalized, found when the request is settled before
    a preemption: that final output goes through the hook too."""
    llm = make_llm(model)  # async output on: committed tokens wait one step for finalize
    text = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)[0]
    full = text.outputs[0].text
    stop = next(full[-k:] for k in range(2, len(full) + 1) if full.find(full[-k:]) ==
                len(full) - k)
    engine = llm.engine
    engine.add_request("s", "hello", SamplingParams(temperature=0.0, max_tokens=8,
                                                    stop=[stop], ignore_eos=True))
    req = engine.output_processor.parents["s"].children[0]
    while len(req.output_token_ids) < 8:
        engine.step()
    assert req.num_finalized_tokens < 8 and "s" not in seen.finals
    engine.output_processor.settle(req)  # what the scheduler does before preempting it
    assert seen.finals.get("s") == "stop"
    assert [o.request_id for o in engine.output_processor.take_ready()] == ["s"]
    llm.shutdown()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_sample_is_reported_finished_once(model, endpoint):
    """n > 1 streams: each choice's finish_reason arrives in exactly one chunk, after which
    the choice sends nothing more, and the chunks still add up to the whole answer."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import json

    from cadence.server.app import build_app

    # A common stop letter: the samples finish at different steps.
    body = {"model": "tiny", "n": 3, "max_tokens": 24, "temperature": 1.0, "seed": 5,
            "stop": ["e"], "stream": True}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"

    async def run(engine):
        app = build_app(engine, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            r = await client.post(endpoint, json=body)
            whole = await client.post(endpoint, json={**body, "stream": False})
        return r, whole

    r, whole = with_engine(model, run)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    finishes: dict[int, int] = {}
    after_finish = []
    text: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            i = choice["index"]
            if i in finishes:
                after_finish.append(choice)
            piece = choice.get("text") if "text" in choice else \
                choice.get("delta", {}).get("content")
            text[i] = text.get(i, "") + (piece or "")
            if choice.get("finish_reason") is not None:
                finishes[i] = finishes.get(i, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert after_finish == []
    want = {c["index"]: c["text"] if "text" in c else c["message"]["content"]
            for c in whole.json()["choices"]}
    assert text == want


def test_priority_is_served_under_the_priority_policy_and_refused_under_fcfs(model):
    llm = make_llm(model, scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(["a b", "c d"], SamplingParams(max_tokens=2, temperature=0.0),
                        priority=[5, -3], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    llm.engine.shutdown()
    fcfs = make_llm(model)
    with pytest.raises(ValueError, match=r"--scheduling-policy priority"):
        fcfs.generate(["a b"], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    assert not fcfs.engine.has_unfinished_requests()
    fcfs.engine.shutdown()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_model_dir) -> None:
    """vLLM's left truncation: the request runs on the prompt's last k tokens, exactly as
    if it had been sent alone; over HTTP too, where the prompt would not fit otherwise."""
    from engine_helpers import generate, make_llm

    model = tiny_model_dir("llama")
    ids = [(7 * i) % 300 + 3 for i in range(300)]  # longer than max_model_len (256)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(model)
    try:
        (want,) = generate(llm, [{"prompt_token_ids": ids[-40:]}], greedy)
        (got,) = generate(llm, [{"prompt_token_ids": ids}],
                          dataclasses.replace(greedy, truncate_prompt_tokens=40))
        assert got.prompt_token_ids == ids[-40:] and got.prompt is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        (short,) = generate(llm, ["the cat"], dataclasses.replace(
            greedy, truncate_prompt_tokens=100))
        assert short.prompt == "the cat"
        # A text is cut as the tokenizer cuts it from the left: its BOS stays (vLLM).
        tok = llm.get_tokenizer()
        text = "the cat runs over the mat " * 20
        body = tok.encode(text, add_special_tokens=False)
        assert tok.encode(text) == [tok.bos_token_id, *body]
        (cut,) = generate(llm, [text], dataclasses.replace(greedy, truncate_prompt_tokens=40))
        assert cut.prompt_token_ids == [tok.bos_token_id, *body[-39:]] and cut.prompt == text
        (want_cut,) = generate(llm, [{"prompt_token_ids": cut.prompt_token_ids}], greedy)
        assert cut.outputs[0].token_ids == want_cut.outputs[0].token_ids
    finally:
        llm.shutdown()
    pytest.importorskip("httpx", reason="the server part needs httpx (the test extra)")
    from test_server import serve

    async def body(client, engine):
        r = await client.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "truncate_prompt_tokens": 40})
        c = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "the cat " * 200}], "max_tokens": 2,
            "truncate_prompt_tokens": 30})
        return r, c

    r, c = serve(model, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 40
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert c.status_code == 200 and c.json()["usage"]["prompt_tokens"] == 30, c.text


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_holds(tiny_model_dir) -> None:
    """vLLM's -1: the prompt's last max_model_len - 1 tokens, the one left for the output
    every request samples; through the Python API, completions, chat and embeddings."""
    from engine_helpers import generate, make_llm

    model = tiny_model_dir("llama")
    llm = make_llm(model)
    max_len = llm.engine.config.scheduler_config.max_model_len
    ids = [(7 * i) % 300 + 3 for i in range(max_len + 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        (want,) = generate(llm, [{"prompt_token_ids": ids[-(max_len - 1):]}], greedy)
        (got,) = generate(llm, [{"prompt_token_ids": ids}],
                          dataclasses.replace(greedy, truncate_prompt_tokens=-1))
        assert got.prompt_token_ids == ids[-(max_len - 1):]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        (short,) = generate(llm, [{"prompt_token_ids": ids[:10]}],
                            dataclasses.replace(greedy, truncate_prompt_tokens=-1))
        assert short.prompt_token_ids == ids[:10]
        # More tokens than the context leaves: the one it has room for (vLLM's rule).
        (full,) = generate(llm, [{"prompt_token_ids": ids}],
                           dataclasses.replace(greedy, truncate_prompt_tokens=-1, max_tokens=16))
        assert full.outputs[0].token_ids == want.outputs[0].token_ids
        assert full.outputs[0].finish_reason == "length"
        (emb,) = llm.embed([{"prompt_token_ids": ids}], truncate_prompt_tokens=-1,
                           use_tqdm=False)
        assert emb.prompt_token_ids == ids[-(max_len - 1):]
    finally:
        llm.shutdown()
    pytest.importorskip("httpx", reason="the server part needs httpx (the test extra)")
    from test_server import serve

    async def body(client, engine):
        r = await client.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": -1})
        c = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "the cat " * 400}], "max_tokens": 1,
            "truncate_prompt_tokens": -1})
        e = await client.post("/v1/embeddings", json={"input": ids,
                                                       "truncate_prompt_tokens": -1})
        return r, c, e

    r, c, e = serve(model, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == max_len - 1
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert c.status_code == 200 and c.json()["usage"]["prompt_tokens"] == max_len - 1, c.text
    assert e.status_code == 200 and e.json()["usage"]["prompt_tokens"] == max_len - 1, e.text


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_model_dir) -> None:
    """vLLM's -1 for logprobs and prompt_logprobs: every token of the vocabulary, the same
    entries as asking for the vocabulary's size; a server gives it when started with
    --max-logprobs -1, and refuses it, naming the flag, by default."""
    from engine_helpers import generate, make_llm

    model = tiny_model_dir("llama")
    llm = make_llm(model)
    vocab = llm.engine.vocab_size
    base = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        (got,) = generate(llm, ["the cat sat"], dataclasses.replace(
            base, logprobs=-1, prompt_logprobs=-1))
        (want,) = generate(llm, ["the cat sat"], dataclasses.replace(
            base, logprobs=vocab, prompt_logprobs=vocab))
    finally:
        llm.shutdown()
    for g, w in zip([*got.outputs[0].logprobs, *got.prompt_logprobs[1:]],
                    [*want.outputs[0].logprobs, *want.prompt_logprobs[1:]], strict=True):
        assert len(g) == vocab and list(g) == list(w)
        assert all(g[t].logprob == w[t].logprob and g[t].rank == w[t].rank for t in g)
    pytest.importorskip("httpx", reason="the server part needs httpx (the test extra)")
    from test_server import serve

    async def body(client, engine):
        chat = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 1,
                "logprobs": True, "top_logprobs": -1}
        return (await client.post("/v1/chat/completions", json=chat),
                await client.post("/v1/completions", json={
                    "prompt": "the cat", "max_tokens": 1, "logprobs": -1}))

    c, r = serve(model, body, max_logprobs=-1)
    assert c.status_code == 200, c.text
    (entry,) = c.json()["choices"][0]["logprobs"]["content"]
    assert len(entry["top_logprobs"]) == vocab
    # The legacy shape keys alternatives by their text, and tokens holding part of a
    # character read alike (""), so there are fewer keys than tokens.
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) > vocab // 2
    c, r = serve(model, body)
    for reply, name in ((c, "top_logprobs"), (r, "logprobs")):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == name
        assert "--max-logprobs -1" in reply.json()["error"]["message"]


def test_vllm_offline_arguments_port_as_they_are(tiny_model_dir) -> None:
    """What vLLM scripts pass: LLM(max_logprobs=...) (its limit on logprobs; -1 the whole
    vocabulary), generate(tokenization_kwargs={"truncate_prompt_tokens": k}), seed=-1 (no
    fixed seed)."""
    from engine_helpers import make_llm

    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="max_logprobs must be") as e:
        make_llm(model, max_logprobs=-2)
    assert e.value.param == "max_logprobs"
    llm = make_llm(model, max_logprobs=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        ok = llm.generate(["the cat"], dataclasses.replace(greedy, logprobs=3),
                          use_tqdm=False)
        assert len(ok[0].outputs[0].logprobs[0]) >= 3
        for name in ("logprobs", "prompt_logprobs"):
            for asked in (4, -1):
                with pytest.raises(ValueError, match="max_logprobs=3") as e:
                    llm.generate(["the cat"], dataclasses.replace(greedy, **{name: asked}),
                                 use_tqdm=False)
                assert e.value.param == name
        assert not llm.engine.has_unfinished_requests()
        ids = list(range(3, 60))
        (cut,) = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False,
                              tokenization_kwargs={"truncate_prompt_tokens": 10})
        assert cut.prompt_token_ids == ids[-10:]
        with pytest.raises(ValueError, match="truncate_prompt_tokens only") as e:
            llm.generate(["x"], greedy, use_tqdm=False, tokenization_kwargs={"padding": True})
        assert e.value.param == "tokenization_kwargs"
    finally:
        llm.shutdown()
    whole = make_llm(model, max_logprobs=-1)
    try:
        (out,) = whole.generate(["the cat"], dataclasses.replace(greedy, logprobs=-1),
                                use_tqdm=False)
        assert len(out.outputs[0].logprobs[0]) == whole.engine.vocab_size
    finally:
        whole.shutdown()
    assert SamplingParams(seed=-1).seed is None
    # A sample's own seed of -1 (seed -2, sample 1) stays a seed.
    assert SamplingParams(n=2, seed=-2).for_sample(1).seed == -1
