"""Blocks of a request that ends in the step that computed them: registered in the prefix
cache first (a shared prompt is reused by one-token scoring requests), freed at once."""

from __future__ import annotations

import pytest
from engine_helpers import make_llm

from cadence import SamplingParams

SYSTEM = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 2 full blocks of 16, and 8 more


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.mark.parametrize("async_output", [True, False])
def test_one_token_requests_reuse_a_shared_prompt(model, async_output):
    llm = make_llm(model, disable_async_output_proc=not async_output)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    first = llm.generate({"prompt_token_ids": SYSTEM + [11, 12]}, one, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate({"prompt_token_ids": SYSTEM + [13, 14]}, one, use_tqdm=False)[0]
    assert second.num_cached_tokens == 32
    # Reused blocks hold the same K/V: the answer equals a run without the cache.
    cold = make_llm(model, enable_prefix_caching=False)
    alone = cold.generate({"prompt_token_ids": SYSTEM + [13, 14]}, one, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids
    cold.shutdown()
    llm.shutdown()


def test_a_request_gives_its_blocks_back_in_the_step_that_finished_it(model):
    llm = make_llm(model)  # async output on: its final output comes one step later
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": SYSTEM}, SamplingParams(max_tokens=3))
    req = engine.output_processor.parents["r"].children[0]
    finished_seen = False
    while engine.has_unfinished_requests():
        outs = engine.step()
        if req.is_finished and not finished_seen:
            finished_seen = True
            # The output is still being finalized, the blocks are already free.
            assert not any(o.finished for o in outs)
            assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert finished_seen
    engine.block_manager.check_invariants()
    llm.shutdown()


def test_reset_prefix_cache_only_while_idle(model):
    llm = make_llm(model)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate({"prompt_token_ids": SYSTEM + [11, 12]}, one, use_tqdm=False)
    engine = llm.engine
    assert engine.block_manager.num_cached_blocks > 0
    engine.add_request("busy", {"prompt_token_ids": SYSTEM}, SamplingParams(max_tokens=2))
    cached = engine.block_manager.num_cached_blocks
    assert not llm.reset_prefix_cache()  # a request is waiting: nothing changes
    assert engine.block_manager.num_cached_blocks == cached
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache()
    assert engine.block_manager.num_cached_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    again = llm.generate({"prompt_token_ids": SYSTEM + [13, 14]}, one, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    llm.shutdown()
