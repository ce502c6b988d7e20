"""Linears on compressed weights on the CUDA backend (cadence/quantization; the kernel is
``quant_kernels``).

The loader leaves a ``quantized`` attribute (a ``QuantizedWeight``) on each linear it runs
compressed. Two steps, around the model's move to the GPU (cadence/quantization/device.py
holds what every device backend shares of them):

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

import torch
from torch import nn

from cadence.distributed import all_reduce
from cadence.layers.linear import Linear
from cadence.layers.moe import SparseMoE
from cadence.quantization import device as quant_device


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
    def weight(self) -> quant_device.RowsOf:
        """The weight as the LM head's tie refinement reads it (``refine_top_logits``: a
        few rows by index), dequantized on demand."""
        p = self.packed
        return quant_device.RowsOf(lambda index: quant_device.dequantized_rows(
            _kernels().unpack_rows(p, index), p.scale, p.offset, p.group, index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._run(x, self.packed, self.bias)
        return all_reduce(out) if self.reduce_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.packed.bits}, group={self.packed.group}")


def drop_dense_weights(model: nn.Module) -> None:
    """Step 1 of the module docstring (on the CPU, before the model moves)."""
    from cadence.backends.cuda.quant_kernels import check_group

    # The routed experts run stacked in the fused MoE kernels (moe.py), which take dense
    # weights: theirs are written from the quantized values (the shared expert, a plain
    # MLP, runs compressed).
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE)
               for m in moe.experts.modules()}

    def dense_reason(module: Linear) -> str | None:
        if id(module) in experts:
            return ""
        group = module.quantized.group
        if not check_group(group):
            return (f"a linear of {module.quantized.shape[1]} inputs with groups of {group} "
                    "runs its dequantized weight: the CUDA kernel takes groups of a multiple "
                    "of 16 inputs")
        return None

    quant_device.drop_dense_weights(model, dense_reason)


def install_quantized(model: nn.Module, device: torch.device) -> dict[int, int]:
    """Step 2 of the module docstring; returns how many linears run compressed, by the
    bits a value they store."""
    count: dict[int, int] = {}
    for layer in quant_device.swap_quantized(model, lambda lin: QuantLinear(lin, device)):
        count[layer.packed.bits] = count.get(layer.packed.bits, 0) + 1
    return count
