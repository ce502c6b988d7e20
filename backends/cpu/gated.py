"""A SiLU-gated MLP's gate/up GEMM and its activation as one kernel, where the fp32 tiled GEMM
(csrc/tiled_linear.cpp, ``tiled_linear_gated``) or the bf16 AMX tile loop
(csrc/amx_linear.cpp, ``amx_linear_gated``) runs the model's linears.

Unfused, the gate/up GEMM writes a [T, 2I] intermediate that ``silu_and_mul`` reads back to
write [T, I]: at the default model's decode step 0.8 MB in and 0.4 MB out per layer, at a
2048-token prefill chunk 25 MB and 12.5 MB, and a kernel call each time. Fused, each panel of
the GEMM holds the gate and the up columns of the same outputs, and its epilogue writes
silu(gate) * up from registers.

NOTE exactness: every output is the same FMA chain (tile accumulation) over K as in
``tiled_linear`` (``amx_linear``): packing moves columns between panels (blocks), not the
order of a column's sum. The bias is added to the finished sum, in bf16 the sum is rounded
to bf16 as the unfused GEMM's output is, and the activation is ``silu_and_mul``'s own
(csrc/vec.h ``silu``). So the fused module gives the bits of ``TiledLinear`` (``AmxLinear``)
followed by ``KernelSiluAndMul``, and a row's bits still do not depend on its batch;
tests/test_cpu_gated.py and tests/test_cpu_amx_linear.py check both.

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

from cadence.backends.cpu.linear import AmxLinear, TiledLinear
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


class AmxGatedLinear(AmxLinear):
    """``gate_up_proj`` and SiLU-and-mul in one bf16 GEMM on AMX tiles (each 32-column block
    holds 16 gate and the 16 up columns of the same outputs)."""

    variant = "_gated"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.out_features = linear.out_features // 2


# kind -> (the fused module, the weight dtype it runs, the granule of each half's width).
_GATED = {"tiled": (TiledGatedLinear, torch.float32, None),
          "amx": (AmxGatedLinear, torch.bfloat16, 16)}


def gated_width_ok(linear: nn.Module, vector: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the gated layout can hold ``linear``: weights of ``dtype``, an even width whose
    halves are whole multiples of ``vector`` columns (fp32: half the tiled GEMM's panel
    width; AMX: a 16-column tile)."""
    return (isinstance(linear, Linear) and linear.weight.dtype == dtype
            and linear.out_features % 2 == 0 and (linear.out_features // 2) % vector == 0)


def fuse_gated_mlps(model: nn.Module, kind: str = "tiled") -> int:
    """Replace each declared gated MLP's ``gate_up_proj`` by the fused module of ``kind``
    (``tiled``: ``TiledGatedLinear``; ``amx``: ``AmxGatedLinear``) and its ``act_fn`` by an
    identity; run before ``pack_linears``, on plain ``Linear`` weights. Returns how many were
    fused (0 where the kernels are not there)."""
    fused_cls, dtype, vector = _GATED[kind]
    ops = fused_cls.kernel_ops()
    if ops is None:
        return 0
    if vector is None:
        vector = ops.tiled_panel_width() // 2
    count = 0
    for module in model.modules():
        if not getattr(type(module), "gate_act_fusable", False):
            continue
        gate_up, act = getattr(module, "gate_up_proj", None), getattr(module, "act_fn", None)
        # Only SiLU has a fused epilogue; another activation keeps the unfused path.
        if type(act) is not SiluAndMul or not gated_width_ok(gate_up, vector, dtype):
            continue
        module.gate_up_proj = fused_cls(gate_up)
        module.act_fn = nn.Identity()
        count += 1
    if count:
        logger.debug("CPU backend: %d gated MLPs fused into their gate/up GEMM", count)
    return count
