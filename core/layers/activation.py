"""Gated activations as modules, so a backend can swap in a fused kernel after the model is
built (the CPU backend does) without touching the model code."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """x [T, 2 * n] holding (gate, up) -> silu(gate) * up [T, n]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [T, n]
        return nn.functional.silu(gate) * up
