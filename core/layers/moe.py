"""Mixture-of-experts MLP: a router picks each token's top-k experts, each expert is a gated
MLP, and the token's output is the routing-weighted sum of its experts' outputs.

Tokens are grouped by expert (one sort of the token-expert pairs, then one pair of GEMMs
per expert that received tokens): no Python loop over tokens, and each expert's weights
are read once per step however many tokens chose it. Contributions are added to each
token in ascending expert order, the order transformers' loop over experts adds them, so
fp32 outputs match its forward.

The experts are ordinary ``Linear`` modules (one per projection, HF's checkpoint layout),
so a backend's GEMM swap (the CPU backend's packed oneDNN weights) and the batch-invariant
row alignment apply to them as to any other layer.

Under tensor parallel every expert (and the shared expert) is split like the dense MLP:
w1/w3 by columns, w2 by rows, so each rank computes a partial output of every expert for
every token routed to it; the router and the shared expert's gate are replicated. The
partial outputs are summed over the ranks once per layer, after the routing weights
(linear in them), instead of once per expert.

Under expert parallel (``--enable-expert-parallel``) a rank holds whole experts instead,
``held_experts`` of them, and the others' places hold ``NotHeldHere``. Every rank has every
token (the attention before it is tensor parallel, its output summed on every rank), so no
token travels: each rank runs the tokens routed to its own experts, and the same one sum
per layer adds the ranks' outputs (vLLM's all-gather/reduce-scatter dispatch, with one
group). The shared expert stays split across the ranks like a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from cadence.distributed import all_reduce, held_experts
from cadence.layers.activation import SiluAndMul
from cadence.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top ``top_k`` per token, optionally rescaled
    to sum to one: (weights fp32 [T, k], expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def shared_expert_scale(gate_logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate_logits)`` [T, 1], the shared expert's per-token scale (Qwen2-MoE).

    NOTE batch invariance: on a contiguous [T, 1] tensor the elementwise kernel walks the T
    values as one flat buffer, and which of them fall in its scalar tail (a different exp)
    depends on T; a token's output would then change with the batch. Through a strided
    view (one column of [T, 2]) every value takes the same scalar path.
    """
    return torch.sigmoid(F.pad(gate_logits, (0, 1))[:, :1])


class ExpertMLP(nn.Module):
    """One expert: ``w2(silu(w1 x) * w3 x)`` (Mixtral's names; Qwen's gate/up/down map onto
    them at load), with w1 and w3 fused into ``w13`` as the dense MLP fuses gate and up.

    NOTE batch invariance: the activation runs on the two halves of one [rows, 2I] output,
    views whose rows the elementwise kernel walks one by one. On a contiguous [rows, I]
    tensor it would walk the flat buffer, and which elements fall in its scalar tail (a
    different exp) would depend on how many tokens chose the expert.
    """

    def __init__(self, hidden: int, intermediate: int, split: bool = True) -> None:
        super().__init__()
        # ``split``: across the tensor-parallel ranks, whose outputs ``SparseMoE`` sums;
        # whole on the rank that holds it under expert parallel.
        if split:
            self.w13 = ColumnParallelLinear(hidden, 2 * intermediate, bias=False,
                                            part_sizes=[intermediate, intermediate])
            self.w2 = RowParallelLinear(intermediate, hidden, bias=False, reduce=False)
        else:
            self.w13 = Linear(hidden, 2 * intermediate, bias=False)
            self.w2 = Linear(intermediate, hidden, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w13(x)))


class NotHeldHere(nn.Module):
    """Stands where an expert held by another rank would be (expert parallel): no
    weights, so the checkpoint's are skipped, and running it is a bug."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this expert is held by another expert-parallel rank")


class SparseMoE(nn.Module):
    """The MoE block of a decoder layer: router ``gate``, ``experts``, and for Qwen-MoE a
    ``shared_expert`` every token goes through, scaled by ``sigmoid(shared_expert_gate)``.

    ``renormalize``: rescale the top-k weights to sum to one (Mixtral always; Qwen-MoE
    with ``norm_topk_prob``). ``weights_in_model_dtype``: round the routing weights to the
    model's dtype before scaling (Qwen-MoE does; Mixtral scales with the fp32 weights).
    ``held``: the experts this rank holds whole (expert parallel, module NOTE); None splits
    every expert across the tensor-parallel ranks.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, weights_in_model_dtype: bool = False,
                 shared_intermediate: int | None = None,
                 held: list[int] | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize = renormalize
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = Linear(hidden, num_experts, bias=False)
        # Routers stay in the model's dtype under int8 quantization, as llama.cpp keeps them:
        # a rounded router picks other experts, and it is a sliver of the weights.
        self.gate.keep_unquantized = True
        self.held = frozenset(range(num_experts) if held is None else held)
        self.experts = nn.ModuleList(
            (ExpertMLP(hidden, intermediate, split=held is None) if e in self.held
             else NotHeldHere()) for e in range(num_experts))
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = ExpertMLP(hidden, shared_intermediate)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
            self.shared_expert_gate.keep_unquantized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = self.gate(x)  # [T, E]
        weights, ids = route(logits, self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # pair p is token p // k, expert flat[p]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)
        start = 0
        for e, n in enumerate(counts):
            start += n
            if n == 0 or e not in self.held:
                continue
            pairs, rows = order[start - n:start], tokens[start - n:start]
            y = self.experts[e](x.index_select(0, rows))
            y = y * pair_weights.index_select(0, pairs).unsqueeze(1)
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + shared_expert_scale(self.shared_expert_gate(x)) * shared
        return all_reduce(out)  # the ranks' partial outputs (identity on one rank)


def expert_parallel_share(num_experts: int) -> list[int] | None:
    """``SparseMoE``'s ``held`` for this rank: its experts under expert parallel, None
    (split every expert) otherwise."""
    held = held_experts(num_experts)
    return None if len(held) == num_experts else held
