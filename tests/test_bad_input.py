"""Bad input gets a ValueError naming the field and what is allowed, and the engine keeps
serving everything else it accepted, with no KV block left behind."""

from __future__ import annotations

import os

import pytest

from engine_helpers import generate, make_llm
from cadence import LLM, SamplingParams
from cadence.output_state import OutputKind


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logprobs": -2}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    # types, NaN and infinities: a ValueError naming the field, never a TypeError
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": "0.5"}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"min_p": float("nan")}, "min_p"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"n": 2.0}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 3.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"logprobs": False}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": True}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"detokenize": 1}, "detokenize"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output"),
    ({"stop": [3]}, "stop"),
    ({"stop": ["ok", "\ud800"]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir("llama"), max_model_len=64)


def test_empty_and_too_long_prompts(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        generate(llm, [""], SamplingParams())
    with pytest.raises(ValueError, match="prompt must not be empty"):
        generate(llm, [{"prompt_token_ids": []}], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=64"):
        generate(llm, [{"prompt_token_ids": list(range(3, 70))}], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, "):
        generate(llm, [{"prompt_token_ids": [3, 10**6]}], SamplingParams())


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": [3, 4.0]}, {}, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": [3, True]}, {}, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": ["3"]}, {}, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": b"\x03\x04"}, {}, "prompt_token_ids must be a list"),
    ({"prompt_token_ids": 7}, {}, "prompt_token_ids must be a list"),
    ({"prompt_token_ids": [3, -1]}, {}, "prompt_token_ids must be in"),
    ("lone \udc80 surrogate", {}, "valid Unicode"),
    ("fine", {"top_k": 10**20}, "top_k must be <= the vocabulary size"),
    ("fine", {"logprobs": 10**9}, "logprobs must be <= the vocabulary size"),
    ("fine", {"stop_token_ids": [10**6]}, "stop_token_ids must be in"),
    ("fine", {"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids must be in"),
])
def test_bad_requests_against_the_model_are_refused_and_the_engine_serves_on(
        llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        generate(llm, [prompt], SamplingParams(max_tokens=4, **params))
    _assert_nothing_queued_and_serving(llm, 3)


def test_request_id_and_priority_types(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="request_id must be a string"):
        eng.add_request(7, "fine", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="priority must be an integer"):
        eng.add_request("r-prio", "fine", SamplingParams(max_tokens=2), priority="high")
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        eng.add_request("r-params", "fine", {"max_tokens": 2})
    assert not eng.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        generate(llm, ["fine prompt", ""], SamplingParams(max_tokens=4))
    _assert_nothing_queued_and_serving(llm, 4)


def _assert_nothing_queued_and_serving(llm, max_tokens: int) -> None:
    """After a refused request: nothing left queued, every block free, and a normal request
    still gets all its tokens."""
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    out = generate(llm, ["fine prompt"], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == max_tokens


def test_engine_keeps_serving_after_rejecting_a_request(llm):
    eng = llm.engine
    eng.add_request("good-1", "the cat", SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError):
        eng.add_request("bad", "the dog", SamplingParams(max_tokens=6, stop=["x"],
                                                          detokenize=False))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("good-1", "again", SamplingParams())
    eng.add_request("good-2", "a bird", SamplingParams(max_tokens=3, ignore_eos=True))
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert sorted(finals) == ["good-1", "good-2"]
    assert [len(finals[k].outputs[0].token_ids) for k in ("good-1", "good-2")] == [6, 3]
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_abort_frees_blocks_and_emits_one_final_output(llm):
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"a{i}", "the cat sat", SamplingParams(max_tokens=30, ignore_eos=True,
                                                               n=2),
                        output_kind=OutputKind.DELTA)
    for _ in range(4):
        eng.step()
    eng.abort_request("a1")
    finals: dict[str, int] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = finals.get(o.request_id, 0) + 1
                if o.request_id == "a1":
                    assert {c.finish_reason for c in o.outputs} == {"abort"}
    assert finals == {"a0": 1, "a1": 1, "a2": 1}
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    eng.abort_request("does-not-exist")  # unknown ids are ignored, like vLLM


def test_unknown_backend_lists_the_choices(tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'.*cpu"):
        LLM(model=tiny_model_dir("llama"), backend="tpu")


def test_missing_and_broken_model_folders(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(broken))


def test_folder_without_weights(tmp_path, tiny_model_dir):
    src = tiny_model_dir("llama")
    dst = tmp_path / "noweights"
    dst.mkdir()
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".json.index"):
            (dst / name).write_bytes((open(os.path.join(src, name), "rb")).read())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(dst))


def test_unknown_llm_argument_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(model=tiny_model_dir("llama"), max_num_seq=4)
