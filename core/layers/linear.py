"""Linear layers whose rows do not depend on the rest of the batch.

NOTE batch invariance: torch's CPU GEMM computes rows in groups of 4 and finishes a partial
group with a different kernel, so a row's bits depend on its index and the batch size
(measured here on AVX2: rows equal across batch sizes only inside full groups). A request's
logits would then change with whatever else is in the batch, and async output processing
(which keeps a stop-string request in the batch one step longer) could not match sync mode
exactly. Padding the rows to a multiple of ``ROW_ALIGN`` puts every row in a full group.
The cost is at most three extra rows per matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROW_ALIGN = 4


def row_aligned(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` with x's rows padded to a multiple of ``ROW_ALIGN`` (module NOTE); any CPU
    GEMM kernel goes through this."""
    m = x.shape[0]
    pad = -m % ROW_ALIGN
    if pad == 0:
        return gemm(x)
    return gemm(torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]))[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return row_aligned(lambda rows: F.linear(rows, weight, bias), x)


class Linear(nn.Linear):
    """``nn.Linear`` over a flat [tokens, features] input, batch-invariant on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
