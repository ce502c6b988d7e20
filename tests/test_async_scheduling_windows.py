"""Async scheduling on sliding-window models (every layer windowed, so blocks behind the
window are freed while a request runs): outputs equal the sync engine's, the blocks a
request holds stay bounded by the window, and all are free at the end. The tiny windowed
models come from tests/test_sliding_window.py."""

from __future__ import annotations

from engine_helpers import generate, make_llm, summarize
from test_async_scheduling import SubmitSpy
from test_sliding_window import (  # noqa: F401  (windowed_model: a fixture)
    NUM_KV_BLOCKS,
    PROMPTS,
    WINDOW,
    windowed_model,
)

from cadence import SamplingParams

BLOCK = 4
CHUNK = 8
# Keys from c + 1 - W through c + chunk - 1, plus a partial block at each end: the most
# blocks one sequence holds, and the smallest cache the engine accepts for it.
MOST_BLOCKS = (WINDOW - 1 + CHUNK) // BLOCK + 2


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True,
                           logprobs=1, presence_penalty=0.3) if i % 2 else
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            for i in range(2 * len(PROMPTS))]


def _run(model: str, **kw):
    llm = make_llm(model, block_size=BLOCK, max_num_batched_tokens=CHUNK, **kw)
    spy = SubmitSpy(llm.engine) if kw.get("async_scheduling") else None
    try:
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS * 2], _params())
        eng = llm.engine
        bm = eng.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        assert eng.stats.num_generation_tokens == sum(len(c.token_ids) for o in outs
                                                      for c in o.outputs)
        return summarize(outs), eng.stats.num_preemptions, spy
    finally:
        llm.shutdown()


def test_async_scheduling_equals_sync_past_the_window(windowed_model) -> None:  # noqa: F811
    """Greedy and seeded (penalties, logprobs), chunked prefill, with and without a cache
    small enough to preempt."""
    model = windowed_model("mistral")
    for num_kv_blocks in (NUM_KV_BLOCKS, 20):
        want, _, _ = _run(model, disable_async_output_proc=True, num_kv_blocks=num_kv_blocks)
        got, num_preemptions, spy = _run(model, async_scheduling=True,
                                         num_kv_blocks=num_kv_blocks)
        assert got == want
        assert spy.num_placeholders > 0 and spy.num_penalty_placeholders > 0
        assert (num_preemptions > 0) == (num_kv_blocks == 20)


def test_blocks_stay_bounded_even_in_a_cache_of_one_sequence(windowed_model) -> None:  # noqa: F811
    """One request decoding far past the window. With the cache exactly one sequence's
    size, the blocks the step in flight leaves behind the window are only freed once it is
    committed: the next chunk waits for them (it used to preempt the request itself at
    every step, and never finish)."""
    model = windowed_model("mistral")
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    llm = make_llm(model, block_size=BLOCK, max_num_batched_tokens=CHUNK,
                   num_kv_blocks=NUM_KV_BLOCKS)
    want = generate(llm, [{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0].token_ids
    llm.shutdown()
    # Room for the whole sequence with nothing freed, then exactly one sequence's worth.
    for num_kv_blocks in (NUM_KV_BLOCKS, MOST_BLOCKS):
        llm = make_llm(model, block_size=BLOCK, max_num_batched_tokens=CHUNK,
                       async_scheduling=True, num_kv_blocks=num_kv_blocks)
        engine = llm.engine
        bm = engine.block_manager
        engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, params)
        most, outs = 0, []
        for _ in range(400):
            if not engine.has_unfinished_requests():
                break
            num_steps = engine.stats.num_steps
            new = engine.step()
            # AsyncLLM takes a step that ran nothing and returned nothing for a stall and
            # waits for a command: waiting for the commit must not look like one.
            assert new or engine.stats.num_steps > num_steps or \
                not engine.has_unfinished_requests(), "a step that ran nothing"
            outs += new
            most = max(most, bm.num_blocks - bm.num_free_blocks)
            bm.check_invariants()
        assert not engine.has_unfinished_requests(), "the request never finished"
        assert list(outs[-1].outputs[0].token_ids) == list(want)
        # Without freeing it would be (40 + 150) / 4 = 48.
        assert most <= MOST_BLOCKS
        assert bm.num_free_blocks == bm.num_blocks
        assert engine.stats.num_preemptions == 0
        llm.shutdown()
