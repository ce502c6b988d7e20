"""The CUDA backend's mixture-of-experts layer: the core's ``SparseMoE`` with its expert
loop replaced by the fused Triton kernels (``moe_kernels``).

``install_fused_moe`` swaps every ``SparseMoE`` of a loaded model for a ``FusedSparseMoE``
holding the same router, shared expert and routing rules; the per-expert weights are
stacked into ``w13`` [E, 2I, H] and ``w2`` [E, H, I] one layer at a time, so the extra
memory while loading is one layer's experts. The model code and the CPU path are untouched.
Under expert parallel only the rank's own experts are stacked, and ``expert_map`` sends the
pairs routed to the other ranks' experts nowhere (they add zero here; their rank adds them).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from cadence.distributed import all_reduce
from cadence.layers.moe import SparseMoE, route, shared_expert_scale


def _default_kernels() -> ModuleType:
    from cadence.backends.cuda import moe_kernels  # triton only when an MoE layer is built

    return moe_kernels


class FusedSparseMoE(nn.Module):
    """``SparseMoE``'s contract (x [T, hidden] -> [T, hidden], same routing) run by one
    ``fused_experts`` call instead of a GEMM pair per expert.

    ``kernels``: any module with ``fused_experts`` (the Triton one by default; under expert
    parallel it is also given ``expert_map``).
    """

    def __init__(self, moe: SparseMoE, kernels: ModuleType | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.gate = moe.gate
        self.shared_expert = moe.shared_expert
        self.shared_expert_gate = moe.shared_expert_gate
        held = sorted(moe.held)
        with torch.no_grad():
            self.w13 = nn.Parameter(torch.stack([moe.experts[e].w13.weight for e in held]),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.stack([moe.experts[e].w2.weight for e in held]),
                                   requires_grad=False)
            expert_map = None  # global expert -> its index in w13/w2, -1 elsewhere
            if len(held) < self.num_experts:
                expert_map = torch.full((self.num_experts,), -1, dtype=torch.int64,
                                        device=self.w13.device)
                expert_map[held] = torch.arange(len(held), device=self.w13.device)
            self.register_buffer("expert_map", expert_map, persistent=False)
        self.kernels = kernels or _default_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = route(logits, self.top_k, self.renormalize)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        # ``expert_map`` only when this rank holds a share: a kernels module written for
        # the whole set of experts keeps working.
        extra = {} if self.expert_map is None else {"expert_map": self.expert_map}
        out = self.kernels.fused_experts(x, self.w13, self.w2, weights, ids, **extra)
        if self.shared_expert is not None:
            out = out + shared_expert_scale(self.shared_expert_gate(x)) * self.shared_expert(x)
        # The ranks' slices of every expert (tensor parallel) or their own experts' outputs
        # (expert parallel).
        return all_reduce(out)


def install_fused_moe(model: nn.Module, kernels: ModuleType | None = None) -> int:
    """Replace every ``SparseMoE`` in ``model`` with a ``FusedSparseMoE``; returns how many."""
    count = 0
    # Walked parent by parent (not over a list of every module, which would keep each
    # layer's per-expert weights alive until all layers were stacked).
    for name, child in list(model.named_children()):
        if isinstance(child, SparseMoE):
            setattr(model, name, FusedSparseMoE(child, kernels))
            count += 1
        else:
            count += install_fused_moe(child, kernels)
    return count
