"""Linears on weights kept compressed (cadence/quantization): csrc/quant_linear.cpp.

A module the loader gave a ``quantized`` attribute (a ``QuantizedWeight``) is replaced by a
``QuantTiledLinear`` over its int8 values and fp32 group scales (and offsets), packed in the
fp32 tiled GEMM's panels; its fp32 weight is dropped. The kernel expands a block at a time
into fp32 and runs the tiled GEMM's tiles on it, so the outputs are ``TiledLinear``'s on the
dequantized weight, bit for bit, at every batch size (tests/test_cpu_quant_linear.py), and
a gated MLP's gate/up GEMM keeps its fused SiLU epilogue (``QuantTiledGatedLinear``).

The activations are fp32: the CPU backend takes ``--dtype auto`` as float32 under
``--quantization`` and refuses another dtype (``check_dtype``).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from cadence.distributed import all_reduce
from cadence.layers.activation import SiluAndMul
from cadence.layers.linear import Linear

logger = logging.getLogger(__name__)


def check_dtype(quantization: str | None, dtype: str) -> None:
    """Refuse weights of another dtype than fp32 beside quantized ones."""
    if quantization is not None and dtype != "float32":
        raise ValueError(f"quantization {quantization!r} on the CPU backend runs float32 "
                         f"activations; got dtype {dtype!r}: use --dtype float32 or auto")


class QuantTiledLinear(nn.Module):
    """x [T, K] fp32 -> x @ w.T (+ bias), w = scale * q (+ offset) packed for qtiled_linear."""

    variant = ""

    def __init__(self, linear: nn.Linear, ops: ModuleType) -> None:
        super().__init__()
        weight = linear.quantized
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.reduce_output = bool(getattr(linear, "reduce_output", False))
        self.group = weight.group
        self.packed = getattr(ops, f"qtiled_pack{self.variant}")(weight.q, weight.scale,
                                                                 weight.offset)
        self._run = getattr(ops, f"qtiled_linear{self.variant}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._run(x, self.packed, self.out_features, self.bias)
        return all_reduce(out) if self.reduce_output else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"group={self.group}"


class QuantTiledGatedLinear(QuantTiledLinear):
    """``gate_up_proj`` and SiLU-and-mul in one GEMM on compressed weights (backends/cpu/gated.py
    says why and what it keeps exact): x -> silu(x @ gate.T + b) * (x @ up.T + b)."""

    variant = "_gated"

    def __init__(self, linear: nn.Linear, ops: ModuleType) -> None:
        super().__init__(linear, ops)
        self.out_features = linear.out_features // 2


def _fusable(module: nn.Module, vector: int) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    return (getattr(type(module), "gate_act_fusable", False)
            and type(getattr(module, "act_fn", None)) is SiluAndMul
            and getattr(gate_up, "quantized", None) is not None
            and gate_up.out_features % 2 == 0 and (gate_up.out_features // 2) % vector == 0)


def run_quantized(model: nn.Module, ops: ModuleType, fuse_gated: bool) -> int:
    """Replace every linear of ``model`` that carries a ``quantized`` weight (gated MLPs'
    gate/up GEMMs fused with their activation when ``fuse_gated``); returns how many."""
    count = 0
    if fuse_gated:
        vector = ops.tiled_panel_width() // 2
        for module in model.modules():
            if _fusable(module, vector):
                module.gate_up_proj = QuantTiledGatedLinear(module.gate_up_proj, ops)
                module.act_fn = nn.Identity()
                count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and getattr(child, "quantized", None) is not None:
                setattr(parent, name, QuantTiledLinear(child, ops))
                count += 1
    return count
