"""Tensor and pipeline parallel on the families beyond Llama (CPU, gloo, two rank processes;
four for tensor parallel inside pipeline stages):
the same greedy tokens as one process, logprobs within 1e-4, every block back
(docs/distributed.md). One engine per family and split, on tiny models from
tests/family_factory.py; the variant a split runs on is the one whose feature it
exercises (below).

A unit check covers OLMo 2's q/k norm over heads split across ranks, KV heads replicated
included, without processes."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_same_as, generate, make_llm
from family_factory import build_family_model

from cadence import SamplingParams

PROMPTS = ["the quick brown fox", "once upon a time there was a bird", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)

# (family_factory name, split). Under TP: Granite's multipliers, Phi-3's fused checkpoint
# tensors with LongRoPE, OLMo 2's q/k norms over all heads, Gemma 2's soft caps (scores and
# the gathered logits), GPT-2's fused Conv1D c_attn with a tied head, GPT-NeoX's interleaved
# query_key_value with the parallel residual. Under PP: Gemma 3's layer types and GPT-2's
# inverse-layer scale read at each layer's index in the whole model (3 layers: 2 + 1), and
# GPT-NeoX's tied head loaded on the last stage from the embeddings of the first. Phi-3
# runs Llama's stage code unchanged (tests/test_pipeline_parallel.py), so it is checked
# under TP only. Mixture of experts: Qwen2-MoE's experts and shared expert split across
# ranks with one sum per layer (and a dense layer among them); Qwen3-MoE's sparse layers
# (every second one) on both sides of the stage boundary; under TP inside PP stages,
# Qwen3-MoE's experts split over each stage's two ranks and GPT-2's tied head (first stage's
# embeddings, split by vocabulary on the last stage's ranks). Expert parallel: Qwen2-MoE's
# experts whole on their rank (2 + 2) beside its split shared expert; Mixtral's 4 placed
# round-robin, each rank reading only its own experts' tensors (recorded).
CASES = [("granite", "tp"), ("granite", "pp"), ("phi3", "tp"),
         ("olmo2", "tp"), ("olmo2", "pp"), ("gemma2", "tp"), ("gemma3", "pp"),
         ("gpt2", "tp"), ("gpt2-layer-scaled", "pp"), ("gpt_neox", "tp"),
         ("gpt_neox-sequential", "pp"), ("qwen2_moe", "tp"), ("qwen3_moe", "pp"),
         ("qwen3_moe", "tp-pp"), ("gpt2-layer-scaled", "tp-pp"), ("qwen2_moe", "tp-ep"),
         ("mixtral", "tp-ep-round-robin")]
SPLITS = {"tp": {"tensor_parallel_size": 2}, "pp": {"pipeline_parallel_size": 2},
          # four ranks on however few cores: unbound, sharing them
          "tp-pp": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                    "backend_options": {"overlap": "sync", "bind": "none"}},
          "tp-ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
          "tp-ep-round-robin": {"tensor_parallel_size": 2, "enable_expert_parallel": True,
                                "expert_placement_strategy": "round_robin"}}

EXPERTS_HELD = {"tp-ep": "rank 0: 0,1 of 4; rank 1: 2,3 of 4",
                "tp-ep-round-robin": "rank 0: 0,2 of 4; rank 1: 1,3 of 4"}


@pytest.fixture(scope="module")
def reference(tokenizer_dir, tmp_path_factory):
    """``reference(name)`` -> (model folder, one process's outputs for PROMPTS)."""
    built: dict[str, tuple[str, list]] = {}

    def make(name: str) -> tuple[str, list]:
        if name not in built:
            path = build_family_model(name, tmp_path_factory.mktemp(name), tokenizer_dir)
            llm = make_llm(path, num_kv_blocks=64)
            try:
                built[name] = (path, generate(llm, PROMPTS, GREEDY))
            finally:
                llm.shutdown()
        return built[name]

    return make


@pytest.mark.parametrize(("name", "split"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_split_matches_one_process(reference, name, split):
    model, want = reference(name)
    llm = make_llm(model, num_kv_blocks=64, **SPLITS[split])
    try:
        assert len(llm.engine.backend.worker_pids) == 2 * (1 + (split == "tp-pp"))
        assert llm.engine.backend.env_info().get("experts_held") == EXPERTS_HELD.get(split)
        outputs = generate(llm, PROMPTS, GREEDY)
        assert_same_as(want, outputs)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_olmo2_qk_norm_over_heads_split_across_ranks(rank):
    """Rank ``rank`` of 2 (the gather stubbed): q's 2 heads split one per rank, k's one
    head replicated on both; each rank's columns equal the norm of the whole projection."""
    from cadence import distributed
    from cadence.layers.norm import RMSNormWeightFirst
    from cadence.models.olmo2 import ShardedQKNorm

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    weight = torch.randn(8, generator=g)

    class Gather(distributed.Communicator):
        def all_gather(self, x, dim=-1):  # the other rank holds q's other head, k's copy
            if x.shape[-1] == 4 and torch.equal(x, k):
                return torch.cat([k, k], dim=dim)
            return q

    distributed.set_tensor_parallel(rank, 2, Gather())
    try:
        q_norm, k_norm = ShardedQKNorm(8, 4, 1e-6, 1), ShardedQKNorm(4, 4, 1e-6, 2)
        full_q, full_k = RMSNormWeightFirst(8, 1e-6), RMSNormWeightFirst(4, 1e-6)
        with torch.no_grad():
            for norm in (q_norm, full_q, k_norm, full_k):
                norm.weight.copy_(weight[:norm.weight.shape[0]])
            got_q, got_k = q_norm(q[:, 4 * rank:4 * rank + 4]), k_norm(k)
            assert torch.equal(got_q, full_q(q)[:, 4 * rank:4 * rank + 4])
            assert torch.equal(got_k, full_k(k))
    finally:
        distributed.set_tensor_parallel(0, 1, None)


def test_a_fused_checkpoint_tensor_is_sliced_part_by_part():
    """Rank 1 of 2: a checkpoint storing q/k/v (or gate/up) in one tensor gives this rank
    its rows of each part, in order; one KV head is replicated on both ranks."""
    from cadence import distributed
    from cadence.layers.linear import ColumnParallelLinear, QKVParallelLinear

    distributed.set_tensor_parallel(1, 2, distributed.Communicator())
    try:
        rows = torch.arange(8 + 2 + 2, dtype=torch.float32).view(-1, 1)  # q 4x2, k 2, v 2
        qkv = QKVParallelLinear(1, 4, 1, 2)
        assert qkv.tp_load("weight", None, rows).flatten().tolist() == list(range(4, 12))
        gate_up = ColumnParallelLinear(1, 8, part_sizes=[4, 4])
        assert gate_up.tp_load("bias", None, torch.arange(8.0)).tolist() == [2, 3, 6, 7]
        with pytest.raises(ValueError, match="fused checkpoint tensor of 10 rows"):
            qkv.tp_load("weight", None, rows[:10])
    finally:
        distributed.set_tensor_parallel(0, 1, None)
