"""The CPU backend's kernel for LoRA's expand (cadence.lora.runtime.UpdateKernels):
``lora_expand_add`` (csrc/lora.cpp) adds each row's update into the base layer's output in
place, an FMA chain per output over the row's own adapter's columns only, so its bits do
not depend on the batch or on which adapters share the step, by construction.

It replaced the masked expand GEMM plus an add: at a prefill chunk those wrote and read
the [tokens, out] update twice more, which cost more than the layer's own GEMM. A variant
on the AMX tile loop, adding into y from the GEMM's epilogue, measured no faster at a
prefill (both are bound by the pass over y) and only ~0.1 ms a decode step faster, so it
was not kept (docs/performance.md, "LoRA").
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


class CpuLoRAKernels:
    """``UpdateKernels`` on the compiled CPU kernels (float32 and bfloat16 models)."""

    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops

    def prepare(self, b: torch.Tensor) -> Any:
        return b.t().float().contiguous()  # bf16 weights widen exactly

    def expand_add(self, y: torch.Tensor, t: torch.Tensor, prepared: Any, step: Any,
                   update: Any) -> None:
        self.ops.lora_expand_add(y, t, prepared, *step.columns(update.spans), step.order)


def lora_kernels(ops: ModuleType, dtype: torch.dtype) -> CpuLoRAKernels | None:
    """The kernels for a model of ``dtype``; None where they do not run it (float16: the
    updates then take the masked expand GEMM)."""
    return CpuLoRAKernels(ops) if dtype in (torch.float32, torch.bfloat16) else None
