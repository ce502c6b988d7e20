"""Pipeline parallel through the whole CUDA backend on the CPU (its ``device: cpu`` mode,
interpreted Triton kernels, gloo between the stages where GPUs would use NCCL send/recv):
PP=2 gives one process's tokens and logprobs, dense and mixture of experts, and so does
TP=2 inside each of two stages (with expert parallel); a stage before the last samples
nothing, and a stage lost mid-run ends every request with an error that names it.

On GPUs each stage takes cuda:LOCAL_RANK and runs eagerly (no CUDA graphs under pipeline
parallel); nothing here checks NCCL or the GPUs themselves.
"""

from __future__ import annotations

import os
import re

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the stage processes

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if torch.cuda.is_available():
    pytest.skip("needs a GPU per stage, not this mode", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from engine_helpers import StageOutbox, assert_same_as, generate, lose_a_rank_mid_run

from cadence import LLM, SamplingParams
from cadence.backend import ProbeResult

PROMPTS = ["the quick brown fox", "hello there", "once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)


def _llm(model: str, **kw) -> LLM:
    return LLM(model=model, backend="cuda", dtype="float32", max_model_len=256,
               num_kv_blocks=64, backend_options={"device": "cpu"}, **kw)


@pytest.fixture(autouse=True)
def _chosen_without_probing(monkeypatch):
    # The engine's process probes; the stages take the class it chose without probing.
    from cadence.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))


def _reference(model: str) -> list:
    single = _llm(model)
    try:
        return generate(single, PROMPTS, GREEDY)
    finally:
        single.shutdown()


def test_cuda_pp2_on_cpu_matches_one_process_then_loses_a_stage(tiny_model_dir,
                                                                 caplog) -> None:
    """qwen2 (q/k/v biases, untied head). Then the last stage is killed mid-run: every
    request ends with an error naming it, and with no restart left the engine stops."""
    from cadence.faults import EngineFailedError

    model = tiny_model_dir("qwen2")
    reference = _reference(model)
    llm = _llm(model, pipeline_parallel_size=2)
    try:
        engine = llm.engine
        info = engine.backend.env_info()
        assert (info["executor"], info["pipeline_parallel_size"]) == ("mp", "2")
        outputs = generate(llm, PROMPTS, GREEDY)
        assert "failed" not in caplog.text  # no micro-batch was run again on its own
        assert_same_as(reference, outputs)
        assert engine.block_manager.num_free_blocks == engine.num_blocks

        engine.guard.max_restarts = 0
        expect = r"rank 1 of 2 died \(killed by SIGKILL\)"
        with pytest.raises(EngineFailedError, match=expect):
            lose_a_rank_mid_run(engine, PROMPTS, engine.backend.worker_pids[1], True,
                                expect, warmup_steps=2)
        failed = engine.output_processor.take_ready()
        assert sorted(o.request_id for o in failed if o.finished) == ["k0", "k1", "k2"]
        assert all(re.search(expect, o.error) for o in failed if o.finished)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert not engine.scheduler.in_flight
    finally:
        llm.shutdown()


def test_cuda_pp2_moe_on_cpu_matches_one_process(tmp_path, tokenizer_dir) -> None:
    """Mixture of experts: each stage runs its layers' fused Triton MoE kernels. With
    --async-scheduling, which under pipeline parallel is the pipeline's own planning (no
    placeholders): the stages run every micro-batch through ``execute`` all the same."""
    from family_factory import build_family_model

    model = build_family_model("qwen2_moe", tmp_path, tokenizer_dir)
    reference = _reference(model)
    llm = _llm(model, pipeline_parallel_size=2, async_scheduling=True)
    try:
        assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_cuda_tp2_inside_pp2_on_cpu_matches_one_process(tmp_path, tokenizer_dir) -> None:
    """Four ranks, two stages of two: each stage's ranks split its layers (their own group
    for the all-reduces), the activations go to the same tensor-parallel index of the next
    stage, and the mixture-of-experts layers hold whole experts per rank (expert parallel:
    the fused kernels skip the other rank's pairs)."""
    from family_factory import build_family_model

    model = build_family_model("qwen3_moe", tmp_path, tokenizer_dir)
    reference = _reference(model)
    llm = _llm(model, tensor_parallel_size=2, pipeline_parallel_size=2,
               enable_expert_parallel=True)
    try:
        info = llm.engine.backend.env_info()
        assert (info["tensor_parallel_size"], info["pipeline_parallel_size"]) == ("2", "2")
        # Each stage's two ranks split its layers' 6 experts 3 + 3.
        assert info["experts_held"] == "; ".join(
            f"rank {r}: {'0,1,2' if r % 2 == 0 else '3,4,5'} of 6" for r in range(4))
        assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_a_stage_before_the_last_samples_nothing(tiny_model_dir) -> None:
    """In one process, as stage 0 of 2 (the send to stage 1 replaced): the forward hands
    its activations on and returns no logits, and the step returns what the CPU backend's
    stage returns, a SamplerOutput with no ids."""
    from cadence import distributed
    from cadence.backend import PostSample
    from cadence.backends.cuda.backend import CudaBackend, profile_input
    from cadence.engine_args import EngineArgs

    config = EngineArgs(model=tiny_model_dir("qwen2"), backend="cuda", dtype="float32",
                        max_model_len=64, num_kv_blocks=8,
                        backend_options={"device": "cpu"}).create_engine_config()
    outbox = StageOutbox()
    distributed.set_pipeline_parallel(0, 2, outbox)
    try:
        backend = CudaBackend(config)
        backend.load_model()
        backend.allocate_kv_cache()
        mi = profile_input(5, 2, 64)  # two prompts, every slot -1: no KV written
        assert backend.launch(mi) is None  # no logits on this stage
        out = backend.execute(mi, PostSample(None))
        hidden = backend.runner.model.hidden_size
    finally:
        distributed.set_pipeline_parallel(0, 1, None)
    assert out.sampled_token_ids == [] and out.logprobs is None
    # Each forward sent its branch output and residual stream, stacked, to rank 1.
    assert outbox.sent == [((2, 5, hidden), 1)] * 2


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_more_stages_than_gpus_is_refused(tiny_model_dir) -> None:
    import dataclasses

    from cadence.backends.cuda.backend import CudaBackend
    from cadence.config import ParallelConfig
    from cadence.engine_args import EngineArgs
    from cadence.executor import create_executor

    config = EngineArgs(model=tiny_model_dir("qwen2")).create_engine_config()
    pp2 = dataclasses.replace(config, backend="cuda",
                              parallel_config=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2 needs 2 GPUs, one per "
                                         r"rank; \d visible"):
        create_executor(CudaBackend, pp2)
