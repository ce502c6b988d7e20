"""AsyncLLM: concurrent streams equal LLM.generate, early exits abort and free blocks, bad
input raises before anything is queued, and a failing engine ends every stream."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from engine_helpers import generate, make_llm

from cadence import SamplingParams
from cadence.async_engine import AsyncLLM, EngineDeadError, EngineOverloadedError
from cadence.backend import WorkerLostError
from cadence.engine_args import EngineArgs
from cadence.output_state import OutputKind

PROMPTS = ["the quick brown fox", "a small bird sings", "hello", "once upon a time there"]


def make_async(model: str, **kw) -> AsyncLLM:
    pending = kw.pop("max_pending_requests", None)
    kw.setdefault("max_model_len", 256)
    # A small KV cache: these tests build many engines in one process.
    kw.setdefault("backend_options", {"overlap": "sync", "kv_cache_gb": 0.1})
    return AsyncLLM.from_engine_args(EngineArgs(model=model, **kw),
                                     max_pending_requests=pending)


def all_blocks_free(engine: AsyncLLM) -> bool:
    eng = engine.engine
    return eng.block_manager.num_free_blocks == eng.num_blocks


def with_engine(model: str, body, **kw):
    """Run ``await body(engine)`` on a fresh AsyncLLM; the engine is always shut down."""
    async def main():
        engine = make_async(model, **kw)
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, kind=OutputKind.DELTA):
    """Concatenate a stream's deltas per sample; return (texts, token_ids, finish reasons)."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    finals = 0
    async for out in engine.generate(prompt, params, output_kind=kind):
        finals += out.finished
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
            reasons[c.index] = c.finish_reason
    assert finals == 1, "exactly one final output per request"
    return ([texts[i] for i in sorted(texts)], [ids[i] for i in sorted(ids)],
            [reasons[i] for i in sorted(reasons)])


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """LLM.generate results (the offline path) for greedy and seeded n=2 sampling."""
    llm = make_llm(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop=[" the"])
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=16)
    res = {
        "greedy": [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs]
                   for o in generate(llm, PROMPTS, greedy)],
        "seeded": [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs]
                   for o in generate(llm, PROMPTS, seeded)],
    }
    llm.shutdown()
    return res, greedy, seeded


def test_concurrent_streams_equal_offline_generate(model, reference):
    import cadence

    assert cadence.AsyncLLM is AsyncLLM
    expected, greedy, seeded = reference

    async def body(engine):
        for key, params in (("greedy", greedy), ("seeded", seeded)):
            got = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))
            for (texts, ids, reasons), want in zip(got, expected[key]):
                assert [(t, i, r) for t, i, r in zip(texts, ids, reasons)] == want
        assert engine.num_pending_requests == 0
        assert all_blocks_free(engine)
        stats = engine.stats()
        assert stats.num_generation_tokens == sum(
            len(c[1]) for rows in expected.values() for r in rows for c in r)

    with_engine(model, body)


def test_cumulative_and_final_only_kinds(model, reference):
    expected, greedy, _ = reference

    async def body(engine):
        outs = [o async for o in engine.generate(PROMPTS[0], greedy,
                                                 output_kind=OutputKind.FINAL_ONLY)]
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].text == expected["greedy"][0][0][0]
        cumulative = [o.outputs[0].text async for o in engine.generate(
            PROMPTS[0], greedy, output_kind=OutputKind.CUMULATIVE)]
        assert cumulative[-1] == expected["greedy"][0][0][0]
        assert all(b.startswith(a) for a, b in zip(cumulative, cumulative[1:]))
        # vLLM's default, so `async for out in generate(...): final = out` reads the whole
        # text; the params' output_kind (vLLM's field) or the argument asks for deltas.
        default = [o.outputs[0].text async for o in engine.generate(PROMPTS[0], greedy)]
        assert default == cumulative and len(default) > 1
        by_params = replace(greedy, output_kind=OutputKind.DELTA)
        deltas = [o.outputs[0].text async for o in engine.generate(PROMPTS[0], by_params)]
        assert "".join(deltas) == cumulative[-1] and len(deltas) > 1
        overridden = [o async for o in engine.generate(PROMPTS[0], by_params,
                                                       output_kind=OutputKind.FINAL_ONLY)]
        assert len(overridden) == 1 and overridden[0].outputs[0].text == cumulative[-1]
        with pytest.raises(ValueError, match="output_kind must be an OutputKind"):
            await engine.add_request(PROMPTS[0], greedy, output_kind="delta")
        with pytest.raises(ValueError, match="output_kind must be an OutputKind"):
            replace(greedy, output_kind=1)

    with_engine(model, body)


def test_leaving_a_stream_early_aborts_and_frees_blocks(model):
    async def body(engine):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        seen = 0
        async for _ in engine.generate(PROMPTS[1], params):
            seen += 1
            if seen == 3:
                break
        await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 1)
        await wait_until(lambda: all_blocks_free(engine))
        assert engine.num_pending_requests == 0

        # A cancelled consumer task aborts too.
        async def consume():
            async for _ in engine.generate(PROMPTS[2], params):
                pass

        task = asyncio.ensure_future(consume())
        await wait_until(lambda: engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 2)
        await wait_until(lambda: all_blocks_free(engine))
        # The engine still serves.
        texts, _, reasons = await collect(engine, PROMPTS[0],
                                          SamplingParams(temperature=0.0, max_tokens=4))
        assert reasons == ["length"] and texts[0]

    with_engine(model, body)


def test_vllm_argument_names_and_abort_of_several_ids(model, reference):
    """Code written for vLLM's AsyncLLM runs: ``generate(prompt, sampling_params=...,
    request_id=...)`` by keyword, and ``abort`` of a list of ids ends each of them."""
    expected, greedy, _ = reference

    async def body(engine):
        outs = [o async for o in engine.generate(PROMPTS[0], sampling_params=greedy,
                                                 request_id="kw")]
        assert outs[-1].request_id == "kw" and outs[-1].finished
        assert outs[-1].outputs[0].text == expected["greedy"][0][0][0]
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        streams = [await engine.add_request(PROMPTS[i], long, request_id=f"a{i}")
                   for i in range(3)]
        await wait_until(lambda: engine.stats().num_running == 3)
        await engine.abort(["a0", "a2", "not-in-flight"])
        finals = {}
        for s in (streams[0], streams[2]):
            async for out in s:
                finals[out.request_id] = out
        assert {k: v.outputs[0].finish_reason for k, v in finals.items()} == {
            "a0": "abort", "a2": "abort"}
        assert engine.has_request("a1")
        await engine.abort(iter(["a1"]))  # any iterable of ids
        async for out in streams[1]:
            last = out
        assert last.outputs[0].finish_reason == "abort"
        await wait_until(lambda: all_blocks_free(engine))
        for bad, word in ((7, "int"), (["a", 3], "int")):
            with pytest.raises(ValueError, match=f"request_id.*string.*{word}|must be strings"
                                                 f", got {word}"):
                await engine.abort(bad)

    with_engine(model, body)


def test_bad_input_raises_before_queueing(model):
    async def body(engine):
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request({"prompt_token_ids": [5] * 300})
        with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, "):
            await engine.add_request([10**6])
        assert engine.num_pending_requests == 0
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        a = await engine.add_request(PROMPTS[0], params, request_id="a")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request(PROMPTS[0], params, request_id="a")
        b = await engine.add_request(PROMPTS[1], params)
        with pytest.raises(EngineOverloadedError, match="max_pending_requests=2"):
            await engine.add_request(PROMPTS[2], params)
        for stream in (a, b):
            outs = [o async for o in stream]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert engine.num_pending_requests == 0 and all_blocks_free(engine)

    with_engine(model, body, max_pending_requests=2)


def test_engine_failure_ends_every_stream(model):
    async def main():
        engine = make_async(model)
        backend = engine.engine.backend
        original = backend.execute
        calls = [0]

        def failing(mi, post_sample):
            calls[0] += 1
            if calls[0] == 3:
                # A failure that only one step sees would be retried in smaller groups
                # (tests/test_faults.py); a device that is gone for good ends the engine.
                raise WorkerLostError("simulated device loss", restartable=False)
            return original(mi, post_sample)

        backend.execute = failing
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        results = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS[:2]),
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "simulated device loss" in str(results[0])
        assert "cannot restart" in str(results[0])
        assert not engine.is_running
        # Its gauges say nothing runs any more (/metrics reads them per replica).
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        with pytest.raises(EngineDeadError):
            await engine.add_request(PROMPTS[0], params)
        await engine.shutdown()

    asyncio.run(main())


def test_shutdown_ends_pending_streams(model):
    async def main():
        engine = make_async(model)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = await engine.add_request(PROMPTS[0], params)

        async def drain():
            async for _ in stream:
                pass

        task = asyncio.ensure_future(drain())
        await wait_until(lambda: engine.stats().num_running == 1)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await task
        assert not engine.is_running

    asyncio.run(main())


def test_cancelled_while_being_added_is_aborted(model):
    """A caller cancelled while the engine thread is still adding its request (a client that
    hangs up at once) must not leave the request running with nobody listening."""
    async def body(engine):
        add = engine.engine.add_request

        def slow_add(*args, **kwargs):
            time.sleep(0.3)
            return add(*args, **kwargs)

        engine.engine.add_request = slow_add
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(engine.add_request(PROMPTS[0], params))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 1)
        await wait_until(lambda: all_blocks_free(engine))
        assert engine.stats().num_generation_tokens < 200

    with_engine(model, body)


def test_a_batch_cancelled_while_being_added_aborts_what_was_queued(model):
    """``add_all`` cancelled (a server deadline, beam search's rounds) after some of its
    requests were queued: those are aborted too, so they free their blocks and their slot
    of max_pending_requests (which would otherwise fill up for good)."""
    from cadence.async_stream import add_all

    async def body(engine):
        add = engine.engine.add_request

        def slow_third(*args, **kwargs):
            if args[1] == PROMPTS[2]:
                time.sleep(0.5)
            return add(*args, **kwargs)

        engine.engine.add_request = slow_third
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(add_all(engine, [(p, params) for p in PROMPTS[:3]]))
        await wait_until(lambda: engine.engine.has_unfinished_requests())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.stats().finish_reasons.get("abort") == 3)
        await wait_until(lambda: all_blocks_free(engine) and engine.num_pending_requests == 0)
        # The slots are free again: a full batch fits.
        streams = await add_all(engine, [(p, SamplingParams(max_tokens=2)) for p in PROMPTS])
        for stream in streams:
            async for _ in stream:
                pass

    with_engine(model, body, max_pending_requests=4)


def test_stats_snapshot_is_independent_of_the_live_stats():
    """The engine thread keeps counting while the event loop reads the snapshot."""
    from cadence.metrics import EngineStats

    live = EngineStats(finish_reasons={"length": 3})
    live.time_to_first_token.observe(0.2)
    snap = live.snapshot()
    live.finish_reasons["stop"] = 1
    for hist in (live.time_to_first_token, live.e2e_request_latency, live.request_queue_time,
                 live.time_per_output_token, live.inter_token_latency):
        hist.observe(5.0)
    live.times.add("schedule", 1.0)
    assert snap.finish_reasons == {"length": 3} and snap.time_to_first_token.count == 1
    edges = len(snap.time_to_first_token.edges)
    assert snap.time_to_first_token.counts == [0] * 8 + [1] + [0] * (edges - 8)
    for hist in (snap.e2e_request_latency, snap.request_queue_time,
                 snap.time_per_output_token, snap.inter_token_latency):
        assert hist.count == 0 and sum(hist.counts) == 0
    assert snap.times.phases["schedule"] == 0.0
