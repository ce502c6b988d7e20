"""Beam search (core/beam_search.py; vLLM's ``LLM.beam_search`` and ``use_beam_search``):
the beams equal transformers' ``generate(num_beams=...)``, with EOS ending hypotheses and
every length penalty; one beam is greedy decoding; the ranking rules hold on a scripted
model; bad parameters are refused; nothing is left holding KV blocks. The server's
``use_beam_search`` is in tests/test_server_beam.py."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.beam_search import BeamSearch, BeamSearchParams

EOS = 1  # the test tokenizer's </s>


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Llama with its EOS row of the LM head scaled up: EOS comes up within a few
    tokens, so hypotheses end at it (the random model alone almost never says it)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(tiny_model_dir("llama"), folder, dirs_exist_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    head = weights["lm_head.weight"].clone()
    head[EOS] *= 2.2
    weights["lm_head.weight"] = head
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 8))] for _ in range(n)]


def _hf_beams(hf, prompt, width, max_new, length_penalty, eos) -> list[list[int]]:
    out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                      do_sample=False, max_new_tokens=max_new, length_penalty=length_penalty,
                      eos_token_id=eos, pad_token_id=EOS)
    beams = []
    for seq in out[:, len(prompt):].tolist():
        if eos is not None and eos in seq:
            seq = seq[:seq.index(eos) + 1]  # the padding after a finished beam
        beams.append(seq)
    return beams


@pytest.mark.parametrize(("width", "length_penalty", "max_tokens"),
                         [(3, 1.0, 40), (3, 0.0, 10), (2, 2.0, 10), (3, -0.5, 12)])
def test_match_transformers(eos_model, width, length_penalty, max_tokens) -> None:
    """Up to 40 tokens: transformers stops a search once the best live beam cannot beat the
    finished ones, and so must cadence (without that stop, 6 of 30 prompts differed)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(eos_model, dtype=torch.float32)
    llm = make_llm(eos_model)
    try:
        prompts = _prompts(30, llm.engine.vocab_size)
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                  length_penalty=length_penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        stopped = 0
        for prompt, out in zip(prompts, outs, strict=True):
            got = [s.output_token_ids for s in out.sequences]
            assert got == _hf_beams(hf, prompt, width, max_tokens, length_penalty, EOS), prompt
            for s in out.sequences:
                assert s.tokens[:len(prompt)] == prompt
                assert s.cum_logprob == pytest.approx(sum(s.logprobs))
                assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
                stopped += s.finish_reason == "stop"
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
        assert stopped > 0  # EOS did end some hypotheses
        eng = llm.engine
        assert not eng.has_unfinished_requests()
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def test_ignore_eos_searches_through_it(eos_model) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(eos_model, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    llm = make_llm(eos_model)
    try:
        prompts = _prompts(3, llm.engine.vocab_size, seed=1)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
        for prompt, out in zip(prompts, outs, strict=True):
            assert [s.output_token_ids for s in out.sequences] == \
                _hf_beams(hf, prompt, 3, 8, 1.0, None)
            assert all(len(s.output_token_ids) == 8 and s.finish_reason == "length"
                       for s in out.sequences)
    finally:
        llm.shutdown()


def test_one_beam_is_greedy_decoding(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir("llama"))
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts(3, llm.engine.vocab_size)]
        greedy = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                       logprobs=0))
        beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6))
        for g, b in zip(greedy, beams, strict=True):
            (seq,) = b.sequences
            c = g.outputs[0]
            assert seq.output_token_ids == c.token_ids
            assert seq.logprobs == pytest.approx([d[t].logprob for d, t in
                                                  zip(c.logprobs, c.token_ids)])
            assert seq.text == c.text
    finally:
        llm.shutdown()


def test_ranking_rules_on_a_scripted_model() -> None:
    """An EOS ranked beyond the beam width ends nothing; one within it ends a hypothesis
    and the next non-EOS candidates keep the width; the length penalty ranks the end."""
    s = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0),
                   [EOS], 64)
    assert s.requests() == [[7]]
    s.advance([{10: -0.1, 11: -0.5, EOS: -3.0, 12: -4.0}])  # EOS ranks third: ignored
    assert [b.tokens for b in s.live] == [[10], [11]] and not s.finished
    s.advance([{EOS: -0.2, 20: -1.0, 21: -2.0}, {22: -0.05, 23: -2.5}])
    # Ranked: 10+EOS -0.3, 11+22 -0.55, 10+20 -1.1, ...: EOS within the width ends a beam.
    assert [s_.output_token_ids for s_ in s.finished] == [[10, EOS]]
    assert [b.tokens for b in s.live] == [[11, 22], [10, 20]]
    s.advance([{30: -0.1, 31: -0.2}, {32: -0.3, 33: -0.4}])
    assert s.done  # max_tokens: every live beam is finished by length
    out = s.output(None)
    # Mean log-probability: [10, EOS] -0.15, [11, 22, 30] -0.217, [11, 22, 31] -0.25.
    assert [q.output_token_ids for q in out.sequences] == [[10, EOS], [11, 22, 30]]
    assert [q.finish_reason for q in out.sequences] == ["stop", "length"]


def test_bad_parameters_are_refused(tiny_model_dir) -> None:
    for kw, field in (({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                      ({"beam_width": 65, "max_tokens": 4}, "beam_width"),
                      ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                      ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")},
                       "length_penalty"),
                      ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos")):
        with pytest.raises(ValueError, match=field) as e:
            BeamSearchParams(**kw)
        assert e.value.param == field
    llm = make_llm(tiny_model_dir("llama"), max_model_len=32)
    try:
        with pytest.raises(ValueError, match="shorter than max_model_len") as e:
            llm.beam_search({"prompt_token_ids": list(range(3, 40))},
                            BeamSearchParams(beam_width=2, max_tokens=2))
        with pytest.raises(ValueError, match="lower max_tokens to 22") as e:
            llm.beam_search({"prompt_token_ids": list(range(3, 13))},
                            BeamSearchParams(beam_width=2, max_tokens=30))
        assert e.value.param == "max_tokens"
        with pytest.raises(ValueError, match="params must be BeamSearchParams"):
            llm.beam_search("the cat", SamplingParams())
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_async_llm_beam_search_equals_llm(tiny_model_dir) -> None:
    import asyncio

    from cadence import AsyncLLM

    model = tiny_model_dir("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    llm = make_llm(model)
    try:
        (want,) = llm.beam_search({"prompt_token_ids": [5, 9, 11]}, params)
    finally:
        llm.shutdown()
    engine = AsyncLLM(make_llm(model).engine)

    async def run():
        try:
            return await engine.beam_search({"prompt_token_ids": [5, 9, 11]}, params)
        finally:
            await engine.shutdown()

    got = asyncio.run(run())
    assert [(s.tokens, s.text) for s in got.sequences] == \
        [(s.tokens, s.text) for s in want.sequences]
