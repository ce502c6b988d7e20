"""Tensor parallel on the HPU backend, in emulation (CADENCE_HPU_EMULATE=1): two rank
processes, each the whole HPU backend (buckets, padding, lazy-mode call order, warmup of
every bucket with the collectives inside), give one process's tokens and logprobs.

In emulation the collectives run over gloo; on a Gaudi they run over HCCL and each rank
takes the card its LOCAL_RANK names (the executor sets it). The emulation checks the
backend's sharded model and bucketed steps, not the device or HCCL itself.
"""

from __future__ import annotations

from engine_helpers import assert_same_as, generate, make_llm

from cadence import SamplingParams

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings",
           "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)


def test_hpu_tp2_matches_one_process(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")  # inherited by the rank processes
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    model = tiny_model_dir("qwen2")
    kw = {"backend": "hpu", "max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 64}
    single = make_llm(model, **kw)
    try:
        reference = generate(single, PROMPTS, GREEDY)
    finally:
        single.shutdown()
    llm = make_llm(model, tensor_parallel_size=2, **kw)
    try:
        engine = llm.engine
        info = engine.backend.env_info()
        assert (info["executor"], info["tensor_parallel_size"]) == ("mp", "2")
        outputs = generate(llm, PROMPTS, GREEDY)
        assert_same_as(reference, outputs)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()
