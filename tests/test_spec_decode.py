"""Speculative decoding (n-gram drafts, cadence/spec_decode) gives exactly the tokens,
text, logprobs and finish reasons of the engine without it: greedy and seeded sampling,
penalties, min_tokens, stop strings, stop ids, max_tokens, n > 1, under preemption and
chunked prefill, for every CPU strategy and with async output processing on and off. Drafts
are really proposed, kept and turned down; every KV block is free at the end; what cannot
run it is refused by name. docs/speculative_decoding.md."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_helpers import PlanSpy, generate, make_llm, summarize

from cadence import SamplingParams
from cadence.spec_decode import NgramProposer, SpeculativeConfig, accept_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = ["the cat sat on the mat", "a dog ran in the park today", "café résumé naïve",
           "hello", "one two three four five six seven", "why"]


def make_cycling_model(src: str, dst: Path, sharpness: float) -> str:
    """``src`` with the layers' outputs damped and an LM head that maps each token to the
    next of a 5-token cycle, so outputs repeat and n-gram drafts are often right; the
    attention still moves every logit a little, so a draft row that read wrong K/V would
    show in the logprobs. ``sharpness`` scales the logits: high is near-deterministic, low
    lets sampling wander off the cycle (drafts turned down)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    w = load_file(str(Path(src) / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    order = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(0))
    nxt = torch.empty_like(order)
    for i in range(0, len(order), 5):
        cycle = order[i:i + 5]
        nxt[cycle] = torch.roll(cycle, -1)
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.1
    head = torch.empty_like(emb)
    head[nxt] = emb / emb.norm(dim=1, keepdim=True) * sharpness
    w["lm_head.weight"] = head.contiguous()
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> str:
    return make_cycling_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("cyc"), 1.5)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.8, seed=1),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, top_p=0.9, seed=2,
                       logprobs=1),
        SamplingParams(max_tokens=40, temperature=1.0, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, seed=4),
        SamplingParams(max_tokens=30, temperature=1.0, seed=6, n=3),
        SamplingParams(max_tokens=40, temperature=0.0, min_tokens=12),
    ]


def _run(model: str, prompts, params, **kw):
    llm = make_llm(model, **kw)
    plans = PlanSpy(llm)
    outs = generate(llm, prompts, params)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    eng.block_manager.check_invariants()
    assert eng.stats.num_generation_tokens == sum(len(c.token_ids) for o in outs
                                                  for c in o.outputs)
    llm.shutdown()
    return summarize(outs), eng, plans


CONFIGS = {
    "default": {},
    "preemption": {"num_kv_blocks": 24, "block_size": 8, "max_model_len": 128},
    "chunked": {"max_num_batched_tokens": 12, "block_size": 4, "max_model_len": 128},
}


def _with_stops(model: str) -> list[SamplingParams]:
    """Stops that end the cycling outputs part-way through a step's drafts: a stop id and a
    stop string taken from what the model generates."""
    llm = make_llm(model)
    out = generate(llm, [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))
    llm.shutdown()
    ids, text = out[0].outputs[0].token_ids, out[0].outputs[0].text
    return [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[ids[8]]),
            SamplingParams(max_tokens=40, temperature=0.0, stop=[text[-3:]]),
            SamplingParams(max_tokens=40, temperature=0.0, stop=[text[-3:]],
                           include_stop_str_in_output=True, logprobs=1),
            SamplingParams(max_tokens=9, temperature=0.0)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("async_output", [True, False])
def test_speculation_gives_the_same_outputs(model, config, async_output):
    params = _params()
    kw = {**CONFIGS[config], "disable_async_output_proc": not async_output}
    want, plain, _ = _run(model, PROMPTS, params, **kw)
    got, eng, plans = _run(model, PROMPTS, params, speculative_config=NGRAM, **kw)
    assert got == want
    st = eng.stats
    # Drafts were proposed, most kept (the outputs cycle), and some turned down.
    assert st.num_accepted_tokens > 50
    assert st.num_accepted_tokens < st.num_draft_tokens
    if config == "preemption":
        assert st.num_preemptions > 0
    if config == "chunked":
        lens = {str(i): len(eng.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)}
        assert plans.saw_chunked_prefill(lens)
    # Several tokens per step: fewer steps than without drafts.
    assert st.num_steps < plain.stats.num_steps


def test_stops_inside_a_step_end_the_output_where_they_would(model):
    params = _with_stops(model)
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]]
    want, _, _ = _run(model, prompts, params)
    got, eng, _ = _run(model, prompts, params, speculative_config=NGRAM)
    assert got == want
    assert eng.stats.num_accepted_tokens > 0
    assert [row[4] for row in got] == ["stop", "stop", "stop", "length"]
    assert len(got[-1][2]) == 9


@pytest.mark.parametrize("overlap", ["thread", "process"])
def test_every_cpu_strategy(model, overlap):
    params = _params()
    want, _, _ = _run(model, PROMPTS, params, **CONFIGS["preemption"])
    got, eng, _ = _run(model, PROMPTS, params, speculative_config=NGRAM,
                       backend_options={"overlap": overlap}, **CONFIGS["preemption"])
    assert got == want
    assert eng.stats.num_accepted_tokens > 0


def test_draft_rows_see_the_same_kv_as_plain_decodes(model):
    """Greedy logprobs of every token equal the plain engine's to the last bit: the draft
    rows' attention read the K/V of the tokens before them, not a turned-down draft's."""
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=3)
    plain = make_llm(model)
    spec = make_llm(model, speculative_config={"method": "ngram",
                                               "num_speculative_tokens": 7})
    try:
        a = generate(plain, PROMPTS, params)
        b = generate(spec, PROMPTS, params)
    finally:
        plain.shutdown()
        spec.shutdown()
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        assert [{t: lp.logprob for t, lp in d.items()} for d in cx.logprobs] == \
            [{t: lp.logprob for t, lp in d.items()} for d in cy.logprobs]


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    # The longest suffix seen before wins, and its latest occurrence.
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], None, 2)[0] == [4, 5]
    # A match close to the end continues with the period it implies: 9 7 9 ..., a a a ...
    assert p.propose([7, 8, 7, 9, 7], None, 3)[0] == [9, 7, 9]
    assert p.propose([4, 5, 5, 5], None, 3)[0] == [5, 5, 5]
    assert p.propose([1, 2, 3], None, 3)[0] == []
    # The index grows with the tokens and is rebuilt when they were cut back.
    drafts, state = p.propose([5, 6, 7, 8, 5, 6], None, 5)
    assert drafts == [7, 8, 5, 6, 7]
    assert p.propose([5, 6, 7, 8, 5, 6, 9], state, 5)[0] == []
    assert p.propose([5, 6, 7, 8, 5, 6, 9, 5], state, 2)[0] == [6, 9]
    assert p.propose([5, 6, 5], state, 2)[0] == [6, 5]
    low = NgramProposer(2, 2)
    assert low.propose([4, 1, 4], None, 2)[0] == []  # a 1-token match is below the minimum


def test_accept_drafts():
    taken = []

    def take(j, token):
        taken.append(token)
        return token == 99

    assert accept_drafts([5, 6, 7, 8], [5, 6, 7], take) == 3 and taken == [5, 6, 7, 8]
    taken.clear()
    assert accept_drafts([5, 4, 7, 8], [5, 6, 7], take) == 1 and taken == [5, 4]
    taken.clear()
    assert accept_drafts([99, 6, 7, 8], [99, 6, 7], take) == 0 and taken == [99]


def test_drafts_respect_limits_and_skip_what_they_cannot_follow(model):
    llm = make_llm(model, speculative_config=NGRAM, max_model_len=64)
    spy = PlanSpy(llm)
    try:
        prompt = list(range(3, 50))
        outs = generate(llm, [{"prompt_token_ids": prompt}] * 2, [
            SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True,
                           bad_words=["the"])])
    finally:
        llm.shutdown()
    first, second = (o.outputs[0] for o in outs)
    assert first.finish_reason == second.finish_reason == "length"
    # max_model_len 64 with a 47-token prompt: 17 tokens fit, never a draft past them.
    assert len(first.token_ids) == 17
    assert all(computed + new < 64 for step in spy.steps for _, computed, new in step)
    # bad words depend on the token before: that request never gets drafts.
    assert all(new == 1 or computed == 0 for step in spy.steps
               for rid, computed, new in step if rid == "1")
    assert any(new > 1 and computed > 0 for step in spy.steps
               for rid, computed, new in step if rid == "0")


def test_bad_configs_are_refused(model, monkeypatch):
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"method": "eagle"})
    with pytest.raises(ValueError, match="unknown keys.*valid keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        SpeculativeConfig.parse("ngram")
    with pytest.raises(ValueError, match="prompt_lookup_min .* must not exceed"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="cannot be combined with async_scheduling"):
        make_llm(model, speculative_config=NGRAM, async_scheduling=True)
    # Checked on the engine's own config, whoever built it.
    from dataclasses import replace

    from cadence.engine import LLMEngine
    from cadence.engine_args import EngineArgs

    config = EngineArgs(model=model, speculative_config=NGRAM,
                        backend_options={"overlap": "sync"}).create_engine_config()
    with pytest.raises(ValueError, match="cannot be combined with async_scheduling"):
        LLMEngine(replace(config, async_scheduling=True))
    with pytest.raises(ValueError, match="pipeline_parallel_size=1 only"):
        make_llm(model, speculative_config=NGRAM, pipeline_parallel_size=2)
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")  # the HPU backend declares no support
    with pytest.raises(ValueError, match="not supported by backend 'hpu'.*cpu"):
        make_llm(model, backend="hpu", speculative_config=NGRAM)


def test_tensor_parallel(model):
    """Two ranks (the mp executor, gloo): every rank computes the draft rows, the last
    rank's samples come back, and the outputs equal two ranks without drafts."""
    params = _params()[:3]
    kw = {"tensor_parallel_size": 2, "num_kv_blocks": 64}
    want, _, _ = _run(model, PROMPTS[:3], params, **kw)
    got, eng, _ = _run(model, PROMPTS[:3], params, speculative_config=NGRAM, **kw)
    assert got == want
    assert eng.stats.num_accepted_tokens > 0


def test_server_streams_the_same_text_and_counts_drafts(model):
    """Through the OpenAI server with AsyncLLM: a streamed greedy completion (several tokens
    per step arrive as one delta or more) joins to the text of an engine without drafts, and
    /metrics carries vLLM's spec_decode counters."""
    pytest.importorskip("fastapi", reason="the server tests need the server extra")
    httpx = pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
    import json

    from test_async_engine import with_engine

    from cadence.server.app import build_app

    body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True}

    def serve(**kw):
        async def run(engine):
            app = build_app(engine, "tiny")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as client:
                whole = (await client.post("/v1/completions", json=body)).json()
                r = await client.post("/v1/completions", json={**body, "stream": True})
                chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                deltas = [c["choices"][0]["text"] for c in chunks if c["choices"]]
                metrics = (await client.get("/metrics")).text
            return whole["choices"][0]["text"], "".join(deltas), metrics

        return with_engine(model, run, **kw)

    plain_text, _, plain_metrics = serve()
    text, streamed, metrics = serve(speculative_config=NGRAM)
    assert text == streamed == plain_text
    assert "spec_decode" not in plain_metrics
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and accepted[0] > 0


def test_lora_adapters(model, tmp_path):
    """Draft rows run with their sequence's adapter: base and two adapters in one batch give
    the outputs they give without drafts."""
    from test_lora import make_adapters

    loras = [None, *make_adapters(model, tmp_path)]
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=1)
    outs = []
    for spec in (None, NGRAM):
        llm = make_llm(model, enable_lora=True, max_loras=2, speculative_config=spec)
        try:
            outs.append(summarize(llm.generate(PROMPTS[:3], params, use_tqdm=False,
                                               lora_request=loras)))
            accepted = llm.engine.stats.num_accepted_tokens
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
    assert len({row[2] for row in outs[0]}) == 3
    assert accepted > 0


def test_drafts_take_only_what_the_step_leaves(model):
    """Every running request gets its own token before anyone gets drafts: with a token
    budget that cannot hold everyone's drafts, a step with drafts serves every running
    request, and drafts never need a preemption the plain engine would not make."""
    kw = {"max_num_batched_tokens": 8, "max_num_seqs": 6, "max_model_len": 128}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = make_llm(model, speculative_config=NGRAM, **kw)
    sched = llm.engine.scheduler
    schedule, seen = sched.schedule, []

    def spy():
        plan = schedule()
        seen.append((any(e.spec_token_ids for e in plan.scheduled), len(plan.scheduled),
                     len(sched.running)))
        return plan

    sched.schedule = spy
    try:
        got = summarize(generate(llm, PROMPTS, params))
        stats = llm.engine.stats
    finally:
        llm.shutdown()
    plain, plain_eng, _ = _run(model, PROMPTS, params, **kw)
    assert got == plain
    assert stats.num_accepted_tokens > 0
    with_drafts = [(n, running) for drafted, n, running in seen if drafted]
    assert any(running >= 4 for _, running in with_drafts)
    assert all(n == running for n, running in with_drafts)
    assert stats.num_preemptions == plain_eng.stats.num_preemptions == 0


def test_drafts_back_off_while_they_are_turned_down_and_resume():
    """A request whose drafts are turned down stops drafting but for a one-draft probe every
    few steps; once its drafts are kept again it gets them all again."""
    from cadence.request import Request
    from cadence.spec_decode import Speculator

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1),
                      max_model_len=10_000)
    req = Request("r", [1, 2, 3] * 4, SamplingParams(max_tokens=5000))

    def step(keep: bool) -> list[int]:
        req.num_computed_tokens = req.num_tokens - 1
        drafts = spec.drafts(req, 100)
        # The step keeps all drafts plus one token, or none of them and its own token.
        req.output_token_ids.extend(drafts + [9] if keep and drafts else [1])
        spec.observe(req, len(drafts), len(drafts) if keep else 0)
        return drafts

    assert len(step(keep=False)) == 3
    counts = [len(step(keep=False)) for _ in range(30)]
    assert counts[:4] == [3, 3, 3, 0]  # the running rate fell below the threshold
    assert set(counts[4:]) == {0, 1}
    assert 1 in counts[10:]  # the probes
    req.output_token_ids.extend([1, 2, 3] * 3)  # the output repeats again
    while not step(keep=True):
        pass
    counts = [len(step(keep=True)) for _ in range(12)]
    assert counts[-1] == 3


def test_a_sequence_named_g_times_samples_its_last_g_rows():
    from cadence.backend import ModelInput

    mi = ModelInput([0] * 9, list(range(9)), [0] * 9, [1, 4, 3, 1], [1, 4, 3, 1],
                    [[0]] * 4, 1, [0, 1, 1, 1, 2, 3], None)
    assert mi.sampled_rows() == [0, 2, 3, 4, 7, 8]
