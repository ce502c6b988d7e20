"""Mixture of experts (core/layers/moe.py, core/models/moe.py): routing, grouping tokens by
expert against a per-token reference, rows independent of the batch, both checkpoint
layouts, and the families' window rules. Exactness against transformers for Mixtral,
Qwen2-MoE and Qwen3-MoE is in tests/test_families.py (their entries in family_factory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cadence.layers.moe import SparseMoE, route
from cadence.model_limits import layer_windows


def _moe(shared: int | None = None, renormalize: bool = True, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(16, 24, num_experts=5, top_k=2, renormalize=renormalize,
                    shared_intermediate=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The textbook definition, one token at a time."""
    out = []
    for row in x:
        probs = torch.softmax(moe.gate(row[None]).float(), -1)[0]
        w, ids = probs.topk(moe.top_k)
        if moe.renormalize:
            w = w / w.sum()
        y = sum(w[j] * moe.experts[int(e)](row[None])[0] for j, e in enumerate(ids))
        if moe.shared_expert is not None:
            y = y + torch.sigmoid(moe.shared_expert_gate(row[None]))[0] * \
                moe.shared_expert(row[None])[0]
        out.append(y)
    return torch.stack(out)


def test_routing_picks_the_top_k_and_renormalizes_on_request():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]] and torch.allclose(w[0], probs[[1, 2]])
    w, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("shared", [None, 20])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouping_by_expert_equals_the_per_token_definition(shared, renormalize):
    moe = _moe(shared, renormalize)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _per_token(moe, x), atol=1e-5, rtol=1e-5)


def test_a_rows_output_does_not_depend_on_the_rest_of_the_batch():
    moe = _moe(shared=20)
    x = torch.randn(23, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = moe(x)
        for r, n in ((0, 1), (4, 3), (9, 14)):
            assert torch.equal(moe(x[r:r + n]), whole[r:r + n]), (r, n)


def test_the_shared_experts_scale_does_not_depend_on_the_batch():
    """The sigmoid of the shared expert's [T, 1] gate: on a flat buffer its scalar tail
    would move with T (shared_expert_scale's NOTE); slices of a larger batch show it."""
    moe = _moe(shared=20)
    x = torch.randn(150, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = moe(x)
        for r, n in ((0, 13), (7, 31), (40, 100), (3, 129), (149, 1)):
            assert torch.equal(moe(x[r:r + n]), whole[r:r + n]), (r, n)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("shared", [None, 20])
def test_expert_parallel_ranks_outputs_add_up_to_the_whole_layer(placement, shared):
    """Two ranks, 5 experts: each holds its experts whole (3 and 2) and half of the shared
    expert; their partial outputs (before the sum over ranks) add up to one process's."""
    from ep_helpers import as_rank, rank_share

    from cadence.layers.moe import ExpertMLP, NotHeldHere

    full = _moe(shared, renormalize=True)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(2))
    want = {"linear": [[0, 1, 2], [3, 4]], "round_robin": [[0, 2, 4], [1, 3]]}[placement]
    parts = []
    for rank in (0, 1):
        with as_rank(rank, 2, placement):
            part = rank_share(full, 16, 24, shared)
            assert sorted(part.held) == want[rank]
            for e, expert in enumerate(part.experts):
                assert isinstance(expert, ExpertMLP if e in want[rank] else NotHeldHere)
            if shared:
                assert part.shared_expert.w2.weight.shape == (16, shared // 2)
            with torch.no_grad():
                parts.append(part(x))
    assert part.experts[want[1][0]].w13.weight.shape == (48, 16)  # whole, not halved
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], full(x), atol=1e-5, rtol=1e-5)
        assert not torch.equal(parts[0], parts[1])


def test_expert_parallel_needs_an_expert_per_rank_and_a_known_placement():
    from ep_helpers import as_rank

    from cadence.config import ParallelConfig
    from cadence.distributed import held_experts, set_expert_parallel

    with as_rank(2, 3):
        assert held_experts(8) == [6, 7]
        with pytest.raises(ValueError, match="at least one expert per rank"):
            held_experts(2)
    assert held_experts(4) == [0, 1, 2, 3]  # one rank: every expert
    with pytest.raises(ValueError, match=r"one of \('linear', 'round_robin'\)"):
        set_expert_parallel(True, "random")
    with pytest.raises(ValueError, match="expert_placement_strategy must be one of"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True,
                       expert_placement_strategy="packed")


def test_expert_parallel_flags_reach_the_parallel_config(tiny_model_dir):
    from cadence.cli.main import build_parser
    from cadence.engine_args import EngineArgs

    argv = ["generate", "--prompt", "hi", "--model", tiny_model_dir("llama"), "-tp", "2",
            "--enable-expert-parallel", "--expert-placement-strategy", "round_robin"]
    args, _ = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    parallel = args.create_engine_config().parallel_config
    assert parallel.enable_expert_parallel
    assert parallel.expert_placement_strategy == "round_robin"
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(argv[:-1] + ["packed"])


def test_expert_parallel_with_one_rank_runs_and_says_it_changes_nothing(tiny_model_dir,
                                                                        caplog):
    from engine_helpers import make_llm

    llm = make_llm(tiny_model_dir("llama"), enable_expert_parallel=True)
    llm.shutdown()
    assert "--enable-expert-parallel has no effect with one tensor-parallel rank" in \
        caplog.text


def test_an_expert_parallel_rank_reads_only_its_own_experts(tokenizer_dir, tmp_path,
                                                           checkpoint_reads):
    """Mixtral's 4 experts round-robin over 2 ranks: each rank reads every tensor but the
    other rank's experts, holds its own whole with one process's values, and between them
    they read every expert once."""
    from ep_helpers import as_rank
    from family_factory import build_family_model

    from cadence.engine_args import EngineArgs
    from cadence.model_loader import load_model

    path = build_family_model("mixtral", tmp_path, tokenizer_dir)
    model_config = EngineArgs(model=path).create_engine_config().model_config
    whole, _ = load_model(model_config)
    params = dict(whole.named_parameters())
    everything = set(checkpoint_reads)
    checkpoint_reads.clear()
    per_rank = []
    for rank in (0, 1):
        with as_rank(rank, 2, "round_robin"):
            part, _ = load_model(model_config)
        per_rank.append(set(checkpoint_reads))
        checkpoint_reads.clear()
        experts = {n for n, _ in part.named_parameters() if ".experts." in n}
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in experts}
        assert held == {rank, rank + 2}
        for name in experts:
            assert torch.equal(dict(part.named_parameters())[name], params[name]), name
    experts_read = [{n for n in reads if ".experts." in n} for reads in per_rank]
    assert experts_read[0] and experts_read[1] and not experts_read[0] & experts_read[1]
    assert per_rank[0] - experts_read[0] == per_rank[1] - experts_read[1]  # the rest: both
    assert per_rank[0] | per_rank[1] == everything


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\]"):
        SparseMoE(8, 8, num_experts=4, top_k=5, renormalize=True)


def _stacked(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-MoE checkpoint's tensors in transformers 5's stacked layout
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    stacked: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in per_expert.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            groups.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
        else:
            stacked[name] = t
    assert groups, "the model has no sparse layer"
    for prefix, experts in groups.items():
        order = sorted(experts)
        stacked[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        stacked[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [experts[e]["down_proj"] for e in order])
    return stacked


def test_stacked_expert_checkpoints_load_like_per_expert_ones(tokenizer_dir, tmp_path):
    """transformers 5 holds experts as stacks (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); a checkpoint saved that way loads to the same weights."""
    from family_factory import build_family_model

    from cadence.config import ModelConfig
    from cadence.model_loader import iterate_weights, load_model

    path = build_family_model("qwen3_moe", tmp_path / "m", tokenizer_dir)
    ours, _ = load_model(ModelConfig(model=path, max_model_len=128))
    stacked = _stacked(dict(iterate_weights(path)))
    again, _ = load_model(ModelConfig(model=path, max_model_len=128))
    again.load_weights(stacked.items())
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n


def test_an_expert_parallel_rank_takes_its_experts_from_stacked_tensors(tokenizer_dir,
                                                                        tmp_path,
                                                                        checkpoint_reads):
    """A checkpoint in the stacked layout holds every expert of a layer in one tensor, so
    each expert-parallel rank reads it whole (docs/distributed.md) and keeps only its own
    experts' slices, with one process's values."""
    from ep_helpers import as_rank
    from family_factory import build_family_model
    from safetensors.torch import save_file

    from cadence.config import ModelConfig
    from cadence.model_loader import iterate_weights, load_model

    path = tmp_path / "m"
    build_family_model("qwen3_moe", path, tokenizer_dir)
    config = ModelConfig(model=str(path), max_model_len=128)
    whole = dict(load_model(config)[0].named_parameters())
    stacked = _stacked(dict(iterate_weights(str(path))))
    for f in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    save_file({n: t.contiguous() for n, t in stacked.items()}, str(path / "model.safetensors"))
    for rank, held in ((0, {0, 2, 4}), (1, {1, 3, 5})):
        checkpoint_reads.clear()
        with as_rank(rank, 2, "round_robin"):
            part, _ = load_model(config)
        assert {n for n in checkpoint_reads if ".experts." in n} == \
            {n for n in stacked if ".experts." in n}
        experts = {n: p for n, p in part.named_parameters() if ".experts." in n}
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in experts} == held
        for name, param in experts.items():
            assert torch.equal(param, whole[name]), name


def test_moe_families_window_rules():
    assert layer_windows({"model_type": "mixtral", "num_hidden_layers": 2,
                          "sliding_window": 16}) == [16, 16]
    assert layer_windows({"model_type": "mixtral", "num_hidden_layers": 2,
                          "sliding_window": None}) == [None, None]
    assert layer_windows({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                          "sliding_window": 8, "use_sliding_window": False}) == [None, None]
    assert layer_windows({"model_type": "qwen3_moe", "num_hidden_layers": 2,
                          "sliding_window": 8, "use_sliding_window": True}) == [8, 8]
    assert layer_windows({"model_type": "qwen2_moe", "num_hidden_layers": 2,
                          "sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention"]}) == [8, None]
    with pytest.raises(ValueError, match="needs layer_types"):
        layer_windows({"model_type": "qwen2_moe", "num_hidden_layers": 2,
                       "sliding_window": 8, "use_sliding_window": True})


def test_moe_models_run_eagerly_on_cuda():
    from cadence.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    for cls in (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM):
        assert cls.graph_capturable is False


def test_expert_outputs_scale_with_the_routing_weight_in_fp32_for_mixtral():
    """Mixtral scales an expert's output by the fp32 weight; Qwen-MoE rounds the weight to
    the model's dtype first. In bf16 the two differ; each follows its transformers."""
    moe = _moe()
    moe.to(torch.bfloat16)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        fp32_weights = moe(x)
        moe.weights_in_model_dtype = True
        rounded = moe(x)
    assert fp32_weights.dtype == torch.bfloat16 and not torch.equal(fp32_weights, rounded)
    assert F.mse_loss(fp32_weights.float(), rounded.float()) < 1e-3
