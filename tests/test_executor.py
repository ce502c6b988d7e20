"""The executors (core/executor/): ``mp`` with one rank gives what the engine's own process
gives, and a rank that cannot start says which and why. A rank lost mid-run:
tests/test_tensor_parallel.py, on its shared engine."""

from __future__ import annotations

import pytest
from engine_helpers import generate, make_llm, summarize

from cadence import SamplingParams

PROMPTS = ["the quick brown fox", "a small bird sings", "hello there", "once upon a time"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=1),
          SamplingParams(temperature=0.9, seed=3, max_tokens=8)]


def test_mp_executor_with_one_rank_matches_uniproc(tiny_model_dir):
    model = tiny_model_dir("llama")
    prompts = PROMPTS[:2]
    local = make_llm(model, num_kv_blocks=64)
    expected = [row[1:] for row in summarize(generate(local, prompts, PARAMS))]
    local.shutdown()
    llm = make_llm(model, num_kv_blocks=64, distributed_executor_backend="mp")
    try:
        assert type(llm.engine.backend).__name__ == "MultiprocExecutor"
        assert len(llm.engine.backend.worker_pids) == 1
        assert [row[1:] for row in summarize(generate(llm, prompts, PARAMS))] == expected
    finally:
        llm.shutdown()


def test_a_rank_that_cannot_start_says_which_and_why(tiny_model_dir):
    with pytest.raises(ValueError, match=r"rank \d of 2: cpu attention must be one of"):
        make_llm(tiny_model_dir("llama"), tensor_parallel_size=2,
                 backend_options={"overlap": "sync", "attention": "bogus"})
