"""A SiLU-gated MLP's gate/up GEMM and its activation as one kernel (csrc/tiled_linear.cpp,
``tiled_linear_gated``), where the fp32 tiled GEMM runs the model's linears.

Unfused, the gate/up GEMM writes a [T, 2I] intermediate that ``silu_and_mul`` reads back to
write [T, I]: at the default model's decode step 0.8 MB in and 0.4 MB out per layer, at a
2048-token prefill chunk 25 MB and 12.5 MB, and a kernel call each time. Fused, each panel of
the GEMM holds the gate and the up columns of the same outputs, and its epilogue writes
silu(gate) * up from registers.

NOTE exactness: every output is the same FMA chain over K as in ``tiled_linear`` (packing
moves columns between panels, not the order of a column's sum), the bias is added to the
finished sum, and the activation is ``silu_and_mul``'s own (csrc/vec.h ``silu``). So the
fused module gives the bits of ``TiledLinear`` followed by ``KernelSiluAndMul``, and a row's
bits still do not depend on its batch; tests/test_cpu_gated.py checks both.

Which modules qualify is declared by the model, not guessed from names: a module whose
class sets ``gate_act_fusable = True`` promises that its ``act_fn`` is applied to
``gate_up_proj``'s output and to nothing else, and that ``gate_up_proj`` feeds nothing else
(core/models/llama.py ``MLP``). The fusion is made only beside the other compiled kernels:
where the attention runs the torch path, the model runs as the reference, torch's SiLU
included (backends/cpu/runtime.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cadence.backends.cpu.linear import TiledLinear
from cadence.layers.activation import SiluAndMul
from cadence.layers.linear import Linear

logger = logging.getLogger(__name__)


class TiledGatedLinear(TiledLinear):
    """``gate_up_proj`` (a [2I, K] gate-then-up weight) and SiLU-and-mul in one GEMM:
    x [T, K] -> silu(x @ gate.T + b_gate) * (x @ up.T + b_up) [T, I]."""

    variant = "_gated"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        # What the module returns, and the h the gated kernel is called with.
        self.out_features = linear.out_features // 2


def gated_width_ok(linear: nn.Module, vector: int) -> bool:
    """Whether the gated layout can hold ``linear``: fp32, an even width whose halves are
    whole vectors (``vector`` floats: half the tiled GEMM's panel width)."""
    return (isinstance(linear, Linear) and linear.weight.dtype == torch.float32
            and linear.out_features % 2 == 0 and (linear.out_features // 2) % vector == 0)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Replace each declared gated MLP's ``gate_up_proj`` by a ``TiledGatedLinear`` and its
    ``act_fn`` by an identity; run before ``pack_linears``, on plain ``Linear`` weights.
    Returns how many were fused (0 where the kernels are not there)."""
    ops = TiledLinear.kernel_ops()
    if ops is None:
        return 0
    vector = ops.tiled_panel_width() // 2
    count = 0
    for module in model.modules():
        if not getattr(type(module), "gate_act_fusable", False):
            continue
        gate_up, act = getattr(module, "gate_up_proj", None), getattr(module, "act_fn", None)
        # Only SiLU has a fused epilogue; another activation keeps the unfused path.
        if type(act) is not SiluAndMul or not gated_width_ok(gate_up, vector):
            continue
        module.gate_up_proj = TiledGatedLinear(gate_up)
        module.act_fn = nn.Identity()
        count += 1
    if count:
        logger.debug("CPU backend: %d gated MLPs fused into their gate/up GEMM", count)
    return count
