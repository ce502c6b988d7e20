"""Tensor parallel through the whole CUDA backend on the CPU (its ``device: cpu`` mode,
interpreted Triton kernels, gloo between the ranks where GPUs would use NCCL): TP=2 gives
one process's tokens and logprobs, dense and mixture of experts (the fused MoE kernels on
each rank's slice of the experts, or on its own whole experts under expert parallel, summed
once per layer).

On GPUs each rank takes cuda:LOCAL_RANK and the ranks run eagerly (no CUDA graphs yet);
nothing here checks NCCL or the GPUs themselves.
"""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the rank processes

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from engine_helpers import assert_same_as, generate

from cadence import LLM, SamplingParams
from cadence.backend import ProbeResult

PROMPTS = ["the quick brown fox", "hello there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)


def _llm(model: str, **kw) -> LLM:
    return LLM(model=model, backend="cuda", dtype="float32", max_model_len=64,
               num_kv_blocks=32, backend_options={"device": "cpu"}, **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs GPUs per rank, not this mode")
@pytest.mark.parametrize(("kind", "async_scheduling", "expert_parallel"),
                         [("llama", True, False), ("qwen2_moe", False, False),
                          ("qwen2_moe", False, True)])
def test_cuda_tp2_on_cpu_matches_one_process(kind, async_scheduling, expert_parallel,
                                             tiny_model_dir, tokenizer_dir, tmp_path,
                                             monkeypatch, caplog) -> None:
    """Dense with async scheduling (each rank fills its placeholders from its own samples,
    through submit/collect), MoE without, and MoE with whole experts per rank (the fused
    kernels skipping the other rank's pairs)."""
    from cadence.backends.cuda.backend import CudaBackend

    # The engine's process probes; the ranks take the class it chose without probing.
    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    if kind == "llama":
        model = tiny_model_dir("llama")
    else:
        from family_factory import build_family_model

        model = build_family_model(kind, tmp_path, tokenizer_dir)
    single = _llm(model)
    try:
        reference = generate(single, PROMPTS, GREEDY)
    finally:
        single.shutdown()
    llm = _llm(model, tensor_parallel_size=2, async_scheduling=async_scheduling,
               enable_expert_parallel=expert_parallel)
    try:
        info = llm.engine.backend.env_info()
        assert info["tensor_parallel_size"] == "2"
        assert info.get("experts_held") == \
            ("rank 0: 0,1 of 4; rank 1: 2,3 of 4" if expert_parallel else None)
        outputs = generate(llm, PROMPTS, GREEDY)
        # No step failed and was run again the synchronous way.
        assert "failed" not in caplog.text
        assert_same_as(reference, outputs)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_more_ranks_than_gpus_is_refused(tiny_model_dir) -> None:
    import dataclasses

    from cadence.backends.cuda.backend import CudaBackend
    from cadence.config import ParallelConfig
    from cadence.engine_args import EngineArgs
    from cadence.executor import create_executor

    config = EngineArgs(model=tiny_model_dir("llama")).create_engine_config()
    tp2 = dataclasses.replace(config, backend="cuda",
                              parallel_config=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"needs 2 GPUs, one per rank; \d visible"):
        create_executor(CudaBackend, tp2)
    pinned = dataclasses.replace(tp2, backend_options=(("device", "cuda:1"),))
    with pytest.raises(ValueError, match="would put every rank on one GPU"):
        create_executor(CudaBackend, pinned)
