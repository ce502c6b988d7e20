"""Streaming outputs and the failure modes the one-step lag caused elsewhere."""

from __future__ import annotations

import pickle

import pytest

from engine_helpers import generate, make_llm
from cadence import SamplingParams
from cadence.input_builder import build_model_input
from cadence.output_state import OutputKind

PROMPTS = ["the cat sat on the mat", "a dog ran", "café résumé", "中文 text", "why"]


def _stream(llm, params, kind=OutputKind.DELTA):
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"s{i}", p, params, output_kind=kind)
    deltas: dict[tuple[str, int], list[str]] = {}
    finals: dict[str, int] = {}
    first = eng.step()
    outputs = list(first)
    while eng.has_unfinished_requests():
        outputs.extend(eng.step())
    for o in outputs:
        assert o.request_id not in finals, "an output after the final one"
        for c in o.outputs:
            deltas.setdefault((o.request_id, c.index), []).append(c.text)
        if o.finished:
            finals[o.request_id] = finals.get(o.request_id, 0) + 1
    return first, deltas, finals


@pytest.mark.parametrize("async_on", [True, False])
def test_deltas_concatenate_to_the_final_text_with_stop_strings(tiny_model_dir, async_on):
    model = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, stop=["e ", "at", "中"],
                            n=2)
    final = generate(make_llm(model), PROMPTS, params)
    llm = make_llm(model, disable_async_output_proc=not async_on)
    first, deltas, finals = _stream(llm, params)
    assert finals == {f"s{i}": 1 for i in range(len(PROMPTS))}
    for i, out in enumerate(final):
        for c in out.outputs:
            assert "".join(deltas[(f"s{i}", c.index)]) == c.text
    assert any(c.finish_reason == "stop" for o in final for c in o.outputs)
    # The first step() returns nothing with async output processing: its outputs are
    # finalized during the second step.
    assert (first == []) == async_on


def test_cumulative_outputs_only_grow(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"))
    eng = llm.engine
    eng.add_request("c", "the cat", SamplingParams(max_tokens=12, ignore_eos=True),
                    output_kind=OutputKind.CUMULATIVE)
    texts, ids = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            texts.append(o.outputs[0].text)
            ids.append(list(o.outputs[0].token_ids))
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert all(b[: len(a)] == a for a, b in zip(ids, ids[1:]))
    assert len(ids[-1]) == 12


def test_model_input_pickles(tiny_model_dir):
    """Step payloads are plain data (vLLM #9931): they cross to worker processes."""
    llm = make_llm(tiny_model_dir("llama"))
    eng = llm.engine
    eng.add_request("p", "the cat", SamplingParams(max_tokens=2, logprobs=2, seed=1,
                                                   repetition_penalty=1.1, min_tokens=1))
    plan = eng.scheduler.schedule()
    mi = build_model_input(plan, eng.block_manager.get_block_table,
                           eng.config.cache_config.block_size)
    again = pickle.loads(pickle.dumps(mi))
    assert again == mi and again.sampling.max_num_logprobs == 2
    eng.abort_request("p")
    while eng.has_unfinished_requests():
        eng.step()
