"""Linears on compressed weights on the CUDA backend (cadence/quantization; the kernel is
``quant_kernels``).

The loader leaves a ``quantized`` attribute (a ``QuantizedWeight``) on each linear it runs
compressed. Two steps, around the model's move to the GPU:

1. ``drop_dense_weights``, before the move: each such linear's dense weight, which for a
   packed or GGUF checkpoint was never written (its shape only), is replaced by an empty
   tensor, so the model's full-size linears never take GPU memory. A linear whose groups
   the kernel cannot run (``check_group``), and a mixture-of-experts layer's routed
   experts (the fused MoE kernels take dense weights), get their dense weights written
   from the quantized ones instead and run as before.
2. ``install_quantized``, after the move and after LoRA wrapped its projections: every
   such linear, a LoRA wrapper's ``base`` included, becomes a ``QuantLinear`` holding the
   packed weight on the GPU. Tensor-parallel shares were cut at load
   (``quantization.weights.rank_share``); a row-parallel layer keeps its all-reduce.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cadence.distributed import all_reduce
from cadence.layers.linear import Linear
from cadence.layers.moe import SparseMoE

logger = logging.getLogger(__name__)


def _kernels():
    from cadence.backends.cuda import quant_kernels  # triton only when a model needs it

    return quant_kernels


class QuantLinear(nn.Module):
    """x [T, K] -> x @ w.T (+ bias) in x's dtype, w = scale * q (+ offset) packed by
    ``quant_kernels.pack`` (4 bits a value where the values allow it, else 8)."""

    def __init__(self, linear: Linear, device: torch.device) -> None:
        super().__init__()
        kernels = _kernels()
        weight = linear.quantized
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_output = bool(getattr(linear, "reduce_output", False))
        self.bias = linear.bias  # moved with the model, in its dtype
        self.packed = kernels.pack(weight.q, weight.scale, weight.offset).to(device)
        self._run = kernels.quant_linear

    @property
    def weight(self) -> DequantizedRows:
        """The weight as the LM head's tie refinement reads it (``refine_top_logits``: a
        few rows by index), dequantized on demand."""
        return DequantizedRows(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._run(x, self.packed, self.bias)
        return all_reduce(out) if self.reduce_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.packed.bits}, group={self.packed.group}")


class DequantizedRows:
    """Rows of a packed weight in fp32, ``s * q + o`` as the kernel computes them: what a
    bf16 head's tie refinement (core/layers/logits.py) takes with ``index_select``."""

    def __init__(self, packed) -> None:
        self.packed = packed

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        p = self.packed
        q = _kernels().unpack_rows(p, index)
        rows = p.scale.index_select(0, index).repeat_interleave(p.group, dim=1) * q.float()
        if p.offset is not None:
            rows = rows + p.offset.index_select(0, index).repeat_interleave(p.group, dim=1)
        return rows


def _quantized_linears(model: nn.Module):
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "quantized", None) is not None:
            yield module


def _dense(module: Linear) -> None:
    # A weight of its own, not a copy into the one it has: a tied head's is the embedding
    # table, which the lookup reads as the checkpoint holds it.
    module.weight = nn.Parameter(module.quantized.dequantize().to(module.weight.dtype),
                                 requires_grad=False)
    del module.quantized


def drop_dense_weights(model: nn.Module) -> None:
    """Step 1 of the module docstring (on the CPU, before the model moves)."""
    from cadence.backends.cuda.quant_kernels import check_group

    # The routed experts run stacked in the fused MoE kernels (moe.py), which take dense
    # weights: theirs are written from the quantized values (the shared expert, a plain
    # MLP, runs compressed).
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE)
               for m in moe.experts.modules()}
    for module in list(_quantized_linears(model)):
        weight = module.quantized
        if id(module) in experts:
            _dense(module)
            continue
        if not check_group(weight.group):
            logger.warning("a linear of %d inputs with groups of %d runs its dequantized "
                           "weight: the CUDA kernel takes groups of a multiple of 16 inputs",
                           weight.shape[1], weight.group)
            _dense(module)
            continue
        # A tied head's weight is the embedding table, which the lookup still needs: the
        # head's own reference is dropped, not the table.
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def install_quantized(model: nn.Module, device: torch.device) -> dict[int, int]:
    """Step 2 of the module docstring; returns how many linears run compressed, by the
    bits a value they store."""
    count: dict[int, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and getattr(child, "quantized", None) is not None:
                layer = QuantLinear(child, device)
                setattr(parent, name, layer)
                count[layer.packed.bits] = count.get(layer.packed.bits, 0) + 1
    return count
