"""The ``ray`` executor on a local Ray cluster started in this process: TP=2 ranks as Ray
actors give one process's tokens and logprobs, and a rank killed mid-run fails every pending
request with an error naming it.

Opt-in (``CADENCE_TEST_RAY=1`` with Ray installed: ``pip install 'cadence[ray]'``): starting
Ray and two actors takes ~20 s on 2 cores, over the suite's budget."""

from __future__ import annotations

import os
import signal

import pytest
from engine_helpers import generate, make_llm

from cadence import SamplingParams

if os.environ.get("CADENCE_TEST_RAY") != "1":
    pytest.skip("Ray executor tests are opt-in: CADENCE_TEST_RAY=1", allow_module_level=True)
ray = pytest.importorskip("ray")

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield
    ray.shutdown()


def test_ray_ranks_match_one_process_and_a_lost_rank_fails_the_requests(local_ray,
                                                                        tiny_model_dir):
    from cadence.faults import EngineFailedError

    model = tiny_model_dir("qwen3")
    single = make_llm(model, num_kv_blocks=64)
    reference = generate(single, PROMPTS, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2,
                   distributed_executor_backend="ray")
    try:
        engine = llm.engine
        assert engine.backend.env_info()["executor"] == "ray"
        for ref, out in zip(reference, generate(llm, PROMPTS, GREEDY), strict=True):
            a, b = ref.outputs[0], out.outputs[0]
            assert b.token_ids == a.token_ids
            for da, db in zip(a.logprobs, b.logprobs, strict=True):
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        engine.guard.max_restarts = 0
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"k{i}", prompt, SamplingParams(max_tokens=200,
                                                               ignore_eos=True))
        engine.step()
        os.kill(engine.backend.worker_pids[1], signal.SIGKILL)
        with pytest.raises(EngineFailedError, match="rank 1 of 2 died"):
            for _ in range(50):
                engine.step()
        failed = [o for o in engine.output_processor.take_ready() if o.finished]
        assert sorted(o.request_id for o in failed) == ["k0", "k1"]
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()
