"""Activations as modules, so a backend can swap in a fused kernel after the model is built
(the CPU backend does for ``SiluAndMul``) without touching the model code.

The GELU variants follow transformers' ``ACT2FN`` names and formulas operation for
operation: the tanh approximations differ from each other in the last bits, and a family
must use the one its checkpoint names (``hidden_act``, ``activation_function``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


class SiluAndMul(nn.Module):
    """x [T, 2 * n] holding (gate, up) -> silu(gate) * up [T, n]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [T, n]
        return nn.functional.silu(gate) * up


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # OpenAI GPT's formula, as transformers' NewGELUActivation writes it.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation_fn(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers names ``name``; ``field`` names the config field in the
    error for an activation cadence does not have."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class Activation(nn.Module):
    """An elementwise activation by transformers' name (``activation_fn``)."""

    def __init__(self, name: str, field: str = "hidden_act") -> None:
        super().__init__()
        self.name = name
        self.fn = activation_fn(name, field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class ActAndMul(nn.Module):
    """x [T, 2 * n] holding (gate, up) -> act(gate) * up [T, n]: GeGLU with a GELU
    (Gemma), SwiGLU with SiLU (where the fused ``SiluAndMul`` is not used)."""

    def __init__(self, name: str, field: str = "hidden_act") -> None:
        super().__init__()
        self.name = name
        self.fn = activation_fn(name, field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [T, n]
        return self.fn(gate) * up
