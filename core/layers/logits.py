"""Logits from a bf16/fp16 LM head whose top entries are exact.

A GEMM in bf16 accumulates in fp32 and rounds each logit to bf16: 8 bits of mantissa, so
at a logit of 25 one step is 0.125. Two candidates for the next token that fp32 separates
by 0.08 come out equal, and argmax takes the lower token id. On the default model's README
prompt that turns "The capital of France is Paris." into a rambling "L'Étoile..." (the
fp32 logits are 25.33 for "The" and 25.24 for "L"; transformers' bf16 forward happens to
round them apart, cadence's kernels rounded them together).

Recomputing the whole head in fp32 doubles its cost (measured 18.2 against 9.6 ms per
step at 64 rows). It is not needed: rounding is monotonic, so a token whose fp32 logit is
the row's largest has a bf16 logit equal to the row's bf16 maximum. Recomputing only the
entries tied at the maximum (a handful of dot products per row) makes greedy decoding pick
the token an fp32 head would pick for the same hidden state, and leaves every other logit
as the bf16 GEMM gave it.
"""

from __future__ import annotations

import torch
from torch import nn

# Ties wider than this at a row's maximum keep their bf16 value past the first TOP_K (the
# backends' own kernels may handle any number): a fixed k keeps the torch path free of
# host syncs and shape changes, so it can run inside a captured CUDA graph.
TOP_K = 8


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, k: int = TOP_K) -> torch.Tensor:
    """fp32 logits [B, V] from the head's low-precision ``logits`` [B, V], with the entries
    tied at each row's maximum recomputed as fp32 dot products of ``hidden`` [B, H] and the
    head's ``weight`` rows [V, H] (module docstring)."""
    out = logits.float()
    k = min(k, out.shape[-1])
    top, idx = out.topk(k, dim=-1)
    rows = weight.index_select(0, idx.reshape(-1)).view(*idx.shape, -1).float()
    # A product and a sum per entry, not bmm: bmm's kernel depends on the batch size, and a
    # row's logits must not (async output processing keeps a request one step longer).
    exact = (rows * hidden.float().unsqueeze(1)).sum(-1)
    if bias is not None:
        exact = exact + bias.float().index_select(0, idx.reshape(-1)).view(idx.shape)
    tied = top == top[:, :1]
    return out.scatter(1, idx, torch.where(tied, exact, top))


class RefineTopLogits(nn.Module):
    """The step from the LM head's output to the fp32 logits the sampler reads; a backend
    may swap it for its own kernel (same contract as ``refine_top_logits``)."""

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if logits.dtype == torch.float32:
            return logits
        return refine_top_logits(logits, hidden, weight, bias)
