"""RMSNorm as the Llama family computes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    The statistics are taken in float32 and the result is cast back before the weight is
    applied, in this order, to match transformers' ``LlamaRMSNorm`` in bf16/fp16 too.

    ``forward(x, residual)`` first adds the residual stream (``x + residual`` in x's dtype,
    as the decoder's residual connection computes it) and returns ``(norm(sum), sum)``: the
    decoder carries the residual separately, so a backend can fuse the add into the norm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)


class RMSNormWeightFirst(nn.Module):
    """RMSNorm that applies its weight in float32 before casting back (OLMo 2's and Gemma's
    order; ``RMSNorm`` casts first, as Llama does). In float32 the two agree bit for bit; in
    bf16 they round differently, so each family uses its own.

    ``offset``: the scale is ``offset + weight`` (Gemma stores ``weight`` around 0 and
    scales by ``1 + weight``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + self.offset if self.offset else self.weight
        return (scale * normed).to(input_dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with a bias over the last dimension (GPT-2, GPT-NeoX): torch's own, as
    transformers runs it, named here so that a backend can find and swap it."""
