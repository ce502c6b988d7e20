"""Tensor parallel on the CPU (gloo, two rank processes): the same greedy tokens and
logprobs as one process, and the refusals of splits that cannot run (docs/distributed.md).

Starting two ranks costs seconds, so one engine per architecture serves every check."""

from __future__ import annotations

import json
import re

import pytest
from engine_helpers import (
    assert_same_as,
    assert_same_embeddings,
    assert_same_prompt_logprobs,
    generate,
    lose_a_rank_mid_run,
    make_llm,
    summarize,
)

from cadence import PoolingParams, SamplingParams
from cadence.backend import Backend
from cadence.config import ParallelConfig

PROMPTS = ["the quick brown fox", "once upon a time there was a small bird that sings",
           "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
# qwen2: q/k/v biases (column-parallel) and two KV heads split one per rank, on F.linear;
# llama-mqa: one KV head replicated on both ranks, on the CPU backend's packed GEMMs.
CASES = {"qwen2": {"overlap": "sync", "linear": "torch"},
         "llama-mqa": {"overlap": "sync", "linear": "packed"}}


@pytest.fixture(scope="module", params=sorted(CASES))
def tp_pair(request, tiny_model_dir):
    """(one-process reference outputs, a TP=2 LLM) for one architecture."""
    model = tiny_model_dir(request.param)
    single = make_llm(model, num_kv_blocks=64)
    reference = generate(single, PROMPTS, GREEDY)
    single.shutdown()
    llm = make_llm(model, num_kv_blocks=64, tensor_parallel_size=2,
                   backend_options=CASES[request.param])
    yield reference, llm
    llm.shutdown()


def test_tp2_matches_one_process(tp_pair):
    reference, llm = tp_pair
    info = llm.engine.backend.env_info()
    assert info["executor"] == "mp" and info["tensor_parallel_size"] == "2"
    assert len(llm.engine.backend.worker_pids) == 2
    assert_same_as(reference, generate(llm, PROMPTS, GREEDY))
    # Every request's blocks came back.
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_tp2_prompt_logprobs_match_one_process(tp_pair):
    """Every rank computes the vocabulary-parallel logits of the prompt rows (their
    all-gather is a collective), and rank 0's come back."""
    _, llm = tp_pair
    ids = [[5, 9, 11, 40, 2, 7, 7, 30], [3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    single = make_llm(llm.engine.config.model_config.model, num_kv_blocks=64)
    try:
        want = generate(single, [{"prompt_token_ids": p} for p in ids], params)
    finally:
        single.shutdown()
    got = generate(llm, [{"prompt_token_ids": p} for p in ids], params)
    assert all(w.prompt_logprobs is not None for w in want)
    assert_same_prompt_logprobs(got, want)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_tp2_embeddings_match_one_process(tp_pair):
    """Every rank computes the pooled sums of its replicated hidden states; rank 0's come back."""
    _, llm = tp_pair
    ids = [[5, 9, 11, 40, 2, 7, 7, 30], [3, 4], list(range(10, 60))]
    prompts = [{"prompt_token_ids": p} for p in ids]
    single = make_llm(llm.engine.config.model_config.model, num_kv_blocks=64)
    try:
        want = single.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    finally:
        single.shutdown()
    got = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert_same_embeddings(got, want, atol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_tp2_async_output_on_equals_off(tp_pair):
    _, llm = tp_pair
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=12, stop=["e"])]
    on = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]  # ids differ
    llm.engine.async_output = False
    try:
        off = [row[1:] for row in summarize(generate(llm, PROMPTS, params))]
    finally:
        llm.engine.async_output = True
    assert on == off
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_a_rank_lost_mid_run_fails_every_pending_request(tp_pair, request):
    """Runs last on its engine. qwen2: rank 1 is killed (its pipe closes, seen at once),
    then the engine restarts the whole group, which serves as before; llama-mqa: rank 0
    freezes (no reply within the step deadline, 1 s here) while rank 1 waits for it in a
    collective, and with no restart left the engine stops. Either way every request ends
    with an error naming the ranks, the blocks come back, and /health's check reports it
    until the group is back."""
    kill = "qwen2" in request.node.callspec.id
    reference, llm = tp_pair
    engine = llm.engine
    # After the kill the group is restarted once; after the freeze the engine gives up.
    engine.guard.max_restarts = 1 if kill else 0
    engine.backend.step_timeout_s = 1.0
    pids = engine.backend.worker_pids
    expect = (r"rank 1 of 2 died \(killed by SIGKILL\)" if kill
              else r"rank\(s\) \[0, 1\] of 2 gave no reply within 1 s")
    failed = lose_a_rank_mid_run(engine, PROMPTS, pids[1 if kill else 0], kill, expect)
    assert sorted(o.request_id for o in failed) == ["k0", "k1", "k2"]
    assert all(re.search(expect, o.error) for o in failed)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    with pytest.raises(Exception, match=expect):
        engine.backend.check_health()
    if kill:  # the next step starts a new group, which serves as the first did
        engine.backend.step_timeout_s = 600.0
        outputs = generate(llm, PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == \
            [o.outputs[0].token_ids for o in reference]
        assert not set(engine.backend.worker_pids) & set(pids)


# -- refusals: checked before any rank starts -------------------------------------------------

def _config_dir(tmp_path, **fields) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, **fields}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_splits_that_cannot_run_are_refused(tmp_path):
    from cadence.executor import check_tensor_parallel_model

    check_tensor_parallel_model(_config_dir(tmp_path), 4)  # 2 KV heads, each on 2 ranks
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        check_tensor_parallel_model(_config_dir(tmp_path), 3)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel_model(_config_dir(tmp_path, num_attention_heads=6,
                                                num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match="MLP width 99"):
        check_tensor_parallel_model(_config_dir(tmp_path, intermediate_size=99), 2)
    with pytest.raises(ValueError, match=r"experts' width 49 \(moe_intermediate_size\)"):
        check_tensor_parallel_model(_config_dir(tmp_path, architectures=["Qwen2MoeForCausalLM"],
                                                moe_intermediate_size=49), 2)
    # Whole experts per rank: their width need not divide, their number must cover the ranks.
    qwen_moe = {"architectures": ["Qwen2MoeForCausalLM"], "moe_intermediate_size": 49,
                "num_experts": 4}
    check_tensor_parallel_model(_config_dir(tmp_path, **qwen_moe), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="at least one expert per rank; the model has 4"):
        check_tensor_parallel_model(_config_dir(tmp_path, **qwen_moe, num_attention_heads=8,
                                                num_key_value_heads=8), 8,
                                    expert_parallel=True)
    mixtral = {"architectures": ["MixtralForCausalLM"], "intermediate_size": 99,
               "num_local_experts": 8}
    check_tensor_parallel_model(_config_dir(tmp_path, **mixtral), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="MLP width 99"):
        check_tensor_parallel_model(_config_dir(tmp_path, **mixtral), 2)
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*LlamaForCausalLM.*Qwen3"):
        check_tensor_parallel_model(_config_dir(tmp_path, architectures=["FalconForCausalLM"]),
                                    2)


def test_more_ranks_than_cores_and_the_core_split():
    from cadence.backends.cpu.placement import rank_cpus

    with pytest.raises(ValueError, match="needs at least 3 CPU cores"):
        rank_cpus(ParallelConfig(tensor_parallel_size=3), [0, 1])
    five = [0, 1, 2, 3, 4]
    assert [rank_cpus(ParallelConfig(tensor_parallel_size=2, tensor_parallel_rank=r), five)
            for r in range(2)] == [[0, 1, 2], [3, 4]]
    # Two replicas of two ranks: each rank its own quarter of the machine.
    eight = list(range(8))
    assert [rank_cpus(ParallelConfig(2, d, 2, t), eight) for d in range(2)
            for t in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_bad_executor_choices_are_refused(tiny_model_dir):
    import dataclasses

    from cadence.engine_args import EngineArgs
    from cadence.executor import create_executor

    with pytest.raises(ValueError, match="use --distributed-executor-backend mp"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uniproc")
    with pytest.raises(ValueError, match="must be one of"):
        ParallelConfig(distributed_executor_backend="threads")
    config = EngineArgs(model=tiny_model_dir("llama")).create_engine_config()

    class NoSplit(Backend):
        name = "nosplit"

    split = dataclasses.replace(config, parallel_config=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="backend 'nosplit' does not support tensor parallel"):
        create_executor(NoSplit, split)


def test_layers_slice_the_checkpoint_for_their_rank():
    """Rank 1 of 2 (no processes: the collectives are stubbed)."""
    import torch

    from cadence import distributed
    from cadence.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    class Sum2(distributed.Communicator):
        def all_reduce(self, x):
            return x * 2

    distributed.set_tensor_parallel(1, 2, Sum2())
    try:
        full = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
        head = ColumnParallelLinear(4, 5)  # a vocabulary of 5: 3 rows each, one padding
        assert head.weight.shape == (3, 4)
        sliced = head.tp_load("weight", None, full)
        assert torch.equal(sliced[:2], full[3:]) and not sliced[2].any()
        # 4 query heads, 1 KV head replicated: rank 1 holds q heads 2-3 and the KV head.
        qkv = QKVParallelLinear(4, 4, 1, 2)
        assert qkv.weight.shape == (2 * 2 + 2 + 2, 4)
        rows = torch.arange(8 + 2 + 2, dtype=torch.float32).view(-1, 1)
        assert qkv.tp_load("weight", 0, rows[:8]).flatten().tolist() == [4, 5, 6, 7]
        assert qkv.tp_load("weight", 1, rows[8:10]).flatten().tolist() == [8, 9]
        down = RowParallelLinear(4, 3, bias=True)
        assert torch.equal(down.tp_load("weight", None, full[:3]), full[:3, 2:])
        assert not down.tp_load("bias", None, torch.ones(3)).any()  # rank 0 adds it
        emb = VocabParallelEmbedding(5, 4)
        emb.weight.data.copy_(emb.tp_load("weight", None, full))
        out = emb(torch.tensor([0, 3, 4]))  # id 0 lives on rank 0: zeros here, then "summed"
        assert not out[0].any() and torch.equal(out[1:], 2 * full[3:])
    finally:
        distributed.set_tensor_parallel(0, 1, None)


@pytest.mark.parametrize(("library", "widened"), [("gloo", True), ("nccl", False),
                                                  ("hccl", False)])
def test_low_precision_sums_are_widened_only_where_the_library_needs_it(monkeypatch, library,
                                                                        widened):
    """gloo has no bfloat16 sum: the shards go over in fp32. NCCL and HCCL sum bf16/fp16
    themselves: sending fp32 would double the bytes."""
    import torch
    import torch.distributed as dist

    from cadence.distributed import Communicator

    monkeypatch.setattr(dist, "get_backend", lambda group=None: library)
    comm = Communicator()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.ones(3, dtype=dtype)
        assert comm._wide(x).dtype == (torch.float32 if widened else dtype)
    assert comm._wide(torch.ones(2)).dtype == torch.float32

    class Mine(Communicator):
        native_dtypes = ("float32", "bfloat16")  # a plugin's own library says so itself

    assert Mine()._wide(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
