"""Async output processing on == off, exactly, for every sampling setting with a seed, under
forced preemption and chunked prefill. Also: every KV block is free at the end."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import PlanSpy, generate, make_llm, summarize
from cadence import SamplingParams

WORDS = ["the cat sat on the mat", "a dog ran in the park today", "café résumé naïve",
         "中文 text and more", "hello", "she said that the weather was fine and warm",
         "one two three four five six seven", "why"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=20, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.8, seed=1),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, top_p=0.9, seed=2),
        SamplingParams(max_tokens=20, temperature=0.7, min_p=0.05, seed=3, logprobs=3),
        SamplingParams(max_tokens=20, temperature=1.0, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, seed=4),
        SamplingParams(max_tokens=24, temperature=0.9, seed=5, stop=["e", "at"]),
        SamplingParams(max_tokens=16, temperature=1.0, seed=6, n=3, logprobs=2),
        SamplingParams(max_tokens=20, temperature=1.0, seed=7, min_tokens=10,
                       stop=[" the"], include_stop_str_in_output=True),
    ]


def _run(model: str, async_on: bool, prompts, params, **kw):
    llm = make_llm(model, disable_async_output_proc=not async_on, **kw)
    spy = PlanSpy(llm)
    outs = generate(llm, prompts, params)
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    assert eng.stats.num_generation_tokens == sum(len(c.token_ids) for o in outs
                                                  for c in o.outputs)
    return summarize(outs), eng, spy


CONFIGS = {
    "default": {},
    "preemption": {"num_kv_blocks": 20, "block_size": 8, "max_model_len": 128},
    "chunked": {"max_num_batched_tokens": 16, "max_model_len": 128},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_equals_sync(tiny_model_dir, config):
    model = tiny_model_dir("llama")
    prompts = list(WORDS)
    params = _params()
    kw = CONFIGS[config]
    got_async, eng_a, spy_a = _run(model, True, prompts, params, **kw)
    got_sync, eng_s, _ = _run(model, False, prompts, params, **kw)
    assert got_async == got_sync
    # The workload must really exercise what the config is about.
    if config == "preemption":
        assert eng_a.stats.num_preemptions > 0 and eng_s.stats.num_preemptions > 0
    if config == "chunked":
        tok = eng_a.tokenizer
        lens = {str(i): len(tok.encode(p)) for i, p in enumerate(prompts)}
        assert spy_a.saw_chunked_prefill(lens)
    finish = {row[4] for row in got_async}
    assert "stop" in finish and "length" in finish


@pytest.mark.parametrize("overlap", ["thread", "process"])
def test_async_equals_sync_for_every_cpu_strategy(tiny_model_dir, overlap):
    model = tiny_model_dir("llama")
    ref, _, _ = _run(model, False, list(WORDS), _params(), **CONFIGS["preemption"])
    got, eng, _ = _run(model, True, list(WORDS), _params(),
                       backend_options={"overlap": overlap}, **CONFIGS["preemption"])
    eng.shutdown()
    assert got == ref
    assert eng.stats.num_preemptions > 0


def test_stop_strings_do_not_leak_the_lagging_token(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = make_llm(model)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = generate(llm, WORDS, sp)
    # A stop string taken from the middle of each greedy output must cut it right there.
    stops = []
    for o in base:
        text = o.outputs[0].text
        stops.append(text[len(text) // 2: len(text) // 2 + 2] if len(text) > 4 else None)
    for async_on in (True, False):
        llm = make_llm(model, disable_async_output_proc=not async_on)
        spy = PlanSpy(llm)
        for i, (o, stop) in enumerate(zip(base, stops)):
            if not stop or not stop.strip():
                continue
            res = generate(llm, [WORDS[i]], SamplingParams(
                max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
            out = res.outputs[0]
            full = o.outputs[0].text
            assert out.finish_reason == "stop" and out.stop_reason == stop
            assert out.text == full[: full.index(stop)]
            assert stop not in out.text
            n = len(out.token_ids)
            assert list(out.token_ids) == list(o.outputs[0].token_ids[:n])
            # Prefill + (n - 1) decodes, plus exactly one lagging step with async on.
            assert spy.times_scheduled(res.request_id) == n + (1 if async_on else 0)
        eng = llm.engine
        assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("async_on", [True, False])
def test_eos_stop_ids_and_max_tokens_cost_no_extra_step(tiny_model_dir, async_on):
    model = tiny_model_dir("llama")
    prompt = {"prompt_token_ids": torch.arange(3, 40).tolist()}
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref = generate(make_llm(model), [prompt], greedy)[0].outputs[0].token_ids
    k = 6
    target = ref[k]
    first = list(ref).index(target)  # the first time that token appears

    llm = make_llm(model, disable_async_output_proc=not async_on)
    spy = PlanSpy(llm)
    out = generate(llm, [prompt], SamplingParams(max_tokens=20, temperature=0.0,
                                                 stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert len(out.token_ids) == first + 1
    assert spy.times_scheduled("0") == first + 1

    llm.engine.eos_token_ids = (target,)
    out = generate(llm, [prompt], SamplingParams(max_tokens=20, temperature=0.0)
                   )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert len(out.token_ids) == first + 1
    assert spy.times_scheduled("1") == first + 1

    out = generate(llm, [prompt], SamplingParams(max_tokens=5, temperature=0.0,
                                                 ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert spy.times_scheduled("2") == 5
    assert llm.engine.stats.num_generation_tokens == 2 * (first + 1) + 5


def test_request_reaching_max_model_len_exactly(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = make_llm(model, max_model_len=64)
    prompt = {"prompt_token_ids": list(range(3, 3 + 50))}
    out = generate(llm, [prompt], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_seed_is_independent_of_batch(tiny_model_dir):
    model = tiny_model_dir("llama")
    llm = make_llm(model)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42)
    alone = summarize(generate(llm, ["the cat sat"], sp))[0][2:]
    others = SamplingParams(max_tokens=16, temperature=1.0)
    mixed = generate(llm, ["x y z", "the cat sat", "hello there"], [others, sp, others])
    assert summarize(mixed)[1][2:] == alone
