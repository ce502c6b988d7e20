"""Pipeline parallel on the HPU backend, in emulation (CADENCE_HPU_EMULATE=1): two stage
processes (or two stages of two tensor-parallel ranks), each the whole HPU backend (buckets, padding, lazy-mode call order, the warmup
of every bucket run in lockstep over the stages), give one process's tokens and logprobs;
each bucketed part's activations cross between the stages at the part's padded shape.

In emulation the activations go over gloo; on a Gaudi they would go over HCCL, in lazy
mode without HPU graphs. The emulation checks the backend's staged, bucketed steps, not
the device or HCCL itself.
"""

from __future__ import annotations

import pytest
from engine_helpers import StageInbox, StageOutbox, assert_same_as, generate, make_llm

from cadence import SamplingParams

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings",
           "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
KW = {"backend": "hpu", "max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 64}


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")  # inherited by the stage processes
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2-inside-pp2"])
def test_hpu_pp2_matches_one_process(tiny_model_dir, tp):
    """llama-tied: the last stage loads the head from the embeddings' weight. The warmup
    runs on both stages (every bucket, largest first): a stage that ran its warmup
    forwards alone would wait for activations that never come. With two tensor-parallel
    ranks per stage (four processes), each stage's ranks warm up and run in lockstep with
    their peer in the other stage too."""
    model = tiny_model_dir("llama-tied")
    single = make_llm(model, **KW)
    try:
        reference = generate(single, PROMPTS, GREEDY)
    finally:
        single.shutdown()
    llm = make_llm(model, pipeline_parallel_size=2, tensor_parallel_size=tp, **KW)
    try:
        engine = llm.engine
        info = engine.backend.env_info()
        assert (info["executor"], info["pipeline_parallel_size"]) == ("mp", "2")
        assert info["tensor_parallel_size"] == str(tp)
        assert len(engine.backend.worker_pids) == 2 * tp
        assert int(info["hpu_warmup_compiles"]) > 0  # stage 0 ran its warmup forwards
        outputs = generate(llm, PROMPTS, GREEDY)
        assert_same_as(reference, outputs)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()


def _stage(stage: int, model: str, comm):
    """An HPU backend in this process as stage ``stage`` of 2 over ``comm`` (no warmup)."""
    from cadence import distributed
    from cadence.backends.hpu.backend import HpuBackend
    from cadence.engine_args import EngineArgs

    config = EngineArgs(model=model, **KW, backend_options={"skip_warmup": True}
                        ).create_engine_config()
    distributed.set_pipeline_parallel(stage, 2, comm)
    backend = HpuBackend(config)
    backend.load_model()
    backend.allocate_kv_cache()
    return backend, config


def _mixed_step(config):
    """One decode (5 tokens cached) and one fresh 3-token prompt: two parts, two buckets."""
    from cadence.backend import ModelInput, SamplingMetadata
    from cadence.backends.hpu import buckets as bk

    greedy = SamplingMetadata([0.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, [None] * 2, [0] * 2,
                              all_greedy=True)
    mi = ModelInput([7, 11, 12, 13], [4, 0, 1, 2], [4, 16, 17, 18], [1, 3], [5, 3],
                    [[0], [1]], 1, [0, 1], greedy)
    cfg = bk.bucket_config(config)
    padded = [bk.bucket_for(cfg, mi, range(1), "decode").num_tokens,
              bk.bucket_for(cfg, mi, range(1, 2), "prefill").num_tokens]
    return mi, padded


def test_stages_hand_on_each_part_at_its_bucket_shape(tiny_model_dir):
    """Stage 0 sends each part's activations at the part's padded token count, stage 1
    asks for the same shapes (both pick the buckets from the same ModelInput); the first
    stage samples nothing, the last samples every row."""
    from cadence import distributed
    from cadence.backend import PostSample

    model = tiny_model_dir("llama-tied")
    outbox, inbox = StageOutbox(), StageInbox()
    try:
        first, config = _stage(0, model, outbox)
        mi, padded = _mixed_step(config)
        hidden = first.runner.model.hidden_size
        out = first.execute(mi, PostSample(None))
        assert out.sampled_token_ids == [] and out.logprobs is None
        last, _ = _stage(1, model, inbox)
        out = last.execute(mi, PostSample(None))
        assert len(out.sampled_token_ids) == 2
    finally:
        distributed.set_pipeline_parallel(0, 1, None)
    assert padded[1] > 3  # the prompt was padded to its bucket
    assert outbox.sent == [((2, n, hidden), 1) for n in padded]
    assert inbox.asked == [((2, n, hidden), 0) for n in padded]
