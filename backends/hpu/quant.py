"""Linears on compressed weights on the HPU backend (cadence/quantization).

Every quantization method loads into a ``QuantizedWeight`` (int8 values, fp32 scales and
offsets per group of inputs). The dense weights are dropped before the model moves and the
linears swapped after (cadence/quantization/device.py), for ``DequantLinear``: it keeps the
int8 values on the card (with fp32 scales per group: about half a bf16 weight's bytes at
groups of 32 inputs or more, 0.75 at GGUF's 16 with offsets) and expands the weight in each
call, ``s * q + o`` in fp32 (a block of rows at a time) rounded to the activations' dtype,
then runs the GEMM a plain linear runs. Inside an HPU graph the expansion is part of the
graph; the bytes the card holds are the int8 ones.
The outputs are those of the dequantized weights rounded to the model's dtype (bit for bit
in the emulation's fp32: the same weights, the same GEMM).
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.distributed import all_reduce
from cadence.layers.linear import Linear, linear
from cadence.quantization import device as quant_device


# Values expanded to fp32 at a time for a weight of a narrower dtype (16 Mi: 64 MiB).
_BLOCK_ELEMS = 1 << 24


class DequantLinear(nn.Module):
    """x [T, K] -> x @ w.T (+ bias), w expanded from int8 values and fp32 group scales (and
    offsets) in each call."""

    def __init__(self, linear: Linear, device: torch.device) -> None:
        super().__init__()
        weight = linear.quantized
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_output = bool(getattr(linear, "reduce_output", False))
        self.group = weight.group
        self.bias = linear.bias  # moved with the model, in its dtype
        self.register_buffer("q", weight.q.to(device), persistent=False)
        self.register_buffer("scale", weight.scale.float().to(device), persistent=False)
        offset = None if weight.offset is None else weight.offset.float().to(device)
        self.register_buffer("offset", offset, persistent=False)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        # By groups, the scales broadcast rather than repeated, and by blocks of rows: the
        # fp32 temporary is one block's (at most _BLOCK_ELEMS values), not the weight's, so
        # a 70B layer's expansion does not hold four bytes a weight at once. The same
        # products and sums per element, so the same values.
        n, k = self.q.shape
        if dtype == torch.float32:
            return self._expand(0, n).view(n, k)
        out = torch.empty(n, k, dtype=dtype, device=self.q.device)
        rows = max(1, _BLOCK_ELEMS // k)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            out[start:stop] = self._expand(start, stop).view(stop - start, k)
        return out

    def _expand(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight in fp32, shaped [rows, groups, group]."""
        n, k = self.q.shape
        q = self.q[start:stop].view(stop - start, k // self.group, self.group)
        w = q.float() * self.scale[start:stop].unsqueeze(-1)
        if self.offset is not None:
            w += self.offset[start:stop].unsqueeze(-1)
        return w

    @property
    def weight(self) -> quant_device.RowsOf:
        """The weight as the LM head's tie refinement reads it (a few rows by index)."""
        return quant_device.RowsOf(lambda index: quant_device.dequantized_rows(
            self.q.index_select(0, index), self.scale, self.offset, self.group, index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The core's GEMM, as a plain linear runs (batch-invariant rows in the emulation).
        out = linear(x, self.dense(x.dtype), self.bias)
        return all_reduce(out) if self.reduce_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}")


def install_quantized(model: nn.Module, device: torch.device) -> int:
    """Swap every linear with quantized weights for a ``DequantLinear``; returns how many."""
    return len(quant_device.swap_quantized(model, lambda lin: DequantLinear(lin, device)))
