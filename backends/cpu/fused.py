"""Swaps the decoder's elementwise modules for the compiled CPU kernels (csrc/ops.cpp,
logits.cpp) after the model is built: RMSNorm, SiLU-and-mul, the rotary embedding and the
LM head's top-logit refinement; and the sampler's last step (``KernelDraw``, set on the
runner). The model code stays the reference; this is the same
module-replacement idea as ``linear.pack_linears``."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from cadence.layers.activation import SiluAndMul
from cadence.layers.logits import RefineTopLogits, refine_top_logits
from cadence.layers.norm import RMSNorm
from cadence.layers.rotary import ApplyRotary

FUSED_DTYPES = (torch.float32, torch.bfloat16)


class KernelRMSNorm(nn.Module):
    """``RMSNorm`` in one pass (same rounding points in bf16); with a residual, the add and
    the norm in one pass, in place (both inputs are this step's own intermediates)."""

    def __init__(self, ops: ModuleType, norm: RMSNorm) -> None:
        super().__init__()
        self.ops = ops
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if not (x.is_contiguous() and residual.is_contiguous()):
            x, residual = x.contiguous(), residual.contiguous()
        self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class KernelSiluAndMul(nn.Module):
    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class KernelRotary(nn.Module):
    """Rotates q and k in place (they are views of this step's fresh qkv output). Tables
    narrower than the head rotate its leading dimensions only (partial rotary): the kernel
    takes strided heads, so it runs on the narrower views as they are."""

    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rd = cos_sin[0].shape[-1]
        if rd == q.shape[-1]:
            self.ops.rotary_inplace(q, k, *cos_sin)
        else:
            self.ops.rotary_inplace(q[..., :rd], k[..., :rd], *cos_sin)
        return q, k


class KernelRefineTopLogits(nn.Module):
    """``RefineTopLogits`` in one pass per row for bf16 (any number of ties refined)."""

    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if logits.dtype == torch.float32:
            return logits
        if logits.dtype == torch.bfloat16:
            return self.ops.refine_top_logits(logits, hidden, weight, bias)
        return refine_top_logits(logits, hidden, weight, bias)


class KernelDraw:
    """``sampler.draw_softmax`` in one pass over each row (csrc/logits.cpp): no softmax
    tensor, the chunk sums of the two-level CDF taken as the exponentials are computed."""

    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops

    def __call__(self, logits: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
        return self.ops.draw_from_logits(logits, frac.reshape(-1))


def install_fused_ops(model: nn.Module, ops: ModuleType) -> int:
    """Replace the modules above in ``model``; returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if isinstance(child, RMSNorm) and child.weight.dtype in FUSED_DTYPES:
                new = KernelRMSNorm(ops, child)
            elif isinstance(child, SiluAndMul):
                new = KernelSiluAndMul(ops)
            elif isinstance(child, ApplyRotary):
                new = KernelRotary(ops)
            elif isinstance(child, RefineTopLogits):
                new = KernelRefineTopLogits(ops)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count
